"""The engine: the one thread that owns the model, the scheduler and, through its KV manager
(worker/tiers/manager.py), the SessionBank, the KV writer and the conversation records.

It is an actor. Other threads never touch what it owns: they post commands
(worker/commands.py) to its queue and read the `Snapshot` it publishes whole after every turn
of its loop. The coldstore link's acknowledgements arrive through the writer's inbox, which
the loop empties at every turn (and a write-out, while it waits).

A generation goes: its conversation (the name, else the one its tokens continue), admission
(price it, make room by the bank's policies, or refuse), restore the longest cached prefix
(RAM bank, else SSD), then the scheduler prefills the rest and decodes, step by step with the
other admitted requests, and finally the turn is committed: the conversation's record first
(durable before the final message), then the bank entry, then the write-behind job for its
new KV blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvbank import events, metrics
from kvbank.blocks import BlockId, chain_block_ids, chain_root, common_prefix_len
from kvbank.config import Layout
from kvbank.contracts.failures import InvalidRequest, Refused
from kvbank.contracts.pricing import Pricing
from kvbank.models import default_cache_dir
from kvbank.v1 import api_pb2, worker_pb2
from kvbank.worker import commands as cmd
from kvbank.worker.compute import reports
from kvbank.worker.compute.cores import Cores
from kvbank.worker.compute.decoding import Decodings
from kvbank.worker.compute.joins import BatchJoins, length
from kvbank.worker.compute.scheduler import PREFILL_STEP_TOKENS, BatchScheduler, Running, warm_up
from kvbank.worker.compute.scheduler_config import SchedulerConfig
from kvbank.worker.compute.mtp.serving import DEFAULT_DEPTH
from kvbank.worker.compute.prerender import Prerenders, off_reason
from kvbank.worker.compute.served_model import load_served_model
from kvbank.worker.link.kv_events import EventsConfig, Publisher
from kvbank.worker.memory import calibration
from kvbank.heap import resident_bytes
from kvbank.worker.memory.allocator import (give_back_freed_memory, mlx_cache_limit,
                                            serve_buffers_from_the_heap)
from kvbank.worker.memory.guard import Guard
from kvbank.worker.memory.pricing import (calibrate, held_bytes, memory_budget_bytes,
                                          reconcile_rss, rss_slack)
from kvbank.worker.tiers.manager import MAX_CHECKPOINTS, KVManager, Restoring, Start

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_path: Path, layout: Layout, *, block_tokens: int, bank_bytes: int,
                 staging_max_bytes: int | None = None, restore_via: str = "direct",
                 scheduler: SchedulerConfig = SchedulerConfig(),
                 memory_budget: str | int | None = None, active_pin_s: float = 600.0,
                 admission_chain_shed: bool = False,
                 prefill_chunk_tokens: int = PREFILL_STEP_TOKENS,
                 write_out_deadline_s: float | None = None,
                 max_checkpoints: int = MAX_CHECKPOINTS, checkpoint_every: int | None = None,
                 kv_events: EventsConfig | None = None, kv_bits: int | None = None,
                 mtp: str = "auto", mtp_depth: int = DEFAULT_DEPTH, mtp_head: Path | None = None):
        """Built on the caller's thread; once its thread starts, that thread owns it all."""
        serve_buffers_from_the_heap()
        self.layout = layout.ensure()
        self.block_tokens = block_tokens
        self.scheduler = scheduler
        served = load_served_model(Path(model_path), block_tokens, kv_bits=kv_bits, mtp=mtp,
                                   mtp_depth=mtp_depth, mtp_head=mtp_head)
        self.model_path, self.model, self.tokenizer = served.path, served.model, served.tokenizer
        self.config, self.kinds, self.fingerprint = served.config, served.kinds, served.fingerprint
        self.max_context_tokens = served.max_context_tokens
        self.eos_token_ids = sorted(self.tokenizer.eos_token_ids)
        self.vocab_size = served.vocab_size
        self.kv_bytes_per_token, self.kv_dtype = served.kv_bytes_per_token, served.kv_dtype
        self.checkpoint_bytes = served.checkpoint_bytes
        self.checkpoint_every = served.checkpoint_every(checkpoint_every, block_tokens)
        self.decodings = Decodings(self.tokenizer, self.vocab_size, self.model_path.name)
        self._queue: queue.Queue = queue.Queue()
        self._arrived: deque = deque()  # taken from the queue mid-step, for the loop (`_arrivals`)
        self._pending: deque[cmd.Generate] = deque()
        # A request's window and recurrent caches, priced twice; with MTP, a verify also keeps
        # the recurrent states after each of its depth + 1 tokens (worker/kv/rollback.py).
        speculation = served.mtp.depth + 1 if served.mtp is not None else 0
        self.pricing = Pricing(self.kv_bytes_per_token, 0, prefill_chunk_tokens,  # calibrated below
                               state_bytes=(2 + speculation) * self.checkpoint_bytes,
                               kv_layers=self.kinds.full_count,
                               logits_bytes_per_query=4 * self.vocab_size)
        self._step_queries = scheduler.max_active * max(1, speculation)  # a decode step's most
        self.memory_budget = 0  # known once the model and the tiers are in memory (below)
        self.kv = KVManager(
            layout, kinds=self.kinds, fingerprint=self.fingerprint, block_tokens=block_tokens,
            bank_bytes=bank_bytes, staging_max_bytes=staging_max_bytes, restore_via=restore_via,
            active_pin_s=active_pin_s, max_checkpoints=max_checkpoints,
            write_out_deadline_s=write_out_deadline_s, publisher=self._events_publisher(kv_events),
            wake=self._wake, pricing=self.pricing, budget=lambda: self.memory_budget,
            chain_shed=admission_chain_shed, kv_bytes_per_token=self.kv_bytes_per_token,
            waiting=lambda: bool(self._pending))  # waiting requests come first
        mx.set_cache_limit(0)  # until the budget is known (below)
        self.mtp = served.mtp  # its head's weights read by now: in the fixed part below
        self.mtp_message = served.mtp_message
        self.batch = BatchScheduler(self.model, kinds=self.kinds, max_active=scheduler.max_active,
                                    eos_token_ids=self.eos_token_ids,
                                    decode=self.tokenizer.decode,
                                    prefill_step_tokens=prefill_chunk_tokens,
                                    decode_wait_s=scheduler.decode_wait_s,
                                    shared_forward_s=scheduler.shared_forward_s, mtp=self.mtp,
                                    may_join=lambda joining: self.joins.may_join(joining))
        self.joins = BatchJoins(self.pricing, self.kv, self.batch,
                                budget=lambda: self.memory_budget)
        # The prefill transients and what a first request leaves behind (the fixed part of
        # the budget): measured at a first start, read from kvbank's cache at every other
        # (into the one Pricing the KV manager holds too).
        calibration.measured(
            self.pricing,
            calibration.CalibrationFile(default_cache_dir(), self.fingerprint,
                                        prefill_chunk_tokens, head=self.kinds.has_head),
            calibrate=lambda pricing, on_chunk: calibrate(
                self.model, pricing, on_chunk,
                last_forward_tokens=self.batch.last_forward_tokens),
            warm_up=lambda: warm_up(self.batch, self.kinds, self.tokenizer,
                                    prefill_chunk_tokens))
        self.memory_budget = memory_budget_bytes(memory_budget, self.pricing)
        slack = rss_slack(self.memory_budget)
        cache_limit = mlx_cache_limit(self.memory_budget - slack, self.pricing.fixed_bytes)
        mx.set_cache_limit(cache_limit)
        # MLX may keep that much, and the allocators drift by up to the slack: held, always
        self.pricing.fixed_bytes += cache_limit + slack
        self.prerenders = Prerenders(model=self.model, kinds=self.kinds, kv=self.kv,
                                     pricing=self.pricing, chunk_tokens=prefill_chunk_tokens,
                                     stream=self.batch.gen.stream, off_reason=off_reason(self.mtp))
        self._held_seen = 0  # the ledger at the last _give_back_freed
        self.cores = Cores(self.batch.gen.stream)  # its `compiling` set by the worker's server
        kv = self.kv
        self._handlers = {
            cmd.DeleteSession: lambda c: kv.delete(c.session),
            cmd.Release: lambda c: kv.release(c.session, c.write_out),
            cmd.Trim: lambda c: kv.trim(c.tenant),
            cmd.Flush: lambda c: kv.flush(c.tenant),
            cmd.Status: lambda c: (reports.status(self, c.tenant), *kv.receipts(c.tenant)),
            cmd.Tick: self._tick,
            cmd.PressureTrim: lambda c: kv.pressure(c.level, c.source, c.deferred_s),
            cmd.Probe: lambda c: kv.probe(c.tokens, c.tenant),
            cmd.Prefetch: lambda c: (self.prerenders.ask if c.prefill else kv.hint)(
                c.tenant, c.session_id, np.asarray(c.tokens, np.uint32)),
            cmd.History: lambda c: kv.history(c.session),
            cmd.Announce: lambda c: kv.announce(),
        }
        self.snapshot = cmd.Snapshot()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        for state in cmd.SESSION_STATES:  # counted when scraped, from the snapshot
            metrics.SESSIONS.labels(state).set_function(
                lambda state=state: sum(self.snapshot.state(k) == state
                                        for k in self.snapshot.sessions))
        metrics.MEMORY_BUDGET.set(self.memory_budget)
        self.guard = Guard(self).start()

    # -- identity ---------------------------------------------------------------------------

    def root_for(self, tenant: str) -> BlockId:
        return chain_root(self.fingerprint, tenant)

    def _events_publisher(self, config: EventsConfig | None) -> Publisher | None:
        """Several machines behind a router: where the KV manager says what this worker
        holds (a joining subscriber is told it all again, on the engine's thread)."""
        if config is None:
            return None
        return Publisher(config, on_subscribe=lambda: self.post(cmd.Announce())).start()

    # -- the queue --------------------------------------------------------------------------

    def post(self, command) -> Any:
        """Any thread: hand a command to the engine; returns it (its `reply` resolves). A
        request that comes while a pre-render runs is logged as it comes (the pre-render
        yields to it after the chunk in flight: tests/test_family_loops.py reads the order)."""
        if isinstance(command, cmd.Generate) and self.prerenders.busy:
            events.emit("request_during_prerender", request_id=command.request.request_id,
                        session_id=command.request.session_id)
        self._queue.put(command)
        return command

    def ask(self, command: cmd.Command, timeout_s: float | None = None) -> Any:
        """Any thread but the engine's: post and wait for the answer."""
        return self.post(command).reply.result(timeout=timeout_s)

    def _wake(self) -> None:
        """The writer's inbox has mail, or a restore's read ended: a blocked loop turns once."""
        self._queue.put(_WAKE)

    def _run(self) -> None:
        while True:
            idle = not self.batch and not self._pending and not self._arrived
            items = [self._queue.get()] if idle and not self._prerender_now() else []
            items = list(self._arrived) + items + self._drain_queue()  # in the order they came
            self._arrived.clear()
            self.kv.pump()  # acknowledgements first: they free staging and mark durable
            for item in items:
                if isinstance(item, cmd.Stop):
                    for r in self.kv.stop(timeout_s=4):
                        self._end_restoring(r, None)
                    item.reply.set_result(None)
                    return
                if isinstance(item, cmd.Generate):
                    self._pending.append(item)
                elif item is not _WAKE:
                    self._handle(item)
            self.kv.set_busy(bool(self.batch or self._pending), write_now=self.joins.wants_writes())
            running = self.running()
            self._join_restored()
            self.kv.land()  # hints' reads that ended, into the bank
            self._admit_pending()
            if self.running() > running:  # seen running (guard, Status) before it answers
                self._publish()
            self._give_back_freed()  # what commands, acknowledged writes and evictions freed
            self.cores.share()  # a grammar compile running beside takes a core
            if self.batch:
                self._step()
            elif not self._pending and self._prerender_now():
                self.prerenders.step()  # idle: one chunk, then the queue is looked at again
            self._publish()
            if self._pending and not self.batch:  # first in line waits for memory
                time.sleep(0.01)

    def _arrivals(self) -> None:
        """Between the batch's decode and its next prompt chunk: requests that came meanwhile
        join the line and start where they fit, so a short prompt that came during the decode
        is read in this step, not after another tenant's chunk (bench tenants full_queue: a
        probe's first token waited a decode, a 0.15 s chunk and its own forward). A request
        behind another command waits for the loop, which runs them all in order."""
        came, held = False, any(item is not _WAKE for item in self._arrived)
        for item in self._drain_queue():
            if isinstance(item, cmd.Generate) and not held:
                self._pending.append(item)
                came = True
            else:
                held = held or item is not _WAKE
                self._arrived.append(item)
        if came:
            running = self.running()
            self._admit_pending()
            if self.running() > running:
                self._publish()

    def _drain_queue(self) -> list:
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def _prerender_now(self) -> bool:
        """A pre-render may take a chunk: no request runs, restores or waits (the caller
        checks the batch and the line)."""
        return self.prerenders.waiting and not self.kv.reading

    def _handle(self, command: cmd.Command) -> None:
        """Run a command; its effect is in the snapshot before its caller hears back."""
        try:
            result, error = self._handlers[type(command)](command), None
        except Exception as e:
            logger.exception("%s failed", type(command).__name__)
            result, error = None, e
        self.kv.refresh()
        self._publish()
        if error is None:
            command.reply.set_result(result)
        else:
            command.reply.set_exception(error)

    def _publish(self) -> None:
        """The snapshot other threads read, replaced whole (and this turn's KV events)."""
        self.kv.flush_events()
        ledger = self.kv.ledger()  # once: this runs at every step of the loop
        held = self.pricing.fixed_bytes + self.pricing.unaccounted_bytes + ledger["held_bytes"]
        self.snapshot = cmd.Snapshot(
            **self.kv.published(), held_bytes=held,
            kv_bytes=ledger["entries_bytes"] + ledger["active_bytes"],
            running=self.running(), waiting=len(self._pending))

    def running(self) -> int:
        """Admitted requests: in the batch, or restoring from SSD on a thread."""
        return len(self.batch) + self.kv.reading

    def waiting(self, tenant: str | None = None) -> int:
        """Requests in line, not admitted yet (`tenant`'s only, if named)."""
        if tenant is None:
            return len(self._pending)
        return sum(j.request.tenant == tenant for j in self._pending)

    def close(self) -> None:
        self.guard.close()
        try:
            self.ask(cmd.Stop(), timeout_s=5)
        except Exception:  # a step still running: the thread is a daemon, the process ends
            logger.warning("the engine did not stop within 5 s")
        self.kv.close()

    # -- one generation ---------------------------------------------------------------------

    def _admit_pending(self) -> None:
        """Start waiting requests in order while the scheduler has room and memory allows. A
        request waiting for memory stops the line for its own tenant and for every tenant
        with as many requests running: the memory it waits for is held by requests in
        flight, and those behind it would take what they free. A tenant with fewer running
        goes past it (one API key's flood never holds another's short request until the
        flood's turns end), which a waiting request's tenant can allow only up to its own
        count, so the request first in line is not starved. One waiting for the prefix a
        running request is computing lets the requests behind it start."""
        i = 0
        blocked: int | None = None  # the running count of the first tenant waiting for memory
        while i < len(self._pending) and self.running() < self.scheduler.max_active:
            job = self._pending[i]
            if job.cancelled.is_set():
                del self._pending[i]
                job.emit(None)
                continue
            if blocked is not None and self._running_of(job.request.tenant) >= blocked:
                i += 1
                continue
            try:
                started = self._start(job)
            except (InvalidRequest, Refused) as e:
                del self._pending[i]
                job.emit(e)
                continue
            except Exception as e:
                logger.exception("could not start a request")
                del self._pending[i]
                job.emit(e)
                continue
            if started is Start.WAIT_MEMORY:  # waits for memory held by requests in flight
                mine = self._running_of(job.request.tenant)
                blocked = mine if blocked is None else min(blocked, mine)
                i += 1
                continue
            if started is Start.WAIT_PREFIX:
                i += 1
                continue
            del self._pending[i]

    def _running_of(self, tenant: str) -> int:
        """`tenant`'s admitted requests: in the batch, or restoring on a thread."""
        return (sum(r.job.request.tenant == tenant for r in self.batch.running.values())
                + self.kv.reading_of(tenant))

    def _start(self, job: cmd.Generate):
        """Admission, restore, and hand-over to the scheduler: STARTED, or WAIT_MEMORY, or
        WAIT_PREFIX (a running request is computing KV this one would compute again)."""
        req = job.request
        tokens = np.asarray(req.token_ids, dtype=np.uint32)
        if len(tokens) == 0:
            raise InvalidRequest("the prompt is empty: send at least one token")
        if len(tokens) + req.max_tokens > self.max_context_tokens:
            raise InvalidRequest(
                f"prompt ({len(tokens)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                f"model's context of {self.max_context_tokens} tokens")
        if job.decoding is None:  # once: a request may wait here for several turns
            job.decoding = self.decodings.for_request(req, job.grammar)  # or refused
        decoding = job.decoding
        ids = chain_block_ids(tokens, self.root_for(req.tenant), self.block_tokens)  # once
        joins = bool(decoding.processors)  # mlx-lm applies them in its batch: joins at once
        own, forward = self._price(len(tokens), req.max_tokens, joins)
        need = own + max(0, forward - self.kv.forward_bytes())  # the largest forward is held
        if self.prerenders.waiting:  # requests first: a pre-render gives way
            self.prerenders.hand_over(tokens, req.tenant)
            if need > self.memory_budget - held_bytes(self.pricing, self.kv):
                self.prerenders.make_room()
        admitted = self.kv.admit(job, tokens, ids, need=need, batch=self.batch,
                                 solo_need=self.pricing.request_bytes(
                                     len(tokens), req.max_tokens, joins=joins),
                                 running=len(self.batch))
        if isinstance(admitted, Start):
            return admitted
        job.emit(worker_pb2.WorkerGenerateResponse())  # admitted: a client's stream may open
        restoring, on_thread = self.kv.start(admitted, own, forward, decoding)
        if not on_thread:  # the batch steps on while a long read runs on a thread
            self._join(restoring, where="inline")
        return Start.STARTED

    def _join(self, restoring: Restoring, where: str) -> None:
        """A request's restored cache (from what SSD read, else RAM's hit) into the batch.
        Raises, the bank given back, when it cannot join."""
        job, tokens, session, history = (restoring.job, restoring.tokens, restoring.session,
                                         restoring.history)
        req = job.request
        t_join = time.monotonic()
        taken = self.kv.take(restoring)
        try:
            reports.count_restore(req, session, len(tokens), taken.cached, taken.source)
            r = Running(job=job, tokens=tokens, bank_key=session, session=session,
                        cached=taken.cached, source=taken.source,
                        known=common_prefix_len(history, tokens) if history is not None else 0,
                        started=time.monotonic(), stops=list(req.stop),
                        detok=self.tokenizer.detokenizer, decoding=restoring.decoding,
                        handed=taken.handed, at_rest=self.kinds.at_rest(taken.cache),
                        split_at=self.kinds.splits(taken.cached, len(tokens), req.checkpoint_at,
                                                   self.checkpoint_every))
            r.restore_s = r.started - restoring.t0
            if not req.no_cache:
                r.prefix_lost = taken.lost
                metrics.PREFIX_LOST.labels("no_checkpoint").inc(r.prefix_lost)
            self.kv.copies_history(session, taken.handed, len(tokens))
            self.batch.add(r, taken.cache, req.max_tokens)
        except Exception:
            self.kv.abandon(session, taken.handed)
            raise
        if taken.source == api_pb2.CACHE_SOURCE_SSD:
            stall = (r.restore_s if where == "inline"
                     else restoring.stall_s + time.monotonic() - t_join)
            metrics.RESTORE_STALL.labels(where).observe(stall)

    def _join_restored(self) -> None:
        """Restores whose read on a thread ended: each request joins the batch, or ends (its
        client went away, the read failed)."""
        for r in self.kv.ready():
            if r.job.cancelled.is_set() or r.error is not None:
                self._end_restoring(r, r.error)
                continue
            try:
                self._join(r, where="thread")
            except Exception as e:
                logger.exception("could not start a request")
                r.job.emit(e)

    def _end_restoring(self, r: Restoring, error: BaseException | None) -> None:
        """A request that ends while, or as, its KV was read on a thread: its reservation and
        what was read go; its client hears the error, or the end of its stream."""
        r.ssd = None
        self.kv.abandon(r.session)
        if error is not None:
            logger.error("restore of session %s failed: %s", r.session[1], error)
        r.job.emit(error if isinstance(error, Exception) else None)

    def _price(self, prompt_tokens: int, max_tokens: int, joins: bool) -> tuple[int, int]:
        """This request's own bytes (its cache on its own, or, `joins`, in mlx-lm's batch as
        it is) and its forwards' working memory. The engine runs one forward at a time, so the
        ledger holds only the largest of the running requests' (`reserve_active`); mlx-lm's
        batch reads the prompts in it together, so a request that joins at once holds its own."""
        lens = self.joins.lens()
        own = self.pricing.own_bytes(prompt_tokens, max_tokens, joins=joins,
                                     batch_len=max(lens, default=0), batch_size=len(lens))
        forward = self.pricing.prefill_transient(prompt_tokens)
        return (own + forward, 0) if joins else (own, forward)

    def _step(self) -> None:
        # A cancelled turn is not committed: the client never saw it, so the session's
        # history stays as it was (an append builds on what the client has).
        for r in self.batch.take_cancelled():
            self.kv.leave(r)
            r.job.emit(None)
        if not self.batch:
            return
        try:
            self.joins.hold_leave()
            done = self.batch.step(between=self._arrivals)
            self.joins.settle()
            for r in self.batch.take_prefix_ready():
                self.kv.share(r, self.batch)
            for r in self.batch.take_prompts_read():  # from now on a decode step's memory
                self.kv.prompt_read(r.bank_key, self.pricing.decode_transient(
                    length(r), self._step_queries))
            if self.joins.ask_again():  # the memory a refused join lacked may be here
                self.batch.join_beside()
        except Exception as e:  # a failed step fails every request in it, not the worker
            logger.exception("generation step failed")
            for r in list(self.batch.running.values()):
                self.batch.drop(r)
                self.kv.leave(r)
                r.job.emit(e)
            return
        for r, e in self.batch.take_failed():  # its own forward failed; the others went on
            self.kv.leave(r)
            r.job.emit(e)
        answers = []
        for r, cache in done:
            try:
                answers.append((r, self._finish(r, cache)))
            except Exception as e:
                logger.exception("commit failed")
                answers.append((r, e))
            finally:
                self.kv.leave(r)
        if done:
            self.kv.turns_ended()  # the memory they held is free: hints may read back
            # The turns are in the snapshot (and their KV events out) before their clients
            # hear back: what a client reads next (its session, a router's view) includes it.
            self._publish()
            for r, answer in answers:
                r.job.emit(answer)
                if not isinstance(answer, Exception):
                    r.job.emit(None)
            self._give_back_freed(turn_ended=True)

    def _give_back_freed(self, *, turn_ended: bool = False) -> None:
        """The heap's free pages back to the OS (`serve_buffers_from_the_heap` keeps them),
        after a turn and whenever the ledger fell since the last look: RSS follows it. The
        ledger then meets RSS at once: measured by the guard's last tick, during the turn
        (a forward's pages not yet given back), the excess counted as held refused the next
        request in `bench compare` at 1.3 GB ("unaccounted 84.6 MB")."""
        held = self.kv.ledger()["held_bytes"]
        if turn_ended or held < self._held_seen:
            give_back_freed_memory()
            if self.pricing.unaccounted_bytes:
                reconcile_rss(self.pricing, held, resident_bytes())
        self._held_seen = held

    def _finish(self, r: Running, cache: list) -> worker_pb2.WorkerGenerateResponse:
        """Commit a finished turn; its last message, to send once the snapshot has it."""
        full = np.concatenate([r.tokens, np.asarray(r.completion, dtype=np.uint32)])
        durable = self.kv.commit(r.session, full, cache, r.started, handed=r.handed,
                                 checkpoints=r.checkpoints, at_rest=r.at_rest)
        r.handed = None  # superseded by the turn, or gone with its deleted conversation
        reasoning = r.decoding.reasoning
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
            max_tokens=r.job.request.max_tokens,
            prefix_lost_tokens=r.prefix_lost,
            reasoning_tokens=(reasoning.count(r.completion) if reasoning else
                              r.decoding.harmony.count(r.completion, self.tokenizer.decode)
                              if r.decoding.harmony else 0),
            drafted_tokens=r.drafted,
            accepted_tokens=r.accepted,
        )
        for stage, seconds in (("waiting", usage.queue_s - r.restore_s),
                               ("restore", r.restore_s), ("first_token", usage.ttft_s)):
            metrics.WORKER_STAGE.labels(stage).observe(seconds)
        metrics.GENERATION_TOKENS.inc(len(r.completion))
        if r.drafted:
            metrics.MTP_TOKENS.labels("drafted").inc(r.drafted)
            metrics.MTP_TOKENS.labels("accepted").inc(r.accepted)
        metrics.RECOMPUTED_TOKENS.inc(usage.recomputed_tokens)
        finish = r.finish
        if finish == api_pb2.FINISH_REASON_STOP and r.decoding.made_calls:
            finish = api_pb2.FINISH_REASON_TOOL_CALLS
        return worker_pb2.WorkerGenerateResponse(finish_reason=finish, usage=usage,
                                                 stop_sequence=r.stop_sequence)

    # -- commands (engine thread) --------------------------------------------------------------

    def _tick(self, tick: cmd.Tick) -> None:
        """The guard's tick: the ledger meets RSS, then the tiers' (the dynamic ceiling,
        writes sent again, hints read back)."""
        reconcile_rss(self.pricing, self.kv.ledger()["held_bytes"], tick.rss_bytes)
        self.kv.tick()
        metrics.MEMORY_HELD.set(held_bytes(self.pricing, self.kv))


_WAKE = object()  # a turn of the loop, nothing else (the writer's inbox has mail)
