"""The worker's side of the ZeroMQ link to the coldstore (proto/kvbank/v1/coldstore.proto).

One I/O thread owns the sockets (ZeroMQ sockets are not thread-safe): a DEALER to the
coldstore's ROUTER for requests, write jobs and their acknowledgements, and a PUB that says
busy/quiet every `STATE_EVERY_S` and on each change. Other threads hand messages to it through
an inproc PUSH/PULL pair, one PUSH per thread.

The API is typed: `call(ping=pb.Ping())` sends a `Request` and returns its `Reply` and frames,
`send(cancel=pb.Cancel(job=3))` fires and forgets, `send_write(pb.Write(...), payloads)`
streams a write job. The coldstore's unasked messages (`progress`, `done`, `retired`) reach
`on_event` as `pb.Message`s, on the I/O thread.

The link never blocks generation for long: a request waits at most its timeout, and a coldstore
that is down only means writes wait (ZeroMQ reconnects by itself when it is back).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

import zmq

from kvbank.config import Layout
from kvbank.contracts import coldstore_wire as wire
from kvbank.contracts.coldstore_wire import pb
from kvbank.contracts.failures import ColdstoreUnavailable

logger = logging.getLogger(__name__)

__all__ = ["ColdstoreClient", "ColdstoreUnavailable", "STREAM_CHUNK_BYTES", "pb"]

STATE_EVERY_S = 0.1
STREAM_CHUNK_BYTES = 8 << 20
_OUT = "inproc://kvbank-coldstore-out"


class ColdstoreClient:
    def __init__(self, layout: Layout, on_event: Callable[[pb.Message], None]):
        self.layout = layout
        # Called on the I/O thread with each `progress`, `done` and `retired` (never a reply).
        self.on_event = on_event
        self.ctx = zmq.Context()
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(_OUT)
        self._local = threading.local()
        self._pushes: list[zmq.Socket] = []
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._said_state = b"quiet"  # the caller's of set_busy (the engine thread's)
        self._state = b"quiet"  # the I/O thread's: what it publishes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coldstore-io", daemon=True)

    def start(self) -> "ColdstoreClient":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        try:
            self._send_raw([b"wake"], flags=zmq.NOBLOCK)
        except zmq.Again:  # the I/O thread is gone already: nothing to wake
            pass
        self._thread.join(timeout=2)
        with self._lock:
            for push in self._pushes:
                push.close(linger=0)
            self._pushes.clear()
        self.ctx.term()  # blocks while any socket is open: all are closed above

    # -- any thread -------------------------------------------------------------------------

    def next_id(self) -> int:
        """A number no other request or write job of this client carries."""
        return next(self._ids)

    def call(self, *, timeout_s: float = 10.0, frames: Sequence = (),
             **op) -> tuple[pb.Reply, list]:
        """Send one op (`call(ping=pb.Ping())`) and wait for its Reply: (reply, the frames
        after it, as memoryviews). Raises ColdstoreUnavailable on timeout or `ok=False`."""
        name = _op_name(op)
        req = self.next_id()
        fut: Future = Future()
        with self._lock:
            self._pending[req] = fut
        try:
            self._post(pb.Request(req=req, **op), frames)
            reply, got = fut.result(timeout=timeout_s)
        except TimeoutError:
            raise ColdstoreUnavailable(f"coldstore did not answer {name} in {timeout_s}s") from None
        finally:
            with self._lock:
                self._pending.pop(req, None)
        if not reply.ok:
            raise ColdstoreUnavailable(f"coldstore refused {name}: {reply.error}")
        return reply, got

    def put_session(self, tenant: str, session_id: str, block_tokens: int, tokens: bytes,
                    timeout_s: float = 10.0) -> int:
        """Commit a conversation's token ids (uint32 little-endian); its durable extent."""
        reply, _ = self.call(put_session=pb.PutSession(tenant=tenant, session_id=session_id,
                                                       block_tokens=block_tokens),
                             frames=[tokens], timeout_s=timeout_s)
        return reply.put_session.durable_tokens

    def put_response(self, tenant: str, response_id: str, created_at: float, body: bytes,
                     timeout_s: float = 10.0) -> None:
        """Keep a Responses API response (durable on return)."""
        self.call(put_response=pb.PutResponse(tenant=tenant, id=response_id,
                                              created_at=created_at),
                  frames=[body], timeout_s=timeout_s)

    def get_response(self, tenant: str, response_id: str, timeout_s: float = 10.0
                     ) -> bytes | None:
        reply, frames = self.call(get_response=pb.ResponseKey(tenant=tenant, id=response_id),
                                  timeout_s=timeout_s)
        return bytes(frames[0]) if reply.get_response.found else None

    def delete_response(self, tenant: str, response_id: str, timeout_s: float = 10.0) -> bool:
        reply, _ = self.call(delete_response=pb.ResponseKey(tenant=tenant, id=response_id),
                             timeout_s=timeout_s)
        return reply.delete_response.deleted

    def delete_session(self, tenant: str, session_id: str, timeout_s: float = 10.0) -> bool:
        """Delete a conversation's record (its queued jobs are cancelled); whether it had one."""
        reply, _ = self.call(delete_session=pb.DeleteSession(tenant=tenant,
                                                             session_id=session_id),
                             timeout_s=timeout_s)
        return reply.delete_session.deleted

    def ping(self, timeout_s: float = 2.0) -> pb.PingReply:
        reply, _ = self.call(ping=pb.Ping(), timeout_s=timeout_s)
        return reply.ping

    def get_blocks(self, ids: list[bytes], timeout_s: float = 10.0) -> list:
        """The blocks' payloads through the coldstore, one frame (a memoryview) per id;
        an empty one where the store lacks the block."""
        _, frames = self.call(get_blocks=pb.GetBlocks(ids=ids), timeout_s=timeout_s)
        if len(frames) != len(ids):
            raise ColdstoreUnavailable(f"coldstore answered get_blocks with {len(frames)} "
                                       f"frames for {len(ids)} ids")
        return frames

    def send(self, frames: Sequence = (), **op) -> None:
        """Fire and forget one op (`send(cancel=pb.Cancel(job=3))`); queued by ZeroMQ while
        the coldstore is down."""
        _op_name(op)
        self._post(pb.Request(**op), frames)

    def send_write(self, write: pb.Write, payloads: Sequence, released: Sequence[str] = ()
                   ) -> None:
        """A write job, its payloads streamed: the first block's payload rides with the header
        and the rest follow in `payload` messages of about STREAM_CHUNK_BYTES, so the
        coldstore commits the first block while the others are still in transit. With a
        payload for every block, each block's `nbytes` is set from it; with fewer, the blocks
        announce their sizes already and the rest come later (`send_payloads`). A payload
        that is a `str` names a shared-memory buffer holding it (Write.shm): those go in one
        message, the few that are frames beside them. `released`: shared buffers the worker
        let go of (Write.shm_released)."""
        write.shm_released.extend(released)
        if len(payloads) > len(write.blocks) or not payloads:
            raise ValueError(f"{len(payloads)} payloads for {len(write.blocks)} blocks")
        if not all(b.HasField("nbytes") for b in write.blocks):
            if len(payloads) < len(write.blocks) or any(isinstance(p, str) for p in payloads):
                raise ValueError("a write whose payloads stream later or lie in shared memory "
                                 "announces their sizes")
            for block, payload in zip(write.blocks, payloads):
                block.nbytes = len(payload)
        if any(isinstance(p, str) for p in payloads):
            write.shm.extend(_names(payloads))
            self.send(write=write, frames=[p for p in payloads if not isinstance(p, str)])
            return
        self.send(write=write, frames=payloads[:1])
        self.send_payloads(write.job, payloads[1:])

    def send_payloads(self, job: int, payloads: Sequence, released: Sequence[str] = ()
                      ) -> None:
        """The next blocks' payloads of a write job, in order, in messages of about
        STREAM_CHUNK_BYTES (or, as in `send_write`, names of shared memory in one)."""
        if any(isinstance(p, str) for p in payloads) or released:
            self.send(payload=pb.Payload(job=job, shm=_names(payloads), shm_released=released),
                      frames=[p for p in payloads if not isinstance(p, str)])
            return
        chunk, size = [], 0
        for payload in payloads:
            chunk.append(payload)
            size += len(payload)
            if size >= STREAM_CHUNK_BYTES:
                self.send(payload=pb.Payload(job=job), frames=chunk)
                chunk, size = [], 0
        if chunk:
            self.send(payload=pb.Payload(job=job), frames=chunk)

    def sees_shared_memory(self, name: str, timeout_s: float = 2.0) -> bool:
        """Whether the coldstore read the probe in the shared-memory buffer `name`."""
        reply, _ = self.call(ping=pb.Ping(shm_probe=name), timeout_s=timeout_s)
        return reply.ping.shm_ok

    def set_busy(self, busy: bool, write_now: bool = False) -> None:
        """One thread's (the engine's): whether it is computing, or needs the memory the
        coldstore's queued writes hold (`write_now`: it writes them at once, tails too); the
        I/O thread publishes it."""
        state = b"write-now" if write_now else b"busy" if busy else b"quiet"
        if state != self._said_state:
            self._said_state = state
            self._send_raw([b"busy", state])

    def _post(self, request: pb.Request, frames: Sequence) -> None:
        self._send_raw([b"msg", *wire.encode(request, frames)])

    def _send_raw(self, parts: list, flags: int = 0) -> None:
        push = getattr(self._local, "push", None)
        if push is None:
            push = self._local.push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(_OUT)
            with self._lock:
                self._pushes.append(push)
        push.send_multipart(parts, flags=flags, copy=False)

    # -- the I/O thread ---------------------------------------------------------------------

    def _run(self) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"worker")
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.layout.coldstore_address)
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.layout.worker_state_address)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        last_state, sent_state = 0.0, None
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(int(STATE_EVERY_S * 1000)))
                    if self._pull in events:
                        self._forward(dealer)
                    if dealer in events:
                        self._receive(dealer)
                    now = time.monotonic()
                    if self._state != sent_state or now - last_state >= STATE_EVERY_S:
                        pub.send(self._state)
                        sent_state, last_state = self._state, now
                except Exception:  # the link outlives a bad message: writes depend on it
                    logger.exception("coldstore link: I/O step failed")
        finally:
            dealer.close()
            pub.close()
            self._pull.close()

    def _forward(self, dealer: zmq.Socket) -> None:
        """Other threads' messages, out to the coldstore."""
        while True:
            try:
                parts = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if parts[0].bytes == b"msg":
                dealer.send_multipart(parts[1:], copy=False)
            elif parts[0].bytes == b"busy":
                self._state = parts[1].bytes

    def _receive(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                parts = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg, frames = wire.decode(parts)
            self._dispatch(msg, [f.buffer for f in frames])

    def _dispatch(self, msg: pb.Message, frames: list) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "reply":
            with self._lock:
                fut = self._pending.get(msg.reply.req)
            if fut is not None and not fut.done():
                fut.set_result((msg.reply, frames))
            elif not msg.reply.ok:  # a fire-and-forget message the coldstore could not take
                logger.warning("coldstore refused a message (req %d): %s", msg.reply.req,
                               msg.reply.error)
            return
        if kind is None:
            logger.warning("coldstore sent a message of no kind known here")
            return
        try:
            self.on_event(msg)
        except Exception:
            logger.exception("coldstore event handler failed")


def _op_name(op: dict) -> str:
    if len(op) != 1:
        raise TypeError(f"one op per request, not {sorted(op) or 'none'}")
    return next(iter(op))


def _names(payloads: Sequence) -> list[str]:
    """Write.shm / Payload.shm: each payload's buffer name, '' where it is a frame."""
    return [p if isinstance(p, str) else "" for p in payloads]
