"""JSON from clients, checked once before anything reads it: how deep it nests, and that its
strings are Unicode a protobuf message can carry.

Python's JSON reader takes `"\\ud800"` (a lone surrogate) as a string protobuf then refuses to
encode, and a body nested ~1,000 deep as a RecursionError: both were a 500. A client gets a
400 that names the field instead. The depth limit is serde_json's default (the JSON reader of
Rust servers, vLLM's router among them): deeper than any request or schema an agent sends.
"""

from __future__ import annotations

import json
import re

MAX_JSON_DEPTH = 128


class BadJson(ValueError):
    """`param`: the field at fault, as a path (`messages[0].content`); empty: the body."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def loads(text: str | bytes, where: str = "") -> object:
    """`json.loads`, checked (`check`); a body too deep for the reader is a BadJson too.
    Cheap for what passes (a 1.1 MB schema: ~25 ms more than the read): the walk that names
    the field runs only for a body that fails."""
    try:
        value = json.loads(text)
    except RecursionError:
        field = where or _too_deep_field(text if isinstance(text, bytes) else text.encode())
        raise BadJson(f"{_name(field)} nests deeper than {MAX_JSON_DEPTH} levels of arrays "
                      f"and objects", field) from None
    raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    if _deeper_than_limit(value) or _SURROGATE_ESCAPE.search(raw):
        check(value, where)  # names the field, or passes (a surrogate pair is fine)
    return value


# A lone surrogate in a parsed string comes only from a \uD800-\uDFFF escape (UTF-8 cannot
# carry one; a body that tries is not UTF-8, and not read): without one, none to look for.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _deeper_than_limit(value: object) -> bool:
    """Whether arrays and objects nest past MAX_JSON_DEPTH (containers only: no paths)."""
    if type(value) is not dict and type(value) is not list:
        return False
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH:
            return True
        for item in (v.values() if type(v) is dict else v):
            if type(item) is dict or type(item) is list:
                stack.append((item, depth + 1))
    return False


_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
SCAN_BYTES = 1 << 16


def _too_deep_field(raw: bytes) -> str:
    """The top-level field in which nesting first passes MAX_JSON_DEPTH, for a body too deep
    for Python's reader to parse; found in its first SCAN_BYTES ("" when not there, or the
    body is not an object), so a hostile body costs little."""
    depth, key = 0, b""
    for m in _TOKENS.finditer(raw, 0, SCAN_BYTES):
        tok = m.group()
        if tok[:1] == b'"':
            if depth == 1:
                key = tok  # at the top level, the last string before a bracket is its key
        elif tok in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                try:
                    return json.loads(key) if raw.lstrip()[:1] == b"{" and key else ""
                except ValueError:
                    return ""
        else:
            depth -= 1
    return ""


def check(value: object, where: str = "") -> None:
    """Raises BadJson naming the first string (or key) that is not valid Unicode (a lone
    surrogate), or the field where nesting passes MAX_JSON_DEPTH. Iterative: a value as deep
    as the reader took does not exhaust Python's stack here."""
    stack = [(value, where, 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            _unicode(v, path)
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise BadJson(f"{_name(_top(path))} nests deeper than {MAX_JSON_DEPTH} "
                              f"levels of arrays and objects", _top(path))
            if isinstance(v, dict):
                for k, item in v.items():
                    _unicode(k, path, key=True)
                    stack.append((item, f"{path}.{k}" if path else str(k), depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(v))


def _unicode(s: str, path: str, key: bool = False) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        what = f"a key of {_name(path)}" if key else _name(path)
        raise BadJson(f"{what} is not valid Unicode: it has a lone surrogate "
                      f"({s[e.start]!r} at character {e.start}); send UTF-8 text (a "
                      f"\\ud800-\\udfff escape only as half of a pair)", path or "") from None


def _name(path: str) -> str:
    return path or "the body"


def _top(path: str) -> str:
    """The request's own field a path starts from (`tools` of `tools[0].function...`)."""
    return path.split(".", 1)[0].split("[", 1)[0]
