"""`kvbank bench scale`'s model: a real model's cache geometry with no weights, and the turns a
forward would write into its caches, synthesized.

The worker's cache seam (worker/kv/cache_kinds.py `CacheKinds`) takes a model and asks it for
`make_cache()`. `SynthModel` answers with mlx-lm's own cache classes in the real model's order
(for Qwen3.6-27B, mlx-lm's qwen3_5 `make_cache`: an `ArraysCache(size=2)` for each Gated
DeltaNet layer, a `KVCache` for every 4th, the full-attention ones), so the bench runs the
worker's real `CacheKinds`: its freeze, snapshot, restore and checkpoint encoding, with the
same slot layout the real model gives. Only the forward is synthesized (`forward`): it writes
K and V into the full-attention caches as mlx-lm's `KVCache.update_and_fetch` does, and reads
each recurrent layer's state and writes its next one (conv state in the activations' dtype,
the recurrent state in float32, as mlx-lm's qwen3_5 and gated_delta keep them).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

# From each model's config.json. `layers` counts full-attention layers; `linear` (hybrid
# models) gives the Gated DeltaNet layers' state shapes.
GEOMETRIES = {
    # Qwen3.6-27B (mlx-lm model_type qwen3_5): 64 layers, every 4th full attention
    # (full_attention_interval 4): 16 of 4 KV heads of 256 in bf16 (64 KiB a token). The other
    # 48 are Gated DeltaNet (linear_num_key_heads 16, linear_num_value_heads 48,
    # linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4; values as
    # public code quoting the config.json has them, not read from the Hugging Face file
    # here). Their state, as mlx-lm keeps it: conv (1, 3, 2*16*128 + 48*128) in the
    # activations' dtype (bf16) and recurrent (1, 48, 128, 128) float32: 3,207,168 bytes a
    # layer, 146.8 MiB a checkpoint (llama.cpp logs 149.6 MiB: it keeps the conv state in f32).
    "qwen3.6-27b": {"layers": 16, "kv_heads": 4, "head_dim": 256, "bytes_per_token": 65536,
                    "full_attention_interval": 4,
                    "linear": {"num_key_heads": 16, "num_value_heads": 48, "key_head_dim": 128,
                               "value_head_dim": 128, "conv_kernel_dim": 4}},
    # 64 layers, 8 KV heads of 128: 256 KiB a token, 100K tokens = 25 GiB. No recurrent layers.
    "qwen3-32b": {"layers": 64, "kv_heads": 8, "head_dim": 128, "bytes_per_token": 262144},
    # --quick: 4 layers, every 2nd full attention, a small recurrent state
    "tiny": {"layers": 2, "kv_heads": 2, "head_dim": 64, "bytes_per_token": 1024,
             "full_attention_interval": 2,
             "linear": {"num_key_heads": 2, "num_value_heads": 2, "key_head_dim": 16,
                        "value_head_dim": 16, "conv_kernel_dim": 4}},
}


def state_shapes(g: dict) -> list[tuple[tuple[int, ...], str]]:
    """One recurrent layer's arrays, in ArraysCache order: conv state, recurrent state."""
    lin = g["linear"]
    conv_dim = 2 * lin["num_key_heads"] * lin["key_head_dim"] + (
        lin["num_value_heads"] * lin["value_head_dim"])
    return [((1, lin["conv_kernel_dim"] - 1, conv_dim), "bfloat16"),
            ((1, lin["num_value_heads"], lin["value_head_dim"], lin["key_head_dim"]), "float32")]


def checkpoint_bytes(g: dict) -> int:
    """One checkpoint: every recurrent layer's state (0 for a model without one)."""
    if "linear" not in g:
        return 0
    one = sum(int(np.prod(s)) * (2 if d == "bfloat16" else 4) for s, d in state_shapes(g))
    return one * g["layers"] * (g["full_attention_interval"] - 1)


def checkpoint_every(g: dict, tokens: int | None, block_tokens: int) -> int:
    """The worker's interval between a long prompt's checkpoints for this geometry
    (`ServedModel.checkpoint_every`, the worker's own rule: 9,472 tokens for Qwen3.6-27B)."""
    from kvbank.worker.compute.served_model import ServedModel

    sized = SimpleNamespace(kv_bytes_per_token=g["bytes_per_token"],
                            checkpoint_bytes=checkpoint_bytes(g))
    return ServedModel.checkpoint_every(sized, tokens, block_tokens)


class SynthModel:
    """A model without weights: its caches, in the real model's order (module docstring)."""

    def __init__(self, g: dict):
        self.g = g

    def make_cache(self) -> list:
        from mlx_lm.models.cache import ArraysCache, KVCache

        every = self.g.get("full_attention_interval", 1)
        n = self.g["layers"] * every
        return [KVCache() if (i + 1) % every == 0 else ArraysCache(size=2) for i in range(n)]


def kinds_for(g: dict):
    from kvbank.worker.kv.cache_kinds import CacheKinds

    return CacheKinds(SynthModel(g), "qwen3_5" if "linear" in g else "synthetic")


def presize(kinds, cache: list, n_tokens: int) -> None:
    """A new cache's full-attention buffers made at their final size at once, so a long build
    writes in place (mlx-lm's own growth copies the whole buffer every chunk)."""
    import mlx.core as mx

    from kvbank.worker.kv import arrays

    g = kinds.model.g
    shape = (1, g["kv_heads"], arrays.capacity(n_tokens), g["head_dim"])
    for c in kinds.full_caches(cache):
        c.state = (mx.zeros(shape, dtype=mx.bfloat16), mx.zeros(shape, dtype=mx.bfloat16), 0)
        mx.eval(c.keys, c.values)


def forward(kinds, cache: list, start: int, end: int, *, seed: int, splits=(),
            first_chunk: int | None = None) -> tuple[dict, float]:
    """The tokens [start, end) computed into `cache`, as forwards stopping at the first chunk's
    end (`first_chunk` tokens), at each of `splits` and at `end`: each full-attention layer's K
    and V written (`update_and_fetch`), each recurrent layer's state read and its next one
    written. Returns the checkpoints taken at `splits` (kinds.snapshot, as the scheduler
    takes them) and the seconds until the first forward was evaluated."""
    import mlx.core as mx

    g = kinds.model.g
    splits = {p for p in splits if start < p < end}
    marks = sorted(splits | {end} | ({start + first_chunk} if first_chunk else set()))
    checkpoints, first_s, pos, t0 = {}, None, start, time.perf_counter()
    for stop in (p for p in marks if p <= end):
        n = stop - pos
        for j, c in enumerate(kinds.full_caches(cache)):
            k = mx.full((1, g["kv_heads"], n, g["head_dim"]), float(seed % 97 + j),
                        dtype=mx.bfloat16)
            c.update_and_fetch(k, k + 1)
            mx.eval(c.keys, c.values)
        for c in kinds.other_caches(cache):
            if c[0] is None:
                c[0], c[1] = (mx.full(s, float(seed % 89), dtype=getattr(mx, d))
                              for s, d in state_shapes(g))
            else:  # the next state from the last, as a recurrent layer's forward
                c[0], c[1] = c[0] * 0.5 + 1, c[1] * 0.5 + 1
            mx.eval(c[0], c[1])
        pos = stop
        if first_s is None:
            first_s = time.perf_counter() - t0
        if stop in splits:
            checkpoints[stop] = kinds.snapshot(cache)
    return checkpoints, first_s
