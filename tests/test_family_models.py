"""kvbank/testing/family_models.py: the published chat templates of the families kvbank claims, byte
for byte as their sources have them, and per family a scripted tiny model of its architecture
that writes, after the family's own generation prompt, the family's call (mlx-lm loads and
runs it as any checkpoint; no kvbank code in the loop)."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from kvbank.testing.family_models import CALL, FAMILIES, TEMPLATES, TOOLS, conversation, scripted_model
from tests.conftest import matrix
from tests.test_family_loops import KEPT


def test_the_templates_are_the_published_ones():
    sources = (TEMPLATES / "SOURCES.md").read_text()
    rows = re.findall(r"^\| (\S+\.jinja) \|.*\| ([0-9a-f]{64}) \|", sources, re.M)
    assert {name for name, _ in rows} == {f.template for f in FAMILIES.values()}
    for name, digest in rows:
        assert hashlib.sha256((TEMPLATES / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name", matrix(FAMILIES, keep=KEPT))
def test_a_scripted_model_writes_its_familys_call_after_the_generation_prompt(name, cache_dir):
    """Greedy decoding through mlx-lm: the family's reasoning, the call of `run` with a string
    and a boolean argument in its own syntax, its stop token; and, where mlx-lm has the
    family's parser, that parser reads the call."""
    import mlx_lm
    from mlx_lm.generate import stream_generate

    f = FAMILIES[name]
    model, tok = mlx_lm.load(str(scripted_model(name, cache_dir=cache_dir)))
    prompt = tok.apply_chat_template(conversation(f, turns=2), tools=TOOLS,
                                     add_generation_prompt=True)
    ids = [r.token for r in stream_generate(model, tok, prompt, max_tokens=80)]
    assert ids[-1] in tok.eos_token_ids
    text = tok.decode(ids)
    assert text == f.reasoning + f.call
    if tok.has_tool_calling:
        body = text.split(tok.tool_call_start, 1)[1].rsplit(tok.tool_call_end, 1)[0]
        call = tok.tool_parser(body, TOOLS)
        assert (call["name"], call["arguments"]) == CALL
    else:  # harmony and nemotron: kvbank's own parsers (tests/test_family_formats.py)
        assert json.dumps(CALL[1])[1:-1].replace(" ", "") in text.replace(" ", "")
