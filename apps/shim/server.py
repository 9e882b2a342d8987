"""`kvbank shim`: the OpenAI HTTP API and Anthropic's Messages API (`/v1/messages`), as an
ordinary client of the router's gRPC API.

It holds no model and no privileged path: each request becomes one `Generate` call (a render,
for vllm-router's kv_aware policy, one `Render` call), and the client's API key travels on as
`authorization` metadata so that the router puts the request in the key's tenant (the shim
checks the key too, to refuse early with a 401). Anthropic's clients send the key as
`x-api-key`; it travels on as the same metadata.

A stream's HTTP headers go out with the router's first message, not before: a refusal (bad
input, queue full, worker restarting) then still gets its own HTTP status and Retry-After, as
OpenAI's clients expect. Once a stream has started, a failure is one SSE error event, in
the API's shape, that ends it. A client that hangs up cancels its router call.

A max_tokens the client did not choose (the OpenAI routes' `--default-max-tokens`; Anthropic's
max_tokens, which its clients send as a bound, e.g. 32000 whatever the model) goes to the
router with `fit_max_tokens`: the router lowers it to the room the prompt leaves in the
model's context and under its ceilings.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import time
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kvbank import json_input
from kvbank.apps.shim import anthropic_format, responses_format, responses_store
from kvbank.apps.shim.openai_answer import Answer
from kvbank.apps.shim.errors import error_for, router_away
from kvbank.apps.shim.recorder import Recorder
from kvbank.apps.shim.openai_format import (DEFAULT_MAX_TOKENS, ApiError, invalid, parse,
                                            parse_render)
from kvbank.apps.shim.pacing import RefusalPacing
from kvbank.config import DEFAULT_REFUSAL_SHARE, PEER_READY_WAIT_S, RECONNECT_OPTIONS
from kvbank.contracts.failures import Unauthenticated
from kvbank.v1 import api_pb2, api_pb2_grpc
from kvbank.router.auth import AUTH_KEY, sent_key, tenant_for

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "kvbank"
HEALTH_TIMEOUT_S = 1.0
# The load endpoints' deadline for the router's Load: a scraper (Prometheus: 10 s by default)
# or a gateway's poll waits for it. With the health check's 1 s, a machine busy with other
# work (load average 20 on 2 cores) had /metrics answer 503 "router unavailable" 2 times in
# 300 while the router served (p99 1.7 s): a busy stack looked down.
LOAD_TIMEOUT_S = 5.0
RENDER_TIMEOUT_S = 30.0  # a render only tokenizes (and reads a session's history in append mode)


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


def anthropic_error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(anthropic_format.error_body(e), status_code=e.status,
                        headers=e.headers())


class Shim:
    """The router channel, the keys, the one model /v1/models names, and the max_tokens of
    an OpenAI request that sends none."""

    def __init__(self, router_address: str, keys: dict[str, str], model_name: str | None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, keep_attribution: bool = False,
                 record_to: Path | None = None, strict_model: bool = False):
        self.router_address = router_address
        self.strict_model = strict_model  # refuse a `model` that is not model_name
        self.recorder = Recorder(record_to) if record_to else None
        self.keys = keys
        self.model_name = model_name or DEFAULT_MODEL_NAME
        self.default_max_tokens = default_max_tokens
        self.keep_attribution = keep_attribution  # Claude Code's per-request system line
        self.started_at = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        """The channel belongs to the server's event loop, so it is made inside it."""
        self.channel = grpc.aio.insecure_channel(self.router_address,
                                                 options=list(RECONNECT_OPTIONS))
        self.generation = api_pb2_grpc.GenerationStub(self.channel)
        self.stored = api_pb2_grpc.ResponsesStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        logger.info("OpenAI and Anthropic APIs for router %s, model %r, %s, default max_tokens "
                    "%d", self.router_address, self.model_name,
                    f"{len(self.keys)} API keys" if self.keys else "no API keys",
                    self.default_max_tokens)
        try:
            yield
        finally:
            await self.channel.close()

    def authorize(self, request: Request) -> tuple[tuple[str, str], ...]:
        """The metadata that carries the client's key on to the router; raises a 401."""
        return self._authorize(request.headers.get(AUTH_KEY, ""))

    def authorize_anthropic(self, request: Request) -> tuple[tuple[str, str], ...]:
        """As `authorize`, for a key sent as Anthropic's `x-api-key` (or, as Anthropic's
        clients do with an auth token, `authorization: Bearer`)."""
        header = sent_key(request.headers.get("x-api-key"), request.headers.get(AUTH_KEY))
        if self.keys and not header:
            raise ApiError(401, "this server needs an API key: send `x-api-key: KEY`",
                           code="invalid_api_key")
        return self._authorize(header)

    def _authorize(self, header: str) -> tuple[tuple[str, str], ...]:
        try:
            tenant_for(self.keys, [(AUTH_KEY, header)])
        except Unauthenticated as e:
            raise ApiError(401, str(e), code="invalid_api_key") from None
        if header and header.isascii() and header.isprintable():
            return ((AUTH_KEY, header),)
        return ()

    async def router_ready(self) -> None:
        """The router's channel, connected: a request that comes while the router (re)starts
        waits for it up to PEER_READY_WAIT_S (the channel tries again every half second at
        most), then is a 503 with Retry-After."""
        if self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(self.channel.channel_ready(), PEER_READY_WAIT_S)
        except asyncio.TimeoutError:
            raise router_away() from None

    # -- endpoints ------------------------------------------------------------------------

    async def health(self, request: Request) -> JSONResponse:
        try:
            r = await self.health_stub.Check(health_pb2.HealthCheckRequest(),
                                             timeout=HEALTH_TIMEOUT_S)
            serving = r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        return JSONResponse({"status": "ok" if serving else "router unavailable"},
                            status_code=200 if serving else 503)

    # -- load, as gateways read it (no key: it names no tenant's data) ----------------------

    async def _load(self) -> api_pb2.LoadResponse | str:
        """The router's Load, or why there is none (a sentence)."""
        try:
            return await self.generation.Load(api_pb2.LoadRequest(), timeout=LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"the router did not answer within {LOAD_TIMEOUT_S:.0f} s"
            return "router unavailable"

    async def metrics(self, request: Request) -> Response:
        """vLLM's load gauges, under vLLM's names, for gateways that scrape /metrics."""
        load = await self._load()
        if isinstance(load, str):
            return PlainTextResponse(f"# {load}\n", status_code=503)
        labels = f'{{engine="0",model_name="{self.model_name}"}}'
        out = []
        for name, help_, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.",
                 load.running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 load.waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 load.kv_cache_usage)):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge",
                    f"{name}{labels} {float(value)}"]
        return PlainTextResponse("\n".join(out) + "\n",
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def loads(self, request: Request) -> JSONResponse:
        """SMG's `/v1/loads`: one scheduler (data-parallel rank 0)."""
        load = await self._load()
        if isinstance(load, str):
            return JSONResponse({"error": load}, status_code=503)
        return JSONResponse({
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "dp_rank_count": 1,
            "loads": [{"dp_rank": 0, "num_running_reqs": load.running,
                       "num_waiting_reqs": load.waiting,
                       "num_total_reqs": load.running + load.waiting,
                       "num_used_tokens": load.kv_tokens,
                       "max_total_num_tokens": load.kv_capacity_tokens,
                       "token_usage": load.kv_cache_usage,
                       "max_running_requests": load.max_running}]})

    async def get_load(self, request: Request) -> JSONResponse:
        """vllm-router's `/get_load`: one integer, requests running and waiting."""
        load = await self._load()
        if isinstance(load, str):
            return JSONResponse({"error": load}, status_code=503)
        return JSONResponse({"load": load.running + load.waiting})

    async def models(self, request: Request) -> JSONResponse:
        try:
            self.authorize(request)
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [self._model()]})

    async def model(self, request: Request) -> JSONResponse:
        try:
            self.authorize(request)
            if request.path_params["model"] != self.model_name:
                raise ApiError(404, f"the model {request.path_params['model']!r} does not exist; "
                                    f"this server has {self.model_name!r}",
                               code="model_not_found", param="model")
        except ApiError as e:
            return error_response(e)
        return JSONResponse(self._model())

    async def _body(self, request: Request) -> object:
        """The request's JSON; with --strict-model-name, a `model` other than the served one
        is a 404 (by default any name maps to the served model: agents send their own)."""
        body = await _json(request)
        asked = body.get("model") if isinstance(body, dict) else None
        if self.strict_model and asked is not None and asked != self.model_name:
            raise ApiError(404, f"the model {asked!r} does not exist; this server has "
                                f"{self.model_name!r} (--strict-model-name)",
                           code="model_not_found", param="model")
        return body

    def _model(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.started_at,
                "owned_by": "kvbank"}

    async def chat_completions(self, request: Request):
        return await self._generate(request, "chat")

    async def completions(self, request: Request):
        return await self._generate(request, "completion")

    async def chat_render(self, request: Request) -> JSONResponse:
        return await self._render(request, "chat")

    async def completions_render(self, request: Request) -> JSONResponse:
        return await self._render(request, "completion")

    async def _render(self, request: Request, kind: str) -> JSONResponse:
        """The prompt token ids the generation endpoint would have the worker prefill for this
        body (vllm-router's render endpoints, which its kv_aware policy asks before routing).
        Always JSON, even for a body with `"stream": true`; nothing is queued or generated."""
        try:
            metadata = self.authorize(request)
            req = parse_render(kind, await self._body(request),
                               session_header=_session_header(request))
            try:
                out = await self.generation.Render(req.generate, metadata=metadata,
                                                   timeout=RENDER_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                raise error_for(e) from None
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"model": self.model_name, "token_ids": list(out.token_ids)})

    async def prefetch(self, request: Request) -> JSONResponse:
        """`POST /v1/kvbank/prefetch`: a hint that a conversation will come back (an agent in
        a tool call). The body is what the agent will send to chat completions (`messages`,
        `tools`...) or completions (`prompt`), or only a session name (`session_id`, or the
        `x-session-id` header). The worker brings the KV from SSD into RAM if it has room;
        the answer says what it did. Nothing is generated."""
        try:
            metadata = self.authorize(request)
            body = await _json(request)
            if not isinstance(body, dict):
                raise invalid(None, "the body must be a JSON object")
            name = _session_header(request) or body.get("session_id")
            if "messages" in body or "prompt" in body:
                rest = {k: v for k, v in body.items() if k != "session_id"}
                req = parse_render("chat" if "messages" in body else "completion", rest,
                                   session_header=name).generate
            elif isinstance(name, str) and name:
                req = api_pb2.GenerateRequest(session_id=name)
            else:
                raise invalid("session_id", "a prefetch names the conversation: send the "
                                            "messages (or prompt) the agent will send, or a "
                                            "session_id")
            try:
                out = await self.generation.Prefetch(req, metadata=metadata,
                                                     timeout=RENDER_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                raise error_for(e) from None
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"status": out.status, "ram_tokens": out.ram_tokens,
                             "ssd_tokens": out.ssd_tokens,
                             "restored_tokens": out.restored_tokens})

    async def _generate(self, request: Request, kind: str):
        try:
            metadata = self.authorize(request)
            req = parse(kind, await self._body(request), session_header=_session_header(request),
                        default_max_tokens=self.default_max_tokens)
            answer = Answer(kind, self.model_name, include_usage=req.include_usage)
            sent = request.state.body
            params = ({"max_tokens": "max_completion_tokens"}
                      if isinstance(sent, dict) and "max_completion_tokens" in sent else {})
            return await self._answer(request, req.generate, metadata, req.fit_max_tokens,
                                      answer, _events if req.stream else None, params=params)
        except ApiError as e:
            return error_response(e)

    async def _answer(self, request: Request, generate: api_pb2.GenerateRequest, metadata,
                      fit: bool, answer, events, finish=None,
                      params: dict[str, str] | None = None) -> Response:
        """Run the request and answer with `answer`'s body, or with the stream `events(call,
        first, answer)` makes of it; 499 (nginx's "client closed request") if the client left
        before anything was sent. Once a stream starts, sse-starlette cancels it on a
        hang-up. `params`: the router's field names as this API spells them, for a refusal."""
        try:
            started = await self._start(request, generate, metadata, fit=fit)
        except ApiError as e:
            e.param = (params or {}).get(e.param, e.param)
            raise
        if started is HUNG_UP:
            return Response(status_code=499)
        call, first = started
        if events is not None:
            return EventSourceResponse(self._finishing(request, answer, finish,
                                                       events(call, first, answer)), sep="\n")
        body = await _unless_hung_up(request, call, _collect(call, first, answer))
        if body is HUNG_UP:
            return Response(status_code=499)
        await self._finished(request, answer, finish)
        return JSONResponse(body)

    async def _finishing(self, request: Request, answer, finish, events):
        """The stream; what follows a whole answer (`_finished`) is done once its usage is
        known, before the events that end it leave: a client that got its answer finds it
        stored and recorded."""
        done = False
        async for event in events:
            if not done and answer.usage is not None:
                await self._finished(request, answer, finish)
                done = True
            yield event

    async def _finished(self, request: Request, answer, finish) -> None:
        """A whole answer: its record (`--record-requests`), then `finish(answer)` (the
        Responses API's store)."""
        self._record(request, answer)
        if finish is not None:
            await finish(answer)

    def _record(self, request: Request, answer) -> None:
        if self.recorder is not None:
            self.recorder.record(request.url.path, getattr(request.state, "body", None),
                                 answer.usage, answer.body())

    async def _start(self, request: Request, generate: api_pb2.GenerateRequest, metadata, *,
                     fit: bool):
        """The router's Generate call and its first message; HUNG_UP if the client left first.
        With `fit`, max_tokens is a bound the router lowers to what fits (`fit_max_tokens`)."""
        generate.fit_max_tokens = fit
        await self.router_ready()
        call = self.generation.Generate(generate, metadata=metadata)
        try:
            first = await _unless_hung_up(request, call, call.read())
        except grpc.aio.AioRpcError as e:
            raise error_for(e) from None
        return HUNG_UP if first is HUNG_UP else (call, first)

    # -- OpenAI's Responses API --------------------------------------------------------------

    async def responses(self, request: Request):
        try:
            metadata = self.authorize(request)
            body = await self._body(request)
            prior = await responses_store.prior_items(self.stored, metadata, body)
            req = responses_format.parse(body, session_header=_session_header(request),
                                         default_max_tokens=self.default_max_tokens,
                                         prior=prior)
            answer = responses_format.ResponseAnswer(self.model_name, req.custom_tools, req.echo,
                                                     req.namespaces)
            items = responses_store.input_items(body, prior)

            async def keep(answer) -> None:
                if answer.echo["store"]:
                    await responses_store.keep(self.stored, metadata, items, answer.body())

            response = await self._answer(request, req.chat.generate, metadata,
                                          req.chat.fit_max_tokens, answer,
                                          _responses_events if req.chat.stream else None, keep,
                                          params={"max_tokens": "max_output_tokens",
                                                  "messages": "input"})
            if req.left_out:
                warning = (f"left out of the prompt: {', '.join(req.left_out)} (a tool OpenAI's "
                           f"servers run; kvbank runs none)")
                logger.warning("responses: %s", warning)
                response.headers["x-kvbank-warning"] = warning
            return response
        except ApiError as e:
            return error_response(e)

    async def stored_response(self, request: Request) -> JSONResponse:
        """GET /v1/responses/{id}: a stored response as it was answered; DELETE forgets it."""
        try:
            metadata = self.authorize(request)
            rid = request.path_params["id"]
            if request.method == "DELETE":
                return JSONResponse(await responses_store.delete(self.stored, metadata, rid))
            return JSONResponse((await responses_store.load(self.stored, metadata, rid))
                                ["response"])
        except ApiError as e:
            return error_response(e)

    # -- Anthropic's Messages API -----------------------------------------------------------

    async def messages(self, request: Request):
        try:
            metadata = self.authorize_anthropic(request)
            req = anthropic_format.parse(await self._body(request),
                                         session_header=_session_header(request),
                                         keep_attribution=self.keep_attribution)
            message = anthropic_format.Message(self.model_name,
                                               asked_max_tokens=req.generate.max_tokens)
            return await self._answer(request, req.generate, metadata, True, message,
                                      _anthropic_events if req.stream else None)
        except ApiError as e:
            return anthropic_error_response(e)

    async def count_tokens(self, request: Request) -> JSONResponse:
        """`/v1/messages/count_tokens`: the prompt tokens of a Messages body (its render)."""
        try:
            metadata = self.authorize_anthropic(request)
            req = anthropic_format.parse(await self._body(request),
                                         session_header=_session_header(request),
                                         count_only=True,
                                         keep_attribution=self.keep_attribution)
            req.generate.max_tokens = 1  # only a prompt that fills the context is refused
            try:
                out = await self.generation.Render(req.generate, metadata=metadata,
                                                   timeout=RENDER_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                raise error_for(e) from None
        except ApiError as e:
            return anthropic_error_response(e)
        return JSONResponse({"input_tokens": len(out.token_ids)})


HUNG_UP = object()


def _session_header(request: Request) -> str | None:
    return request.headers.get("x-session-id") or request.headers.get("x-smg-routing-key")


async def _unless_hung_up(request: Request, call, work):
    """`work`'s result, or HUNG_UP if the client leaves first; then the router call is
    cancelled, since nobody will read its answer (the worker stops generating it)."""
    task = asyncio.ensure_future(work)
    hung_up = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, hung_up), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hung_up.cancel()
        if not task.done():
            task.cancel()
            call.cancel()
    return task.result() if task.done() and not task.cancelled() else HUNG_UP


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (its body is read, so nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json(request: Request) -> object:
    """The body, parsed and checked (kvbank/json_input.py: nesting, lone surrogates)."""
    raw = await request.body()
    try:
        request.state.body = json_input.loads(raw)
        return request.state.body
    except json_input.BadJson as e:
        raise invalid(e.param or None, str(e)) from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        raise invalid(None, f"the body is not valid JSON: {e}") from None


async def _read(call):
    """The router's next message (or grpc.aio.EOF); a gRPC failure becomes an ApiError."""
    try:
        return await call.read()
    except grpc.aio.AioRpcError as e:
        raise error_for(e) from None


async def _collect(call, msg, answer: Answer) -> dict:
    while msg is not grpc.aio.EOF:
        answer.add(msg)
        msg = await _read(call)
    return answer.body()


async def _events(call, msg, answer: Answer):
    """SSE data: one JSON chunk per event, then `[DONE]`; or an error event, then the end."""
    try:
        if (first := answer.first_chunk()) is not None:
            yield _dumps(first)
        while msg is not grpc.aio.EOF:
            for chunk in answer.chunks(msg):
                yield _dumps(chunk)
            msg = await _read(call)
        yield "[DONE]"
    except ApiError as e:
        yield _dumps(e.body())
    finally:
        call.cancel()  # a no-op once the call is done; stops the worker if the client left


def _responses_events(call, msg, answer: responses_format.ResponseAnswer):
    return _typed_events(call, msg, answer, lambda e: {"type": "error", **e.body()["error"]})


def _anthropic_events(call, msg, message: anthropic_format.Message):
    return _typed_events(call, msg, message, anthropic_format.error_body)


async def _typed_events(call, msg, answer, error_event):
    """Events that name their type (Anthropic's, Responses'), each as `event: TYPE` and
    `data: {"type": TYPE, ...}`; a failure once the stream has started is an error event
    (`error_event(e)`) that ends it."""
    try:
        for event in answer.opening():
            yield _sse(event)
        while msg is not grpc.aio.EOF:
            for event in answer.events(msg):
                yield _sse(event)
            msg = await _read(call)
    except ApiError as e:
        yield _sse(error_event(e))
    finally:
        call.cancel()


def _sse(event: dict) -> dict:
    return {"event": event["type"], "data": _dumps(event)}


def _dumps(body: dict) -> str:
    # json escapes newlines, so each event is exactly one `data:` line
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def _error_response(request: Request, e: ApiError) -> JSONResponse:
    """In the shape of the API the path belongs to."""
    if request.url.path.startswith("/v1/messages"):
        return anthropic_error_response(e)
    return error_response(e)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return _error_response(request, ApiError(exc.status_code, f"{request.method} "
                                                              f"{request.url.path}: {exc.detail}"))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises `exc` after this answer, and uvicorn logs its traceback.
    return _error_response(request, ApiError(500, "kvbank failed to answer (internal error); "
                                                  "the server log says why",
                                             type="server_error", code="internal_error"))


def create_app(router_address: str, keys: dict[str, str] | None = None,
               model_name: str | None = None,
               default_max_tokens: int = DEFAULT_MAX_TOKENS,
               keep_attribution: bool = False, record_to: Path | None = None,
               strict_model: bool = False,
               refusal_share: float = DEFAULT_REFUSAL_SHARE) -> Starlette:
    shim = Shim(router_address, keys or {}, model_name, default_max_tokens, keep_attribution,
                record_to, strict_model)
    return Starlette(
        routes=[
            Route("/health", shim.health),
            Route("/v1/models", shim.models),
            Route("/metrics", shim.metrics),
            Route("/v1/loads", shim.loads),
            Route("/get_load", shim.get_load),
            Route("/v1/models/{model:path}", shim.model),
            Route("/v1/chat/completions", shim.chat_completions, methods=["POST"]),
            Route("/v1/completions", shim.completions, methods=["POST"]),
            Route("/v1/chat/completions/render", shim.chat_render, methods=["POST"]),
            Route("/v1/completions/render", shim.completions_render, methods=["POST"]),
            Route("/v1/kvbank/prefetch", shim.prefetch, methods=["POST"]),
            Route("/v1/responses", shim.responses, methods=["POST"]),
            Route("/v1/responses/{id}", shim.stored_response, methods=["GET", "DELETE"]),
            Route("/v1/messages", shim.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", shim.count_tokens, methods=["POST"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        middleware=[Middleware(RefusalPacing, keys=shim.keys, share=refusal_share)],
        lifespan=shim.lifespan,
    )


def main(router_address: str, host: str, port: int, keys: dict[str, str],
         model_name: str | None, default_max_tokens: int = DEFAULT_MAX_TOKENS,
         keep_attribution: bool = False, record_to: Path | None = None,
         strict_model: bool = False, refusal_share: float = DEFAULT_REFUSAL_SHARE) -> None:
    app = create_app(router_address, keys, model_name, default_max_tokens, keep_attribution,
                     record_to, strict_model, refusal_share)
    # log_config=None keeps the process's logging (set up by the CLI); loop="asyncio" because
    # grpc.aio wants the standard event loop.
    config = uvicorn.Config(app, host=host, port=port, loop="asyncio", log_config=None,
                            access_log=False, timeout_graceful_shutdown=3)
    uvicorn.Server(config).run()
