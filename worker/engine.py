"""The engine: the one thread that owns the model and the SessionBank.

Everything that touches MLX or the bank runs here, fed by a queue (as mlx-lm's server does),
so no state needs a lock. A generation job goes: its conversation (the name, else the one its
tokens continue), admission (price it, make room by the bank's policies, or refuse), restore
the longest cached prefix (RAM bank, else SSD), then the scheduler prefills the rest and
decodes, step by step with the other admitted requests, and finally the turn is committed:
the session record first (durable before the final message), then the bank entry, then the
write-behind job for its new KV blocks.

Other threads read two snapshots the engine replaces whole (`sessions`, `ram_bytes`), never
structures it mutates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from kvbank import events, metrics
from kvbank.blocks import BlockId, chain_block_ids, chain_root, common_prefix_len, tail_block_id
from kvbank.config import Layout
from kvbank.v1 import api_pb2, worker_pb2
from coldstore.store import ColdStore
from worker import kv
from worker.admission import (Pricing, Refused, SchedulerConfig, calibrate,
                              give_back_freed_memory, keep_large_buffers_off_the_heap,
                              make_room, memory_budget_bytes, mlx_cache_limit, resident_bytes)
from worker.bank import SessionBank, SessionKey
from worker.guard import Guard
from worker.lineage import Lineages, is_anonymous
from worker.persist import ColdstoreClient, ColdstoreUnavailable, KVWriter
from worker.scheduler import PREFILL_STEP_TOKENS, BatchScheduler, Running, make_request_sampler
from worker.upkeep import Upkeep

logger = logging.getLogger(__name__)

RECORD_TIMEOUT_S = 3.0
SESSION_STATES = ("active", "resident-dirty", "resident-clean", "cold", "gone")


@dataclass(frozen=True)
class SessionInfo:
    """What the worker knows of a session record (a snapshot; replaced, never mutated)."""

    tokens: np.ndarray
    durable_tokens: int
    created_at: float
    updated_at: float
    recorded: bool = True  # the record on disk holds these tokens


@dataclass
class GenerateJob:
    request: worker_pb2.WorkerGenerateRequest
    emit: Callable[[Any], None]  # thread-safe; gets responses, then None, or an Exception
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.monotonic)


class RequestError(ValueError):
    """Bad input that got past the router; the message says what to change."""


class NotAdmitted(Exception):
    """Admission refused the request (worker/admission.py); carries the receipt."""

    def __init__(self, refused: Refused):
        super().__init__(str(refused))
        self.receipt = refused.receipt


class Engine(Upkeep):
    def __init__(self, model_path: Path, layout: Layout, *, block_tokens: int, bank_bytes: int,
                 staging_max_bytes: int | None = None, restore_via: str = "direct",
                 scheduler: SchedulerConfig = SchedulerConfig(),
                 memory_budget: str | int | None = None, active_pin_s: float = 600.0,
                 admission_chain_shed: bool = False,
                 prefill_chunk_tokens: int = PREFILL_STEP_TOKENS,
                 write_out_deadline_s: float | None = None):
        from mlx_lm import load

        keep_large_buffers_off_the_heap()
        self.model_path = Path(model_path)
        self.layout = layout.ensure()
        self.block_tokens = block_tokens
        self.restore_via = restore_via
        self.scheduler = scheduler
        t0 = time.monotonic()
        self.model, self.tokenizer = load(str(self.model_path))
        self.config = json.loads((self.model_path / "config.json").read_text())
        self.max_context_tokens = int(self.config.get("max_position_embeddings", 8192))
        self.eos_token_ids = sorted(self.tokenizer.eos_token_ids)
        self.kv_bytes_per_token, self.kv_dtype = self._measure_kv()
        self.fingerprint = self._fingerprint()
        logger.info("model %s loaded in %.1fs: %d KV bytes/token (%s), fingerprint %s",
                    self.model_path, time.monotonic() - t0, self.kv_bytes_per_token,
                    self.kv_dtype, self.fingerprint.hex()[:12])
        self.sessions: dict[SessionKey, SessionInfo] = {}
        self.ram_bytes: dict[SessionKey, int] = {}
        self._store: ColdStore | None = None
        self.lineages = Lineages(root_for=self.root_for, block_tokens=block_tokens)
        self._load_sessions()
        self.coldstore = ColdstoreClient(layout, on_event=self._on_coldstore_event).start()
        self.writer = KVWriter(self.coldstore, block_tokens=block_tokens, root_for=self.root_for,
                               staging_max_bytes=staging_max_bytes)
        self.bank = SessionBank(block_tokens=block_tokens, root_for=self.root_for,
                                max_bytes=bank_bytes, writer=self.writer,
                                active_pin_s=active_pin_s)
        self.bank.write_out_deadline_s = write_out_deadline_s
        mx.set_cache_limit(0)  # until the budget is known (below)
        self.pricing = calibrate(self.model, Pricing(self.kv_bytes_per_token, 0,
                                                     prefill_chunk_tokens))
        self.admission_chain_shed = admission_chain_shed
        self.admission_log: deque = deque(maxlen=1024)
        self.batch = BatchScheduler(self.model, max_active=scheduler.max_active,
                                    eos_token_ids=self.eos_token_ids,
                                    prefill_step_tokens=prefill_chunk_tokens)
        self._warm_up(prefill_chunk_tokens)
        self.pricing.fixed_bytes = resident_bytes()
        self.memory_budget = memory_budget_bytes(memory_budget, self.pricing)
        cache_limit = mlx_cache_limit(self.memory_budget, self.pricing.fixed_bytes)
        mx.set_cache_limit(cache_limit)
        self.pricing.fixed_bytes += cache_limit  # MLX may keep that much: held, always
        self._pending: deque[GenerateJob] = deque()
        self._deleted_at: dict[SessionKey, float] = {}  # deleted while a turn ran on it
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        for state in SESSION_STATES:  # counted when scraped
            metrics.SESSIONS.labels(state).set_function(
                lambda state=state: sum(self.session_state(k, i) == state
                                        for k, i in list(self.sessions.items())))
        self.guard = Guard(self).start()

    def _warm_up(self, chunk_tokens: int) -> None:
        """One short request through the scheduler, so the memory a first request leaves
        behind (kernels, allocator, buffers) is in the fixed part of the budget."""
        tokens = np.arange(1000, 1000 + 2 * chunk_tokens + 1, dtype=np.uint32)
        job = GenerateJob(worker_pb2.WorkerGenerateRequest(max_tokens=2), emit=lambda ev: None)
        r = Running(job=job, tokens=tokens, bank_key=("", "warm-up"), session=None, cached=0,
                    source=api_pb2.CACHE_SOURCE_NONE, known=0, started=time.monotonic(),
                    stops=[], detok=self.tokenizer.detokenizer)
        from mlx_lm.models.cache import make_prompt_cache

        self.batch.add(r, make_prompt_cache(self.model), 2, make_request_sampler(0.0, 0.0, None))
        while self.batch:
            self.batch.step()
        mx.clear_cache()

    # -- identity ---------------------------------------------------------------------------

    def _measure_kv(self) -> tuple[int, str]:
        """KV bytes per token, measured from a one-token forward (works for any model)."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        self.model(mx.array([[0]]), cache=cache)
        mx.eval([c.keys for c in cache])
        per_token = sum(int(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes) for c in cache)
        return per_token, str(cache[0].keys.dtype).split(".")[-1]

    def _fingerprint(self) -> bytes:
        """Nothing restores across model, weights, KV dtype or block size."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(self.config, sort_keys=True).encode())
        for f in sorted(self.model_path.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}".encode())
        h.update(f"{self.kv_dtype}:{self.kv_bytes_per_token}:{self.block_tokens}".encode())
        h.update(kv.BLOCK_LAYOUT.encode())
        return h.digest()

    def root_for(self, tenant: str) -> BlockId:
        return chain_root(self.fingerprint, tenant)

    # -- the store (read-only here: the coldstore is the only writer) -----------------------

    def store(self) -> ColdStore | None:
        if self._store is None and (self.layout.store_dir / "data.mdb").exists():
            try:
                self._store = ColdStore(self.layout.store_dir, readonly=True)
            except Exception as e:
                logger.warning("cannot open the store read-only yet: %s", e)
        return self._store

    def _load_sessions(self) -> None:
        store = self.store()
        if store is None:
            return
        sessions = {}
        for meta in store.list_sessions():
            got = store.get_session(meta.tenant, meta.session_id)
            if got is not None:
                meta, toks = got
                sessions[(meta.tenant, meta.session_id)] = SessionInfo(
                    toks.copy(), meta.durable_tokens, meta.created_at, meta.updated_at)
        self.sessions = sessions
        self.lineages.rebuild((k, i.tokens) for k, i in sessions.items())
        logger.info("loaded %d session records from the store (%d anonymous)", len(sessions),
                    len(self.lineages))

    # -- the queue --------------------------------------------------------------------------

    def submit(self, job: GenerateJob) -> None:
        self._queue.put(job)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the engine thread (after the jobs queued before it)."""
        fut: Future = Future()
        self._queue.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            idle = not self.batch and not self._pending
            items = [self._queue.get()] if idle else []
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is None:
                    return
                if isinstance(item, GenerateJob):
                    self._pending.append(item)
                else:
                    fn, fut = item
                    try:
                        fut.set_result(fn())
                    except Exception as e:
                        fut.set_exception(e)
            self.coldstore.set_busy(bool(self.batch or self._pending))
            self._admit_pending()
            if self.batch:
                self._step()
            elif self._pending:  # first in line waits for memory that nothing will free
                time.sleep(0.01)

    def close(self) -> None:
        self.guard.close()
        self._queue.put(None)
        self._thread.join(timeout=5)
        self.writer.drain(timeout_s=5)  # what was handed over leaves before the link closes
        self.coldstore.close()

    # -- one generation ---------------------------------------------------------------------

    def _admit_pending(self) -> None:
        """Start waiting requests in order while the scheduler has room and memory allows."""
        while self._pending and len(self.batch) < self.scheduler.max_active:
            job = self._pending[0]
            if job.cancelled.is_set():
                self._pending.popleft()
                job.emit(None)
                continue
            try:
                started = self._start(job)
            except (RequestError, NotAdmitted) as e:
                self._pending.popleft()
                job.emit(e)
                continue
            except Exception as e:
                logger.exception("could not start a request")
                self._pending.popleft()
                job.emit(e)
                continue
            if not started:
                return  # waits for memory held by requests in flight
            self._pending.popleft()

    def _start(self, job: GenerateJob) -> bool:
        """Admission, restore, and hand-over to the scheduler. False: wait for memory."""
        req = job.request
        tokens = np.asarray(req.token_ids, dtype=np.uint32)
        if len(tokens) == 0:
            raise RequestError("the prompt is empty: send at least one token")
        if len(tokens) + req.max_tokens > self.max_context_tokens:
            raise RequestError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                f"model's context of {self.max_context_tokens} tokens")
        tenant = req.tenant
        ids = chain_block_ids(tokens, self.root_for(tenant), self.block_tokens)  # hashed once
        session = self._conversation(tokens, ids, tenant, req.session_id)
        need = self._price(len(tokens), req.max_tokens)
        try:
            receipt = make_room(bank=self.bank, pricing=self.pricing, budget=self.memory_budget,
                                need=need, tokens=tokens, tenant=tenant,
                                solo_need=self.pricing.request_bytes(len(tokens), req.max_tokens),
                                session_id=session[1], running=len(self.batch),
                                chain_shed=self.admission_chain_shed)
        except Refused as e:
            self._log_admission(req, e.receipt)
            raise NotAdmitted(e) from None
        finally:
            self._refresh_ram_bytes()
        if receipt.decision == "wait":
            return False
        self._log_admission(req, receipt)
        info = self.sessions.get(session)
        self.bank.begin_request(session)
        self.bank.reserve_active(session, need)
        try:
            cache, cached, source = self._restore(tokens, ids, tenant, session, req.no_cache)
            self._count_restore(req, session, len(tokens), cached, source)
            sampling = req.sampling
            seed = sampling.seed if sampling.HasField("seed") else None
            r = Running(job=job, tokens=tokens, bank_key=session, session=session,
                        cached=cached, source=source,
                        known=common_prefix_len(info.tokens, tokens) if info is not None else 0,
                        started=time.monotonic(), stops=list(req.stop),
                        detok=self.tokenizer.detokenizer)
            self.batch.add(r, cache, req.max_tokens,
                           make_request_sampler(sampling.temperature, sampling.top_p, seed))
        except Exception:
            self.bank.end_request(session)
            raise
        return True

    def _conversation(self, tokens: np.ndarray, ids: list[BlockId], tenant: str,
                      name: str) -> SessionKey:
        """The conversation this request continues: its name, else the one its tokens extend
        (worker/lineage.py), else a new anonymous one."""
        if name:
            return (tenant, name)
        found = self.lineages.find(tokens, ids, tenant, self.sessions, self.bank.is_busy)
        if found is not None:
            return found
        taken = lambda k: k in self.sessions or bool(self.bank.session_entries(k))  # noqa: E731
        return (tenant, self.lineages.new_id(tokens, tenant,
                                             lambda k: taken(k) or self.bank.is_busy(k)))

    def _count_restore(self, req, session: SessionKey, n_tokens: int, cached: int,
                       source: int) -> None:
        tier = {api_pb2.CACHE_SOURCE_RAM: "ram", api_pb2.CACHE_SOURCE_SSD: "ssd"}.get(source,
                                                                                     "none")
        metrics.PROMPT_TOKENS.inc(n_tokens)
        if req.no_cache:
            return
        metrics.PREFIX_QUERIES.inc()
        metrics.PREFIX_HITS.labels(tier).inc()
        if cached:
            metrics.CACHED_TOKENS.labels(tier).inc(cached)
            events.emit("kv_restored", tenant=req.tenant, session_id=session[1], tier=tier,
                        tokens=cached, prompt_tokens=n_tokens)

    def _price(self, prompt_tokens: int, max_tokens: int) -> int:
        """This request's bytes, with the padding a batched cache adds to the batch."""
        lens = [len(r.tokens) + r.job.request.max_tokens for r in self.batch.running.values()]
        return self.pricing.request_bytes(prompt_tokens, max_tokens,
                                          batch_len=max(lens, default=0), batch_size=len(lens))

    def _log_admission(self, req, receipt) -> None:
        self.admission_log.append((time.time(), req.tenant, req.session_id, receipt))
        metrics.ADMISSIONS.labels(receipt.decision).inc()
        if receipt.decision != "wait":
            events.emit("admission", tenant=req.tenant, session_id=req.session_id,
                        prompt_tokens=len(req.token_ids), max_tokens=req.max_tokens,
                        **dataclasses.asdict(receipt))
        if receipt.decision != "admitted" or receipt.lru_evicted or receipt.released_sessions:
            logger.info("admission %s for %s: need %.0f MB, free %.0f -> %.0f MB, lru %d, "
                        "shed %d+%d, released %d (%d written out) %s %s", receipt.decision,
                        req.session_id or "(anonymous)", receipt.need_bytes / 1e6,
                        receipt.free_before / 1e6, receipt.free_after / 1e6,
                        receipt.lru_evicted, receipt.shed_non_terminal, receipt.shed_terminal,
                        receipt.released_sessions, receipt.written_out, receipt.reason,
                        receipt.verdict)

    def _step(self) -> None:
        # A cancelled turn is not committed: the client never saw it, so the session's
        # history stays as it was (an append builds on what the client has).
        for r in self.batch.take_cancelled():
            self.bank.end_request(r.bank_key)
            r.job.emit(None)
        if not self.batch:
            return
        try:
            done = self.batch.step()
        except Exception as e:  # a failed step fails every request in it, not the worker
            logger.exception("generation step failed")
            for r in list(self.batch.running.values()):
                self.batch.drop(r)
                self.bank.end_request(r.bank_key)
                r.job.emit(e)
            return
        for r, cache in done:
            try:
                self._finish(r, cache)
            except Exception as e:
                logger.exception("commit failed")
                r.job.emit(e)
            finally:
                self.bank.end_request(r.bank_key)
        if done:
            give_back_freed_memory()

    def _finish(self, r: Running, cache: list) -> None:
        full = np.concatenate([r.tokens, np.asarray(r.completion, dtype=np.uint32)])
        durable = self._commit(r.session, full, cache, r.started)
        usage = api_pb2.Usage(
            prompt_tokens=len(r.tokens),
            completion_tokens=len(r.completion),
            cached_tokens=r.cached,
            cache_source=r.source,
            recomputed_tokens=max(0, min(r.known, len(r.tokens) - 1) - r.cached),
            ttft_s=(r.first_token_at or time.monotonic()) - r.started,
            queue_s=r.started - r.job.queued_at,
            durable=durable,
            session_id=r.session[1],
        )
        metrics.GENERATION_TOKENS.inc(len(r.completion))
        metrics.RECOMPUTED_TOKENS.inc(usage.recomputed_tokens)
        r.job.emit(worker_pb2.WorkerGenerateResponse(finish_reason=r.finish, usage=usage))
        r.job.emit(None)

    def _restore(self, tokens: np.ndarray, ids: list[BlockId], tenant: str,
                 session: SessionKey, no_cache: bool) -> tuple[list, int, int]:
        """The request's own cache over the longest known prefix: (cache, tokens, source)."""
        from mlx_lm.models.cache import make_prompt_cache

        none = (make_prompt_cache(self.model), 0, api_pb2.CACHE_SOURCE_NONE)
        if no_cache:
            return none
        limit = len(tokens) - 1  # leave one token to compute: its logits give the next token
        hit = self.bank.lookup(tokens, tenant, ids)
        ram_n = min(hit.n_tokens, limit) if hit else 0
        # SSD can only add when RAM leaves something to restore: skip its reads.
        ssd = (self._ssd_prefix(tokens, ids, tenant, session, better_than=ram_n)
               if ram_n < limit else None)
        if ssd is not None:
            layers, n = ssd
            n = min(n, limit)
            return kv.restore(layers, n), n, api_pb2.CACHE_SOURCE_SSD
        if ram_n > 0:
            self.bank.touch(hit.entry)
            return kv.restore(hit.entry.layers, ram_n), ram_n, api_pb2.CACHE_SOURCE_RAM
        return none

    def _ssd_prefix(self, tokens: np.ndarray, ids: list[BlockId], tenant: str,
                    session: SessionKey, better_than: int) -> tuple[kv.Layers, int] | None:
        """The longest prefix whose blocks are committed in LMDB, if it beats `better_than`."""
        store = self.store()
        if store is None:
            return None
        B = self.block_tokens
        root = self.root_for(tenant)
        n_full = 0
        while n_full < len(ids) and store.has_block(ids[n_full]):
            n_full += 1
        want = list(ids[:n_full])
        n = n_full * B
        got = store.get_session(*session)
        if got is not None:
            meta = got[0]
            if meta.tail and len(meta.blocks) == n_full and len(tokens) >= n + meta.tail_tokens:
                parent = ids[n_full - 1] if n_full else root
                if tail_block_id(parent, tokens[n : n + meta.tail_tokens]).hex() == meta.tail:
                    want.append(BlockId(bytes.fromhex(meta.tail)))
                    n += meta.tail_tokens
        if min(n, len(tokens) - 1) <= better_than:
            return None
        layers = self._read_blocks(store, want)
        if layers is None:  # collected since we looked: fall back
            return None
        return layers, n

    def _read_blocks(self, store: ColdStore, ids: list[BlockId]) -> kv.Layers | None:
        """The blocks' KV: decoded straight from the read-only LMDB map (zero-copy; the
        default, `kvbank bench coldstore` measured it faster), or fetched through the coldstore
        process. None when a block is missing."""
        if self.restore_via == "direct":
            return store.get_blocks(ids, decode=kv.decode_blocks)
        reply = self.coldstore.request({"op": "get_blocks", "ids": [b.hex() for b in ids]},
                                       timeout_s=RECORD_TIMEOUT_S)
        frames = reply.get("frames", [])
        if len(frames) != len(ids) or not all(len(f) for f in frames):
            return None
        return kv.decode_blocks(frames)

    # -- commit -----------------------------------------------------------------------------

    def _commit(self, session: SessionKey, full: np.ndarray, cache: list,
                started: float = 0.0) -> bool:
        """Session record (durable), then bank entry, then the write-behind job.

        A session deleted while its turn ran stays deleted: the turn is answered, not kept."""
        if self._deleted_at.get(session, -1.0) >= started:
            self._deleted_at.pop(session, None)
            return False
        layers = kv.freeze(cache, len(full))
        durable, durable_tokens = False, 0
        try:
            reply = self.coldstore.request(
                {"op": "put_session", "tenant": session[0], "session_id": session[1],
                 "block_tokens": self.block_tokens},
                [full.tobytes()], timeout_s=RECORD_TIMEOUT_S)
            durable, durable_tokens = True, reply["durable_tokens"]
        except ColdstoreUnavailable as e:
            logger.warning("session %s: turn not durable: %s", session[1], e)
        now = time.time()
        old = self.sessions.get(session)
        self._set_session(session, SessionInfo(full, durable_tokens,
                                               old.created_at if old else now, now,
                                               recorded=durable))
        anonymous = is_anonymous(session[1])
        entry = self.bank.insert(session, full, layers, durable_tokens=durable_tokens,
                                 supersede_slack=self.lineages.slack if anonymous else 0)
        if anonymous:
            self.lineages.set(session, len(full), entry.block_ids)
        events.emit("kv_resident", tenant=session[0], session_id=session[1],
                    tokens=len(full), bytes=entry.nbytes, durable_tokens=durable_tokens)
        if durable:
            self.writer.write_behind(entry)
        else:  # the coldstore is away: record and KV go when it is back
            entry.write_pending = True
        # Over budget, least recently used entries leave, but never one whose SSD write is
        # still queued: it leaves once written (at most --max-dirty-s later).
        self.bank.shrink_to_bytes(self.bank.effective_max_bytes, reason="bank_budget",
                                  protect_unwritten=True, protect_keys=(entry.key,))
        self._refresh_ram_bytes()
        return durable

    def _set_session(self, session: SessionKey, info: SessionInfo | None) -> None:
        sessions = dict(self.sessions)
        if info is None:
            sessions.pop(session, None)
        else:
            sessions[session] = info
        self.sessions = sessions

    def _refresh_ram_bytes(self) -> None:
        out: dict[SessionKey, int] = {}
        for e in self.bank.entries.values():
            out[e.session] = out.get(e.session, 0) + e.nbytes
        self.ram_bytes = out
        metrics.BANK_BYTES.set(self.bank.total_nbytes)
        metrics.BANK_ENTRIES.set(len(self.bank.entries))

    def session_state(self, key: SessionKey, info: SessionInfo) -> str:
        """Any thread: where a session's KV is."""
        ram = self.ram_bytes.get(key, 0)
        if self.bank.is_busy(key):
            return "active"
        if ram and info.durable_tokens < len(info.tokens):
            return "resident-dirty"
        if ram:
            return "resident-clean"
        return "cold" if info.durable_tokens > 0 else "gone"

    def _on_coldstore_event(self, msg: dict) -> None:
        """Progress and completion of write jobs (I/O thread): update snapshots, then the bank."""
        if msg.get("op") == "retired":
            self.call(lambda: self.forget_retired(msg))
            return
        self.writer.on_event(msg)
        if "session_id" not in msg:
            return
        session = (msg["tenant"], msg["session_id"])
        durable = msg.get("durable_tokens", 0)
        # A write-out is all or nothing: a failed one's blocks were taken back.
        lowered = msg.get("outcome") == "deadline" or bool(msg.get("taken_back"))
        info = self.sessions.get(session)
        if info is not None and (durable > info.durable_tokens or lowered):
            self._set_session(session, replace(info, durable_tokens=durable))

        def apply():
            self.bank.mark_durable(session, durable, lowered=lowered)
            if msg["op"] == "done":
                self.bank.mark_write_done(session, msg["job"],
                                          retry=msg["outcome"] in ("refused", "error"))
                if msg["outcome"] == "written":
                    events.emit("kv_durable", tenant=session[0], session_id=session[1],
                                durable_tokens=durable)
                if msg["outcome"] not in ("written", "superseded", "cancelled"):
                    logger.warning("write of %s ended %s (%s): %s", session[1], msg["outcome"],
                                   msg.get("reason", ""), msg.get("error", ""))

        self.call(apply)
