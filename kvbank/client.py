"""A small synchronous client of the router, for people (`kvbank chat`, `kvbank ask`),
scripts, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import grpc

from kvbank.config import RECONNECT_OPTIONS
from kvbank.v1 import api_pb2, api_pb2_grpc

CACHE_SOURCES = {
    api_pb2.CACHE_SOURCE_UNSPECIFIED: "none",
    api_pb2.CACHE_SOURCE_NONE: "none",
    api_pb2.CACHE_SOURCE_RAM: "ram",
    api_pb2.CACHE_SOURCE_SSD: "ssd",
}
FINISH_REASONS = {api_pb2.FINISH_REASON_STOP: "stop", api_pb2.FINISH_REASON_LENGTH: "length",
                  api_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls"}


def usage_dict(u: api_pb2.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "cached_tokens": u.cached_tokens,
        "cache_source": CACHE_SOURCES[u.cache_source],
        "recomputed_tokens": u.recomputed_tokens,
        "prefix_lost_tokens": u.prefix_lost_tokens,
        "ttft_s": round(u.ttft_s, 4),
        "queue_s": round(u.queue_s, 4),
        "durable": u.durable,
        "session_id": u.session_id,
        "drafted_tokens": u.drafted_tokens,
        "accepted_tokens": u.accepted_tokens,
    }


class _Keys(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Metadata every call carries: the API key (a tenant's), the operator's key, or both."""

    def __init__(self, api_key: str | None, admin_key: str | None):
        self.md = ((("authorization", f"Bearer {api_key}"),) if api_key else ()) + (
            (("x-kvbank-admin-key", admin_key),) if admin_key else ())

    def _add(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self.md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._add(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._add(details), request)


@dataclass
class Turn:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict = field(default_factory=dict)
    logprobs: list[float] = field(default_factory=list)  # of each token, when asked
    reasoning: str = ""  # what the model wrote between its think markers (chat input)


class Client:
    def __init__(self, address: str, api_key: str | None = None, admin_key: str | None = None):
        """`api_key`: a tenant's (the router maps it to the tenant); `admin_key`: the
        operator's (the router's --admin-key), for the Admin service and the list of every
        tenant's sessions."""
        self.channel = grpc.insecure_channel(address, options=list(RECONNECT_OPTIONS))
        if api_key or admin_key:  # every call carries them
            self.channel = grpc.intercept_channel(self.channel, _Keys(api_key, admin_key))
        self.generation = api_pb2_grpc.GenerationStub(self.channel)
        self.sessions = api_pb2_grpc.SessionsStub(self.channel)
        self.admin = api_pb2_grpc.AdminStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, *, session_id: str = "", messages: Iterable[dict] | None = None,
                 prompt: str | None = None, token_ids: Iterable[int] | None = None,
                 append: bool = False, max_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 0.0, seed: int | None = None, stop: Iterable[str] = (),
                 no_cache: bool = False, on_text: Callable[[str], None] | None = None,
                 timeout_s: float | None = None, logprobs: bool = False,
                 on_call: Callable[[grpc.Call], None] | None = None) -> Turn:
        """One turn, streamed (`on_text` sees each piece). `on_call` gets the streaming call as
        it starts, for a caller that may cancel it (Ctrl-C in `kvbank chat`)."""
        req = _request(session_id=session_id, messages=messages, prompt=prompt,
                       token_ids=token_ids, append=append, max_tokens=max_tokens,
                       temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                       no_cache=no_cache)
        req.sampling.logprobs = logprobs
        text, ids, finish, usage, lps, reasoning = [], [], "", {}, [], []
        call = self.generation.Generate(req, timeout=timeout_s)
        if on_call is not None:
            on_call(call)
        for ev in call:
            reasoning.append(ev.reasoning)
            if ev.text:
                text.append(ev.text)
                if on_text:
                    on_text(ev.text)
            ids.extend(ev.token_ids)
            lps.extend(lp.logprob for lp in ev.logprobs)
            if ev.HasField("usage"):
                usage = usage_dict(ev.usage)
                finish = FINISH_REASONS.get(ev.finish_reason, "")
        return Turn("".join(text), ids, finish, usage, lps, "".join(reasoning))

    def render(self, *, session_id: str = "", messages: Iterable[dict] | None = None,
               prompt: str | None = None, token_ids: Iterable[int] | None = None,
               append: bool = False, max_tokens: int = 64,
               timeout_s: float | None = 30) -> list[int]:
        """The prompt token ids `generate` with these arguments would have the worker
        prefill; nothing runs or is stored."""
        req = _request(session_id=session_id, messages=messages, prompt=prompt,
                       token_ids=token_ids, append=append, max_tokens=max_tokens)
        return list(self.generation.Render(req, timeout=timeout_s).token_ids)

    def prefetch(self, *, session_id: str = "", messages: Iterable[dict] | None = None,
                 timeout_s: float | None = 30) -> api_pb2.PrefetchResponse:
        """A hint that this conversation comes back soon: by the messages it will send, or by
        its name alone. The worker brings its KV from SSD into RAM if it has room."""
        req = (_request(session_id=session_id, messages=messages, prompt=None, token_ids=None,
                        append=False, max_tokens=1) if messages is not None
               else api_pb2.GenerateRequest(session_id=session_id))
        return self.generation.Prefetch(req, timeout=timeout_s)

    def get_session(self, session_id: str) -> api_pb2.Session:
        return self.sessions.Get(api_pb2.GetSessionRequest(session_id=session_id), timeout=30)

    def release(self, session_id: str, write_out: bool = True,
                tenant: str = "") -> api_pb2.ReleaseResponse:
        """`tenant`: whose conversation (the operator's call, with API keys configured)."""
        return self.admin.Release(api_pb2.ReleaseRequest(session_id=session_id,
                                                         write_out=write_out, tenant=tenant),
                                  timeout=120)

    def set_pressure(self, level: str) -> api_pb2.PressureResponse:
        return self.admin.SetPressure(api_pb2.PressureRequest(level=level), timeout=30)

    def trim(self) -> api_pb2.TrimResponse:
        return self.admin.Trim(api_pb2.TrimRequest(), timeout=120)

    def flush(self) -> api_pb2.FlushResponse:
        return self.admin.Flush(api_pb2.FlushRequest(), timeout=120)

    def status(self) -> api_pb2.StatusResponse:
        return self.admin.Status(api_pb2.StatusRequest(), timeout=30)

    def list_sessions(self) -> list[api_pb2.Session]:
        return list(self.sessions.List(api_pb2.ListSessionsRequest(), timeout=30).sessions)


def _request(*, session_id: str, messages: Iterable[dict] | None, prompt: str | None,
             token_ids: Iterable[int] | None, append: bool, max_tokens: int,
             temperature: float = 0.0, top_p: float = 0.0, seed: int | None = None,
             stop: Iterable[str] = (), no_cache: bool = False) -> api_pb2.GenerateRequest:
    req = api_pb2.GenerateRequest(session_id=session_id, append=append,
                                  max_tokens=max_tokens, stop=list(stop), no_cache=no_cache)
    req.sampling.temperature = temperature
    req.sampling.top_p = top_p
    if seed is not None:
        req.sampling.seed = seed
    if messages is not None:
        req.chat.messages.extend(api_pb2.ChatMessage(**m) for m in messages)
    elif prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.tokens.ids.extend(token_ids)
    return req
