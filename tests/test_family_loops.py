"""Each model family's published chat template and tool-call format, end to end: its scripted
tiny model (kvbank/testing/family_models.py) behind a real stack, and an agent's tool loop
(tests/families.py): every answer one structured call, nothing leaked into the text, the
reasoning apart, and each request reading the whole previous turn from cache wherever the
template renders the model's tokens back (the answer splice: whatever the generation prompt
ends with, whatever the template writes the model's text back as). Where the template itself
changes the history (Nemotron drops the reasoning, Qwen3.5 and GLM drop earlier reasoning at a
new query), the loss is exactly that and its cause is named.

One stack per family (a module-scoped parametrized fixture: pytest runs a family's tests
together); each loop's query is its own, so none finds another's history. The chat API runs
the whole loop for every family; the Responses and Anthropic APIs a shorter one for the two
formats kvbank reads itself (harmony, Nemotron's <TOOLCALL>)."""

from __future__ import annotations

import pytest

from kvbank.testing.family_models import FAMILIES, TOOLS, conversation, scripted_model
from tests.conftest import start_stack
from tests.families import check_loop, loop

OWN_FORMATS = ("gpt_oss", "nemotron_nano_v2")  # read by worker/compute/call_formats.py


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, cache_dir):
    """(name, stack, tokens of the family's generation prompt, of its system part)."""
    from kvbank.router.tokenizer import PromptTokenizer

    name = request.param
    model = scripted_model(name, cache_dir=cache_dir)
    tok = PromptTokenizer(model)
    messages = conversation(FAMILIES[name])
    prompt = tok.chat(messages, tools=TOOLS)
    gen = len(prompt) - len(tok.encode(tok._render_open(messages, TOOLS)))
    stack = start_stack(model, tmp_path_factory.mktemp(name), cache_dir=cache_dir)
    yield name, stack, gen, tok.shared_end(messages, prompt, TOOLS)
    stack.stop()


def test_a_tool_loop_reads_each_turn_from_cache(family):
    name, s, gen, system_part = family
    f = FAMILIES[name]
    for api in ("chat", "responses", "anthropic") if name in OWN_FORMATS else ("chat",):
        steps = loop(s, f, api, requests=9 if api == "chat" else 4)
        losses = check_loop(f, steps, gen, system_part)
        if name == "nemotron_nano_v2":
            assert len(losses) == len(steps) - 1  # every turn: the template drops the reasoning
        elif name in ("qwen3_5", "glm4_5", "glm4_6") and api == "chat":
            assert list(losses) == [6]  # only where the new query drops earlier reasoning
        else:
            assert not losses, (api, losses)

