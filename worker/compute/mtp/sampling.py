"""What a draft and a verify draw from, and the rule that keeps speculative answers exact.

Both the head's draft distribution q and the trunk's distribution p go through the same
steps as mlx-lm's `generate_step` with `make_sampler`: the request's logits processors
(logit_bias, penalties) on the history up to that position, log-softmax (the logprobs a
client gets, always the trunk's), then top-p, min-p, top-k (mlx-lm's filters, in its order)
and the temperature. Greedy (temperature 0) is the argmax.

The speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023): a draft d drawn from
q is kept with probability min(1, p(d)/q(d)) on an independent uniform; the first rejected
one is replaced by a draw from the normalized residual max(p - q, 0); when every draft is
kept, one more token is drawn from p. The tokens that come out are distributed exactly as
plain sampling from p, position by position. Under greedy the rule reduces to "keep while
the draft is the trunk's argmax".

Processors must be functions of the history they are given (mlx-lm's are): a processor that
keeps state of its own (a grammar matcher) would be stepped by drafts that are then rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass
class Sampling:
    """One request's sampling settings and its random stream (seeded: reproducible)."""

    temperature: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0
    processors: list[Callable] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def logprobs(self, logits: mx.array, history: mx.array | None) -> mx.array:
        """Rows of logits [R, V] -> the logprobs mlx-lm reports. With processors, row r's
        history is `history[r]` (each row has its own)."""
        if self.processors:
            rows = []
            for r in range(logits.shape[0]):
                row = logits[r:r + 1]
                for proc in self.processors:
                    row = proc(history[r], row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def filtered(self, logprobs: mx.array) -> mx.array:
        """mlx-lm's sampler filters, in make_sampler's order, scaled by the temperature: the
        log-weights a draw is taken from (softmax of them is the distribution)."""
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs * (1.0 / self.temperature)

    def choose(self, logprobs: mx.array) -> mx.array:
        """A lazy token per row: the argmax (greedy) or a draw (the draft's own draws; their
        distribution is `probs` of the same rows)."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        key = mx.random.key(int(self.rng.integers(2**63)))
        return mx.random.categorical(self.filtered(logprobs), key=key)

    def probs(self, logprobs: mx.array) -> mx.array:
        return mx.softmax(self.filtered(logprobs), axis=-1, precise=True)

    def accept(self, drafts: list[int], q: np.ndarray | None, p_logprobs: mx.array,
               targets: list[int] | None = None) -> tuple[int, int]:
        """The rule over one verify: (how many drafts are kept, the token that follows them).
        drafts[j] was drawn from q[j]; p_logprobs[j] is the trunk's row after the j-th fed
        token (row len(drafts) is the bonus row); `targets`: its argmaxes, if known."""
        k = len(drafts)
        if self.greedy:
            if targets is None:
                targets = mx.argmax(p_logprobs, axis=-1).tolist()
            a = 0
            while a < k and drafts[a] == targets[a]:
                a += 1
            return a, targets[a]
        p = np.asarray(self.probs(p_logprobs), dtype=np.float64)
        for j, d in enumerate(drafts):
            if self.rng.random() * q[j, d] < p[j, d]:
                continue
            residual = np.maximum(p[j] - q[j], 0.0)
            total = residual.sum()
            dist = residual / total if total > 0 else p[j] / p[j].sum()
            return j, self._draw(dist)
        return k, self._draw(p[k] / p[k].sum())

    def _draw(self, dist: np.ndarray) -> int:
        return int(np.searchsorted(np.cumsum(dist), self.rng.random() * dist.sum(), side="right"))
