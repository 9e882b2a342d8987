"""`kvbank shim`: the OpenAI HTTP API, as an ordinary client of the router's gRPC API.

It holds no model and no privileged path: each request becomes one `Generate` call (a render,
for vllm-router's kv_aware policy, one `Render` call), and the client's API key travels on as
`authorization` metadata so that the router puts the request in the key's tenant (the shim
checks the key too, to refuse early with OpenAI's 401).

A stream's HTTP headers go out with the router's first message, not before: a refusal (bad
input, queue full, worker restarting) then still gets its own HTTP status and Retry-After, as
OpenAI's clients expect. Once a stream has started, a failure is one SSE error event, in
OpenAI's shape, that ends it. A client that hangs up cancels its router call.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import time

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from apps.shim.openai_format import Answer, ApiError, invalid, parse, parse_render
from kvbank.contracts.failures import HTTP_STATUS, Unauthenticated, failure_for
from kvbank.contracts.vocabulary import NO_RETRY_VERDICTS
from kvbank.v1 import api_pb2, api_pb2_grpc
from router.auth import AUTH_KEY, tenant_for

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "kvbank"
DEFAULT_RETRY_AFTER_S = 1.0  # when the router's refusal carries no `retry-after`
HEALTH_TIMEOUT_S = 1.0
RENDER_TIMEOUT_S = 30.0  # a render only tokenizes (and reads a session's history in append mode)
# The router's refusals carry `x-kvbank-reason` (our error code) and `x-kvbank-verdict`; a
# verdict in NO_RETRY_VERDICTS (kvbank/contracts/vocabulary.py) says a retry cannot help.
# A gRPC status that stands for a failure of kvbank/contracts/failures.py gets that failure's
# HTTP status, OpenAI error type and code (HTTP_STATUS, the one table). Any other status is a
# 500 with a plain message; the details go to the log, not the client.
INTERNAL = (500, "server_error", "internal_error")


def error_for(e: grpc.aio.AioRpcError) -> ApiError:
    failure = failure_for(e.code())
    status, kind, code = HTTP_STATUS[failure] if failure is not None else INTERNAL
    if status == 500:
        logger.error("router call failed: %s: %s", e.code().name, e.details())
        return ApiError(500, "kvbank failed to answer (internal error); the server log says why",
                        type=kind, code=code)
    md = e.trailing_metadata() or grpc.aio.Metadata()
    busy = status in (429, 503)
    hopeless = busy and md.get("x-kvbank-verdict") in NO_RETRY_VERDICTS  # retrying can't help
    retry_after_s = _seconds(md.get("retry-after")) if busy and not hopeless else None
    return ApiError(status, e.details() or e.code().name, type=kind,
                    code=md.get("x-kvbank-reason") or code, retry_after_s=retry_after_s,
                    retry=False if hopeless else None)


def _seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        return DEFAULT_RETRY_AFTER_S


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


class Shim:
    """The router channel, the keys, and the one model /v1/models names."""

    def __init__(self, router_address: str, keys: dict[str, str], model_name: str | None):
        self.router_address = router_address
        self.keys = keys
        self.model_name = model_name or DEFAULT_MODEL_NAME
        self.started_at = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        """The channel belongs to the server's event loop, so it is made inside it."""
        self.channel = grpc.aio.insecure_channel(self.router_address)
        self.generation = api_pb2_grpc.GenerationStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        logger.info("OpenAI API for router %s, model %r, %s", self.router_address,
                    self.model_name, f"{len(self.keys)} API keys" if self.keys else "no API keys")
        try:
            yield
        finally:
            await self.channel.close()

    def authorize(self, request: Request) -> tuple[tuple[str, str], ...]:
        """The metadata that carries the client's key on to the router; raises a 401."""
        header = request.headers.get(AUTH_KEY, "")
        try:
            tenant_for(self.keys, [(AUTH_KEY, header)])
        except Unauthenticated as e:
            raise ApiError(401, str(e), code="invalid_api_key") from None
        if header and header.isascii() and header.isprintable():
            return ((AUTH_KEY, header),)
        return ()

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

    async def _load(self) -> api_pb2.LoadResponse | None:
        try:
            return await self.generation.Load(api_pb2.LoadRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None

    async def metrics(self, request: Request) -> Response:
        """vLLM's load gauges, under vLLM's names, for gateways that scrape /metrics."""
        load = await self._load()
        if load is None:
            return PlainTextResponse("# router unavailable\n", status_code=503)
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
        if load is None:
            return JSONResponse({"error": "router unavailable"}, status_code=503)
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
        if load is None:
            return JSONResponse({"error": "router unavailable"}, status_code=503)
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
            req = parse_render(kind, await _json(request), session_header=_session_header(request))
            try:
                out = await self.generation.Render(req.generate, metadata=metadata,
                                                   timeout=RENDER_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                raise error_for(e) from None
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"model": self.model_name, "token_ids": list(out.token_ids)})

    async def _generate(self, request: Request, kind: str):
        try:
            metadata = self.authorize(request)
            req = parse(kind, await _json(request), session_header=_session_header(request))
            call = self.generation.Generate(req.generate, metadata=metadata)
            first = await _unless_hung_up(request, call, _read(call))
            if first is HUNG_UP:
                return Response(status_code=499)  # nginx's "client closed request"; unsent
            answer = Answer(kind, self.model_name, include_usage=req.include_usage)
            if req.stream:  # from here on, sse-starlette cancels the stream on a hang-up
                return EventSourceResponse(_events(call, first, answer), sep="\n")
            body = await _unless_hung_up(request, call, _collect(call, first, answer))
            return Response(status_code=499) if body is HUNG_UP else JSONResponse(body)
        except ApiError as e:
            return error_response(e)


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
    try:
        return json.loads(await request.body())
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


def _dumps(body: dict) -> str:
    # json escapes newlines, so each event is exactly one `data:` line
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                                    f"{exc.detail}"))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises `exc` after this answer, and uvicorn logs its traceback.
    return error_response(ApiError(500, "kvbank failed to answer (internal error); the server "
                                        "log says why", type="server_error",
                                   code="internal_error"))


def create_app(router_address: str, keys: dict[str, str] | None = None,
               model_name: str | None = None) -> Starlette:
    shim = Shim(router_address, keys or {}, model_name)
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
        ],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        lifespan=shim.lifespan,
    )


def main(router_address: str, host: str, port: int, keys: dict[str, str],
         model_name: str | None) -> None:
    app = create_app(router_address, keys, model_name)
    # log_config=None keeps the process's logging (set up by the CLI); loop="asyncio" because
    # grpc.aio wants the standard event loop.
    config = uvicorn.Config(app, host=host, port=port, loop="asyncio", log_config=None,
                            access_log=False, timeout_graceful_shutdown=3)
    uvicorn.Server(config).run()
