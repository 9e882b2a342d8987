"""Tiny random-weight mlx-lm model folders of several architectures, for tests and benchmarks.

kvbank must serve models whose caches are not all plain KV (sliding windows, Gated DeltaNet
and Mamba states, layers with no cache at all), and no such weights can be had offline. These
folders are built from mlx-lm's own model classes, so they load with ``mlx_lm.load`` exactly as
a real checkpoint of the architecture would, with the default model's tokenizer (plus
``<think>``/``</think>``) and a Qwen3.5-style reasoning chat template.

    python -m kvbank.testing.tiny qwen3_5 /tmp/qwen35-tiny [--size default] [--context N] [--seed N] [--mtp]

``--mtp`` adds a multi-token-prediction head (`mtp.*` tensors, `mtp_num_hidden_layers: 1`,
as Qwen3.5 checkpoints ship it) with seeded random weights; kvbank/testing/tiny_mtp.py trains
one.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from kvbank.models import TOKENIZER_FILES, atomic_dir, default_model_dir, llama_config, locked

ARCHS = ("llama", "qwen3", "gpt_oss", "gemma3_text", "qwen3_5", "nemotron_h", "mamba2",
         "falcon_h1", "baichuan_m1", "qwen3_moe", "glm4_moe", "gemma4_text")
MTP_ARCHS = ("qwen3_5",)  # the architectures whose checkpoints ship an MTP head
SIZES = ("tiny", "default", "wide-kv", "scripted")
THINK_TOKENS = ("<think>", "</think>")
TEMPLATE_PATH = Path(__file__).parent / "templates" / "qwen35_reasoning.jinja"
WEIGHT_STD = 0.02
_VOCAB_MATRICES = ("embed_tokens.weight", "embeddings.weight", "lm_head.weight")

# "default" is SmolLM2-135M's shape, so benchmarks compare architectures at one size.
_DIMS = {
    "tiny": {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 128},
    "default": {"hidden": 576, "layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64, "inter": 1536},
    # The default's width and depth with full multi-head attention of 128-wide heads: a token's
    # KV is 270 KB in float32 (135 KB in bfloat16, Llama-3-8B's is 128 KB), 6x the default's.
    # Two agents' conversations then outweigh the weights, as a 7B+ model's do on the machines
    # users run; the default model's are a third of its weights (`bench compare --size`).
    "wide-kv": {"hidden": 576, "layers": 30, "heads": 9, "kv_heads": 9, "head_dim": 128, "inter": 1536},
    # kvbank/testing/family_models.py's scripted models: room for five token codes in the residual
    # stream, and heads wide enough to carry one of them each
    "scripted": {"hidden": 384, "layers": 4, "heads": 4, "kv_heads": 4, "head_dim": 64, "inter": 256},
}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
    "nemotron_h": "NemotronHForCausalLM", "mamba2": "Mamba2ForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM", "baichuan_m1": "BaichuanM1ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
}
# mlx-lm's load changes these saved weights (its sanitize), the same way every time: the model
# built here is the sanitized one, as load makes it.
SANITIZED = {"baichuan_m1": "lm_head's rows normalized"}


def _attention(d: dict, arch: str, vocab: int, context: int, tied: bool) -> dict:
    """Fields every attention transformer here shares, under their HF names."""
    return {
        "architectures": [_ARCHITECTURES[arch]], "model_type": arch, "torch_dtype": "float32",
        "hidden_size": d["hidden"], "num_hidden_layers": d["layers"], "intermediate_size": d["inter"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"], "head_dim": d["head_dim"],
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": context,
        "tie_word_embeddings": tied,
    }


def _mamba(d: dict, tiny: bool) -> dict:
    """Mamba-2 mixer sizes (expand 2, one group), shared by mamba2 and nemotron_h."""
    heads = 8 if tiny else 18
    return {"heads": heads, "head_dim": d["hidden"] * 2 // heads, "state": 16 if tiny else 64,
            "conv_kernel": 4, "n_groups": 1}


def _check(arch: str, size: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")


def arch_config(arch: str, *, size: str = "tiny", vocab: int, context: int = 8192,
                window: int = 128, head_dim: int | None = None) -> dict:
    """config.json for one architecture: the smallest layer pattern that still mixes the arch's
    cache kinds when tiny, the arch's usual pattern at SmolLM2-135M's width and depth when default."""
    _check(arch, size)
    d, tiny = _DIMS[size], size not in ("default", "wide-kv")
    if head_dim:  # attention heads' width (--kv-bits quantizes in groups of 32 or 64 of it)
        d = {**d, "head_dim": head_dim}
    if arch == "llama":
        config = llama_config(d["hidden"], d["layers"], d["inter"], d["heads"], d["kv_heads"],
                               d["head_dim"], vocab=vocab, max_pos=context, theta=100000.0)
        config["torch_dtype"] = "float32"
        return config
    if arch == "qwen3":
        return {**_attention(d, arch, vocab, context, tied=True), "rope_theta": 1000000.0}
    if arch == "gpt_oss":
        config = _attention(d, arch, vocab, context, tied=False)
        # Four experts of a quarter width, two active: the dense model's FFN size, routed.
        config.update(num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
                      intermediate_size=d["inter"] // 4,
                      sliding_window=window, rope_theta=150000.0, rms_norm_eps=1e-5,
                      # Plain RoPE; left out, transformers assumes gpt-oss's YaRN and warns.
                      rope_scaling={"rope_type": "default", "rope_theta": 150000.0},
                      layer_types=["sliding_attention", "full_attention"] * (d["layers"] // 2))
        return config
    if arch == "gemma3_text":
        config = _attention(d, arch, vocab, context, tied=True)
        config.update(sliding_window=window, sliding_window_pattern=4 if tiny else 6,
                      rope_theta=1000000.0, rope_local_base_freq=10000.0,
                      query_pre_attn_scalar=d["head_dim"])
        return config
    if arch == "qwen3_moe":  # Qwen3-Coder-30B-A3B's architecture
        config = _attention(d, arch, vocab, context, tied=True)
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=d["inter"] // 4,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                      rope_theta=1000000.0)
        return config
    if arch == "glm4_moe":  # GLM-4.5 / 4.6: a dense first layer, then routed experts and a shared one
        config = _attention(d, arch, vocab, context, tied=False)
        config.update(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                      moe_intermediate_size=d["inter"] // 4, first_k_dense_replace=1,
                      n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                      partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
                      rope_theta=1000000.0, rope_scaling=None)
        return config
    if arch == "gemma4_text":  # Gemma 4's dense text model (the 31B's shape: no per-layer inputs)
        config = _attention(d, arch, vocab, context, tied=True)
        pattern = ["sliding_attention"] * (3 if tiny else 5) + ["full_attention"]
        config.update(sliding_window=window, sliding_window_pattern=len(pattern),
                      layer_types=(pattern * d["layers"])[:d["layers"]],
                      global_head_dim=d["head_dim"], num_kv_shared_layers=0,
                      hidden_size_per_layer_input=0, vocab_size_per_layer_input=vocab,
                      use_double_wide_mlp=False, final_logit_softcapping=30.0)
        return config
    if arch == "qwen3_5":
        config = _attention(d, arch, vocab, context, tied=True)
        config.update(full_attention_interval=4, linear_conv_kernel_dim=4,
                      linear_num_key_heads=2 if tiny else 4, linear_num_value_heads=4 if tiny else 8,
                      linear_key_head_dim=d["head_dim"], linear_value_head_dim=d["head_dim"],
                      rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                       "partial_rotary_factor": 0.25})
        return config
    if arch == "baichuan_m1":
        config = _attention(d, arch, vocab, context, tied=False)
        del config["head_dim"]  # hidden_size // num_attention_heads
        layers = list(range(d["layers"]))
        # Its layers each keep a conv state (the last token's K and V) beside their attention
        # cache: a CacheList of an ArraysCache and a KVCache, or a RotatingKVCache on the
        # sliding-window layers (every other one).
        config.update(rope_theta=1000000.0, sliding_window=window, conv_window=2,
                      sliding_window_layers=layers[1::2])
        return config
    m = _mamba(d, tiny)
    if arch == "falcon_h1":
        # Each layer runs a Mamba-2 mixer and attention side by side on one input: a CacheList
        # of an ArraysCache (conv and SSM states) and a KVCache.
        config = _attention(d, arch, vocab, context, tied=False)
        config.update(rope_theta=1000000.0, mamba_n_heads=m["heads"], mamba_d_head=m["head_dim"],
                      mamba_d_ssm=m["heads"] * m["head_dim"], mamba_d_state=m["state"],
                      mamba_d_conv=m["conv_kernel"], mamba_n_groups=m["n_groups"],
                      mamba_chunk_size=128)
        return config
    if arch == "nemotron_h":
        config = _attention(d, arch, vocab, context, tied=False)
        pattern = "M*M-" if tiny else "M-M*-" * 6
        del config["rms_norm_eps"]  # nemotron_h reads layer_norm_epsilon
        config.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern),
                      layer_norm_epsilon=1e-5, attention_bias=False, mlp_bias=False,
                      use_bias=False, use_conv_bias=True, mamba_num_heads=m["heads"],
                      mamba_head_dim=m["head_dim"], mamba_proj_bias=False,
                      ssm_state_size=m["state"], conv_kernel=m["conv_kernel"], n_groups=m["n_groups"])
        return config
    return {  # mamba2
        "architectures": [_ARCHITECTURES[arch]], "model_type": arch, "torch_dtype": "float32",
        "hidden_size": d["hidden"], "num_hidden_layers": d["layers"],
        "num_heads": m["heads"], "head_dim": m["head_dim"], "intermediate_size": m["heads"] * m["head_dim"],
        "state_size": m["state"], "conv_kernel": m["conv_kernel"], "n_groups": m["n_groups"],
        "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
        "tie_word_embeddings": True, "time_step_rank": "auto", "vocab_size": vocab,
        "max_position_embeddings": context,
        # HF writes (0, Infinity); a finite bound clips nothing and keeps config.json strict JSON.
        "time_step_limit": [0.0, 1e9],
    }


def _init(name: str, p, rng: np.random.Generator):
    """One parameter's seeded value, or p itself to keep mlx-lm's.

    Embeddings and lm_head are N(0, 0.02); other matrices N(0, 1/fan_in), so every block
    moves the residual stream and the next token depends on the context (and on the caches),
    not only on the last token's embedding (at 0.02, tiny tied models just repeat it). Biases
    are N(0, 0.02); norms, A_log, D and attention sinks keep mlx-lm's values.
    """
    if name.endswith(("mixer.dt_bias", "mamba.dt_bias")):
        # Mamba-2's own init (dt log-uniform in [1e-3, 1e-1]): with mlx-lm's ones a state
        # forgets a token within a few steps, and a state that remembers nothing tests no restore.
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), p.shape)).astype(np.float32)
        return dt + np.log(-np.expm1(-dt))  # inverse softplus
    if p.ndim == 1 and not name.endswith(".bias"):
        return p
    if p.ndim == 1 or name.endswith(_VOCAB_MATRICES):
        std = WEIGHT_STD
    else:  # Linear (out, in), SwitchLinear (experts, out, in), depthwise Conv1d (channels, kernel, 1)
        std = (p.shape[1] * p.shape[2] if "conv1d" in name else p.shape[-1]) ** -0.5
    return rng.standard_normal(p.shape, dtype=np.float32) * np.float32(std)


def build_model(config: dict, seed: int = 0, zero: tuple[str, ...] = ()):
    """The mlx-lm model for config with seeded weights (see ``_init``), exactly as
    ``mlx_lm.load`` will rebuild it from the saved weights. Returns (model, weights).

    Numpy draws the weights, in sorted name order; ``mx.random.seed(seed)`` fixes what
    mlx-lm draws itself (qwen3_5's A_log). Weights whose names end with one of ``zero`` are
    zeros, drawn from nothing (a caller that sets them itself).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = json.loads(json.dumps(config))  # what load reads back; ModelArgs may edit dicts
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {name: mx.zeros(p.shape, p.dtype) if name.endswith(zero) else
               mx.array(_init(name, p, rng))
               for name, p in sorted(tree_flatten(model.parameters()))}
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    if hasattr(model, "sanitize"):
        # Run it now, so the model below is the loaded one (gemma3_text ties lm_head here),
        # and refuse weights it would change: load must give back what is saved.
        clean = model.sanitize(dict(weights))
        if clean.keys() != weights.keys() or (
                config["model_type"] not in SANITIZED
                and not all(mx.array_equal(clean[k], weights[k]) for k in weights)):
            raise RuntimeError(f"mlx-lm's {config['model_type']} sanitize alters the saved weights")
        model.load_weights(list(clean.items()), strict=True)
    else:
        model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model, weights


def _vocab_size(tokenizer: dict) -> int:
    ids = list(tokenizer["model"]["vocab"].values()) + [t["id"] for t in tokenizer["added_tokens"]]
    return max(ids) + 1


def _write_tokenizer(src: Path, dst: Path, *, think_tokens: bool, template: str, context: int,
                     special: tuple[str, ...] = (), bos: str | None = None) -> int:
    """Copy the default model's tokenizer into dst, adding the think tokens (and `special`, a
    model family's own tokens, where the vocabulary lacks them), the template and `bos`;
    returns the vocabulary size the model must cover."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    tok = json.loads((src / "tokenizer.json").read_text())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    decoder = cfg.setdefault("added_tokens_decoder", {})
    have = {t["content"] for t in tok["added_tokens"]} | set(tok["model"]["vocab"])
    added = [t for t in (*(THINK_TOKENS if think_tokens else ()), *special) if t not in have]
    for content in dict.fromkeys(added):
        entry = {"content": content, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True}
        token_id = _vocab_size(tok)
        tok["added_tokens"].append({"id": token_id, **entry})
        decoder[str(token_id)] = entry
    if added:
        (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    if bos is not None:
        cfg["bos_token"] = bos
    cfg["chat_template"] = template
    cfg["model_max_length"] = context
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    (dst / "chat_template.jinja").write_text(template)
    return _vocab_size(tok)


def make_tiny_model(out_dir: Path, seed: int = 0, *, cache_dir: Path | None = None) -> Path:
    """Write a tiny random llama with the default model's tokenizer, for fast tests.

    Weights come from numpy's seeded Generator, so one seed always gives
    bit-identical weights. ``cache_dir`` is where the default model lives.
    """
    import mlx.core as mx

    out_dir = Path(out_dir)
    tok_dir = default_model_dir(cache_dir)
    src = json.loads((tok_dir / "config.json").read_text())
    hidden, layers, heads, kv_heads, head_dim, inter = 64, 2, 4, 2, 16, 128
    config = llama_config(
        hidden, layers, inter, heads, kv_heads, head_dim, vocab=src["vocab_size"], max_pos=2048
    )
    config.update({k: src[k] for k in ("bos_token_id", "eos_token_id") if k in src})
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(config["vocab_size"], hidden)}
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
              "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    for i in range(layers):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = rand(*shape)
        w[f"model.layers.{i}.input_layernorm.weight"] = np.ones(hidden, np.float32)
        w[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    w["model.norm.weight"] = np.ones(hidden, np.float32)
    with locked(out_dir), atomic_dir(out_dir) as tmp:
        tensors = {k: mx.array(v) for k, v in w.items()}
        mx.save_safetensors(str(tmp / "model.safetensors"), tensors, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copy2(tok_dir / name, tmp / name)
    return out_dir


def mtp_head_weights(model, seed: int) -> dict:
    """Seeded random weights of an MTP head for model, under their checkpoint names
    (`mtp.fc.weight`, `mtp.layers.0.self_attn.q_proj.weight`, ...), drawn as ``_init`` draws."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kvbank.mtp_head import Trunk, make_head

    head = make_head(Trunk(model))
    rng = np.random.default_rng(seed + 1_000_003)
    return {f"mtp.{name}": mx.array(_init(name, p, rng))
            for name, p in sorted(tree_flatten(head.parameters()))}


def make_arch_model(out_dir: Path, arch: str, *, seed: int = 0, context: int = 8192,
                    window: int = 128, think_tokens: bool = True, template: str | None = None,
                    cache_dir: Path | None = None, size: str = "tiny",
                    head_dim: int | None = None, special: tuple[str, ...] = (),
                    bos: str | None = None, eos: tuple[str, ...] = (),
                    overrides: dict | None = None, tune=None, zero: tuple[str, ...] = (),
                    mtp: bool = False
                    ) -> Path:
    """Write a random-weight ``arch`` model folder at out_dir (float32) and return it.

    One seed gives bit-identical files. ``context`` is max_position_embeddings, ``window`` the
    sliding window of gpt_oss and gemma3_text, ``template`` a chat template replacing the
    Qwen3.5-style one, ``cache_dir`` where the default model (the tokenizer's source) lives.
    A model family's own tokens: ``special`` (added where the vocabulary lacks them), ``bos``,
    ``eos`` (its stop tokens, by text). ``overrides``: config fields set over the arch's.
    ``tune(folder, config, weights, model) -> weights``: last changes to the weights (numpy
    arrays by name), with the tokenizer and config already in ``folder`` and the mlx-lm model
    at hand; ``zero``: weights left at zero for it (``build_model``).
    ``mtp`` adds a random MTP head (`mtp.*`, which mlx-lm's load drops; kvbank reads it).
    """
    import mlx.core as mx
    import numpy as np

    _check(arch, size)
    if mtp and arch not in MTP_ARCHS:
        raise ValueError(f"no MTP head for {arch!r}; expected one of {', '.join(MTP_ARCHS)}")
    out_dir = Path(out_dir)
    tok_dir = default_model_dir(cache_dir)
    src = json.loads((tok_dir / "config.json").read_text())
    template = TEMPLATE_PATH.read_text() if template is None else template
    with locked(out_dir), atomic_dir(out_dir) as tmp:
        vocab = _write_tokenizer(tok_dir, tmp, think_tokens=think_tokens, template=template,
                                 context=context, special=special, bos=bos)
        config = arch_config(arch, size=size, vocab=vocab, context=context, window=window,
                             head_dim=head_dim)
        config.update({k: src[k] for k in ("bos_token_id", "eos_token_id") if k in src})
        ids = _token_ids(tmp)
        if bos is not None:
            config["bos_token_id"] = ids[bos]
        if eos:
            config["eos_token_id"] = [ids[t] for t in eos]
        config.update(overrides or {})
        model, weights = build_model(config, seed, zero)
        if mtp:
            config["mtp_num_hidden_layers"] = 1
            weights.update(mtp_head_weights(model, seed))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if tune is not None:
            tuned = tune(tmp, config, {k: np.array(v) for k, v in weights.items()}, model)
            weights = {k: mx.array(v) for k, v in tuned.items()}
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out_dir


def _token_ids(folder: Path) -> dict[str, int]:
    tok = json.loads((folder / "tokenizer.json").read_text())
    return {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}


def bench_model(arch: str, cache_dir: Path | None = None, size: str = "default") -> Path:
    """A random-weight ``arch`` model of the default model's size, or of `size`
    (`kvbank bench --arch`), built once into kvbank's cache dir, in a child process: the caller
    holds no MLX. "wide-kv" keeps the default model's own chat template (no reasoning), so a
    scenario's conversations are the default model's, only heavier."""
    import subprocess
    import sys

    from kvbank.models import default_cache_dir

    _check(arch, size)
    out = (cache_dir or default_cache_dir()) / "bench-models" / f"{arch}-{size}"
    if not (out / "config.json").exists():
        own = ["--own-template"] if size == "wide-kv" else []
        subprocess.run([sys.executable, "-m", "kvbank.testing.tiny", arch, str(out), "--size", size,
                        *own], check=True, stdout=subprocess.DEVNULL)
    return out


def main(argv: list[str] | None = None) -> None:
    from kvbank.config import preload_openblas

    p = argparse.ArgumentParser(prog="python -m kvbank.testing.tiny", description=__doc__.split("\n")[0])
    p.add_argument("arch", choices=ARCHS)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--context", type=int, default=8192, help="max_position_embeddings")
    p.add_argument("--window", type=int, default=128, help="sliding window (gpt_oss, gemma3_text)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp", action="store_true", help="add a random MTP head (qwen3_5)")
    p.add_argument("--own-template", action="store_true",
                   help="the default model's own chat template, without think tokens (by "
                        "default: Qwen3.5's, whose answers reason)")
    args = p.parse_args(argv)
    preload_openblas()
    template = None
    if args.own_template:
        template = (default_model_dir() / "chat_template.jinja").read_text()
    print(make_arch_model(args.out_dir, args.arch, seed=args.seed, context=args.context,
                          window=args.window, size=args.size, mtp=args.mtp,
                          think_tokens=not args.own_template, template=template))


if __name__ == "__main__":
    main()
