"""Speculative decoding of one sequence with the checkpoint's MTP head.

State between rounds (the invariant every step keeps):

- the trunk's caches hold every token of the conversation but the last one emitted, `y`;
- the head's KV cache holds the pairs (h_i, token i+1) folded so far, and `MTPState.hidden`
  the trunk hiddens whose pairs are not folded yet, `MTPState.tokens` their next tokens (one
  fewer when the last one's next token is not known yet: a finished turn).

A round: the head folds the pending pairs and drafts d1 (the pair (h_{n-1}, y) predicts the
token after y), then d2..dk from its own output g and the embedding of the draft before;
the trunk verifies [y, d1..dk] in one forward; `Sampling.accept` keeps a drafts and gives
the token z that follows them; every trunk cache is rolled back to [y, d1..da]
(`rollback.Speculation`), the head's k-1 speculative pairs are cut, and the true pairs
(H_0, d1) .. (H_a, z) wait to be folded by the next round's first draft.

A stop token or max_tokens inside a round cuts it there: the caches end exactly where plain
decoding would. Nothing here ever leaves a cache in a speculative state between rounds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvbank.mtp_head import Trunk
from kvbank.worker.compute import few_rows
from kvbank.worker.kv.cache_kinds import CacheKinds
from kvbank.worker.kv.rollback import Speculation, install
from kvbank.worker.compute.mtp.sampling import Sampling

MAX_DEPTH = 3
PREFILL_STEP = 2048  # mlx-lm's generate_step default
DRAFT_BITS = 4  # the drafts' copy of the LM head on a GPU (`draft_bits_for`)
DRAFT_GROUP = 64


def draft_bits_for(device) -> int | None:
    """The drafts' LM head on `device`: a 4-bit copy on a GPU, where a draft step is bound
    by reading weights (MTPLX drafts with one on Metal); on a CPU the trunk's own (None), as
    MLX's quantized matmul runs on one thread there and float32 on OpenBLAS's: the default
    model's LM head took 24.7 ms a draft at 4 bits against 11.4 ms (this 2-core VM, mlx
    0.32.4, Dec 2026), and `bench decode` at depth 2 went from 1.17x to 1.49x plain."""
    return None if device.type == mx.DeviceType.cpu else DRAFT_BITS


@dataclass
class MTPState:
    """The head's history of one conversation (see the module docstring)."""

    cache: KVCache = field(default_factory=KVCache)
    hidden: mx.array | None = None  # [1, p, H]
    tokens: list[int] = field(default_factory=list)
    verified: tuple | None = None  # a round's (trunk hiddens, tokens) until it is settled


@dataclass
class DraftStats:
    """What the head proposed and the trunk kept, per draft position."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    kept: list[int] = field(default_factory=lambda: [0] * (MAX_DEPTH + 1))  # rounds by drafts kept

    def rates(self) -> list[float]:
        """Acceptance per draft position, a_j: P(draft j kept | the drafts before it kept).
        A round then yields 1 + a_1 + a_1 a_2 + ... tokens on average."""
        before = [self.rounds, *self.accepted_at[:-1]]
        return [a / b if b else 0.0 for a, b in zip(self.accepted_at, before)]

    @property
    def tokens_per_forward(self) -> float:
        """Tokens emitted per trunk verify (1 + accepted drafts, on average)."""
        return 1 + self.accepted / self.rounds if self.rounds else 0.0


class MTPDecoder:
    """Prefill and speculative rounds over mlx-lm caches, for one model and head."""

    def __init__(self, model, head, depth: int, *, draft_bits: int | None | str = "auto",
                 profile: dict | None = None, kinds: CacheKinds | None = None):
        """`draft_bits`: the drafts score the vocabulary with a copy of the LM head quantized
        to this many bits (None: the trunk's own head; "auto": `draft_bits_for` the device).
        A draft step is the head's one layer and the LM head over every token; the LM head is
        most of it (SmolLM2-135M's: 21 % of the model's weights), and a rejected draft costs only its own time: the verify, with
        the trunk's own head, decides every token (MTPLX drafts with a 4-bit head too).
        `profile`: a dict that gets the CPU seconds each phase of the rounds took (draft,
        verify, accept, rollback), each phase evaluated on its own (slower: benchmarks)."""
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"MTP depth must be 1..{MAX_DEPTH}; given {depth}")
        self.model, self.head, self.depth = model, head, depth
        self.trunk = Trunk(model)
        install(self.trunk.text.layers)
        few_rows.install(model)  # on a CPU, a verify's rows round as plain decoding's
        few_rows.install(head)
        self.kinds = kinds if kinds is not None else CacheKinds.of(model)
        self._draft_head = None
        if draft_bits == "auto":
            draft_bits = draft_bits_for(mx.default_device())
        weight = self.trunk.lm_head_weight()
        if draft_bits and weight is not None and weight.shape[-1] % DRAFT_GROUP == 0:
            wq = mx.quantize(weight, group_size=DRAFT_GROUP, bits=draft_bits)
            mx.eval(wq)
            self._draft_head = (wq, draft_bits)
        self.stats = DraftStats()
        self.profile = profile
        self._t = 0.0

    def _tick(self, phase: str, *arrays) -> None:
        if self.profile is None:
            return
        mx.eval(*arrays)
        now = time.process_time()
        if phase:
            self.profile[phase] = self.profile.get(phase, 0.0) + now - self._t
        self._t = now

    def head_layer_shape(self) -> tuple[int, int, object, int]:
        """(kv_heads, head_dim, dtype) of one row of the head's own KV cache, and the
        hidden size."""
        cache = KVCache()
        x = self.unknown_hidden()
        self.head(x, x, cache)
        keys = cache.state[0]
        return int(keys.shape[1]), int(keys.shape[3]), keys.dtype, int(x.shape[-1])

    def unknown_hidden(self) -> mx.array:
        """The hidden state a pair gets where the model's was not kept: zeros [1, 1, H]
        (the head's RMSNorm of it is zero: the pair is its token's embedding alone)."""
        return mx.zeros((1, 1, self.trunk.args.hidden_size),
                        self.trunk.embed(mx.array([0])).dtype)

    def draft_logits(self, g: mx.array) -> mx.array:
        if self._draft_head is None:
            return self.trunk.logits(g)
        (w, scales, biases), bits = self._draft_head
        return mx.quantized_matmul(g, w, scales, biases, transpose=True, group_size=DRAFT_GROUP,
                                   bits=bits)

    # -- the head's pairs ------------------------------------------------------------------

    def _fold(self, state: MTPState, hidden: mx.array | None = None, tokens=()) -> mx.array | None:
        """Pend `hidden`'s rows, then fold every pending row whose next token is known
        (`state.tokens` + `tokens`, in order) into the head's cache; the head's outputs for
        the folded rows (None if none)."""
        pend = state.hidden
        if hidden is not None:
            pend = hidden if pend is None else mx.concatenate([pend, hidden], axis=1)
        known = state.tokens + list(tokens)
        n, out = len(known), None
        if n:
            out = self.head(pend[:, :n], self.trunk.embed(mx.array([known])), state.cache)
        state.hidden = pend[:, n:] if pend is not None and pend.shape[1] > n else None
        state.tokens = []
        return out

    def _prefill(self, prompt: list[int], cache, state: MTPState) -> mx.array:
        """The trunk over the prompt (all but its last token in chunks, then the last alone,
        as mlx-lm's generate_step does), the head over the pairs it completes; returns the
        last token's hidden [1, 1, H], left pending (its next token is not drawn yet)."""
        if state.hidden is not None and len(state.tokens) < state.hidden.shape[1]:
            state.tokens = state.tokens + prompt[:1]  # a finished turn's last pair
        rest = prompt[:-1]
        for i in range(0, len(rest), PREFILL_STEP):
            chunk = rest[i:i + PREFILL_STEP]
            h = self.trunk.hidden(mx.array([chunk]), cache)
            self._fold(state, h, prompt[i + 1:i + 1 + len(chunk)])
            mx.eval([c.state for c in cache], state.cache.state)
        h = self.trunk.hidden(mx.array([prompt[-1:]]), cache)
        self._fold(state, h)
        return h

    # -- decoding -------------------------------------------------------------------------

    def generate(self, prompt: list[int], sampling: Sampling, *, max_tokens: int,
                 stop_tokens=(), cache=None, state: MTPState | None = None
                 ) -> Iterator[tuple[int, mx.array]]:
        """Yield (token, logprobs [V]) like mlx-lm's generate_step, for up to max_tokens,
        ending at (and with) a stop token. `cache` and `state` (of a turn ended by `finish`)
        continue a conversation; the processors read the tokens of this call, as mlx-lm's."""
        if not prompt or max_tokens < 1:
            raise ValueError("an empty prompt or no tokens to generate")
        cache = make_prompt_cache(self.model) if cache is None else cache
        state = MTPState() if state is None else state
        history = list(prompt)
        h = self._prefill(history, cache, state)
        rows = [mx.array(history)] if sampling.processors else None
        lp = sampling.logprobs(self.trunk.logits(h[:, -1]), rows)
        y = sampling.choose(lp)
        mx.eval(y, lp)
        y = int(y.item())
        state.tokens = [y]
        yield y, lp[0]
        emitted, stop = 1, set(stop_tokens)
        spec = Speculation(self.kinds, cache)
        while emitted < max_tokens and y not in stop:
            out = self._round(y, history, sampling, cache, state, spec, max_tokens - emitted, stop)
            yield from out
            emitted += len(out)
            history.append(y)
            history.extend(t for t, _ in out[:-1])
            y = out[-1][0]

    def _round(self, y: int, history: list[int], sampling: Sampling, cache, state: MTPState,
               spec: Speculation, budget: int, stop: set) -> list[tuple[int, mx.array]]:
        out = self.speculate(y, history, sampling, cache, state, spec, budget, stop)
        self.settle(state, spec, len(out))
        return out

    def speculate(self, y: int, history: list[int] | None, sampling: Sampling, cache,
                  state: MTPState, spec: Speculation, budget: int, stop
                  ) -> list[tuple[int, mx.array]]:
        """One round up to the tokens it gives (1..depth+1, cut after a stop token or at the
        budget), each with the trunk's logprobs. The caches stay speculative until `settle`
        says how many of them the caller keeps (a stop string may end the answer sooner).
        `history`: the tokens before y, read by the processors (None without them)."""
        k = self.depth
        self._tick("")
        procs = bool(sampling.processors)
        base = mx.array(history + [y]) if procs else None  # the tokens up to y
        # Draft: fold the pending pairs, the last one predicts d1; then chain.
        g = self._fold(state)[:, -1:]
        drafts, q_rows = [], []
        for j in range(k):
            hist = [mx.concatenate([base] + drafts)] if procs else None
            lp = sampling.logprobs(self.draft_logits(g[:, 0]), hist)
            d = sampling.choose(lp)
            drafts.append(d)
            if not sampling.greedy:
                q_rows.append(sampling.probs(lp))
            if j + 1 < k:
                g = self.head(g, self.trunk.embed(d[None]), state.cache)
        self._tick("draft", *drafts, *q_rows)
        # Verify [y, d1..dk] in one forward, keeping what the rollback needs.
        fed = mx.concatenate([mx.array([y])] + drafts)
        with spec.recording(k + 1), few_rows.verifying():
            hidden = self.trunk.hidden(fed[None], cache)
        rows = ([mx.concatenate([base] + drafts[:j]) for j in range(k + 1)] if procs else None)
        p_lp = sampling.logprobs(self.trunk.logits(hidden[0]), rows)
        q = mx.concatenate(q_rows, axis=0) if q_rows else None
        targets = mx.argmax(p_lp, axis=-1) if sampling.greedy else None
        mx.eval(fed, p_lp, q, targets)
        self._tick("verify")
        d_list = fed[1:].tolist()
        a, z = sampling.accept(d_list, None if q is None else np.asarray(q, np.float64), p_lp,
                               None if targets is None else targets.tolist())
        self.stats.rounds += 1
        self.stats.drafted += k
        self.stats.accepted += a
        self.stats.kept[a] += 1
        for j in range(a):
            self.stats.accepted_at[j] += 1
        # A stop token or the token budget inside the round ends it there.
        out = d_list[:a] + [z]
        for i, t in enumerate(out):
            if t in stop or i + 1 == budget:
                out = out[:i + 1]
                break
        state.verified = (hidden, out)
        self._tick("accept")
        return [(t, p_lp[i]) for i, t in enumerate(out)]

    def settle(self, state: MTPState, spec: Speculation, n: int) -> None:
        """Keep the first n tokens `speculate` gave: the trunk's caches hold [y, t1..t(n-1)]
        (all but the last one kept, as between plain decoding's steps); the head drops its
        speculative pairs and pends the true ones, (H_0, t1) .. (H_(n-1), tn)."""
        hidden, out = state.verified
        state.verified = None
        spec.keep(n)
        state.cache.trim(self.depth - 1)
        state.hidden, state.tokens = hidden[:, :n], out[:n]
        self._tick("rollback", [c.state for c in spec.cache], state.hidden)

    # -- serving: the scheduler's forwards with the head kept current -------------------------

    def read(self, tokens: list[int], next_tokens: list[int], cache, state: MTPState
             ) -> mx.array:
        """The trunk over `tokens` (a prompt chunk, or plain decoding's one token), the head
        over every pair it completes (`next_tokens`: the tokens after them, as far as known;
        the rest pend); the hidden states [1, T, H] (`Trunk.logits` gives mlx-lm's logits)."""
        h = self.trunk.hidden(mx.array([tokens]), cache)
        self._fold(state, h, next_tokens)
        return h

    def fold(self, state: MTPState, hidden: mx.array) -> None:
        """Pend `hidden` [1, T, H] (mlx-lm's batch's steps: worker/compute/mtp/serving.py
        BatchHistory) and fold every pair whose next token is known into the head's cache."""
        self._fold(state, hidden)
        mx.eval(state.cache.state, state.hidden)

    def finish(self, last: int, cache, state: MTPState) -> None:
        """End a turn as kvbank commits one: the last emitted token goes into the trunk's
        caches too (its hidden waits for the next turn's first token)."""
        h = self.trunk.hidden(mx.array([[last]]), cache)
        self._fold(state, h)
        mx.eval([c.state for c in cache], state.cache.state, state.hidden)
