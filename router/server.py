"""The router process: kvbank's public gRPC API.

It validates, tokenizes (tokenizer only, no weights), builds the full prompt (appending to the
session's committed history in append mode), and relays the worker's stream. It holds no KV.
Requests on one session run one at a time, so an append always sees the previous turn.

Errors map to gRPC codes in one place, `_status_for`, by kvbank/contracts/failures.py's table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures
import contextlib
import json
import logging
import signal
import time
import uuid
from pathlib import Path
from typing import Callable, TypeVar

import grpc
from jinja2.exceptions import TemplateError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvbank import metrics
from kvbank.config import PEER_READY_WAIT_S, RECONNECT_OPTIONS, RETRY_AFTER_UNAVAILABLE_S
from kvbank.v1 import api_pb2, api_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvbank.contracts.failures import (RELAYED_METADATA, ContextTooLong, KvbankError,
                                      MaxTokensTooLarge, WorkerUnavailable, grpc_status)
from kvbank.router.admission import AdmissionQueue, Ceilings, check_ceilings, worker_pricing
from kvbank.router.auth import OPERATOR, operator_or_tenant, tenant_for
from kvbank.router import next_turn
from kvbank.router.relays import AdminServicer, ResponsesServicer, SessionsServicer
from kvbank.router.tokenizer import AnswerTokens, PromptTokenizer, lift_system
from kvbank.router.validation import InvalidRequest, ValidRequest, validate

logger = logging.getLogger(__name__)

T = TypeVar("T")
TENANT_KEY = "x-kvbank-tenant"
SCOPE_KEY, SERVER_SCOPE = "x-kvbank-scope", "server"  # the operator's call: every tenant


def _status_for(exc: Exception) -> tuple[grpc.StatusCode, str, tuple]:
    """The one table from an exception to the status (and trailing metadata) a client sees."""
    if isinstance(exc, KvbankError):
        return grpc_status(exc), str(exc), exc.trailing_metadata()
    if isinstance(exc, grpc.aio.AioRpcError):  # the worker's: its reasons go on
        md = tuple((k, v) for k, v in (exc.trailing_metadata() or ())
                   if k in RELAYED_METADATA)
        if exc.code() == grpc.StatusCode.UNAVAILABLE and "x-kvbank-reason" not in dict(md):
            return _status_unavailable()  # the transport's, not the worker's own word
        return (*_code_for(exc), md)
    return (*_code_for(exc), ())


def _status_unavailable() -> tuple[grpc.StatusCode, str, tuple]:
    """The worker went away or is not back yet: our sentence, never the transport's."""
    e = WorkerUnavailable(WORKER_AWAY)
    return grpc_status(e), str(e), e.trailing_metadata()


WORKER_AWAY = (f"the worker is not answering (it is starting or restarting): retry in "
               f"{RETRY_AFTER_UNAVAILABLE_S} s")


def _code_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


LARGE_PROMPT_BYTES = 64 << 10  # tokenized on the tokenizing thread, not the router's loop


class LargePrompts:
    """The tokenizing thread: one, with its own tokenizer (a tokenizer is not shared between
    threads), for prompts of LARGE_PROMPT_BYTES or more. A 3.9 MB prompt held the router's
    loop for ~2 s, and every other tenant's request with it; here it waits only for the large
    prompts before it. Its tokenizer is loaded there at the first large prompt, once (about
    half a second): a router that never sees one spends neither the CPU at start nor the
    tokenizer's memory."""

    def __init__(self, model_dir: Path):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._model_dir = model_dir
        self._tokenizer: PromptTokenizer | None = None  # the thread's own: only it touches this

    def _tokenize(self, work: Callable[[PromptTokenizer], T]) -> T:
        if self._tokenizer is None:
            self._tokenizer = PromptTokenizer(self._model_dir)
        return work(self._tokenizer)

    async def run(self, work: Callable[[PromptTokenizer], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._tokenize, work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Backend:
    """The router's view of the worker: its channel, its facts, per-session ordering."""

    def __init__(self, model_dir: Path, worker_address: str, keys: dict[str, str] | None = None,
                 ceilings: Ceilings = Ceilings(), max_queue: int = 64,
                 max_queue_wait_s: float = 300.0, admin_key: str | None = None,
                 max_active_per_tenant: int | None = None,
                 max_queue_per_tenant: int | None = None, prerender: bool = True):
        """Per tenant (with API keys): `max_active_per_tenant` (None: one fewer than the
        worker runs, so a flood never takes every slot) and `max_queue_per_tenant` (None:
        half of `max_queue`). Without keys there is one tenant, and no share. `prerender`:
        after an answer with no tool call, the history the next query will carry is computed
        while the user reads (router/next_turn.py `prerender`)."""
        self.keys = keys or {}
        self.admin_key = admin_key  # the operator's (router/auth.py)
        self.ceilings = ceilings
        self._queue_limits = (max_queue, max_queue_wait_s)
        self._shares = (max_active_per_tenant, max_queue_per_tenant)
        self._queue: AdmissionQueue | None = None
        self.tokenizer = PromptTokenizer(model_dir)
        self.tokenizer.max_token_bytes  # at start: a prompt's first check needs it
        self.large = LargePrompts(model_dir)
        self.answers = AnswerTokens()  # what the model generated, for clients that send it back
        self.prerender = prerender
        self._background: set[asyncio.Task] = set()  # in flight (a task needs a reference)
        self.channel = grpc.aio.insecure_channel(
            worker_address, options=[("grpc.max_receive_message_length", 64 << 20),
                                     *RECONNECT_OPTIONS])
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._info: worker_pb2.InfoResponse | None = None
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def ready(self) -> None:
        """The worker's channel, connected: a request that comes while the worker (re)starts
        waits for it up to PEER_READY_WAIT_S (the channel tries again every half second at
        most, RECONNECT_OPTIONS), then is answered UNAVAILABLE with a retry-after."""
        if self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(self.channel.channel_ready(), PEER_READY_WAIT_S)
        except asyncio.TimeoutError:
            raise WorkerUnavailable(WORKER_AWAY) from None

    async def info(self) -> worker_pb2.InfoResponse:
        if self._info is None:
            await self.ready()
            try:
                self._info = await self.stub.Info(worker_pb2.InfoRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                raise WorkerUnavailable(WORKER_AWAY) from e
        return self._info

    async def queue(self) -> AdmissionQueue:
        """Sized by the worker's scheduler (its max_active_requests), known once it answers."""
        if self._queue is None:
            info = await self.info()
            active, (queue, wait_s) = info.max_active_requests or 1, self._queue_limits
            per_active, per_queue = self._shares
            if len(set(self.keys.values())) > 1:  # tenants to share between
                per_active = per_active or max(1, active - 1)
                per_queue = queue // 2 if per_queue is None else per_queue
            self._queue = AdmissionQueue(active, queue, wait_s, per_active, per_queue)
        return self._queue

    @property
    def queued(self) -> int:
        """Requests waiting in this router's admission queue."""
        return self._queue.depth if self._queue is not None else 0

    def fit(self, v: ValidRequest, tokens: list[int], info) -> ValidRequest:
        """With fit_max_tokens, max_tokens lowered to the room the prompt leaves in the model's
        context and under the ceilings; where none is left, the ceilings refuse as usual."""
        if not v.fit_max_tokens:
            return v
        most = info.max_context_tokens
        if self.ceilings.max_request_tokens is not None:
            most = min(most, self.ceilings.max_request_tokens)
        if info.memory_budget_bytes:
            most = min(most, worker_pricing(info).max_fit_tokens(info.memory_budget_bytes,
                                                                 len(tokens)))
        room = most - len(tokens)
        return dataclasses.replace(v, max_tokens=min(v.max_tokens, room)) if room >= 1 else v

    def admit_sizes(self, tokens: list[int], max_tokens: int, info) -> None:
        check_ceilings(self.ceilings, prompt_tokens=len(tokens), max_tokens=max_tokens,
                       info=info)

    async def holds(self, tenant: str, tokens: list[int]) -> bool:
        """This machine holds most of the prompt's KV (RAM or SSD): refusing would have a
        gateway recompute it elsewhere. A worker that does not answer at once holds nothing."""
        try:
            r = await self.stub.Probe(worker_pb2.ProbeRequest(tenant=tenant, token_ids=tokens),
                                      timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
        held = max(r.ram_tokens, r.ssd_tokens) >= len(tokens) // 2 > 0
        if held:
            metrics.QUEUED_NOT_REFUSED.inc()
        return held

    def session_lock(self, tenant: str, session_id: str):
        if not session_id:
            return contextlib.nullcontext()
        return self._locks.setdefault((tenant, session_id), asyncio.Lock())

    async def history(self, tenant: str, session_id: str) -> list[int]:
        await self.ready()
        try:
            s = await self.stub.GetSession(api_pb2.GetSessionRequest(session_id=session_id),
                                           metadata=((TENANT_KEY, tenant),), timeout=10)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return []
            raise
        return list(s.token_ids)

    async def prompt_tokens(self, v: ValidRequest, tenant: str, info,
                            with_checkpoints: bool = False):
        """The prompt's tokens (history and new), checked against the model's context as
        early as its size allows: refused on its byte count alone when that many bytes are
        more tokens than the context holds, else tokenized (on the tokenizing thread when
        large, `LargePrompts`, so the loop never waits seconds for one prompt). With
        `with_checkpoints`, (tokens, `checkpoints`) computed beside them."""
        if not info.tool_parser:
            _refuse_tools(v, Path(info.model_path).name, self.tokenizer)
        history = await self.history(tenant, v.session_id) if v.append else []
        ctx = info.max_context_tokens
        least = len(history) + (len(v.token_ids) if v.kind == "tokens"
                                else -(-v.text_bytes // self.tokenizer.max_token_bytes))
        if least >= ctx:
            raise ContextTooLong(least, None, ctx, at_least=v.text_bytes)

        def work(tok: PromptTokenizer):
            full = self._tokens(tok, v, tenant, history, info)
            return (full, self.checkpoints(v, full, info, tok)) if with_checkpoints else full

        return await self.tokenize(work, v.text_bytes)

    def in_background(self, work) -> None:
        """Run the coroutine `work` beside the requests (a pre-render), kept until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def tokenize(self, work: Callable[[PromptTokenizer], T], text_bytes: int) -> T:
        """`work` with a tokenizer: the loop's own, or for a prompt of `LARGE_PROMPT_BYTES`
        or more the tokenizing thread's (`LargePrompts`)."""
        if text_bytes >= LARGE_PROMPT_BYTES:
            return await self.large.run(work)
        return work(self.tokenizer)

    def _tokens(self, tok: PromptTokenizer, v: ValidRequest, tenant: str, history: list[int],
                info) -> list[int]:
        """`prompt_tokens`'s rendering and its checks, with `tok` (the loop's or the
        tokenizing thread's own)."""
        tools = list(v.tools) or None
        if v.kind == "chat":
            def render(messages: list[dict]) -> list[int]:
                if v.append:
                    return tok.chat_append(history, messages, set(info.eos_token_ids),
                                           tools=tools, template=v.template)
                return tok.chat(messages, tools=tools, template=v.template,
                                answer_tokens=lambda key, prompt:
                                self.answers.get(tenant, key, prompt))
            try:
                new = render(list(v.messages))
            except TemplateError as e:  # the template's own refusal (raise_exception)
                lifted = lift_system(list(v.messages))
                if lifted is None:
                    raise InvalidRequest(f"the model's chat template refused these messages: "
                                         f"{e}") from None
                new = render(lifted)
        elif v.kind == "prompt":
            new = tok.encode(v.prompt)
        else:
            new = list(v.token_ids)
        if not new:
            raise InvalidRequest("the input tokenizes to nothing: send some text")
        full = history + new
        answer = 1 if v.fit_max_tokens else v.max_tokens  # fit: lowered to the room left
        ctx = info.max_context_tokens
        if len(full) >= ctx:
            raise ContextTooLong(len(full), None, ctx)
        if len(full) + answer > ctx:
            if answer >= ctx:  # too large for any prompt: the field is at fault
                raise MaxTokensTooLarge(len(full), answer, ctx)
            raise ContextTooLong(len(full), answer, ctx)
        return full

    def checkpoints(self, v: ValidRequest, tokens: list[int], info,
                    tok: PromptTokenizer) -> tuple[list[int], int]:
        """Where the worker keeps checkpoints of a model with window or recurrent caches, and
        which of them ends the prefix other conversations share (the system and tools)."""
        if v.kind != "chat" or not info.checkpointed:
            return [], 0
        messages, tools = list(v.messages), list(v.tools) or None
        return (tok.checkpoints(messages, tokens, tools=tools, template=v.template),
                tok.shared_end(messages, tokens, tools=tools, template=v.template))

    def tenant(self, context) -> str:
        return tenant_for(self.keys, context.invocation_metadata())

    def scope(self, context) -> str | None:
        """OPERATOR (None) or the caller's tenant (router/auth.py `operator_or_tenant`)."""
        return operator_or_tenant(self.keys, self.admin_key, context.invocation_metadata(),
                                  context.peer())

    async def forward(self, method, request, context, timeout_s: float,
                      scope: str | None | object = ...):
        """One unary call to the worker as the caller's tenant, or in `scope` (a tenant, or
        OPERATOR: every tenant's); errors go through the table."""
        try:
            tenant = self.tenant(context) if scope is ... else scope
            md = ((SCOPE_KEY, SERVER_SCOPE),) if tenant is OPERATOR else ((TENANT_KEY, tenant),)
            await self.ready()
            return await method(request, metadata=md, timeout=timeout_s)
        except Exception as e:
            code, msg, md = _status_for(e)
            await context.abort(code, msg, trailing_metadata=md)


LOAD_STEPS = 16  # keyless load figures, with API keys: KV usage in sixteenths of capacity


def _coarse(kv_bytes: int, capacity: int) -> float:
    """The share of the KV capacity in use, rounded up to a sixteenth. Load answers without a
    key (the gateways send none), and with exact bytes one tenant could read another's prompt
    and answer sizes off it (a 1,055-token turn moved it by exactly that). A step of 1/16
    still ranks machines for a gateway, and any use at all still shows (rounded up)."""
    if capacity <= 0 or kv_bytes <= 0:
        return 0.0
    return min(LOAD_STEPS, -(-kv_bytes * LOAD_STEPS // capacity)) / LOAD_STEPS


def _copy(request: api_pb2.GenerateRequest) -> api_pb2.GenerateRequest:
    out = api_pb2.GenerateRequest()
    out.CopyFrom(request)
    return out


def _refuse_tools(v: ValidRequest, model: str, tok) -> None:
    """Tools, tool calls and tool results on a model whose chat template has no tools, or
    writes its calls in a syntax kvbank does not read: the template would render them as plain
    turns (or not at all), and nothing would parse a call."""
    if v.tools:
        raise InvalidRequest(tool_refusal(model, *tok.tool_markers()), param="tools")
    if any(m.get("tool_calls") or m["role"] == "tool" for m in v.messages):
        raise InvalidRequest(f"the messages carry tool calls or tool results, and the model "
                             f"{model} has no tool calling in its chat template",
                             param="messages")


def tool_refusal(model: str, renders_tools: bool, markers: list[str]) -> str:
    """Why a request with tools is refused, and what to send instead."""
    if not renders_tools:
        return (f"the model {model} has no tool calling in its chat template: send the "
                f"request without tools")
    seen = ", ".join(markers) if markers else "no special tokens of a call syntax"
    return (f"the model {model}'s chat template renders tools, but kvbank does not read its "
            f"call syntax (markers in the template: {seen}; kvbank reads mlx-lm's tool "
            f"parsers, gpt-oss's harmony and Nemotron's <TOOLCALL>): send the request without "
            f"tools, or serve a model of a family kvbank reads")


class GenerationServicer(api_pb2_grpc.GenerationServicer):
    def __init__(self, backend: Backend):
        self.b = backend

    async def Generate(self, request, context):
        t0 = time.monotonic()
        received_at = time.time()
        try:
            tenant = self.b.tenant(context)
            info = await self.b.info()
            v = validate(request, vocab_size=self.b.tokenizer.vocab_size,
                         max_grammar_bytes=info.max_grammar_bytes)
            async with self.b.session_lock(tenant, v.session_id):
                tokens, checkpoints = await self.b.prompt_tokens(v, tenant, info,
                                                                 with_checkpoints=True)
                v = self.b.fit(v, tokens, info)
                self.b.admit_sizes(tokens, v.max_tokens, info)
                gate = await self.b.queue()
                metrics.QUEUE_DEPTH.set(gate.depth + 1)
                try:
                    queue_s = await gate.acquire(tenant,
                                                 holds=lambda: self.b.holds(tenant, tokens))
                finally:
                    metrics.QUEUE_DEPTH.set(gate.depth)
                metrics.QUEUE_WAIT.observe(queue_s)
                started = time.monotonic()
                try:
                    async for out in self._relay(v, tokens, tenant, received_at, t0, queue_s,
                                                 checkpoints):
                        yield out
                finally:
                    gate.release(tenant, time.monotonic() - started)
        except Exception as e:
            code, msg, md = _status_for(e)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("Generate failed")
            metrics.REQUESTS.labels(code.name).inc()
            reason = dict(md).get("x-kvbank-reason")
            if reason:
                metrics.REFUSALS.labels(reason).inc()
            await context.abort(code, msg, trailing_metadata=md)
        metrics.REQUESTS.labels("OK").inc()

    async def Render(self, request, context):
        """The prompt Generate would send the worker for this request, built by the same
        steps (tenant, validation, `prompt_tokens`: template, append history, answer-token
        splice); no ceilings, no queue, no session lock, no worker Generate, not counted as a
        request. For routers that route by prefix (vllm-router's kv_aware policy)."""
        try:
            tenant = self.b.tenant(context)
            info = await self.b.info()
            v = validate(request, vocab_size=self.b.tokenizer.vocab_size,
                         max_grammar_bytes=info.max_grammar_bytes)
            tokens = await self.b.prompt_tokens(v, tenant, info)
        except Exception as e:
            code, msg, md = _status_for(e)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("Render failed")
            await context.abort(code, msg, trailing_metadata=md)
        return api_pb2.RenderResponse(token_ids=tokens)

    async def Prefetch(self, request, context):
        """A hint: the prompt built as Render builds it (or the session's name alone), handed
        to the worker, which brings the KV from SSD into RAM if it has room."""
        try:
            tenant = self.b.tenant(context)
            tokens: list[int] = []
            if request.WhichOneof("input") is not None:
                info = await self.b.info()
                if request.max_tokens <= 0:  # nothing is generated: any room will do
                    request = _copy(request)
                    request.max_tokens = 1
                v = validate(request, vocab_size=self.b.tokenizer.vocab_size,
                             max_grammar_bytes=info.max_grammar_bytes)
                tokens = await self.b.prompt_tokens(v, tenant, info)
            elif not request.session_id:
                raise InvalidRequest("a prefetch names a session_id or sends the request's "
                                     "input (chat, prompt or tokens)")
            await self.b.ready()
            return await self.b.stub.Prefetch(worker_pb2.PrefetchRequest(
                tenant=tenant, session_id=request.session_id, token_ids=tokens), timeout=30)
        except Exception as e:
            code, msg, md = _status_for(e)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("Prefetch failed")
            await context.abort(code, msg, trailing_metadata=md)

    async def Load(self, request, context):
        """The worker's load, with the requests waiting in the router's own queue. Any caller
        may ask (gateways send no key): with API keys its KV figures are coarse (`_coarse`),
        request counts exact (they say how many, not how big)."""
        try:
            info = await self.b.info()
            w = await self.b.stub.Load(worker_pb2.WorkerLoadRequest(), timeout=5)
        except Exception as e:
            code, msg, md = _status_for(e)
            await context.abort(code, msg, trailing_metadata=md)
        queued = self.b.queued
        cap, kv_bytes = w.kv_capacity_bytes, w.kv_bytes
        usage = min(1.0, kv_bytes / cap) if cap else 0.0
        if self.b.keys:
            usage = _coarse(kv_bytes, cap)
            kv_bytes = int(cap * usage)
        return api_pb2.LoadResponse(
            running=w.running, waiting=w.waiting + queued, kv_bytes=kv_bytes,
            kv_capacity_bytes=cap, max_running=info.max_active_requests,
            kv_tokens=kv_bytes // max(1, info.kv_bytes_per_token),
            kv_capacity_tokens=cap // max(1, info.kv_bytes_per_token), kv_cache_usage=usage)

    async def _relay(self, v: ValidRequest, tokens: list[int], tenant: str, received_at: float,
                     t0: float, queue_s: float, checkpoints: tuple[list[int], int] = ((), 0)):
        """The worker's stream, with the router's view of TTFT and queueing added."""
        wreq = worker_pb2.WorkerGenerateRequest(
            request_id=uuid.uuid4().hex, session_id=v.session_id, token_ids=tokens,
            sampling=v.sampling, max_tokens=v.max_tokens, no_cache=v.no_cache,
            received_at=received_at, stop=v.stop, tenant=tenant,
            tools_json=json.dumps(list(v.tools)) if v.tools else "",
            tool_choice=v.tool_choice, response_format=v.response_format,
            checkpoint_at=checkpoints[0], shared_checkpoint_at=checkpoints[1],
            split_reasoning=v.kind == "chat")
        await self.b.ready()  # the worker may have restarted while this one queued
        first_at = last_at = None
        texts: list[str] = []
        reasoning: list[str] = []
        ids: list[int] = []
        calls: list[tuple[str, str]] = []
        async for ev in self.b.stub.Generate(wreq, metadata=((TENANT_KEY, tenant),)):
            texts.append(ev.text)
            reasoning.append(ev.reasoning)
            ids.extend(ev.token_ids)
            calls.extend((c.name, c.arguments) for c in ev.tool_calls)
            if ev.HasField("usage") and not ev.stop_sequence:
                next_turn.remember_answer(self.b, tenant, tokens, "".join(texts), calls, ids)
            if ev.HasField("usage") and ev.finish_reason == api_pb2.FINISH_REASON_STOP:
                next_turn.prerender(self.b, v, tenant, "".join(texts), "".join(reasoning),
                                    ev.usage.session_id)
            if ev.token_ids:
                now = time.monotonic()
                if first_at is None:
                    metrics.TTFT.observe(now - t0)
                else:
                    metrics.INTER_TOKEN.observe(now - last_at)
                last_at = now
            if first_at is None and (ev.token_ids or ev.HasField("usage")):
                first_at = time.monotonic()
            out = api_pb2.GenerateResponse(text=ev.text, token_ids=ev.token_ids,
                                           finish_reason=ev.finish_reason,
                                           logprobs=ev.logprobs, tool_calls=ev.tool_calls,
                                           stop_sequence=ev.stop_sequence, reasoning=ev.reasoning)
            if ev.HasField("usage"):
                out.usage.CopyFrom(ev.usage)
                out.usage.ttft_s = first_at - t0
                out.usage.queue_s += queue_s
            yield out


def _add_service(server, service, servicer) -> None:
    """Like the generated add_*_to_server, but bytes that do not parse as the request message
    get INVALID_ARGUMENT with a sentence, not UNKNOWN and a traceback."""
    from google.protobuf import message_factory
    from google.protobuf.message import DecodeError

    handlers = {}
    for method in service.methods:
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)

        def parse(raw, req_cls=req_cls):
            try:
                return req_cls.FromString(raw)
            except DecodeError as e:
                return _Undecodable(f"the request is not a valid {req_cls.DESCRIPTOR.full_name} "
                                    f"message ({e}): send a serialized {req_cls.__name__}")

        if method.server_streaming:
            async def call(request, context, behavior=behavior):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for out in behavior(request, context):
                    yield out
            make = grpc.unary_stream_rpc_method_handler
        else:
            async def call(request, context, behavior=behavior):
                if isinstance(request, _Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await behavior(request, context)
            make = grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(call, request_deserializer=parse,
                                     response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))


class _Undecodable:
    def __init__(self, message: str):
        self.message = message


async def serve(model_dir: Path, worker_address: str, host: str, port: int, *,
                run_dir: Path, metrics_port: int = -1, **limits) -> None:
    """`limits`: Backend's keys, admin_key, ceilings, max_queue, max_queue_wait_s. `run_dir`:
    where the metrics port is written (the deployment's Layout.run_dir)."""
    metrics.serve("router", run_dir, metrics_port)
    backend = Backend(model_dir, worker_address, **limits)
    server = grpc.aio.server()
    for name, servicer in (("Generation", GenerationServicer(backend)),
                           ("Sessions", SessionsServicer(backend)),
                           ("Responses", ResponsesServicer(backend)),
                           ("Admin", AdminServicer(backend))):
        _add_service(server, api_pb2.DESCRIPTOR.services_by_name[name], servicer)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [api_pb2.DESCRIPTOR.services_by_name[n].full_name
             for n in ("Generation", "Sessions", "Responses", "Admin")]
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    logger.info("router listening on %s:%d (worker at %s)", host, bound, worker_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=5)
        await backend.channel.close()
        backend.large.close()
        logger.info("router stopped")


def main(model_dir: Path, worker_address: str, host: str, port: int, **limits) -> None:
    asyncio.run(serve(model_dir, worker_address, host, port, **limits))
