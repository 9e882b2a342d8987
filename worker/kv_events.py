"""KV events: which token blocks this machine holds, announced to a router in front of several
machines, in vLLM's wire format, so `vllm-router --policy kv_aware` sends each conversation
back to the machine that holds its KV.

What is announced (`medium`): blocks in the RAM bank as device memory ("GPU"), blocks
committed in LMDB as disk ("STORAGE"), which the router credits least. The bank's KV is MLX
arrays the model computes from directly (unified memory on Apple silicon, the same RAM on a
CPU): a hit there costs a copy, like a GPU prefix-cache hit, not a transfer. Credited as host
memory (0.8) instead, a returning agent lost its machine to a less loaded one 2 to 5 times in
30 in tests/test_cluster.py; as device memory, none. A block is announced when the first holder on a medium takes it and removed when the
last one lets go. At start, and whenever a subscriber joins, the whole state goes out again
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
batch from there, `[topic, seq, payload]` each, then an end marker (empty topic, sequence -1,
empty payload).
"""

from __future__ import annotations

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
REPLAY_BUFFER = 10_000  # batches kept for replay


@dataclass(frozen=True)
class EventsConfig:
    endpoint: str  # the publisher binds it: tcp://HOST:PORT (the router connects)
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int = 16


def block_hashes(tokens: np.ndarray, salt: bytes, block_size: int) -> list[int]:
    """Chained ids of the whole `block_size` blocks of `tokens` (63 bits, so any msgpack
    reader takes them as integers)."""
    out, parent = [], salt
    data = np.ascontiguousarray(tokens, dtype=np.uint32)
    for i in range(len(data) // block_size):
        h = hashlib.blake2b(parent + data[i * block_size:(i + 1) * block_size].tobytes(),
                            digest_size=8).digest()
        out.append(int.from_bytes(h, "big") >> 1)
        parent = h
    return out


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
        buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        seq = 0
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


class KVEvents:
    """The engine thread's book of what this machine holds. Each block is announced once, on
    the best medium holding it (RAM over SSD): announcing a block held in RAM as storage too
    would let the later claim stand for both, and the router credits it as disk. Changes
    become events, sent as one batch per turn of the engine's loop (`flush`)."""

    def __init__(self, publisher: Publisher, *, salt_for: Callable[[str], bytes],
                 block_size: int):
        self.publisher = publisher
        self.salt_for = salt_for
        self.block_size = block_size
        self._count = {MEDIUM_RAM: {}, MEDIUM_SSD: {}}  # medium -> hash -> holders
        self._held = {MEDIUM_RAM: {}, MEDIUM_SSD: {}}  # medium -> holder -> (hashes, tokens)
        self._announced: dict[int, str] = {}  # hash -> the medium the router was told
        self._pending: list[dict] = []

    # -- what changed (engine thread) ---------------------------------------------------------

    def ram_added(self, entry) -> None:
        self._hold(MEDIUM_RAM, ("entry", entry.key), entry.session[0], entry.tokens)

    def ram_removed(self, entry) -> None:
        self._hold(MEDIUM_RAM, ("entry", entry.key), entry.session[0], None)

    def ssd_holds(self, session: tuple[str, str], tokens: np.ndarray | None) -> None:
        """LMDB holds `tokens` of this conversation now (None: nothing any more)."""
        self._hold(MEDIUM_SSD, ("session", session), session[0], tokens)

    def announce_all(self) -> None:
        """Everything again, after clearing: a subscriber joined, or the worker started."""
        self._pending.append({"type": "AllBlocksCleared"})
        self._announced.clear()
        self._announce(set(self._count[MEDIUM_RAM]) | set(self._count[MEDIUM_SSD]))

    def flush(self) -> None:
        if self._pending:
            self.publisher.publish(self._pending)
            self._pending = []

    # -- the book -----------------------------------------------------------------------------

    def _hold(self, medium: str, holder, tenant: str, tokens: np.ndarray | None) -> None:
        counts, held = self._count[medium], self._held[medium]
        old = held.pop(holder, None)
        new_hashes: list[int] = []
        if tokens is not None:
            n = len(tokens) // self.block_size * self.block_size
            if n:
                tokens = np.asarray(tokens[:n], dtype=np.uint32)
                new_hashes = block_hashes(tokens, self.salt_for(tenant), self.block_size)
                held[holder] = (new_hashes, tokens)
        for h in new_hashes:
            counts[h] = counts.get(h, 0) + 1
        for h in (old[0] if old else ()):
            counts[h] -= 1
            if not counts[h]:
                del counts[h]
        self._announce(set(new_hashes) | set(old[0] if old else ()))

    def _best(self, h: int) -> str | None:
        return (MEDIUM_RAM if h in self._count[MEDIUM_RAM]
                else MEDIUM_SSD if h in self._count[MEDIUM_SSD] else None)

    def _announce(self, changed: set[int]) -> None:
        """Tell the router what changed among `changed`: removals first, then each medium's
        stores as chains anchored at their root or at the block before them."""
        removed: dict[str, list[int]] = {}
        wanted: dict[str, set[int]] = {MEDIUM_RAM: set(), MEDIUM_SSD: set()}
        for h in changed:
            was, now = self._announced.get(h), self._best(h)
            if was == now:
                continue
            if was is not None:
                removed.setdefault(was, []).append(h)
                del self._announced[h]
            if now is not None:
                wanted[now].add(h)
        for medium, hashes in removed.items():
            self._pending.append({"type": "BlockRemoved", "block_hashes": hashes,
                                  "medium": medium})
        for medium, hashes in wanted.items():
            for chain, tokens in self._held[medium].values():
                if hashes and not hashes.isdisjoint(chain):
                    self._stored_runs(medium, chain, tokens, hashes)

    def _stored_runs(self, medium: str, chain: list[int], tokens: np.ndarray,
                     wanted: set[int]) -> None:
        """The runs of `chain` to announce on `medium`: blocks wanted there, each run after
        the block before it (None at the root)."""
        B, i = self.block_size, 0
        while i < len(chain):
            if chain[i] not in wanted or self._announced.get(chain[i]) == medium:
                i += 1
                continue
            j = i
            while j < len(chain) and chain[j] in wanted and \
                    self._announced.get(chain[j]) != medium:
                self._announced[chain[j]] = medium
                j += 1
            self._pending.append({
                "type": "BlockStored", "block_hashes": chain[i:j],
                "parent_block_hash": chain[i - 1] if i else None,
                "token_ids": tokens[i * B:j * B].tolist(), "block_size": B, "lora_id": None,
                "medium": medium, "lora_name": None})
            i = j
