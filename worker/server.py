"""The worker process: the internal gRPC service the router calls, in front of the engine.

The asyncio side only relays: each call becomes a command on the engine's queue
(worker/commands.py) and awaits its answer; a generation's events come back through
`call_soon_threadsafe`. Reads of sessions come from the engine's published snapshot. A client
that goes away cancels its generation. Failures reach the caller through
kvbank/contracts/failures.py's table.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvbank import events, metrics
from kvbank.config import Layout
from kvbank.contracts.failures import ColdstoreUnavailable, KvbankError, grpc_status
from kvbank.v1 import api_pb2, worker_pb2, worker_pb2_grpc
from kvbank.worker import commands as cmd
from kvbank.worker.compute.engine import Engine
from kvbank.worker.compute.grammar_compile import (DEFAULT_GRAMMAR_TIMEOUT_S,
                                                   DEFAULT_MAX_GRAMMAR_BYTES, GrammarCompiles)
from kvbank.worker.tiers.conversations import history_in_ram

logger = logging.getLogger(__name__)
MATMUL_CHECK_N = 512  # `_matmul_gflops`


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, engine: Engine, compiles: GrammarCompiles):
        self.engine = engine
        self.compiles = compiles

    async def Generate(self, request, context):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        try:  # a grammar compiles here, on a thread, never on the engine's
            grammar = await self.compiles.grammar(request)
        except KvbankError as e:
            await context.abort(grpc_status(e), str(e), trailing_metadata=e.trailing_metadata())
        except Exception as e:
            logger.exception("the request's grammar failed")
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"generation failed: {type(e).__name__}")
        job = self.engine.post(cmd.Generate(
            request, emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
            grammar=grammar))
        try:
            while True:
                ev = await events.get()
                if ev is None:
                    return
                if isinstance(ev, KvbankError):
                    await context.abort(grpc_status(ev), str(ev),
                                        trailing_metadata=ev.trailing_metadata())
                if isinstance(ev, Exception):
                    await context.abort(grpc.StatusCode.INTERNAL,
                                        f"generation failed: {type(ev).__name__}: {ev}")
                yield ev
        finally:
            job.cancelled.set()

    async def _ask(self, command: cmd.Command):
        """A command's answer, awaited without holding the event loop."""
        return await asyncio.wrap_future(self.engine.post(command).reply)

    async def Probe(self, request, context):
        tokens = np.asarray(request.token_ids, dtype=np.uint32)
        ram, ssd = await self._ask(cmd.Probe(request.tenant, tokens))
        return worker_pb2.ProbeResponse(ram_tokens=ram, ssd_tokens=ssd)

    async def Prefetch(self, request, context):
        tokens = np.asarray(request.token_ids, dtype=np.uint32)
        r = await self._ask(cmd.Prefetch(request.tenant, request.session_id, tokens,
                                         prefill=request.prefill))
        return api_pb2.PrefetchResponse(status=r.status, ram_tokens=r.ram_tokens,
                                        ssd_tokens=r.ssd_tokens,
                                        restored_tokens=r.restored_tokens)

    async def Load(self, request, context):
        snap, e = self.engine.snapshot, self.engine
        return worker_pb2.WorkerLoadResponse(
            running=snap.running, waiting=snap.waiting, kv_bytes=snap.kv_bytes,
            kv_capacity_bytes=max(0, e.memory_budget - e.pricing.fixed_bytes))

    async def Info(self, request, context):
        e = self.engine
        return worker_pb2.InfoResponse(
            model_path=str(e.model_path), fingerprint=e.fingerprint.hex(),
            max_context_tokens=e.max_context_tokens, kv_bytes_per_token=e.kv_bytes_per_token,
            block_tokens=e.block_tokens, eos_token_ids=e.eos_token_ids,
            scheduler=e.scheduler.mode, max_active_requests=e.scheduler.max_active,
            memory_budget_bytes=e.memory_budget, fixed_bytes=e.pricing.fixed_bytes,
            max_fit_tokens=e.pricing.max_fit_tokens(e.memory_budget),
            prefill_chunk_tokens=e.pricing.chunk_tokens,
            transient_base_bytes=e.pricing.transient_base,
            transient_per_context_token=e.pricing.transient_per_context_token,
            checkpointed=e.kinds.checkpointed, cache_layout=e.kinds.layout,
            max_grammar_bytes=self.compiles.max_bytes, **_tool_calling(e.decodings.format))

    @staticmethod
    def _session_pb(snap: cmd.Snapshot, key, info, tokens=None) -> api_pb2.Session:
        s = api_pb2.Session(session_id=key[1], token_count=info.n_tokens,
                            durable_tokens=info.durable_tokens,
                            ram_bytes=snap.ram_bytes.get(key, 0), created_at=info.created_at,
                            checkpoint_bytes=snap.checkpoint_bytes.get(key, 0),
                            updated_at=info.updated_at, state=snap.state(key), tenant=key[0])
        if tokens is not None:
            s.token_ids.extend(tokens.tolist())
        return s

    async def ListSessions(self, request, context):
        scope = _scope(context)
        snap = self.engine.snapshot
        return api_pb2.ListSessionsResponse(sessions=[
            self._session_pb(snap, k, v) for k, v in sorted(snap.sessions.items())
            if scope is None or k[0] == scope])

    async def GetSession(self, request, context):
        key = (_tenant(context), request.session_id)
        snap = self.engine.snapshot
        info = snap.sessions.get(key)
        tokens = None if info is None else history_in_ram(info)
        if info is not None and tokens is None:  # on SSD only: the engine reads LMDB
            info, tokens = await self._ask(cmd.History(key))
            snap = self.engine.snapshot
        if info is None or tokens is None:  # unknown, or the coldstore just retired it
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no session {request.session_id!r}: list them with Sessions.List")
        return self._session_pb(snap, key, info, tokens)

    async def DeleteSession(self, request, context):
        key = (_tenant(context), request.session_id)
        deleted = await self._ask(cmd.DeleteSession(key))
        return api_pb2.DeleteSessionResponse(deleted=deleted)

    # -- stored responses: straight to the coldstore (the engine holds none of them) --------

    async def PutResponse(self, request, context):
        await self._coldstore(context, self.engine.kv.coldstore.put_response, _tenant(context),
                              request.id, request.created_at, request.body)
        return api_pb2.PutResponseReply()

    async def GetResponse(self, request, context):
        body = await self._coldstore(context, self.engine.kv.coldstore.get_response,
                                     _tenant(context), request.id)
        if body is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no response {request.id!r}")
        return api_pb2.StoredResponse(id=request.id, body=body)

    async def DeleteResponse(self, request, context):
        deleted = await self._coldstore(context, self.engine.kv.coldstore.delete_response,
                                        _tenant(context), request.id)
        return api_pb2.DeleteResponseReply(deleted=deleted)

    async def _coldstore(self, context, call, *args):
        try:
            return await asyncio.to_thread(call, *args)
        except ColdstoreUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the store is unavailable: {e}",
                                trailing_metadata=e.trailing_metadata())

    async def Release(self, request, context):
        key = (_tenant(context), request.session_id)
        r = await self._ask(cmd.Release(key, request.write_out))
        return api_pb2.ReleaseResponse(released_entries=r.released_entries,
                                       released_bytes=r.released_bytes,
                                       written_out_entries=r.written_out_entries,
                                       dropped_unwritten_entries=r.unwritten_dropped)


    async def SetPressure(self, request, context):
        try:
            level, source = self.engine.guard.inject(request.level)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return api_pb2.PressureResponse(level=level, source=source)

    async def Trim(self, request, context):
        """The operator's: every tenant's idle conversations; a tenant's: its own, and the
        bytes after are its own conversations'."""
        scope = _scope(context)
        r = await self._ask(cmd.Trim(scope))
        after = r.bytes_after if scope is None else sum(
            n for k, n in self.engine.snapshot.ram_bytes.items() if k[0] == scope)
        return api_pb2.TrimResponse(evicted_entries=r.evicted_entries,
                                    unwritten_kept=r.unwritten_kept, bank_bytes_after=after)

    async def Flush(self, request, context):
        r = await self._ask(cmd.Flush(_scope(context)))
        return api_pb2.FlushResponse(written_entries=r.written_entries,
                                     failed_entries=r.failed_entries, seconds=r.seconds)

    async def Status(self, request, context):
        """The operator's: the whole server. A tenant's: its own figures and receipts
        (worker/compute/reports.py `tenant_status`), no SSD tier."""
        scope = _scope(context)
        st, receipts, evictions = await self._ask(cmd.Status(scope))
        if scope is not None:
            return api_pb2.StatusResponse(**st, recent_receipts_json=map(json.dumps, receipts),
                                          recent_evictions_json=map(json.dumps, evictions))
        try:
            cs = await asyncio.to_thread(self.engine.kv.coldstore.ping, 2.0)
            tier = {"store_bytes": cs.stats.block_bytes, "sessions": cs.stats.sessions,
                    "blocks": cs.stats.blocks, "queued_jobs": cs.queued_jobs,
                    "staged_bytes": cs.staged_bytes, "written_bytes": cs.written_bytes,
                    "write_budget_left_bytes": cs.write_budget_left_bytes,
                    "free_disk_bytes": cs.free_disk_bytes}
        except ColdstoreUnavailable:  # away: say nothing rather than fail the status
            tier = {}
        return api_pb2.StatusResponse(**st, recent_receipts_json=map(json.dumps, receipts),
                                      recent_evictions_json=map(json.dumps, evictions),
                                      coldstore_json=json.dumps(tier) if tier else "")


def _tenant(context) -> str:
    return dict(context.invocation_metadata()).get("x-kvbank-tenant", "")


def _scope(context) -> str | None:
    """Whose conversations an admin call acts on: the router's `x-kvbank-scope: server` for
    the operator's (None: every tenant's), else the caller's tenant."""
    md = dict(context.invocation_metadata())
    return None if md.get("x-kvbank-scope") == "server" else md.get("x-kvbank-tenant", "")


def _matmul_gflops() -> float:
    """Float32 512x512 matmuls: they tell the slow reference BLAS (6 GFLOP/s here) from
    OpenBLAS (120) in 10 ms, where 1024x1024 ones took 60-130 ms of both cores at every
    worker start."""
    import mlx.core as mx

    n = MATMUL_CHECK_N
    a = mx.random.normal((n, n))
    mx.eval(a @ a)
    t0 = time.perf_counter()
    for _ in range(4):
        mx.eval(a @ a)
    return 4 * 2 * n**3 / (time.perf_counter() - t0) / 1e9


async def serve(model: Path, layout: Layout, *, metrics_port: int = -1,
                grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
                max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES, **engine_kw) -> None:
    """`engine_kw`: the Engine's settings (block_tokens, bank_bytes, scheduler, ...)."""
    events.open_log(layout.events_path)
    metrics.serve("worker", layout.ensure().run_dir, metrics_port)
    gflops = _matmul_gflops()
    if gflops < 20:
        logger.warning("SLOW MATMUL: %.1f GFLOP/s. MLX is using its bundled reference BLAS; "
                       "install libopenblas0-pthread and start the worker with "
                       "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 (kvbank up does).",
                       gflops)
    else:
        logger.info("matmul check: %.0f GFLOP/s (float32 %dx%d)", gflops, MATMUL_CHECK_N,
                    MATMUL_CHECK_N)
    engine = Engine(model, layout, **engine_kw)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    compiles = GrammarCompiles(engine.decodings, timeout_s=grammar_timeout_s,
                               max_bytes=max_grammar_bytes)
    engine.cores.compiling = lambda: compiles.running  # the forwards leave compiles a core
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(engine, compiles), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    sock = layout.sockets_dir / "worker.sock"
    sock.unlink(missing_ok=True)
    server.add_insecure_port(layout.worker_address)
    await server.start()
    # What start-up made (model, tokenizer, gRPC) lives as long as the process. Frozen, a full
    # collection no longer walks it in the middle of a step (~50 ms each here, at random).
    gc.collect()
    gc.freeze()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    logger.info("worker serving on %s", layout.worker_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=5)
        compiles.close()
        engine.close()
        logger.info("worker stopped")


def main(model: Path, layout: Layout, **engine_kw) -> None:
    asyncio.run(serve(model, layout, **engine_kw))


def _tool_calling(fmt) -> dict:
    """The model's tool calling as read from its chat template (a `CallFormat`; empty:
    none)."""
    if fmt is None:
        return {}
    return {"tool_parser": fmt.name, "tool_call_start": fmt.start, "tool_call_end": fmt.end}
