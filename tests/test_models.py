"""Tests for kvbank.models: GGUF import, default model, tiny models (real MLX, no mocks)."""

import json
from pathlib import Path

import pytest

from kvbank.models import SOURCE_MARKER, default_model_dir, import_gguf, resolve_model
from kvbank.testing.tiny import make_tiny_model

pytestmark = pytest.mark.unit  # make test-fast


@pytest.fixture(scope="session")
def default_dir(cache_dir) -> Path:
    return default_model_dir(cache_dir)


@pytest.fixture(scope="session")
def default_model(default_dir):
    import mlx_lm

    return mlx_lm.load(str(default_dir))


def test_default_model_answers_paris(default_model):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = default_model
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    text = generate(model, tokenizer, prompt, max_tokens=20, sampler=make_sampler(temp=0.0))
    assert "Paris" in text


def test_imported_folder_layout(default_dir):
    config = json.loads((default_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    source = json.loads((default_dir / SOURCE_MARKER).read_text())
    assert source["source"].endswith(".gguf") and source["size"] > 0
    leftovers = [p.name for p in default_dir.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []


def test_reimport_is_skipped(default_dir, cache_dir):
    before = (default_dir / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(cache_dir) == default_dir
    assert (default_dir / "model.safetensors").stat().st_mtime_ns == before  # not written again


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf ``permute`` for q/k rows (what import_gguf undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_gguf(tiny_dir: Path, default_dir: Path, out: Path, **overrides) -> Path:
    """Write tiny_dir's model as an unquantized llama GGUF, the way llama.cpp lays it out."""
    import mlx.core as mx

    cfg = json.loads((tiny_dir / "config.json").read_text())
    source = json.loads((default_dir / SOURCE_MARKER).read_text())["source"]
    _, meta = mx.load(source, return_metadata=True)
    meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta.update({
        "general.architecture": "llama",
        "llama.embedding_length": u32(cfg["hidden_size"]),
        "llama.block_count": u32(cfg["num_hidden_layers"]),
        "llama.feed_forward_length": u32(cfg["intermediate_size"]),
        "llama.attention.head_count": u32(cfg["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(cfg["rope_theta"], dtype=mx.float32),
        "llama.context_length": u32(cfg["max_position_embeddings"]),
        "llama.vocab_size": u32(cfg["vocab_size"]),
    })
    meta.update(overrides)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    tensors = {}
    for key, w in mx.load(str(tiny_dir / "model.safetensors")).items():
        if key.startswith("model.layers."):
            _, _, layer, *rest = key.split(".")
            module = ".".join(rest[:-1])
            if module == "self_attn.q_proj":
                w = _permute(w, cfg["num_attention_heads"])
            elif module == "self_attn.k_proj":
                w = _permute(w, cfg["num_key_value_heads"])
            tensors[f"blk.{layer}.{names[module]}.weight"] = w
        else:
            top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
            tensors[top[key]] = w
    mx.save_gguf(str(out), tensors, meta)
    return out


def test_gguf_import_round_trips_weights(tmp_path, cache_dir, default_dir):
    """A llama.cpp-layout GGUF imports back to the exact original weights (q/k un-permuted)."""
    import mlx.core as mx

    tiny = make_tiny_model(tmp_path / "tiny", seed=3, cache_dir=cache_dir)
    gguf = _tiny_gguf(tiny, default_dir, tmp_path / "tiny-model.gguf")
    imported = resolve_model(str(gguf), cache_dir)
    assert imported == cache_dir / "models" / "tiny-model"
    original, converted = mx.load(str(tiny / "model.safetensors")), mx.load(str(imported / "model.safetensors"))
    assert original.keys() == converted.keys()
    for key in original:
        assert converted[key].dtype == mx.float32
        assert mx.array_equal(original[key], converted[key]), key
    config = json.loads((imported / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["max_position_embeddings"] == 2048
    assert json.loads((imported / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert resolve_model(None, cache_dir) == default_dir


def test_failed_import_leaves_no_folder(tmp_path, cache_dir, default_dir):
    """The tokenizer step fails after the weights are written; nothing half-built may remain."""
    tiny = make_tiny_model(tmp_path / "tiny", seed=1, cache_dir=cache_dir)
    gguf = _tiny_gguf(tiny, default_dir, tmp_path / "spm.gguf", **{"tokenizer.ggml.model": "llama"})
    out = tmp_path / "models" / "spm"
    with pytest.raises(ValueError, match="byte-level BPE"):
        import_gguf(gguf, out)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_tokenizer_round_trip_and_chat_template(default_model):
    _, tokenizer = default_model
    for text in ["Hello world 12345!", "  spaces\n\ttabs", "héllo 日本語 🎉", "<|im_start|>user\nhi<|im_end|>"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]
    messages = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == 2 and 2 in tokenizer.eos_token_ids


def test_tiny_model_deterministic_and_generates(tmp_path, cache_dir, default_dir):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    a = make_tiny_model(tmp_path / "a", seed=7, cache_dir=cache_dir)
    b = make_tiny_model(tmp_path / "b", seed=7, cache_dir=cache_dir)
    c = make_tiny_model(tmp_path / "c", seed=8, cache_dir=cache_dir)
    wa, wb, wc = (mx.load(str(d / "model.safetensors")) for d in (a, b, c))
    assert wa.keys() == wb.keys()
    for key in wa:
        assert bytes(memoryview(wa[key])) == bytes(memoryview(wb[key])), key
    assert not mx.array_equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])

    model, tokenizer = mlx_lm.load(str(a))
    assert json.loads((a / "config.json").read_text())["vocab_size"] == len(tokenizer.vocab)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    logits = model(mx.array([prompt]))
    assert bool(mx.all(mx.isfinite(logits)))
    stream = mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=4, sampler=make_sampler(temp=0.0))
    tokens = [r.token for r in stream]
    assert 0 < len(tokens) <= 4


def test_resolve_model_directory(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(bad))
    (bad / "config.json").write_text("{}")
    assert resolve_model(str(bad)) == bad


def test_resolve_model_missing_and_wrong_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        resolve_model(str(other))


def test_import_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
