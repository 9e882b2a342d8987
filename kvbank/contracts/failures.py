"""One hierarchy for everything kvbank refuses or cannot do, and how each reaches a client:
`GRPC_STATUS` (the router's and the worker's answer) and `HTTP_STATUS` (the shim's), one table
each. A failure's message says what to change; `reason`, `verdict` and the field at fault
travel as trailing metadata (`x-kvbank-reason`, `x-kvbank-verdict`, `retry-after`,
`x-kvbank-param`)."""

from __future__ import annotations

import grpc

from kvbank.contracts.receipts import AdmissionReceipt


class KvbankError(Exception):
    """Base: a failure a client may see. The message is for the person who sent it."""

    reason: str = ""
    verdict: str = ""
    retry_after_s: int | None = None
    param: str | None = None  # the request field at fault (OpenAI's `param`)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        md = [("x-kvbank-param", self.param)] if self.param else []
        if self.reason:
            md.append(("x-kvbank-reason", str(self.reason)))
        if self.verdict:
            md.append(("x-kvbank-verdict", str(self.verdict)))
        if self.retry_after_s is not None:
            md.append(("retry-after", str(self.retry_after_s)))
        return tuple(md)


class InvalidRequest(KvbankError, ValueError):
    """Bad input: nothing ran; the message names the field and what to change."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextTooLong(InvalidRequest):
    """A prompt the model's context cannot hold with room for its answer. The message begins
    the way clients that compact their history look for (`prompt is too long: N tokens > M
    maximum`, Anthropic's); the reason is OpenAI's code for it."""

    reason = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, max_tokens: int | None, context_tokens: int, *,
                 at_least: int | None = None):
        """`max_tokens` None: the prompt alone leaves no room for an answer. `at_least`: the
        prompt was not tokenized; its text of this many bytes is `prompt_tokens` at least."""
        if max_tokens is None:
            counted = (f" (at least: counted from its {at_least} bytes, without tokenizing it)"
                       if at_least is not None else "")
            super().__init__(
                f"prompt is too long: {prompt_tokens} tokens > {context_tokens - 1} maximum"
                f"{counted}: with one answer token it would exceed the model's context of "
                f"{context_tokens} tokens; shorten the prompt (or compact the conversation)",
                param="messages")
            return
        super().__init__(
            f"prompt is too long: {prompt_tokens} tokens > {context_tokens - max_tokens} "
            f"maximum: the prompt and max_tokens ({max_tokens}) together exceed the model's "
            f"context of {context_tokens} tokens; shorten the prompt (or compact the "
            f"conversation) or lower max_tokens to at most {context_tokens - prompt_tokens}",
            param="messages")


class MaxTokensTooLarge(InvalidRequest):
    """A max_tokens no prompt could leave room for (at least the model's whole context): the
    field at fault is max_tokens, not the prompt, so it is not worded as a long prompt (which
    clients take as "compact the conversation")."""

    reason = "max_tokens_too_large"

    def __init__(self, prompt_tokens: int, max_tokens: int, context_tokens: int):
        fits = context_tokens - prompt_tokens
        super().__init__(
            f"max_tokens ({max_tokens}) is more than the model's context of {context_tokens} "
            f"tokens holds: after this prompt ({prompt_tokens} tokens) at most {fits} fit; "
            f"lower max_tokens", param="max_tokens")


class GrammarTooLarge(InvalidRequest):
    """A schema (or a forced call's tools) longer than the worker compiles
    (`--max-grammar-bytes`). The router refuses it too, before it parses the JSON: a client
    resending a 1.1 MB schema cost the router's and the worker's loops ~40 ms each a time."""

    reason = "grammar_too_large"

    def __init__(self, field: str, nbytes: int, max_bytes: int, param: str):
        super().__init__(f"{field} is {nbytes:,} bytes; this server compiles grammars of at "
                         f"most {max_bytes:,} (--max-grammar-bytes): send a smaller schema",
                         param=param)


class Unauthenticated(KvbankError):
    """No key, or one the server does not know."""


class PermissionDenied(KvbankError):
    """A known caller asking for what it may not do (admin from afar without the key)."""


class NotFound(KvbankError):
    """A session the caller's tenant does not have."""


class Refused(KvbankError):
    """kvbank will not run this request now: `reason` says why, `verdict` whether and when a
    retry can work. From admission (with its receipt) or the router's ceilings and queue."""

    def __init__(self, reason: str, verdict: str, message: str, *,
                 retry_after_s: int | None = None, receipt: AdmissionReceipt | None = None):
        super().__init__(message)
        self.reason, self.verdict, self.message = reason, verdict, message
        self.retry_after_s, self.receipt = retry_after_s, receipt

    def __str__(self) -> str:
        return f"{self.message} [reason={self.reason} verdict={self.verdict}]"


class Unavailable(KvbankError):
    """A process kvbank needs is not answering (restarting, or down): retry shortly."""


class WorkerUnavailable(Unavailable):
    """The router cannot reach the worker (it is starting or restarting): retry in a second."""

    reason = "worker_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ColdstoreUnavailable(Unavailable):
    """The worker cannot reach the coldstore in time, or it refused the request."""

    reason = "coldstore_unavailable"


GRPC_STATUS: dict[type[KvbankError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Refused: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}

# HTTP status, OpenAI error type, and the error code when the failure carries no reason.
HTTP_STATUS: dict[type[KvbankError], tuple[int, str, str | None]] = {
    InvalidRequest: (400, "invalid_request_error", None),
    Unauthenticated: (401, "invalid_request_error", "invalid_api_key"),
    PermissionDenied: (403, "invalid_request_error", "permission_denied"),
    NotFound: (404, "invalid_request_error", "not_found"),
    Refused: (429, "requests", "rate_limit_exceeded"),
    Unavailable: (503, "server_error", "unavailable"),
}


# What a process passes on from the trailing metadata of a call it relays.
RELAYED_METADATA = ("retry-after", "x-kvbank-reason", "x-kvbank-verdict", "x-kvbank-param")


def grpc_status(exc: BaseException) -> grpc.StatusCode:
    """The status a failure is answered with; anything not ours is INTERNAL."""
    for cls in type(exc).__mro__:
        if cls in GRPC_STATUS:
            return GRPC_STATUS[cls]
    return grpc.StatusCode.INTERNAL


def failure_for(code: grpc.StatusCode) -> type[KvbankError] | None:
    """The failure a gRPC status stands for (the shim sees only the router's status)."""
    return next((cls for cls, c in GRPC_STATUS.items() if c == code), None)
