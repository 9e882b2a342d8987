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
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

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
    """Its own thread owns the sockets. Batches go out in order, numbered from 0."""

    def __init__(self, config: EventsConfig, on_subscribe: Callable[[], None]):
        self.config = config
        self.on_subscribe = on_subscribe  # a subscriber joined: the owner announces it all
        self._out: queue.Queue = queue.Queue()
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
        """Any thread: one batch."""
        if events:
            self._out.put((time.time(), events))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every join, not only a topic's first
        pub.setsockopt(zmq.LINGER, 0)
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
            return
        self._ready.set()
        logger.info("KV events on %s (replay %s, block size %d)", self.config.endpoint,
                    self.config.replay_endpoint or "off", self.config.block_size)
        topic = self.config.topic.encode()
        buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        seq = 0
        poller = zmq.Poller()
        poller.register(pub, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(20))
                if pub in ready:
                    self._subscriptions(pub)
                if replay is not None and replay in ready:
                    self._replay(replay, topic, buffer)
                while True:
                    try:
                        ts, events = self._out.get_nowait()
                    except queue.Empty:
                        break
                    payload = msgpack.packb([ts, events])
                    buffer.append((seq, payload))
                    pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
                    seq += 1
        finally:
            pub.close()
            if replay is not None:
                replay.close()

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
    """The engine thread's book of what this machine holds, per medium; changes become
    events, sent as one batch per turn of the engine's loop (`flush`)."""

    def __init__(self, publisher: Publisher, *, salt_for: Callable[[str], bytes],
                 block_size: int):
        self.publisher = publisher
        self.salt_for = salt_for
        self.block_size = block_size
        self._count = {MEDIUM_RAM: {}, MEDIUM_SSD: {}}  # medium -> hash -> holders
        self._held = {MEDIUM_RAM: {}, MEDIUM_SSD: {}}  # medium -> holder -> (hashes, tokens)
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
        for medium, held in self._held.items():
            for hashes, tokens in held.values():
                self._stored(medium, hashes, tokens)

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
        fresh = False
        for h in new_hashes:
            counts[h] = counts.get(h, 0) + 1
            fresh |= counts[h] == 1
        gone = []
        for h in (old[0] if old else ()):
            counts[h] -= 1
            if not counts[h]:
                del counts[h]
                gone.append(h)
        if gone:
            self._pending.append({"type": "BlockRemoved", "block_hashes": gone,
                                  "medium": medium})
        if fresh:  # the whole chain from its root: the router anchors it there
            self._stored(medium, new_hashes, held[holder][1])

    def _stored(self, medium: str, hashes: list[int], tokens: np.ndarray) -> None:
        self._pending.append({
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens.tolist(), "block_size": self.block_size, "lora_id": None,
            "medium": medium, "lora_name": None})


def held_conversations(records: Iterable) -> Iterable:
    """(key, tokens LMDB holds) for every conversation record with durable KV."""
    for key, info in records:
        if info.durable_tokens:
            yield key, info.tokens[:info.durable_tokens]
