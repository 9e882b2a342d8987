"""The worker's side of the ZeroMQ link to the coldstore.

One I/O thread owns the sockets (ZeroMQ sockets are not thread-safe): a DEALER to the
coldstore's ROUTER for requests, write jobs and their acknowledgements, and a PUB that says
busy/quiet every `STATE_EVERY_S` and on each change. Other threads hand messages to it through
an inproc PUSH/PULL pair, one PUSH per thread.

The link never blocks generation for long: a request waits at most its timeout, and a coldstore
that is down only means writes wait (ZeroMQ reconnects by itself when it is back).
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

import zmq

from kvbank.config import Layout

logger = logging.getLogger(__name__)

STATE_EVERY_S = 0.1
STREAM_CHUNK_BYTES = 8 << 20
_OUT = "inproc://kvbank-coldstore-out"


class ColdstoreUnavailable(Exception):
    pass


class ColdstoreClient:
    def __init__(self, layout: Layout, on_event: Callable[[dict], None]):
        self.layout = layout
        self.on_event = on_event  # called on the I/O thread with "progress"/"done" messages
        self.ctx = zmq.Context()
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(_OUT)
        self._local = threading.local()
        self._pushes: list[zmq.Socket] = []
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._busy = False
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
        return next(self._ids)

    def request(self, head: dict, frames: Sequence = (), timeout_s: float = 10.0) -> dict:
        """Send and wait for the reply (raises ColdstoreUnavailable on timeout or refusal)."""
        req = self.next_id()
        fut: Future = Future()
        with self._lock:
            self._pending[req] = fut
        self.send({**head, "req": req}, frames)
        try:
            reply = fut.result(timeout=timeout_s)
        except TimeoutError:
            raise ColdstoreUnavailable(f"coldstore did not answer {head.get('op')} in {timeout_s}s")
        finally:
            with self._lock:
                self._pending.pop(req, None)
        if not reply.get("ok"):
            raise ColdstoreUnavailable(f"coldstore refused {head.get('op')}: {reply.get('error')}")
        return reply

    def send(self, head: dict, frames: Sequence = ()) -> None:
        """Fire and forget (write jobs, cancels); queued by ZeroMQ while the coldstore is down."""
        self._send_raw([b"msg", json.dumps(head).encode(), *frames])

    def send_write(self, head: dict, payloads: Sequence) -> None:
        """A write job, its payloads streamed: the first block's rides with the header and the
        rest follow in `payload` messages of about STREAM_CHUNK_BYTES, so the coldstore commits
        the first block while the others are still in transit."""
        for block, payload in zip(head["blocks"], payloads):
            block["bytes"] = len(payload)
        self.send(head, payloads[:1])
        chunk, size = [], 0
        for payload in payloads[1:]:
            chunk.append(payload)
            size += len(payload)
            if size >= STREAM_CHUNK_BYTES:
                self.send({"op": "payload", "job": head["job"]}, chunk)
                chunk, size = [], 0
        if chunk:
            self.send({"op": "payload", "job": head["job"]}, chunk)

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._busy = busy
            self._send_raw([b"wake"])

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
        last_state, sent_busy = 0.0, None
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(int(STATE_EVERY_S * 1000)))
                    if self._pull in events:
                        self._forward(dealer)
                    if dealer in events:
                        self._receive(dealer)
                    now = time.monotonic()
                    if self._busy != sent_busy or now - last_state >= STATE_EVERY_S:
                        pub.send(b"busy" if self._busy else b"quiet")
                        sent_busy, last_state = self._busy, now
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

    def _receive(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                parts = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(json.loads(parts[0]), parts[1:])

    def _dispatch(self, msg: dict, frames: list[bytes]) -> None:
        req = msg.get("req")
        if req is not None and "op" not in msg:
            if frames:
                msg["frames"] = frames
            with self._lock:
                fut = self._pending.get(req)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            return
        try:
            self.on_event(msg)
        except Exception:
            logger.exception("coldstore event handler failed")
