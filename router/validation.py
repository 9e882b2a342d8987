"""Validate once, into a different type: a raw GenerateRequest becomes a `ValidRequest`.

Every refusal is an `InvalidRequest` whose message names the field, the bound and the value
given, so a client knows what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbank.contracts.failures import InvalidRequest
from kvbank.v1 import api_pb2

ROLES = ("system", "user", "assistant", "tool")
# In UTF-8 bytes, not characters: the coldstore's key is `tenant NUL session_id`, and LMDB
# refuses keys over 511 bytes (256 characters of emoji are 1 KiB).
MAX_SESSION_ID_BYTES = 256
MAX_STOP_STRINGS = 8


@dataclass(frozen=True)
class ValidRequest:
    session_id: str
    kind: str  # "chat" | "prompt" | "tokens"
    messages: tuple[dict, ...]
    prompt: str
    token_ids: tuple[int, ...]
    append: bool
    temperature: float
    top_p: float
    seed: int | None
    max_tokens: int
    stop: tuple[str, ...]
    no_cache: bool
    fit_max_tokens: bool = False


def validate(req: api_pb2.GenerateRequest, *, vocab_size: int) -> ValidRequest:
    sid = req.session_id
    if len(sid.encode()) > MAX_SESSION_ID_BYTES:
        raise InvalidRequest(f"session_id must be at most {MAX_SESSION_ID_BYTES} bytes of UTF-8; "
                             f"given {len(sid.encode())} bytes ({len(sid)} characters)")
    if "\0" in sid:
        raise InvalidRequest(f"session_id must not contain NUL; given one at character "
                             f"{sid.index(chr(0))}")
    kind = req.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("the request has no input: set one of chat, prompt or tokens")
    messages: tuple[dict, ...] = ()
    if kind == "chat":
        if not req.chat.messages:
            raise InvalidRequest("chat.messages is empty: send at least one message")
        for i, m in enumerate(req.chat.messages):
            if m.role not in ROLES:
                raise InvalidRequest(f"chat.messages[{i}].role must be one of {', '.join(ROLES)}; "
                                     f"given {m.role!r}")
        messages = tuple({"role": m.role, "content": m.content} for m in req.chat.messages)
        if all(not m["content"].strip() for m in messages):
            raise InvalidRequest("every chat message is empty: send some text")
    elif kind == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt is empty: send some text")
    elif kind == "tokens":
        if not req.tokens.ids:
            raise InvalidRequest("tokens.ids is empty: send at least one token id")
        bad = next((t for t in req.tokens.ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"tokens.ids must be < the vocabulary size {vocab_size}; given {bad}")
    if req.append and not sid:
        raise InvalidRequest("append needs a session_id: name the conversation to append to")
    if req.max_tokens <= 0:
        raise InvalidRequest(f"max_tokens must be > 0; given {req.max_tokens}")
    s = req.sampling
    if not (0.0 <= s.temperature <= 10.0) or s.temperature != s.temperature:
        raise InvalidRequest(f"sampling.temperature must be in [0, 10]; given {s.temperature}")
    if not (0.0 <= s.top_p <= 1.0) or s.top_p != s.top_p:
        raise InvalidRequest(f"sampling.top_p must be in [0, 1]; given {s.top_p}")
    if len(req.stop) > MAX_STOP_STRINGS or any(not x for x in req.stop):
        raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings; "
                             f"given {len(req.stop)}")
    return ValidRequest(
        session_id=sid, kind=kind, messages=messages, prompt=req.prompt,
        token_ids=tuple(req.tokens.ids), append=req.append, temperature=s.temperature,
        top_p=s.top_p, seed=s.seed if s.HasField("seed") else None,
        max_tokens=req.max_tokens, stop=tuple(req.stop), no_cache=req.no_cache,
        fit_max_tokens=req.fit_max_tokens,
    )
