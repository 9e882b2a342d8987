"""KV events: which token blocks this machine holds, announced to a router in front of several
machines, in vLLM's wire format, so `vllm-router --policy kv_aware` sends each conversation
back to the machine that holds its KV.

What is announced (`medium`): blocks in the RAM bank as device memory ("GPU"), blocks
committed in LMDB as disk ("STORAGE"), which the router credits least. The bank's KV is MLX
arrays the model computes from directly (unified memory on Apple silicon, the same RAM on a
CPU): a hit there costs a copy, like a GPU prefix-cache hit, not a transfer. Credited as host
memory (0.8) instead, six agents sent together through vllm-router lost their machine to a
less loaded one 2 to 5 times in 30 returning turns; as device memory, none. A block is
announced when the first holder on a medium takes it and removed when the last one lets go. At start, and whenever a subscriber joins, the whole state goes out again
after `AllBlocksCleared`, so a restarted machine (or router) is found again.

Blocks are `block_size` tokens (the router's `--kv-event-block-size`), whatever kvbank's own
`--block-tokens`; only whole blocks are announced. Their ids are opaque to the router, which
hashes the tokens itself: ours are chained 63-bit hashes, salted by tenant. Events carry no
tenant, so the event endpoints belong on a private network.

Wire format (vLLM `vllm/distributed/kv_events.py`, as vllm-router 0.1.17 reads it): an XPUB
socket sends (topic, 8-byte big-endian sequence number, msgpack payload); the payload is an
array `[ts, events]` (vLLM's `EventBatch`, array-like, `data_parallel_rank` omitted at its
default); each event a map tagged by `type`: `BlockStored` (block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name), `BlockRemoved` (block_hashes, medium),
`AllBlocksCleared`. A ROUTER replay socket answers an 8-byte start sequence with every buffered
batch from there (it keeps the newest 10,000, at most 64 MiB of them), `[topic, seq, payload]`
each, then an end marker (empty topic, sequence -1, empty payload).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np
import zmq

logger = logging.getLogger(__name__)

MEDIUM_RAM = "GPU"
MEDIUM_SSD = "STORAGE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_BUFFER = 10_000  # batches kept for replay, the newest
# and at most this many bytes of them: a released or restored conversation of 100K tokens is
# a batch of 300-500 KB, so 10,000 batches alone could hold gigabytes.
REPLAY_BUFFER_BYTES = 64 << 20


@dataclass(frozen=True)
class EventsConfig:
    endpoint: str  # the publisher binds it: tcp://HOST:PORT (the router connects)
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int = 16


def block_hashes(tokens: np.ndarray, salt: bytes, block_size: int) -> np.ndarray:
    """Chained ids of the whole `block_size` blocks of `tokens` (int64 of 63 bits, so any
    msgpack reader takes them as integers)."""
    data = np.ascontiguousarray(tokens, dtype=np.uint32)
    digests, parent = bytearray(), salt
    for i in range(len(data) // block_size):
        parent = hashlib.blake2b(parent + data[i * block_size:(i + 1) * block_size].tobytes(),
                                 digest_size=8).digest()
        digests += parent
    return (np.frombuffer(digests, dtype=">u8") >> 1).astype(np.int64)


class Publisher:
    """Its own thread owns the sockets. Batches go out in order, numbered from 0, the moment
    they are handed over: they come in on an inproc socket the thread polls with the others,
    because a router decides the next turn a few milliseconds after this one's answer."""

    def __init__(self, config: EventsConfig, on_subscribe: Callable[[], None]):
        self.config = config
        self.on_subscribe = on_subscribe  # a subscriber joined: the owner announces it all
        self._inbox = f"inproc://kv-events-{id(self)}"
        self._push: zmq.Socket | None = None  # the owner's end (one thread: the engine's)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> "Publisher":
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise SystemExit(f"--kv-events-endpoint {self.config.endpoint}: cannot bind "
                             f"({self._error})")
        return self

    def publish(self, events: list[dict]) -> None:
        """The owner's thread: one batch."""
        if not events:
            return
        if self._push is None:
            self._push = zmq.Context.instance().socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.connect(self._inbox)
        self._push.send(msgpack.packb([time.time(), events]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self._push is not None:
            self._push.close()

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every join, not only a topic's first
        pub.setsockopt(zmq.LINGER, 0)
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(self._inbox)
        replay = None
        try:
            pub.bind(self.config.endpoint)
            if self.config.replay_endpoint:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            for sock in (inbox, pub, replay):
                if sock is not None:
                    sock.close()
            return
        self._ready.set()
        logger.info("KV events on %s (replay %s, block size %d)", self.config.endpoint,
                    self.config.replay_endpoint or "off", self.config.block_size)
        topic = self.config.topic.encode()
        buffer: deque[tuple[int, bytes]] = deque()
        seq = buffered = 0
        poller = zmq.Poller()
        for sock in (inbox, pub, replay):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if pub in ready:
                    self._subscriptions(pub)
                if replay is not None and replay in ready:
                    self._replay(replay, topic, buffer)
                while inbox in ready:
                    try:
                        payload = inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    buffer.append((seq, payload))
                    buffered += len(payload)
                    while len(buffer) > 1 and (len(buffer) > REPLAY_BUFFER
                                               or buffered > REPLAY_BUFFER_BYTES):
                        buffered -= len(buffer.popleft()[1])
                    pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
                    seq += 1
        finally:
            for sock in (inbox, pub, replay):
                if sock is not None:
                    sock.close()

    def _subscriptions(self, pub: zmq.Socket) -> None:
        joined = False
        while True:
            try:
                msg = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            joined |= msg[:1] == b"\x01"
        if joined:
            self.on_subscribe()

    @staticmethod
    def _replay(sock: zmq.Socket, topic: bytes, buffer: deque) -> None:
        while True:
            try:
                ident, *rest = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            start = rest[-1] if rest else b""
            if len(start) != 8:
                continue
            first = int.from_bytes(start, "big")
            for seq, payload in list(buffer):
                if seq >= first:
                    sock.send_multipart([ident, b"", topic, seq.to_bytes(8, "big"), payload])
            sock.send_multipart([ident, b"", b"", END_SEQ, b""])


# A block's best medium, as a number: RAM over SSD over nothing.
NONE, SSD, RAM = 0, 1, 2
MEDIA = {RAM: MEDIUM_RAM, SSD: MEDIUM_SSD}
ANNOUNCE_BATCH_TOKENS = 1 << 20  # announce_all sends a batch every this many tokens
_NO_CHAIN = np.zeros(0, dtype=np.int64)


def common_blocks(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading blocks two chains share. Each id hashes the one before it, so equal
    ids at a position mean equal chains up to there: a shared block is a shared prefix."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[n - 1] == b[n - 1]:
        return n
    return int(np.argmin(a[:n] == b[:n]))


class _Ordered:
    """A chain in the lexicographic order of its ids."""
    __slots__ = ("chain",)

    def __init__(self, chain: np.ndarray):
        self.chain = chain

    def __lt__(self, other: "_Ordered") -> bool:
        a, b = self.chain, other.chain
        k = common_blocks(a, b)
        return k < len(b) and (k == len(a) or a[k] < b[k])


class _Book:
    """One medium's holders: each one's chain of block ids (8 bytes a block) and where its
    tokens are, kept in the chains' order. The most blocks a chain shares with any holder is
    what it shares with a neighbour there, so no count is kept per block: a block is held on
    the medium while some holder's chain reaches it."""

    def __init__(self):
        self.held: dict = {}  # holder -> (chain, its tokens or where to read them)
        self.order: list = []  # holders, their chains in order

    def shared(self, chain: np.ndarray) -> int:
        """How many leading blocks of `chain` some holder here holds."""
        if not len(chain) or not self.order:
            return 0
        i = self._where(chain)
        return max(common_blocks(chain, self.held[h][0]) for h in self.order[max(i - 1, 0):i + 1])

    def put(self, holder, chain: np.ndarray, source) -> None:
        self.order.insert(self._where(chain), holder)
        self.held[holder] = (chain, source)

    def pop(self, holder) -> tuple[np.ndarray, object]:
        got = self.held.get(holder)
        if got is None:
            return _NO_CHAIN, None
        i = self._where(got[0])
        while self.order[i] != holder:  # equal chains sit together
            i += 1
        del self.order[i]
        return self.held.pop(holder)

    def _where(self, chain: np.ndarray) -> int:
        return bisect.bisect_left(self.order, _Ordered(chain),
                                  key=lambda h: _Ordered(self.held[h][0]))


def _best(n: int, ram: int, ssd: int) -> np.ndarray:
    """The best medium of each of `n` blocks where RAM holds the first `ram`, SSD the first
    `ssd`."""
    i = np.arange(n)
    return np.where(i < ram, RAM, np.where(i < ssd, SSD, NONE))


class KVEvents:
    """The engine thread's book of what this machine holds. Each block is announced once, on
    the best medium holding it (RAM over SSD): announcing a block held in RAM as storage too
    would let the later claim stand for both, and the router credits it as disk. Changes
    become events, sent as one batch per turn of the engine's loop (`flush`).

    A store holds many conversations of 80-100K tokens, so the book keeps of each only its
    chain of block ids (an int64 each: 50 KB for 100K tokens), not its tokens: a RAM entry's
    are the entry's own, an SSD one's are read from LMDB (`ssd_tokens`) when a subscriber joins.
    What the router was told is not kept either: it is what the book holds, each block on its
    best medium, so a change's events follow from the book before and after it."""

    def __init__(self, publisher: Publisher, *, salt_for: Callable[[str], bytes],
                 block_size: int,
                 ssd_tokens: Callable[[tuple[str, str]], np.ndarray | None] = lambda s: None):
        """`ssd_tokens(session)`: what LMDB holds of a conversation (the KV manager's
        Conversations.history, engine thread), read when its SSD blocks are announced again."""
        self.publisher = publisher
        self.salt_for = salt_for
        self.block_size = block_size
        self.ssd_tokens = ssd_tokens
        self._books = {RAM: _Book(), SSD: _Book()}
        self._pending: list[dict] = []

    # -- what changed (engine thread) ---------------------------------------------------------

    def ram_added(self, entry) -> None:
        self._hold(RAM, entry.key, entry.session[0], entry.tokens)

    def ram_removed(self, entry) -> None:
        self._hold(RAM, entry.key, entry.session[0], None)

    def ssd_holds(self, session: tuple[str, str], tokens: np.ndarray | None) -> None:
        """LMDB holds `tokens` of this conversation now (None: nothing any more)."""
        self._hold(SSD, session, session[0], tokens)

    def announce_all(self) -> None:
        """Everything again, after clearing: a subscriber joined, or the worker started. Each
        block once, from the first holder (in the chains' order) that reaches it, RAM's first."""
        self._pending.append({"type": "AllBlocksCleared"})
        tokens_since_flush = 0
        for medium, book in self._books.items():
            before = _NO_CHAIN
            for holder in book.order:
                chain, source = book.held[holder]
                start = common_blocks(chain, before)
                if medium == SSD:
                    start = max(start, self._books[RAM].shared(chain))
                before = chain
                if start == len(chain):
                    continue
                tokens = self._tokens(source)
                if tokens is None or len(tokens) < len(chain) * self.block_size:
                    logger.warning("KV events: the tokens of %s are not there to announce",
                                   holder)
                    continue
                self._stored(medium, chain, tokens, start, len(chain))
                tokens_since_flush += (len(chain) - start) * self.block_size
                if tokens_since_flush >= ANNOUNCE_BATCH_TOKENS:  # the batch stays bounded
                    self.flush()
                    tokens_since_flush = 0

    def flush(self) -> None:
        if self._pending:
            self.publisher.publish(self._pending)
            self._pending = []

    # -- the book -----------------------------------------------------------------------------

    def _tokens(self, source) -> np.ndarray | None:
        return source if isinstance(source, np.ndarray) else self.ssd_tokens(source)

    def _hold(self, medium: int, holder, tenant: str, tokens: np.ndarray | None) -> None:
        """`holder` holds the whole blocks of `tokens` on `medium` now (None: nothing). The
        blocks it held and holds no more, and the ones it holds now and did not, may change
        their best medium: removals go out first, then stores, each store a run after the
        block before it (None at the root)."""
        B = self.block_size
        book, other = self._books[medium], self._books[SSD if medium == RAM else RAM]
        old, old_source = book.pop(holder)
        new = _NO_CHAIN
        if tokens is not None and len(tokens) >= B:
            new = block_hashes(tokens[:len(tokens) // B * B], self.salt_for(tenant), B)
        k = common_blocks(old, new)
        if k == len(old) == len(new):  # the same blocks (a progress report, a take-back)
            if len(new):
                book.put(holder, new, tokens if medium == RAM else holder)
            return

        def split(mine: int, others: int) -> tuple[int, int]:  # (RAM's reach, SSD's)
            return (mine, others) if medium == RAM else (others, mine)

        # Each changed block's best medium before and after, with the holder out of its book.
        on_other, on_other_new = other.shared(old), other.shared(new)
        changes = [
            (old, old_source, _best(len(old), *split(len(old), on_other)),
             _best(len(old), *split(book.shared(old), on_other))),
            (new, tokens, _best(len(new), *split(book.shared(new), on_other_new)),
             _best(len(new), *split(len(new), on_other_new)))]
        removed: dict[int, list[int]] = {RAM: [], SSD: []}
        stored = []
        for chain, source, was, now in changes:
            changed = np.flatnonzero(was[k:] != now[k:]) + k
            for m in (RAM, SSD):
                removed[m] += chain[changed[was[changed] == m]].tolist()
                stored += [(m, chain, source, run) for run in _runs(changed[now[changed] == m])]
        for m, hashes in removed.items():
            if hashes:
                self._pending.append({"type": "BlockRemoved", "block_hashes": hashes,
                                      "medium": MEDIA[m]})
        for m, chain, source, (i, j) in sorted(stored, key=lambda s: -s[0]):
            self._stored(m, chain, self._tokens(source), i, j)
        if len(new):
            book.put(holder, new, tokens if medium == RAM else holder)

    def _stored(self, medium: int, chain: np.ndarray, tokens: np.ndarray, i: int, j: int):
        """Blocks i to j of `chain` stored on `medium`, after the block before them."""
        B = self.block_size
        self._pending.append({
            "type": "BlockStored", "block_hashes": chain[i:j].tolist(),
            "parent_block_hash": int(chain[i - 1]) if i else None,
            "token_ids": np.asarray(tokens[i * B:j * B]).tolist(), "block_size": B,
            "lora_id": None, "medium": MEDIA[medium], "lora_name": None})


def _runs(blocks: np.ndarray) -> list[tuple[int, int]]:
    """The runs of consecutive positions in `blocks` (ascending), as (start, end)."""
    if not len(blocks):
        return []
    cuts = np.flatnonzero(np.diff(blocks) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(blocks, cuts)]
