"""The call syntaxes kvbank reads itself (worker/compute/call_formats.py): harmony's channels (gpt-oss)
and Nemotron's <TOOLCALL> list, split as the text streams in pieces of any size."""

from __future__ import annotations

import json

import pytest

from kvbank.worker.compute.call_formats import HarmonyText, parse_nemotron

pytestmark = pytest.mark.unit  # make test-fast

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "patch", "format": {"type": "text"},
                                           "parameters": {"type": "object"}}}]
ANSWER = ("<|channel|>analysis<|message|>Let me look.<|end|><|start|>assistant<|channel|>"
          "commentary<|message|>Listing files.<|end|><|start|>assistant<|channel|>commentary "
          'to=functions.run <|constrain|>json<|message|>{"cmd":"ls","background":false}<|call|>')


def _split(text: str, size: int, tools=TOOLS) -> tuple[str, str, list]:
    h, reasoning, out, calls = HarmonyText(tools), [], [], []
    for i in range(0, len(text), size):
        r, o, c = h.feed(text[i:i + size])
        reasoning.append(r), out.append(o), calls.extend(c)
    r, o, c = h.finish()
    return "".join(reasoning) + r, "".join(out) + o, calls + c


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_harmony_channels_are_reasoning_text_and_calls_however_it_streams(size):
    reasoning, text, calls = _split(ANSWER, size)
    assert reasoning == "Let me look."
    assert text == "Listing files."  # a commentary preamble is for the user
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("run", {"cmd": "ls", "background": False})]


def test_harmony_final_answer_and_the_recipient_in_the_role_header():
    reasoning, text, calls = _split("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant"
                                    "<|channel|>final<|message|>Done.<|return|>", 2)
    assert (reasoning, text, calls) == ("Hm.", "Done.", [])
    _, _, calls = _split(' to=functions.run<|channel|>commentary json<|message|>{"cmd":"x"}'
                         "<|call|>", 5)
    assert [(c.name, c.arguments) for c in calls] == [("run", '{"cmd": "x"}')]


def test_a_harmony_call_without_tools_or_that_does_not_parse_is_text():
    body = '<|channel|>commentary to=functions.run<|message|>{"cmd":"ls"}<|call|>'
    assert _split(body, 4, tools=None) == ("", '{"cmd":"ls"}', [])
    assert _split(body.replace('{"cmd":"ls"}', "not json"), 4)[1:] == ("not json", [])
    # a custom tool's input is the message itself, whatever it is
    _, _, [call] = _split(body.replace("run", "patch").replace('{"cmd":"ls"}', "*** diff"), 3)
    assert (call.name, json.loads(call.arguments)) == ("patch", {"input": "*** diff"})


def test_text_without_any_harmony_header_is_text():
    assert _split("Plain words, no channel.", 4) == ("", "Plain words, no channel.", [])
    assert _split("<|channel|>analysis", 4) == ("", "", [])  # a header cut short: nothing


def test_a_harmony_call_cut_at_max_tokens_is_a_call_only_if_it_parses():
    assert len(_split('<|channel|>commentary to=functions.run <|constrain|>json<|message|>'
                      '{"cmd": "ls"}', 6)[2]) == 1
    assert _split('<|channel|>commentary to=functions.run<|message|>{"cmd": "l', 6)[1:] == \
        ('{"cmd": "l', [])


def test_nemotron_toolcall_lists():
    assert parse_nemotron('[{"name": "run", "arguments": {"cmd": "ls"}}, '
                          '{"name": "read", "arguments": "{\\"path\\": \\"a\\"}"}]') == [
        {"name": "run", "arguments": {"cmd": "ls"}}, {"name": "read", "arguments": {"path": "a"}}]
    for bad in ("[]", '[{"arguments": {}}]', "not json"):
        with pytest.raises(ValueError):
            parse_nemotron(bad)


def test_a_template_with_a_call_syntax_kvbank_does_not_read_is_refused_naming_its_markers(
        tmp_path, cache_dir):
    """The router's refusal of `tools` where the worker reads no call format: the template's
    call markers and what to send instead; a template without tools says just that."""
    from kvbank.router.server import tool_refusal
    from kvbank.router.tokenizer import PromptTokenizer
    from kvbank.testing.tiny import make_arch_model

    template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                "{% if tools %}{% for t in tools %}<|invoke_tool|>{{ t.function.name }}"
                "<|invoke_end|>{% endfor %}{% endif %}")
    tok = PromptTokenizer(make_arch_model(tmp_path / "m", "llama", template=template,
                                          special=("<|invoke_tool|>", "<|invoke_end|>"),
                                          think_tokens=False, cache_dir=cache_dir))
    message = tool_refusal("odd-model", *tok.tool_markers())
    assert "odd-model" in message and "<|invoke_tool|>" in message
    assert "harmony" in message and "send the request without tools" in message
    assert tool_refusal("plain", False, []) == \
        "the model plain has no tool calling in its chat template: send the request without tools"
