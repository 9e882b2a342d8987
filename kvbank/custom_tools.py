"""Custom tools (OpenAI's `{"type": "custom", "format": ...}`, as Codex's `apply_patch`): how
one travels as a chat tool, and how a call of one is written raw and read back.

A chat template knows only functions, so a custom tool goes to it as a function with one
string argument, `input`, and its `format` on the function entry: the template shows it to
the model and the worker reads it there (`tools_json`), with no field of its own on the wire.

A JSON string cannot hold a grammar's sentences as they are (they would be escaped), so a
call under a custom tool's grammar is written raw: `{"name": NAME}` on the call's first line,
then the input itself, inside the model's call markers. A model may still write the JSON form,
`{"name": NAME, "arguments": {"input": ...}}`; both read back as arguments `{"input": ...}`.
A raw input cannot contain the call's end marker (`</tool_call>`).

No MLX here: the shim checks formats with it, the worker composes and parses with it.
"""

from __future__ import annotations

import json

from kvbank.contracts.failures import InvalidRequest

CUSTOM_ARG = "input"
FORMAT_KEY = "format"  # on a chat function entry: the custom tool's format
SYNTAXES = ("lark", "regex")


def chat_function(name, description, fmt, where: str) -> dict:
    """The chat function a custom tool is offered as; `where` names the tool for errors
    ("tools[3]"). No format is free text, as OpenAI has it."""
    fmt = {"type": "text"} if fmt is None else fmt
    input_grammar(fmt, f"{where}.format")
    return {"name": name,
            "description": (description or "") + " (freeform: the whole input as one string)",
            "parameters": {"type": "object", "required": [CUSTOM_ARG],
                           "properties": {CUSTOM_ARG: {"type": "string"}}},
            FORMAT_KEY: fmt}


def input_grammar(fmt: object, where: str) -> dict | None:
    """llguidance's grammar for a custom tool's input, as one entry of a top-level grammar's
    `grammars` (for the caller to reference by name); None for free text. A format that is
    wrong is an InvalidRequest naming its field, with llguidance's own message."""
    from llguidance import LLMatcher

    if not isinstance(fmt, dict):
        raise InvalidRequest(f"{where} must be an object", param=where)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind != "grammar":
        raise InvalidRequest(f"{where}.type must be 'text' or 'grammar'; given {kind!r}",
                             param=f"{where}.type")
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if syntax not in SYNTAXES:
        raise InvalidRequest(f"{where}.syntax must be 'lark' or 'regex'; given {syntax!r}",
                             param=f"{where}.syntax")
    if not isinstance(definition, str) or not definition.strip():
        raise InvalidRequest(f"{where}.definition must be a non-empty {syntax} grammar",
                             param=f"{where}.definition")
    # grammar_from_lark gives the Lark text back; grammar_from_regex a whole top-level grammar
    grammar = ({"lark_grammar": LLMatcher.grammar_from_lark(definition)} if syntax == "lark"
               else json.loads(LLMatcher.grammar_from_regex(definition))["grammars"][0])
    error = LLMatcher.validate_grammar(json.dumps({"grammars": [grammar]}))
    if error:
        raise InvalidRequest(f"{where}.definition: {error.strip()}", param=f"{where}.definition")
    return grammar


def custom_format(tool: object) -> dict | None:
    """The format of a chat tool that stands for a custom tool; None for a function."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    fmt = fn.get(FORMAT_KEY) if isinstance(fn, dict) else None
    return fmt if isinstance(fmt, dict) else None


def raw_header(name: str) -> str:
    """The first line of a raw call, before its input."""
    return json.dumps({"name": name}, ensure_ascii=False) + "\n"


def parse_raw(body: str, tools: list[dict]) -> dict | None:
    """A raw call of one of `tools`' custom tools, from the text between the call markers
    (`\\n{"name": NAME}\\nINPUT\\n`), as {"name", "arguments": {"input": INPUT}}; None if the
    text is no such call."""
    head, newline, rest = body.removeprefix("\n").partition("\n")
    try:
        call = json.loads(head) if newline else None
    except ValueError:
        return None
    if not isinstance(call, dict) or set(call) != {"name"} or not isinstance(call["name"], str):
        return None
    if call["name"] not in {t["function"]["name"] for t in tools if custom_format(t)}:
        return None
    return {"name": call["name"], "arguments": {CUSTOM_ARG: rest.removesuffix("\n")}}
