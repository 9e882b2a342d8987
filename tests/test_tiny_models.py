"""kvbank/testing/tiny.py: random-weight models of every architecture kvbank means to serve load with
mlx-lm, give finite greedy tokens, are reproducible per seed, and carry think tokens and the
Qwen3.5-style reasoning template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import matrix

from kvbank.testing.tiny import (ARCHS, SANITIZED, THINK_TOKENS, build_model, main,
                                  make_arch_model)

WINDOW = 16  # shorter than a templated prompt plus its answer, so sliding caches wrap
CONTEXT = 4096
CACHES = {  # make_prompt_cache(model) per arch, in order
    "llama": ["KVCache"] * 4,
    "qwen3": ["KVCache"] * 4,
    "gpt_oss": ["RotatingKVCache", "KVCache"] * 2,
    "gemma3_text": ["RotatingKVCache"] * 3 + ["KVCache"],
    "qwen3_5": ["ArraysCache"] * 3 + ["KVCache"],
    "nemotron_h": ["ArraysCache", "KVCache", "ArraysCache"],  # "M*M-": the MLP block has none
    "mamba2": ["ArraysCache"] * 4,
    "falcon_h1": ["CacheList"] * 4,  # each (ArraysCache, KVCache)
    "baichuan_m1": ["CacheList"] * 4,  # each (ArraysCache, KVCache or RotatingKVCache)
    "qwen3_moe": ["KVCache"] * 4,
    "glm4_moe": ["KVCache"] * 4,
    "gemma4_text": ["RotatingKVCache"] * 3 + ["KVCache"],
}
PROMPT = [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "Name three colours, please."}]


def _build(out: Path, arch: str, seed: int, cache_dir: Path) -> Path:
    return make_arch_model(out, arch, seed=seed, context=CONTEXT, window=WINDOW, cache_dir=cache_dir)


def _greedy(path: Path) -> tuple[list[int], object, object]:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import stream_generate

    model, tok = mlx_lm.load(str(path))
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
    tokens = []
    for r in stream_generate(model, tok, prompt, max_tokens=8):
        assert mx.isfinite(r.logprobs).all().item()
        tokens.append(r.token)
    return tokens, model, tok


@pytest.mark.parametrize("arch", matrix(ARCHS, keep=(  # those make test's stacks run
    "llama", "qwen3", "gpt_oss", "qwen3_5", "nemotron_h")))
def test_arch_loads_generates_and_is_seeded(arch, tmp_path, cache_dir):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    a, b, c = (_build(tmp_path / name, arch, seed, cache_dir)
               for name, seed in (("a", 0), ("b", 0), ("c", 1)))
    weights = (a / "model.safetensors").read_bytes()
    assert weights == (b / "model.safetensors").read_bytes()
    assert weights != (c / "model.safetensors").read_bytes()

    tokens, model, tok = _greedy(a)
    assert 0 < len(tokens) <= 8
    assert _greedy(b)[0] == tokens
    assert _greedy(c)[0] != tokens

    saved = mx.load(str(a / "model.safetensors"))  # sanitize on load kept every tensor as saved
    loaded = dict(tree_flatten(model.parameters()))
    assert saved.keys() == loaded.keys()
    if arch in SANITIZED:  # ...or changed it as it always does (the built model has it so)
        saved = model.sanitize(dict(saved))
    assert all(mx.array_equal(saved[k], loaded[k]).item() for k in saved)
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
    built, _ = build_model(json.loads((a / "config.json").read_text()), seed=0)
    assert mx.array_equal(built(mx.array([prompt])), model(mx.array([prompt]))).item()

    edited = [*prompt[:3], 1000, *prompt[4:]]  # the answer must depend on early context
    last = [model(mx.array([p]))[0, -1] for p in (prompt, edited)]
    assert mx.abs(last[0] - last[1]).max().item() > 1e-2

    caches = make_prompt_cache(model)
    assert [type(x).__name__ for x in caches] == CACHES[arch]
    parts = [p for x in caches for p in getattr(x, "caches", (x,))]
    assert all(x.max_size == WINDOW for x in parts if isinstance(x, RotatingKVCache))
    assert json.loads((a / "config.json").read_text())["max_position_embeddings"] == CONTEXT

    assert tok.has_thinking and tok.think_start == "<think>"
    for t in THINK_TOKENS:
        assert len(tok.encode(t)) == 1
    assert tok.has_tool_calling


@pytest.fixture(scope="module")
def reasoning_tok(tmp_path_factory, cache_dir):
    from mlx_lm.utils import load_tokenizer

    path = make_arch_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", cache_dir=cache_dir)
    return load_tokenizer(path)


def test_template_strips_past_reasoning(reasoning_tok):
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "<think>\nplan A\n</think>\n\nHello!"},
               {"role": "assistant", "content": "Again.", "reasoning_content": "plan B"},
               {"role": "user", "content": "Bye"}]
    text = reasoning_tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert "plan A" not in text and "plan B" not in text
    assert "<|im_start|>assistant\nHello!<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n")
    off = reasoning_tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True,
                                            enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_tools_keep_the_current_turns_reasoning(reasoning_tok):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "ask the tool",
             "tool_calls": [{"type": "function",
                             "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"}]
    text = reasoning_tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "weather"' in text
    assert ('<|im_start|>assistant\n<think>\nask the tool\n</think>\n\n<tool_call>\n'
            '{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text


def test_options_and_cli(tmp_path, cache_dir, capsys):
    from mlx_lm.utils import load_tokenizer

    plain = make_arch_model(tmp_path / "plain", "qwen3", think_tokens=False, template="{{ 'x' }}",
                            cache_dir=cache_dir)
    tok = load_tokenizer(plain)
    assert not tok.has_thinking
    assert json.loads((plain / "config.json").read_text())["vocab_size"] == len(tok.get_vocab())
    assert (plain / "chat_template.jinja").read_text() == "{{ 'x' }}"

    main(["gpt_oss", str(tmp_path / "cli"), "--context", "2048", "--seed", "3", "--window", "8"])
    out = Path(capsys.readouterr().out.strip())
    config = json.loads((out / "config.json").read_text())
    assert (config["max_position_embeddings"], config["sliding_window"]) == (2048, 8)
    with pytest.raises(ValueError, match="unknown arch"):
        make_arch_model(tmp_path / "bad", "gpt2", cache_dir=cache_dir)


def test_the_routers_render_passes_the_reasoning_switch(tmp_path, cache_dir):
    """`thinking` on /v1/messages becomes GenerateRequest.enable_thinking, which the router
    hands the chat template on every render (here its prompt tokenizer, directly)."""
    from kvbank.router.tokenizer import PromptTokenizer

    path = make_arch_model(tmp_path / "llama", "llama", cache_dir=cache_dir)
    tok = PromptTokenizer(path)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.render(messages).endswith("assistant\n<think>\n")
    off = tok.render(messages, template={"enable_thinking": False})
    assert off.endswith("assistant\n<think>\n\n</think>\n\n")
    assert tok.chat(messages, template={"enable_thinking": False}) == tok.encode(off)
