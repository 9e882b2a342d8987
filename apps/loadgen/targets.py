"""Targets: one turn sent to a server, timed on the client, as a `Reply`.

- `grpc://HOST:PORT`: kvbank's router, through `kvbank.client.Client`. Sessions are sent in
  `append=False` mode with the whole conversation, exactly what the OpenAI path sends, so both
  paths render the same prompt. The usage gives cached tokens, the cache source (ram/ssd/none)
  and the server's own count of recomputed tokens.
- `openai://HOST:PORT[/PREFIX]` (or `openai://http://...`, `openai://https://...`): any
  OpenAI-compatible server: kvbank's shim, `mlx_lm.server`, others. `POST
  {base}/v1/chat/completions` with `stream: true` and `stream_options.include_usage`; with
  `names` the agent id goes in `user` and the session id in the `x-session-id` header, without
  (as most real clients send) neither. Cached tokens come from
  `usage.prompt_tokens_details.cached_tokens` when the server gives them.

TTFT is measured here, for both: from just before the request is sent to the first non-empty
piece of answer text (an answer with no text: to the end of the stream).

Refusals (HTTP 429/503, gRPC RESOURCE_EXHAUSTED/UNAVAILABLE) are a `Reply` with status
`refused`, a reason key and the server's message; other failures are status `error` or
`timeout`. Only a target that cannot be reached at all raises (`TargetUnreachable`), from
`check()`, before the run starts.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import grpc
import httpx

from kvbank.client import Client

REFUSED_GRPC = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
REFUSED_HTTP = (429, 503)


class TargetUnreachable(Exception):
    """The target did not answer at all (the run does not start)."""


@dataclass(slots=True)
class Reply:
    status: str                              # ok | refused | error | timeout
    text: str = ""
    ttft_s: float | None = None              # client-side
    total_s: float = 0.0                     # client-side, request sent -> stream ended
    prompt_tokens: int | None = None         # None: the server did not say
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cache_source: str | None = None          # ram | ssd | none, when the server says
    server_recomputed_tokens: int | None = None
    server_ttft_s: float | None = None
    reason: str | None = None                # refusal/error key, e.g. RESOURCE_EXHAUSTED/queue_full
    message: str | None = None


class Target(Protocol):
    url: str

    def check(self, timeout_s: float) -> None: ...

    def send(self, *, agent_id: str, session_id: str, messages: list[dict], max_tokens: int,
             timeout_s: float) -> Reply: ...

    def prefetch(self, *, session_id: str, messages: list[dict], timeout_s: float) -> str: ...

    def close(self) -> None: ...


class GrpcTarget:
    def __init__(self, url: str, address: str):
        self.url = url
        self.address = address
        self.client = Client(address)

    def check(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self.client.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise TargetUnreachable(f"no gRPC server answered at {self.address} within "
                                    f"{timeout_s:.0f} s") from None

    def send(self, *, agent_id: str, session_id: str, messages: list[dict], max_tokens: int,
             timeout_s: float) -> Reply:
        first: list[float] = []

        def on_text(piece: str) -> None:
            if piece and not first:
                first.append(time.monotonic())

        t0 = time.monotonic()
        try:
            turn = self.client.generate(session_id=session_id, messages=messages, append=False,
                                        max_tokens=max_tokens, temperature=0.0, on_text=on_text,
                                        timeout_s=timeout_s)
        except grpc.RpcError as e:
            return _grpc_failure(e, time.monotonic() - t0)
        t1 = time.monotonic()
        u = turn.usage
        return Reply("ok", turn.text, ttft_s=(first[0] if first else t1) - t0, total_s=t1 - t0,
                     prompt_tokens=u.get("prompt_tokens"),
                     completion_tokens=u.get("completion_tokens"),
                     cached_tokens=u.get("cached_tokens"), cache_source=u.get("cache_source"),
                     server_recomputed_tokens=u.get("recomputed_tokens"),
                     server_ttft_s=u.get("ttft_s"))

    def prefetch(self, *, session_id: str, messages: list[dict], timeout_s: float) -> str:
        try:
            return self.client.prefetch(session_id=session_id, messages=messages,
                                        timeout_s=timeout_s).status
        except grpc.RpcError as e:
            return _hint_failed(e)

    def close(self) -> None:
        self.client.close()


def _grpc_failure(e: grpc.RpcError, total_s: float) -> Reply:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    md = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
    reason = code.name + (f"/{md['x-kvbank-reason']}" if "x-kvbank-reason" in md else "")
    if code in REFUSED_GRPC:
        return Reply("refused", total_s=total_s, reason=reason, message=details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Reply("timeout", total_s=total_s, reason=reason, message=details)
    return Reply("error", total_s=total_s, reason=reason, message=details)


def _hint_failed(e: Exception) -> str:
    return f"failed: {type(e).__name__}"


class OpenAITarget:
    def __init__(self, url: str, base_url: str, model_name: str | None = None,
                 names: bool = True):
        self.url = url
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.names = names
        self.http = httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0))

    def _api(self, path: str) -> str:
        base = self.base_url if self.base_url.endswith("/v1") else self.base_url + "/v1"
        return base + path

    def check(self, timeout_s: float) -> None:
        """Reachable = answers GET /v1/models with any status; picks the model name there
        when none was given (the only one listed, else "default_model", mlx_lm.server's
        name for the model it was started with)."""
        try:
            r = self.http.get(self._api("/models"), timeout=timeout_s)
        except httpx.HTTPError as e:
            raise TargetUnreachable(f"no HTTP server answered at {self.base_url}: "
                                    f"{type(e).__name__}: {e}") from None
        if self.model_name is None:
            ids = []
            try:
                ids = [m["id"] for m in r.json().get("data", [])] if r.status_code == 200 else []
            except (ValueError, KeyError, TypeError, AttributeError):
                pass
            self.model_name = ids[0] if len(ids) == 1 else "default_model"

    def send(self, *, agent_id: str, session_id: str, messages: list[dict], max_tokens: int,
             timeout_s: float) -> Reply:
        body = {"model": self.model_name or "default_model", "messages": messages,
                "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        headers = {}
        if self.names:
            body["user"], headers["x-session-id"] = agent_id, session_id
        t0 = time.monotonic()
        first: float | None = None
        text: list[str] = []
        usage: dict = {}
        try:
            with self.http.stream("POST", self._api("/chat/completions"), json=body,
                                  headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=10.0)) as r:
                if r.status_code != 200:
                    r.read()
                    return http_failure(r, time.monotonic() - t0)
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("error"):
                        return Reply("error", total_s=time.monotonic() - t0, reason="stream",
                                     message=_error_message(event))
                    for choice in event.get("choices") or ():
                        delta = choice.get("delta") or {}
                        piece = delta.get("content") or ""
                        if piece or delta.get("reasoning_content"):
                            first = first or time.monotonic()
                        text.append(piece)
                    if event.get("usage"):
                        usage = event["usage"]
        except httpx.TimeoutException as e:
            return Reply("timeout", total_s=time.monotonic() - t0, reason="timeout",
                         message=f"{type(e).__name__}: {e}")
        except (httpx.HTTPError, ValueError) as e:
            return Reply("error", total_s=time.monotonic() - t0, reason=type(e).__name__,
                         message=str(e))
        t1 = time.monotonic()
        details = usage.get("prompt_tokens_details") or {}
        ext = usage.get("kvbank") or {}  # kvbank's shim may add its own usage fields
        return Reply("ok", "".join(text), ttft_s=(first or t1) - t0, total_s=t1 - t0,
                     prompt_tokens=usage.get("prompt_tokens"),
                     completion_tokens=usage.get("completion_tokens"),
                     cached_tokens=details.get("cached_tokens"),
                     cache_source=ext.get("cache_source", usage.get("cache_source")),
                     server_recomputed_tokens=ext.get("recomputed_tokens",
                                                      usage.get("recomputed_tokens")),
                     server_ttft_s=ext.get("ttft_s"))

    def prefetch(self, *, session_id: str, messages: list[dict], timeout_s: float) -> str:
        """kvbank's hint (`POST /v1/kvbank/prefetch`) with the conversation so far; the status
        it answers, or `unsupported` from a server without it."""
        headers = {"x-session-id": session_id} if self.names else {}
        try:
            r = self.http.post(self._api("/kvbank/prefetch"), json={"messages": messages},
                               headers=headers, timeout=timeout_s)
        except httpx.HTTPError as e:
            return _hint_failed(e)
        if r.status_code in (404, 405):
            return "unsupported"
        try:
            return r.json()["status"] if r.status_code == 200 else f"failed: {r.status_code}"
        except (ValueError, KeyError, TypeError):
            return "failed: not kvbank's answer"

    def close(self) -> None:
        self.http.close()


def _error_message(body: object) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


def http_failure(r: httpx.Response, total_s: float) -> Reply:
    try:
        message = _error_message(r.json())
    except ValueError:
        message = r.text[:500]
    status = "refused" if r.status_code in REFUSED_HTTP else "error"
    return Reply(status, total_s=total_s, reason=f"HTTP {r.status_code}", message=message)


def parse_target(url: str, *, model_name: str | None = None, names: bool = True) -> Target:
    """A target from its URL; raises ValueError for one this does not know."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ValueError(f"target must be grpc://HOST:PORT or openai://URL; given: {url!r}")
    if scheme == "grpc":
        host_port = rest.rstrip("/")
        if ":" not in host_port:
            raise ValueError(f"grpc target needs HOST:PORT; given: {url!r}")
        return GrpcTarget(url, host_port)
    if scheme == "openai":
        base = rest if rest.startswith(("http://", "https://")) else "http://" + rest
        if not urlsplit(base).netloc:
            raise ValueError(f"openai target needs a host; given: {url!r}")
        return OpenAITarget(url, base, model_name, names=names)
    raise ValueError(f"target must be grpc://HOST:PORT or openai://URL; given: {url!r}")
