"""Quantization at rest (`--kv-bits 8|4`): a FULL slot's K and V as `mx.quantize` makes
them of each token's head_dim vector on its own (words, scales, biases), so the first n tokens
of an entry are the first n of each of its arrays, and a turn's commit quantizes only the tokens
it added. A request restores them dequantized (worker/kv/arrays.py) and runs in full precision.
"""

from __future__ import annotations

import mlx.core as mx

QArray = tuple[mx.array, mx.array, mx.array]  # mx.quantize's words, scales, biases
QUANT_GROUP_SIZES = (64, 32)  # along head_dim: the largest that divides it


def group_size(head_dim: int) -> int:
    """The quantization group for a head_dim (MLX quantizes in groups of 32, 64 or 128)."""
    for g in QUANT_GROUP_SIZES:
        if head_dim % g == 0:
            return g
    raise ValueError(f"head_dim {head_dim} is not a multiple of 32: --kv-bits cannot "
                     f"quantize it")


def quantize(x: mx.array, bits: int) -> QArray:
    """Each token's vectors (the last axis) quantized on their own."""
    return tuple(mx.quantize(x, group_size=group_size(int(x.shape[-1])), bits=bits))


def dequantize(q: QArray, bits: int) -> mx.array:
    head_dim = int(q[0].shape[-1]) * 32 // bits
    return mx.dequantize(*q, group_size=head_dim // int(q[1].shape[-1]), bits=bits)


def is_quantized(layers) -> bool:
    """Whether an entry's layers are QArrays (kept quantized)."""
    return bool(layers) and isinstance(layers[0][0], tuple)
