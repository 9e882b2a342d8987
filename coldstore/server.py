"""The coldstore process: ZeroMQ endpoints in front of the LMDB store.

One thread owns everything (the sockets, the lanes, the write transactions), so the store has
exactly one writer and no locks. Each loop turn handles what arrived, then writes at most one
block, so a message never waits behind more than one block's commit.

Messages are multipart: a serialized protobuf header (proto/kvbank/v1/coldstore.proto), then
raw frames (token ids, block payloads), framed by kvbank/contracts/coldstore_wire.py. The
worker sends a `Request` whose `op` is one of:
    put_session    PutSession{tenant, session_id, block_tokens} + the token ids (uint32 LE)
                   -> Reply{put_session: SessionPut{durable_tokens}} after the commit
    delete_session DeleteSession{tenant, session_id}
                   -> Reply{delete_session: SessionDeleted{deleted}} after the commit
    write          Write{job, tenant, session_id, root, blocks: [Block{id, start, nbytes?,
                   tail}], dirty_since, give_up_at?} + the first blocks' payloads
                   -> `Progress` after each committed block, `Done` with an outcome at the end
    payload        Payload{job} + the next blocks' payloads (a job's payloads stream in behind)
    promote        Promote{job, give_up_at}   a queued job becomes a write-out with a deadline
    cancel         Cancel{job}
    get_blocks     GetBlocks{ids}   -> Reply{get_blocks: BlocksFollow} + one frame per id
                   (empty: not stored)
    ping           Ping             -> Reply{ping: PingReply}: store stats, worker state, the
                   queued jobs, staged and written bytes, budgets
    drop_blocks    DropBlocks{ids}  blocks a restore found corrupt: deleted, every record
                   naming one cut short of it (a `retired`, reason corrupt_block, for each)
    put_response   PutResponse{tenant, id, created_at} + its JSON -> Reply after the commit
                   (the Responses API's stored responses; under the store's cap and TTL)
    get_response   ResponseKey{tenant, id} -> Reply{get_response: {found}} + its JSON
    delete_response ResponseKey{tenant, id} -> Reply{delete_response: {deleted}}
A request with `req` > 0 is answered with a `Reply` carrying that number; one that fails (a
header that does not parse included) is answered `Reply{ok: false, error}` and the loop goes
on. Block ids and roots travel as bytes.
To the worker, unasked (each a `Message`):
    progress       Progress{job, tenant, session_id, durable_tokens}
    done           Done{job, outcome, tenant, session_id, durable_tokens, error, reason,
                   taken_back, by?}   (outcome: kvbank.contracts.vocabulary.Outcome)
    retired        Retired{tenant, session_id, reason, removed, at, durable_tokens}   a
                   record was retired (`anonymous_ttl`, `store_cap`) or cut short of a corrupt
                   block (`corrupt_block`); also an event in the event log
"""

from __future__ import annotations

import logging
import shutil
import signal
import time
from collections import deque

import numpy as np
import zmq

from kvbank import events, heap, metrics
from kvbank.blocks import BlockId, is_anonymous
from kvbank.config import Layout
from kvbank.contracts import coldstore_wire as wire
from kvbank.contracts.coldstore_wire import pb
from kvbank.contracts.pricing import WRITE_KEEP_MARGIN_BYTES, coldstore_write_bytes
from kvbank.contracts.vocabulary import Outcome
from kvbank.coldstore.budgets import Budgets, Limits, WriteRefusal
from kvbank.coldstore.lanes import Lanes, PendingBlock, WriteJob
from kvbank.coldstore.salvage import open_store
from kvbank.coldstore.shared import SharedPayloads
from kvbank.coldstore.store import SessionMeta, StoreFull

logger = logging.getLogger(__name__)

FLUSH_ON_STOP_S = 10.0
EXPIRE_EVERY_S = 60.0
DEFAULT_ANONYMOUS_TTL_S = 7 * 86400.0
WORKER_PEER = b"worker"  # the worker's DEALER identity
# glibc's trim threshold: none while writing (`keep_freed_pages`), but no more than
# `coldstore_write_bytes` and a margin beyond the payloads held (`ColdstoreServer._bound_heap`)
KEEP_FREED_BYTES = 1 << 30


def keep_freed_pages() -> None:
    """Every buffer from glibc's one heap, its freed pages kept while the loop is busy and
    given back once it goes idle (`ColdstoreServer._idle`).

    A block arrives in a buffer ZeroMQ allocates, and LMDB copies it into pages it allocates
    for the commit. Qwen3.6-27B's recurrent-state checkpoint is 154 MB, past the largest mmap
    threshold glibc takes (32 MB), and libzmq's I/O thread allocates in an arena of its own,
    whose heaps go back to the OS once empty: each such buffer was mapped, faulted in page by
    page and unmapped, twice per payload: 190-220 K page faults for each 1.38 GB the
    coldstore wrote (`kvbank bench scale --tokens 16384`: 1 GiB of KV and two checkpoints a
    build, this 2-core VM, Dec 2026), where a fault costs more CPU than the copy into its
    page. From one heap, untrimmed while writing: 94 K for the first build, under 30 each
    after it."""
    if heap.glibc() and not (heap.mallopt(heap.M_ARENA_MAX, 1)
                             and heap.mallopt(heap.M_MMAP_MAX, 0)
                             and heap.mallopt(heap.M_TRIM_THRESHOLD, KEEP_FREED_BYTES)):
        logger.warning("glibc refused the coldstore's heap settings: its buffers are "
                       "faulted in afresh")


class ColdstoreServer:
    def __init__(self, layout: Layout, *, quiet_grace_s: float = 0.25, max_dirty_s: float = 30.0,
                 tail_delay_s: float = 30.0, payload_stall_s: float = 30.0,
                 limits: Limits = Limits(), anonymous_ttl_s: float = DEFAULT_ANONYMOUS_TTL_S):
        self.layout = layout.ensure()
        # A data file found damaged is set aside and salvaged first (`salvage` says how).
        self.store, self.salvage = open_store(layout.store_dir,
                                              map_max_bytes=limits.store_map_bytes)
        self.map_full = False  # the last KV block found LMDB's map full at its ceiling
        self.limits = limits
        self.anonymous_ttl_s = anonymous_ttl_s
        self._expired_at = 0.0
        self.budgets = Budgets(limits, layout.store_dir)
        self.lanes = Lanes(quiet_grace_s=quiet_grace_s, max_dirty_s=max_dirty_s,
                           tail_delay_s=tail_delay_s, payload_stall_s=payload_stall_s)
        self.written_bytes = 0  # block payload bytes committed since start (benchmarks)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its identity
        self.sock.bind(layout.coldstore_address)
        self.state = self.ctx.socket(zmq.SUB)
        self.state.setsockopt(zmq.SUBSCRIBE, b"")
        self.state.connect(layout.worker_state_address)
        self.stopping = False
        self._heap_used = False  # a message came since the heap's pages last went back
        self._anon_floor = 0  # its anonymous memory after its last trim, beyond the payloads
        self._largest = 0  # the largest block written since the heap last went back
        self.shared = SharedPayloads()  # the worker's buffers it names, mapped while busy

    def _enforce_cap(self) -> None:
        """A store found over its cap (a restart with a smaller cap, a response just kept) is
        brought under it: the least recently used conversations' KV first (it can be computed
        again), then the oldest stored responses (nothing can recompute those)."""
        cap = self.limits.store_cap_bytes
        if cap is None or self.store.block_bytes() + self.store.response_bytes() <= cap:
            return
        retired = self.store.retire_lru(max(0, cap - self.store.response_bytes()))
        self._retired(retired, "store_cap")
        self._responses_retired(
            self.store.retire_responses(target_bytes=cap - self.store.block_bytes()),
            "store_cap")
        logger.warning("store over its cap of %d bytes: retired the KV of %d sessions, now "
                       "%d bytes of KV and %d of responses", cap, len(retired),
                       self.store.block_bytes(), self.store.response_bytes())

    def _responses_retired(self, gone: list[tuple[str, str]], reason: str) -> None:
        for tenant, rid in gone:
            events.emit("response_retired", tenant=tenant, response_id=rid, reason=reason)
            metrics.CS_RETIRED.labels(f"response_{reason}").inc()

    def _expire(self, now: float) -> None:
        """Anonymous conversations that never came back within --anonymous-ttl-s go."""
        if now - self._expired_at < min(EXPIRE_EVERY_S, max(0.5, self.anonymous_ttl_s / 2)):
            return
        self._expired_at = now
        self._retired(self.store.expire_anonymous(now - self.anonymous_ttl_s), "anonymous_ttl")
        self._responses_retired(self.store.retire_responses(before=now - self.anonymous_ttl_s),
                                "anonymous_ttl")

    def _retired(self, metas: list[SessionMeta], reason: str) -> None:
        """Each retirement: an event, a metric, and word to the worker (its list of sessions)."""
        for m in metas:
            gone = "record" if is_anonymous(m.session_id) else "kv"
            kept = 0
            if reason == "corrupt_block":  # the record stays, short of the block
                gone, kept = "kv", m.durable_tokens
            events.emit("conversation_retired", tenant=m.tenant, session_id=m.session_id,
                        reason=reason, removed=gone, tokens=m.token_count,
                        durable_tokens=m.durable_tokens, updated_at=m.updated_at)
            metrics.CS_RETIRED.labels(reason).inc()
            self._send(WORKER_PEER, pb.Message(retired=pb.Retired(
                tenant=m.tenant, session_id=m.session_id, reason=reason, removed=gone,
                at=time.time(), durable_tokens=kept)))

    # -- the loop ---------------------------------------------------------------------------

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self._stop())
        signal.signal(signal.SIGINT, lambda *_: self._stop())
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.state, zmq.POLLIN)
        logger.info("coldstore listening on %s, store %s (%s)",
                    self.layout.coldstore_address, self.layout.store_dir, self.store.stats())
        self._enforce_cap()
        self._anon_floor = heap.anonymous_bytes()
        try:
            while not self.stopping:
                ready = self.lanes.next_job(time.time()) is not None
                events = dict(poller.poll(0 if ready else 50))
                if not events and not self.lanes.jobs:
                    self._idle()
                if self.state in events:
                    self._drain_state()
                if self.sock in events:
                    self._receive(timeout_ms=0)
                self._write_one(time.time())
                self._expire(time.time())
                self._update_gauges(time.monotonic())
            self._flush(time.time() + FLUSH_ON_STOP_S)
        finally:
            self.sock.close(linger=0)
            self.state.close(linger=0)
            self.ctx.term()
            self.store.close()
            logger.info("coldstore stopped")

    def _stop(self) -> None:
        self.stopping = True

    def _idle(self) -> None:
        """No write job, and nothing came for a poll's wait: the heap's freed pages (kept while
        busy: `keep_freed_pages`) go back to the OS, once per busy spell."""
        self.shared.close_all()
        if self._heap_used:
            heap.give_back_freed_pages()
            self._heap_used = False
            self._largest = 0
            self._anon_floor = heap.anonymous_bytes()

    def _update_gauges(self, now: float, every_s: float = 1.0) -> None:
        if now - getattr(self, "_gauges_at", 0.0) < every_s:
            return
        self._gauges_at = now
        metrics.CS_WRITE_BUDGET_LEFT.set(max(0, self.limits.write_bytes_per_hour
                                             - self.budgets.written_last_hour()))
        metrics.CS_DISK_FREE.set(shutil.disk_usage(self.layout.store_dir).free)
        metrics.CS_STORE_BYTES.set(self.store.block_bytes())
        metrics.CS_JOBS.set(len(self.lanes.jobs))

    def _flush(self, until: float) -> None:
        """On a clean stop, write what is queued, bounded in time; payloads still streaming
        in are received meanwhile."""
        left = len(self.lanes.jobs)
        while self.lanes.jobs and time.time() < until:
            self._receive(timeout_ms=0)
            job = self.lanes.next_job(time.time(), flushing=True)
            if job is None:  # waiting for payloads
                self._receive(timeout_ms=50)
                continue
            self._write_block(job, time.time())
        if left:
            logger.info("flush on stop: %d jobs queued, %d left unwritten", left, len(self.lanes.jobs))

    def _receive(self, timeout_ms: int) -> None:
        if self.sock.poll(timeout_ms, zmq.POLLIN):
            for _ in range(64):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._heap_used = True
                self._handle(frames)

    def _drain_state(self) -> None:
        while True:
            try:
                msg = self.state.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.lanes.on_worker_state(msg.startswith(b"busy"), time.time(),
                                       write_now=msg == b"write-now")

    # -- messages ---------------------------------------------------------------------------

    def _handle(self, frames: list[zmq.Frame]) -> None:
        peer, req = frames[0].bytes, 0
        try:
            request, parts = wire.decode_request(frames[1:])
            req = request.req
            op = request.WhichOneof("op")
            if op is None:
                raise ValueError("a request without an op")
            reply = getattr(self, f"_op_{op}")(peer, req, getattr(request, op), parts)
        except Exception as e:  # a bad message must not take the store down
            logger.exception("coldstore: message failed")
            reply = pb.Reply(req=req, ok=False, error=f"{type(e).__name__}: {e}")
        if reply is not None:
            self._send(peer, pb.Message(reply=reply))

    def _send(self, peer: bytes, msg: pb.Message, frames=()) -> None:
        self.sock.send_multipart([peer, *wire.encode(msg, frames)], copy=False)

    def _done(self, peer: bytes, job: int, outcome: Outcome, **fields) -> None:
        self._send(peer, pb.Message(done=pb.Done(job=job, outcome=wire.outcome_pb(outcome),
                                                 **fields)))

    # One handler per op: (peer, the request's number, the op's message, the frames after the
    # header) -> the Reply to send, or None (answered already, or nothing to answer).

    def _op_ping(self, peer, req, ping: pb.Ping, frames):
        now = time.time()
        heard = now - self.lanes.state_heard_at <= self.lanes.silent_worker_s
        state = ("busy" if self.lanes.worker_busy else "quiet") if heard else "silent"
        return pb.Reply(req=req, ok=True, ping=pb.PingReply(
            stats=pb.StoreStats(**self.store.stats()), worker_state=state,
            queued_jobs=len(self.lanes.jobs), jobs=sorted(self.lanes.jobs),
            staged_bytes=self.lanes.staged_bytes(), written_bytes=self.written_bytes,
            write_budget_left_bytes=max(0, self.limits.write_bytes_per_hour
                                        - self.budgets.written_last_hour()),
            free_disk_bytes=shutil.disk_usage(self.layout.store_dir).free,
            shm_ok=bool(ping.shm_probe) and self.shared.probe(ping.shm_probe, wire.SHM_PROBE)))

    def _op_get_blocks(self, peer, req, get: pb.GetBlocks, frames):
        """Restore through the coldstore (the worker can also read LMDB itself, read-only)."""
        payloads = self.store.get_blocks([BlockId(i) for i in get.ids])
        metrics.CS_READ.inc(sum(len(p) for p in payloads if p is not None))
        self._send(peer, pb.Message(reply=pb.Reply(req=req, ok=True,
                                                   get_blocks=pb.BlocksFollow())),
                   [p if p is not None else b"" for p in payloads])
        return None

    def _op_drop_blocks(self, peer, req, drop: pb.DropBlocks, frames):
        """Blocks a restore found corrupt: deleted, and the records naming them cut short."""
        for bid in drop.ids:
            cut = self.store.drop_block(BlockId(bid))
            logger.error("block %s failed its checksum: deleted; %d records keep what comes "
                         "before it", bytes(bid).hex(), len(cut))
            self._retired(cut, "corrupt_block")
        return pb.Reply(req=req, ok=True) if req else None

    def _op_put_response(self, peer, req, put: pb.PutResponse, frames):
        if len(frames) != 1:
            raise ValueError(f"put_response takes one frame (its JSON), not {len(frames)}")
        self.store.put_response(put.tenant, put.id, put.created_at or time.time(),
                                frames[0].buffer)
        self._enforce_cap()
        return pb.Reply(req=req, ok=True)

    def _op_get_response(self, peer, req, get: pb.ResponseKey, frames):
        body = self.store.get_response(get.tenant, get.id)
        self._send(peer, pb.Message(reply=pb.Reply(
            req=req, ok=True, get_response=pb.ResponseFollows(found=body is not None))),
            [body or b""])
        return None

    def _op_delete_response(self, peer, req, delete: pb.ResponseKey, frames):
        deleted = self.store.delete_response(delete.tenant, delete.id)
        return pb.Reply(req=req, ok=True, delete_response=pb.SessionDeleted(deleted=deleted))

    def _op_put_session(self, peer, req, put: pb.PutSession, frames):
        if len(frames) != 1:
            raise ValueError(f"put_session takes one frame of token ids, not {len(frames)}")
        if not put.block_tokens:
            raise ValueError("put_session without block_tokens")
        tokens = np.frombuffer(frames[0].buffer, dtype=np.uint32)
        meta = self.store.put_session_tokens(put.tenant, put.session_id, tokens,
                                             put.block_tokens)
        return pb.Reply(req=req, ok=True,
                        put_session=pb.SessionPut(durable_tokens=meta.durable_tokens))

    def _op_delete_session(self, peer, req, delete: pb.DeleteSession, frames):
        for job in [j for j in self.lanes.jobs.values()
                    if j.session_id == delete.session_id and j.tenant == delete.tenant]:
            self.lanes.cancel(job.job_id)
        deleted = self.store.delete_session(delete.tenant, delete.session_id)
        return pb.Reply(req=req, ok=True, delete_session=pb.SessionDeleted(deleted=deleted))

    def _op_write(self, peer, req, write: pb.Write, frames):
        now = time.time()
        if len(frames) > len(write.blocks):
            raise ValueError(f"{len(frames)} payloads for {len(write.blocks)} blocks")
        blocks = deque(
            PendingBlock(b.id, b.start,  # shared memory: every block announces its size
                         _block_bytes(b, frames[i].buffer if i < len(frames) and not write.shm
                                      else None),
                         tail=b.tail, anchor=b.anchor)
            for i, b in enumerate(write.blocks)
        )
        job = WriteJob(
            job_id=write.job, peer=peer, tenant=write.tenant, session_id=write.session_id,
            root=write.root, blocks=blocks, dirty_since=write.dirty_since or now,
            give_up_at=write.give_up_at if write.HasField("give_up_at") else None,
            first_start=blocks[0].start if blocks else 0, in_transit=len(blocks),
        )
        self.shared.forget(write.shm_released)
        try:
            job.receive(self.shared.payloads(job, write.shm, frames), now)
        except ValueError as e:
            self._finish(job, Outcome.ERROR, error=str(e))
            return None
        old = self.lanes.submit(job)
        if old is not None:
            self._done(old.peer, old.job_id, Outcome.SUPERSEDED, by=job.job_id,
                       tenant=old.tenant, session_id=old.session_id,
                       durable_tokens=old.durable_tokens)
        return None

    def _op_payload(self, peer, req, payload: pb.Payload, frames):
        self.shared.forget(payload.shm_released)
        job = self.lanes.jobs.get(payload.job)
        if job is None or job.peer != peer:  # it ended (superseded, cancelled): drop these
            return None
        try:
            job.receive(self.shared.payloads(job, payload.shm, frames), time.time())
        except ValueError as e:
            self._fail(job, str(e))
        return None

    def _op_promote(self, peer, req, promote: pb.Promote, frames):
        """A release waits on this job: give it a deadline, so it jumps the idle lane."""
        job = self.lanes.jobs.get(promote.job)
        if job is None:
            self._done(peer, promote.job, Outcome.UNKNOWN_JOB)
        else:
            job.give_up_at = promote.give_up_at
        return None

    def _op_cancel(self, peer, req, cancel: pb.Cancel, frames):
        """A write-behind that is cancelled keeps what it committed; a write-out (a release
        that gave up on it) is all or nothing, so its blocks are taken back."""
        job = self.lanes.cancel(cancel.job)
        if job is not None:
            if job.give_up_at is not None:
                self._take_back(job)
            self._done(job.peer, job.job_id, Outcome.CANCELLED, tenant=job.tenant,
                       session_id=job.session_id, durable_tokens=job.durable_tokens,
                       taken_back=job.taken_back)
        return None

    # -- writing ----------------------------------------------------------------------------

    def _write_one(self, now: float) -> None:
        job = self.lanes.next_job(now)
        if job is not None:
            self._write_block(job, now)
            self._bound_heap()

    def _bound_heap(self) -> None:
        """While writing, the freed pages kept for the next blocks (`keep_freed_pages`) stay
        under what one more block takes (its payload, and LMDB's copy of it as it commits),
        `coldstore_write_bytes` beyond the payloads held, and WRITE_KEEP_MARGIN_BYTES. The
        worker counts the first in its ledger for each write (worker/link/writer.py
        `staged_bytes`), so its --memory-budget covers the coldstore's writes but the margin.
        Without a bound the heap kept what any order of frees left: blocks of a wide-KV model
        are tens of MB (70 MB: 256 tokens at 270 KB a token), and two jobs' payloads, LMDB's
        copies and the pages they left took the coldstore from 36 to 303 MB (`bench compare
        --arch llama --size wide-kv`, this VM, Dec 2026). The heap is its anonymous memory
        (RssAnon): the worker's shared buffers it maps are the worker's. One /proc/self/status
        read a block."""
        staged = self.lanes.staged_bytes()
        kept = coldstore_write_bytes(self._largest) + WRITE_KEEP_MARGIN_BYTES
        if heap.anonymous_bytes() > self._anon_floor + staged + kept:
            heap.give_back_freed_pages()
            # What a trim leaves is live (ZeroMQ's and LMDB's own buffers): the next bound
            # counts from there, or every block after the first would be trimmed for it.
            self._anon_floor = heap.anonymous_bytes() - staged

    def _write_block(self, job: WriteJob, now: float) -> None:
        if job.give_up_at is not None and now >= job.give_up_at:
            self._take_back(job)
            self._finish(job, Outcome.DEADLINE)
            return
        if not job.blocks:
            self._finish(job, Outcome.WRITTEN)
            return
        if job.blocks[0].payload is None:  # stalled (or a stop): the rest is not coming
            self._fail(job, f"{job.in_transit} block payloads never arrived")
            return
        refusal = self._refusal(job, len(job.blocks[0].payload))
        if refusal is not None:
            self._refuse(job, refusal)
            return
        block = job.blocks.popleft()
        self._largest = max(self._largest, len(block.payload))
        if not self.lanes.quiet(now):
            self.lanes.last_stale_write_at = now
        commit = self.store.commit_anchor if block.anchor else self.store.commit_block
        try:
            meta = commit(job.tenant, job.session_id, BlockId(job.root), BlockId(block.block_id),
                          block.start, block.payload)
            self.map_full = False
        except StoreFull as e:
            self._refuse(job, self._map_full(e, len(block.payload)))
            return
        except Exception as e:
            logger.exception("coldstore: block write failed")
            self._finish(job, Outcome.ERROR, error=str(e))
            return
        if meta is None and not block.anchor:
            # The record moved on (deleted, edited, or this block is already there).
            self._finish(job, Outcome.STALE)
            return
        self.budgets.record(self.store.last_written_bytes)
        self.written_bytes += self.store.last_written_bytes
        metrics.CS_WRITTEN.inc(self.store.last_written_bytes)
        job.written_blocks += 1
        if meta is not None:  # an anchor the record no longer wants is skipped
            job.durable_tokens = meta.durable_tokens
        job.payload_at = now  # its sender sends the next payloads on this progress
        self._send(job.peer, pb.Message(progress=pb.Progress(
            job=job.job_id, tenant=job.tenant, session_id=job.session_id,
            durable_tokens=job.durable_tokens)))
        if not job.blocks:
            self._finish(job, Outcome.WRITTEN)

    def _refuse(self, job: WriteJob, refusal: WriteRefusal) -> None:
        logger.warning("write of %s refused (%s): %s", job.session_id, refusal.reason,
                       refusal.message)
        metrics.CS_REFUSALS.labels(refusal.reason).inc()
        self._finish(job, Outcome.REFUSED, error=refusal.message, reason=refusal.reason)

    def _map_full(self, e: StoreFull, nbytes: int) -> WriteRefusal:
        """A block LMDB's map had no room for at its ceiling: refused, the worker keeps it in
        RAM and sends it again; an event when the map has just filled."""
        refusal = WriteRefusal(
            "map_full", f"LMDB's map is full at its ceiling of {e.map_bytes} bytes "
            f"(--store-map-bytes) with {self.store.block_bytes()} bytes of KV stored: a block "
            f"of {nbytes} bytes does not fit. Writes resume as the store cap "
            f"(--store-max-bytes, now {self.limits.store_cap_bytes}) retires old conversations "
            f"or they are deleted; raise --store-map-bytes, or lower --store-max-bytes so the "
            f"cap retires them before the map fills")
        if not self.map_full:
            self.map_full = True
            events.emit("store_full", map_bytes=e.map_bytes, used_bytes=e.used_bytes,
                        block_bytes=self.store.block_bytes(), message=refusal.message)
        return refusal

    def _fail(self, job: WriteJob, error: str) -> None:
        """End a job that cannot go on; a write-out's committed blocks are taken back."""
        if job.give_up_at is not None:
            self._take_back(job)
        self._finish(job, Outcome.ERROR, error=error)

    def _take_back(self, job: WriteJob) -> None:
        """A write-out is all or nothing: undo the blocks this job committed."""
        if job.written_blocks:
            meta = self.store.truncate_session(job.tenant, job.session_id, job.first_start)
            job.durable_tokens = meta.durable_tokens if meta else 0
            job.taken_back = True

    def _refusal(self, job: WriteJob, nbytes: int) -> WriteRefusal | None:
        """The budgets, checked before each block; the size cap first makes room if it can."""
        # Sizing what the conversation already stores reads every byte of it (py-lmdb faults a
        # value's pages in to return it): only when there is a cap to hold it to.
        if job.written_blocks == 0 and self.limits.entry_max_bytes is not None:
            entry = job.entry_bytes + self.store.session_block_bytes(job.tenant, job.session_id)
            refusal = self.budgets.check_entry(entry)
            if refusal is not None:
                return refusal
        refusal = self.budgets.check_write(nbytes)
        if refusal is not None:
            return refusal
        cap = self.limits.store_cap_bytes
        if cap is not None:
            cap -= self.store.response_bytes()  # the stored responses' share of the store
        if cap is not None and self.store.block_bytes() + nbytes > cap:
            retired = self.store.retire_lru(cap - nbytes, keep=(job.tenant, job.session_id))
            if retired:
                self._retired(retired, "store_cap")
                logger.info("store cap: retired the KV of %s",
                            ", ".join(m.session_id for m in retired))
            if self.store.block_bytes() + nbytes > cap:
                return WriteRefusal("store_cap", f"the store holds {self.store.block_bytes()} "
                                    f"bytes of KV and its cap is {cap} bytes (--store-max-bytes); "
                                    f"nothing older is left to retire")
        return None

    def _finish(self, job: WriteJob, outcome: Outcome, error: str = "",
                reason: str = "") -> None:
        self.lanes.cancel(job.job_id)
        self._done(job.peer, job.job_id, outcome, tenant=job.tenant, session_id=job.session_id,
                   durable_tokens=job.durable_tokens, error=error, reason=reason,
                   taken_back=job.taken_back)


def _block_bytes(block: pb.Block, payload) -> int:
    """A block's size: announced (its payload streams in later), or its payload's."""
    if block.HasField("nbytes"):
        return block.nbytes
    if payload is None:
        raise ValueError(f"block at {block.start} has neither a payload nor 'nbytes'")
    return len(payload)


def start(layout: Layout, *, quiet_grace_s: float, max_dirty_s: float, tail_delay_s: float,
          limits: Limits, payload_stall_s: float = 30.0, metrics_port: int = -1,
          anonymous_ttl_s: float = DEFAULT_ANONYMOUS_TTL_S) -> ColdstoreServer:
    """The event log, the metrics endpoint and the server, bound and ready to `serve()`."""
    keep_freed_pages()  # before ZeroMQ's I/O thread starts (its first buffer picks an arena)
    events.open_log(layout.events_path)
    metrics.serve("coldstore", layout.ensure().run_dir, metrics_port)
    return ColdstoreServer(layout, quiet_grace_s=quiet_grace_s, max_dirty_s=max_dirty_s,
                           tail_delay_s=tail_delay_s, payload_stall_s=payload_stall_s,
                           limits=limits, anonymous_ttl_s=anonymous_ttl_s)


def main(layout: Layout, *, quiet_grace_s: float, max_dirty_s: float, tail_delay_s: float,
         limits: Limits, payload_stall_s: float = 30.0, metrics_port: int = -1,
         anonymous_ttl_s: float = DEFAULT_ANONYMOUS_TTL_S) -> None:
    """`kvbank coldstore`: serve until SIGTERM/SIGINT. (A slow test disk stands in through
    `start`: tests/slow_coldstore.py.)"""
    start(layout, quiet_grace_s=quiet_grace_s, max_dirty_s=max_dirty_s,
          tail_delay_s=tail_delay_s, limits=limits, payload_stall_s=payload_stall_s,
          metrics_port=metrics_port, anonymous_ttl_s=anonymous_ttl_s).serve()
