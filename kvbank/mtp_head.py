"""The multi-token-prediction (MTP) head that Qwen3.5/3.6/3.8 and Qwen3-Next checkpoints ship
next to the trunk (`mtp.*` tensors), read from the model folder or a sidecar folder.

mlx-lm 0.32.2 drops every `mtp.*` tensor when it loads these models (qwen3_5.py and
qwen3_next.py `sanitize`), so the head is built here, against mlx-lm's own classes, until
mlx-lm ships one. The head is one block run after the trunk:

    x = fc([pre_fc_norm_embedding(embed(token t+1)) ; pre_fc_norm_hidden(h_t)])
    g = norm(decoder_layer(x))          # one full-attention layer with its own KV cache
    logits = trunk's lm_head(g)          # predicts token t+2

h_t is the trunk's hidden state **after its final norm** (the tensor its lm_head scores):
vLLM's Qwen3.5/Qwen3-Next MTP (the serving path Qwen documents for these checkpoints) feeds
that one, and llama.cpp, LightLLM and oMLX measured higher acceptance with it than with the
pre-norm residual (docs/decisions.md). Chained drafts feed g back as the next hidden.

A folder whose head does not fit the trunk (missing or extra tensors, wrong shapes, more than
one MTP layer) is served without MTP, and `read_head` says why; a head is never half-loaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

SIDECAR_MODEL_TYPE = "qwen3_5_mtp"  # mlx-vlm's split-out head folder
HIDDEN_VARIANT = "post_norm"  # which trunk hidden the head reads (module docstring)
_MTP_KEY = re.compile(r"^(?:.*\.)?mtp\.(.+)$")
_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
          "input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
          "k_norm.weight")


def declared_layers(config: dict) -> int:
    """MTP layers the config declares (Qwen: `mtp_num_hidden_layers`; DeepSeek style:
    `num_nextn_predict_layers`), in the text config or at the top."""
    for scope in (config.get("text_config") or {}, config):
        for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
            if scope.get(key):
                return int(scope[key])
    return 0


class Trunk:
    """What the head and the speculative decoder need from an mlx-lm model: the post-norm
    hidden states of a forward, the logits of a hidden state, the token embeddings, and the
    decoder-layer class the head's layer is built from."""

    def __init__(self, model):
        import mlx.nn as nn

        self.model = model
        model_type = getattr(model, "model_type", "")
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            from mlx_lm.models import qwen3_5

            lm = model.language_model
            self.text, self.args, self.layer_class = lm.model, lm.args, qwen3_5.DecoderLayer
            self._lm_head = None if lm.args.tie_word_embeddings else lm.lm_head
        elif model_type == "qwen3_next":
            from mlx_lm.models import qwen3_next

            self.text, self.args = model.model, model.args
            self.layer_class = qwen3_next.Qwen3NextDecoderLayer
            self._lm_head = None if model.args.tie_word_embeddings else model.lm_head
        else:
            raise ValueError(f"no MTP support for model type {model_type!r}")
        self._embed: nn.Embedding = self.text.embed_tokens

    def hidden(self, inputs, cache):
        """Post-norm hidden states of a forward over inputs [B, T] (mlx-lm's own forward)."""
        return self.text(inputs, cache)

    def logits(self, hidden):
        """The logits mlx-lm's model returns for these hidden states (same ops, same order)."""
        return self._embed.as_linear(hidden) if self._lm_head is None else self._lm_head(hidden)

    def embed(self, tokens):
        return self._embed(tokens)

    def lm_head_weight(self):
        """The LM head's float weights [vocab, hidden] (None when they are quantized)."""
        import mlx.nn as nn

        layer = self._embed if self._lm_head is None else self._lm_head
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return None
        return layer.weight


def _head_class():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.base import create_attention_mask

    class MTPHead(nn.Module):
        """The `mtp.*` block; the embedding and LM head stay the trunk's."""

        def __init__(self, trunk: Trunk):
            super().__init__()
            args = trunk.args
            h, eps = args.hidden_size, args.rms_norm_eps
            self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
            self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
            self.fc = nn.Linear(2 * h, h, bias=False)
            # An index whose layer is full attention, as every released head's layer is.
            self.layers = [trunk.layer_class(args, args.full_attention_interval - 1)]
            self.norm = nn.RMSNorm(h, eps=eps)

        def __call__(self, hidden, embeddings, cache):
            """Head outputs g (after `mtp.norm`) for rows of (trunk hidden h_t, embedding of
            token t+1); the rows go into the head's KV cache like a prompt's tokens."""
            x = mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                                self.pre_fc_norm_hidden(hidden)], axis=-1)
            x = self.fc(x)
            x = self.layers[0](x, create_attention_mask(x, cache), cache)
            return self.norm(x)

    return MTPHead


def make_head(trunk: Trunk):
    """A head of the trunk's shapes with mlx's initial weights (loaded or trained after)."""
    return _head_class()(trunk)


@dataclass(frozen=True)
class HeadLoad:
    """What `read_head` found: the head (None: serve without MTP) and the start message."""

    head: object | None
    message: str
    source: str = ""
    tensors: int = 0


def _tensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # only the shards that hold mtp.* tensors
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted({f for k, f in weight_map.items() if _MTP_KEY.match(k)})
        extra = [folder / "mtp.safetensors"] if (folder / "mtp.safetensors").is_file() else []
        return [folder / n for n in names] + [p for p in extra if p.name not in names]
    return sorted(folder.glob("*.safetensors"))


def _read_tensors(folder: Path, sidecar: bool) -> dict:
    """The head's tensors, keyed without the `mtp.` prefix (mx.load maps files lazily: the
    trunk's tensors in the same shards are never read)."""
    import mlx.core as mx

    out = {}
    for f in _tensor_files(folder):
        for key, value in mx.load(str(f)).items():
            m = _MTP_KEY.match(key)
            if m:
                out[m.group(1)] = value
            elif sidecar:
                out[key] = value
    return out


def _raw_checkpoint(folder: Path) -> bool:
    """True for a Hugging Face checkpoint as published (not converted by mlx-lm): its
    conv1d weights are still in PyTorch's layout, and its RMSNorm weights are stored
    zero-centred (the model adds 1). mlx-lm's qwen3_5 sanitize applies the same test."""
    import mlx.core as mx

    for f in sorted(folder.glob("*.safetensors")):
        for key, value in mx.load(str(f)).items():
            if key.endswith("conv1d.weight"):
                return value.shape[-1] != 1
    return False


def _sidecar_config(folder: Path) -> dict | None:
    cfg = folder / "config.json"
    if not cfg.is_file():
        return None
    config = json.loads(cfg.read_text())
    return config if config.get("model_type") == SIDECAR_MODEL_TYPE else None


def read_head(model, model_dir: Path, sidecar: Path | None = None) -> HeadLoad:
    """Build the MTP head of `model` from `model_dir`'s `mtp.*` tensors, or from `sidecar`
    (a folder of `model_type` qwen3_5_mtp). Every mismatch returns head=None with why."""
    from mlx.utils import tree_flatten

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    declared = declared_layers(config)
    try:
        trunk = Trunk(model)
    except ValueError as e:
        return HeadLoad(None, f"MTP off: {e}")
    source, folder, is_sidecar = str(model_dir), model_dir, False
    if sidecar is not None:
        side = _sidecar_config(Path(sidecar))
        if side is None:
            return HeadLoad(None, f"MTP off: {sidecar} is not a {SIDECAR_MODEL_TYPE} folder "
                                  "(config.json model_type)")
        declared = declared_layers(side) or declared
        source, folder, is_sidecar = str(sidecar), Path(sidecar), True
    weights = _read_tensors(folder, is_sidecar)
    if not weights:
        if declared:
            return HeadLoad(None, f"MTP off: {source} declares {declared} MTP layer(s) but "
                                  "holds no mtp.* tensors (a conversion that dropped them?)")
        return HeadLoad(None, "MTP off: the model has no MTP head")
    if declared > 1:
        return HeadLoad(None, f"MTP off: {declared} MTP layers; kvbank runs heads of one")
    head = make_head(trunk)
    if any(k.endswith(".scales") for k in weights):
        quant = config.get("quantization") or {}
        if not quant:
            return HeadLoad(None, "MTP off: the head is quantized but config.json has no "
                                  "quantization settings")
        import mlx.nn as nn

        nn.quantize(head, group_size=quant.get("group_size", 64), bits=quant.get("bits", 4),
                    class_predicate=lambda path, _: f"{path}.scales" in weights)
    expected = dict(tree_flatten(head.parameters()))
    problems = [f"missing {k}" for k in sorted(expected.keys() - weights.keys())]
    problems += [f"unexpected {k}" for k in sorted(weights.keys() - expected.keys())]
    problems += [f"{k}: {tuple(weights[k].shape)} where the trunk needs {tuple(v.shape)}"
                 for k, v in sorted(expected.items())
                 if k in weights and weights[k].shape != v.shape]
    if problems:
        more = f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""
        return HeadLoad(None, f"MTP off: the head in {source} does not fit the trunk: "
                              + "; ".join(problems[:4]) + more)
    shifted = not is_sidecar and _raw_checkpoint(model_dir)
    if shifted:  # zero-centred norms, as the trunk's: the runtime adds 1 (once)
        weights = {k: (v + 1.0 if k.endswith(_NORMS) and v.ndim == 1 else v)
                   for k, v in weights.items()}
    head.load_weights(list(weights.items()), strict=True)
    head.eval()
    import mlx.core as mx

    mx.eval(head.parameters())
    return HeadLoad(head, f"MTP head: {len(weights)} tensors from {source}"
                          + (" (norms shifted by +1)" if shifted else ""),
                    source, len(weights))
