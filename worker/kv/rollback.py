"""Rollback after a verify: every cache stands where the kept tokens leave it.

A verify feeds the trunk T = k+1 tokens (the last committed one and k drafts) in one forward
and keeps the first n of them (1 <= n <= T). How each cache kind takes back the rest is its
own (`CacheKind.rewind` in worker/kv/kinds.py: full caches trim, windows cut the tail the
forward appended, Gated DeltaNet states pick the state after token n). This module records
what a state's rewind needs during the verify's forward: **per-token states** (the
recurrent state after each fed token, and the conv input whose slices are the conv windows).

Why per-token states (docs/decisions.md has the numbers): mlx-lm runs the gated-delta
recurrence one token at a time on CPU and CUDA anyway, so keeping each step's state costs no
compute, only (T-1) transient states per layer; record-and-replay costs a recurrence replay
on every rejection, the confirmed split supports depth 1 only, and snapshot-and-re-advance
costs a trunk forward per rejection.

The per-token states come from `_StatesGatedDeltaNet`, mlx-lm's GatedDeltaNet forward
(0.32.2) with the recurrence run token by token; `install` gives the trunk's GDN layers that
class, which behaves exactly as mlx-lm's unless a `Speculation` is recording its cache.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from kvbank.worker.kv.kinds import RollbackUnsupported

# id(cache) -> (conv_input, per-token states) while a Speculation records a verify.
_RECORDING: ContextVar[dict | None] = ContextVar("mtp_recording", default=None)


def _qkv_qwen3_5(m, x):
    B, S, _ = x.shape
    z = m.in_proj_z(x).reshape(B, S, m.num_v_heads, m.head_v_dim)
    return m.in_proj_qkv(x), z, m.in_proj_b(x), m.in_proj_a(x)


def _qkv_qwen3_next(m, x):
    B, S, _ = x.shape
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
    qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    return qkv, z, b, a


def _forward_with_states(m, x, cache, projections, record: dict):
    """mlx-lm's GatedDeltaNet.__call__ for one unpadded sequence, keeping the recurrent state
    after every token and the conv input (whose slices are the conv windows)."""
    B, S, _ = x.shape
    qkv, z, b, a = projections(m, x)
    n_keep = m.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, m.conv_dim), x.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(m.conv1d(conv_input))
    q, k, v = [t.reshape(B, S, h, d) for t, h, d in zip(
        mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
        [m.num_k_heads, m.num_k_heads, m.num_v_heads], [m.head_k_dim, m.head_k_dim, m.head_v_dim])]
    q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
    state, ys, states = cache[1], [], []
    for t in range(S):
        y, state = gated_delta_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                      a[:, t:t + 1], b[:, t:t + 1], m.A_log, m.dt_bias, state,
                                      None, use_kernel=not m.training)
        ys.append(y)
        states.append(state)
    cache[1] = state
    cache.advance(S)
    record[id(cache)] = (conv_input, states)
    out = m.norm(mx.concatenate(ys, axis=1), z)
    return m.out_proj(out.reshape(B, S, -1))


class _StatesGatedDeltaNet(qwen3_5.GatedDeltaNet):
    def __call__(self, inputs, mask=None, cache=None):
        record = _RECORDING.get()
        if record is None or cache is None or id(cache) not in record:
            return super().__call__(inputs, mask, cache)
        if mask is not None or cache.lengths is not None or self.sharding_group is not None:
            raise RollbackUnsupported("a padded or sharded Gated DeltaNet forward")
        return _forward_with_states(self, inputs, cache, _qkv_qwen3_5, record)


class _StatesQwen3NextGatedDeltaNet(qwen3_next.Qwen3NextGatedDeltaNet):
    def __call__(self, inputs, mask=None, cache=None):
        record = _RECORDING.get()
        if record is None or cache is None or id(cache) not in record:
            return super().__call__(inputs, mask, cache)
        if mask is not None or cache.lengths is not None:
            raise RollbackUnsupported("a padded Gated DeltaNet forward")
        return _forward_with_states(self, inputs, cache, _qkv_qwen3_next, record)


_STATES_CLASS = {qwen3_5.GatedDeltaNet: _StatesGatedDeltaNet,
                 qwen3_next.Qwen3NextGatedDeltaNet: _StatesQwen3NextGatedDeltaNet}


def install(layers) -> int:
    """Give each Gated DeltaNet of the trunk's layers the per-token-state forward (its
    parameters and every other behaviour unchanged); RollbackUnsupported for any other
    recurrent mixer. Returns how many layers were given it."""
    n = 0
    for layer in layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is None:
            if getattr(layer, "is_linear", False):
                raise RollbackUnsupported(f"a recurrent layer of type {type(layer).__name__}")
            continue
        cls = type(mixer)
        if cls in _STATES_CLASS.values():
            n += 1
            continue
        if cls not in _STATES_CLASS:
            raise RollbackUnsupported(f"a recurrent mixer of type {cls.__name__}")
        mixer.__class__ = _STATES_CLASS[cls]
        n += 1
    return n


class Speculation:
    """One request's verifies: `recording(fed)` around the forward, then `keep(n)`."""

    def __init__(self, kinds, cache: list):
        """`kinds`: the model's CacheKinds (worker/kv/cache_kinds.py), the seam that takes
        each cache back."""
        why = kinds.rewindable()
        if why:
            raise RollbackUnsupported(why)
        self.kinds, self.cache = kinds, cache
        self._recorded = kinds.recorded(cache)
        self._record: dict = {}
        self._fed = 0

    @contextmanager
    def recording(self, fed: int):
        """The forward of `fed` tokens inside this block keeps what `keep` needs."""
        self._record = {id(c): None for c in self._recorded}
        self._fed = fed
        token = _RECORDING.set(self._record)
        try:
            yield
        finally:
            _RECORDING.reset(token)

    def keep(self, n: int) -> None:
        """Every cache as the first n of the fed tokens leave it (1 <= n <= fed)."""
        if not 1 <= n <= self._fed:
            raise ValueError(f"keep {n} of {self._fed} fed tokens")
        self.kinds.rewind(self.cache, self._fed, n, self._record)
        self._record, self._fed = {}, 0
