"""The worker's speculative decoding: whether a served model decodes with its MTP head
(`--mtp auto|off`, `--mtp-depth N`), and what one request's speculation carries.

At start `load_mtp` reads the head (kvbank/mtp_head.py) and checks that every cache of the
model can be rolled back after a rejected draft (worker/kv: the cache-kind seam); any reason
it cannot is logged and the model is served without MTP, never wrong and never silently.

The head's history is part of the conversation: the cache kinds get its attention layer (a
row a token, worker/kv/kinds.py HeadKind) and the model's hidden state it pairs with the next
token (HiddenKind, kept at checkpoints) before the model is measured and fingerprinted, so
both are counted, evicted, written to SSD and restored with the rest
(`CacheKinds.add_head`).

Which requests speculate (the scheduler asks `MTP.run_for`): a request with no logits
processors (penalties, logit_bias and grammars run in mlx-lm's BatchGenerator, where a
processor that keeps state, a grammar's matcher, would be stepped by drafts that are then
rejected: those requests decode plainly, and exactly as without MTP). A request on its own
cache speculates while it decodes alone. Beside other answers on their own caches (each
runs its own forwards there), each step it drafts or takes one token, whichever has cost it
less a token so far (`Pace`: measured as it runs, each way tried until it is measured, and
the other tried again now and then); either way its head's history is kept current. A
request in mlx-lm's batch decodes plainly, its head's history kept there too (`BatchTap`,
`BatchHistory`); left alone in the batch, it goes back to its own cache and drafts again
(the scheduler's `_leave_alone`), and its next turn drafts as if it had decoded alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kvbank.mtp_head import read_head
from kvbank.worker.compute.mtp.decode import MAX_DEPTH, MTPDecoder, MTPState
from kvbank.worker.compute.mtp.sampling import Sampling
from kvbank.worker.kv.rollback import RollbackUnsupported, Speculation

logger = logging.getLogger(__name__)

MODES = ("auto", "off")
DEFAULT_DEPTH = 2
PACE_WEIGHT = 0.25  # of the newest step in a `Pace` average
PACE_RETRY = 16  # steps taken one way before the other is measured again
FOLD_EVERY = 64  # batch steps a request's pairs wait before its head folds them
LEAVE_TOKENS = 8  # an answer left alone in the batch with fewer to go stays there


@dataclass
class Pace:
    """What a token has cost one request on its own cache, drafting (a speculative round's
    seconds over the tokens it gave) and not (one forward's seconds), each an exponential
    average; beside other answers, the scheduler takes the cheaper (`speculates`). Each way is
    tried until it has a figure, and after PACE_RETRY steps one way the other is tried once, so
    a figure that has gone stale (a longer context, a head that drafts worse here) is taken
    again."""

    draft_s: float | None = None
    plain_s: float | None = None
    _run: int = 0  # steps taken the same way in a row
    _last: bool | None = None

    def speculates(self) -> bool:
        if self.draft_s is None or self.plain_s is None:
            choice = self.draft_s is None
        else:
            choice = self.draft_s < self.plain_s
            if self._last == choice and self._run >= PACE_RETRY:
                choice = not choice
        self._run = self._run + 1 if choice == self._last else 1
        self._last = choice
        return choice

    def drafted(self, seconds: float, tokens: int) -> None:
        self.draft_s = _average(self.draft_s, seconds / max(1, tokens))

    def plain(self, seconds: float) -> None:
        self.plain_s = _average(self.plain_s, seconds)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + PACE_WEIGHT * (new - old)


@dataclass
class MTPRun:
    """One request's speculation: the head's history, its verifies' rollback, its sampling
    (the speculative-sampling rule's), and what it drafted and kept."""

    state: MTPState
    spec: Speculation
    sampling: Sampling
    drafted: int = 0
    accepted: int = 0
    pace: Pace = field(default_factory=Pace)


class BatchTap:
    """The model as mlx-lm's BatchGenerator runs it, keeping the hidden states of each
    one-token forward (its decode steps) since the scheduler last took them. Its logits are
    the model's own: `Trunk.hidden` then `Trunk.logits` are mlx-lm's forward, op for op."""

    def __init__(self, model, trunk):
        self._model, self._trunk = model, trunk
        self.steps: list = []  # hidden states [B, 1, H] of each one-token forward, in order

    def __call__(self, inputs, cache=None):
        h = self._trunk.hidden(inputs, cache)
        if inputs.shape[1] == 1:
            self.steps.append(h)
        return self._trunk.logits(h)

    def __getattr__(self, name):  # what else mlx-lm asks of the model (its layers, caches)
        return getattr(self._model, name)


@dataclass
class BatchHistory:
    """One request's head history while mlx-lm's batch decodes it: its `MTPState` (the head's
    cache, and the pairs pending) and the batch's hidden states [1, 1, H] not pended yet.
    Each step adds the token the batch fed and the hidden state after it; the head folds the
    pairs every FOLD_EVERY steps and when the request leaves the batch."""

    state: MTPState
    max_tokens: int  # its answer's, for its way back to its own cache (the scheduler's)
    hidden: list = field(default_factory=list)

    def step(self, fed: int | None, hidden) -> None:
        """A batch step: `fed`, the token it fed (None for a join's first step, whose token
        the state already holds), and `hidden`, the hidden state after it."""
        if fed is not None:
            self.state.tokens.append(fed)
        self.hidden.append(hidden)

    def fold(self, decoder: MTPDecoder, *, every: int = 1) -> None:
        """The head over every pair whose next token is known, once `every` hidden states
        wait; the last one stays pending (its next token is not fed yet)."""
        if len(self.hidden) < every:
            return
        import mlx.core as mx

        hidden, self.hidden = mx.concatenate(self.hidden, axis=1), []
        decoder.fold(self.state, hidden)


class MTP:
    """The served model's head and decoder (one per worker)."""

    def __init__(self, decoder: MTPDecoder):
        self.decoder = decoder
        self.depth = decoder.depth

    def run_for(self, request, cache, processors, first: int) -> MTPRun | None:
        """A speculation for a request that can have one (see the module docstring). Its
        head's history is the conversation's (the head's cache in `cache`, as restored: one
        row per token before `first`, the first token the request reads, and the model's hidden
        state before `first`, kept with the checkpoint it was restored at; zero where none
        was kept)."""
        if processors:
            return None
        s = request.sampling
        sampling = Sampling(temperature=s.temperature, top_p=s.top_p, min_p=s.min_p,
                            top_k=s.top_k, seed=s.seed if s.HasField("seed") else None)
        dec = self.decoder
        hidden = dec.kinds.kept_hidden(cache)
        state = MTPState(cache=dec.kinds.head_cache(cache),
                         hidden=hidden if hidden is not None else dec.unknown_hidden(),
                         tokens=[first])
        return MTPRun(state, Speculation(dec.kinds, cache), sampling)


def load_mtp(model, model_dir: Path, kinds, *, mode: str = "auto", depth: int = DEFAULT_DEPTH,
             sidecar: Path | None = None) -> tuple[MTP | None, str]:
    """The served model's MTP, or None, with the start log's line saying which and why."""
    if mode not in MODES:
        raise ValueError(f"--mtp {mode!r}: one of {', '.join(MODES)}")
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"--mtp-depth {depth}: 1..{MAX_DEPTH}")
    if mode == "off":
        return None, "MTP off (--mtp off)"
    got = read_head(model, model_dir, sidecar)
    if got.head is None:
        return None, got.message
    why = kinds.rewindable()
    if why:
        return None, f"MTP off: {why}"
    try:
        decoder = MTPDecoder(model, got.head, depth, kinds=kinds)
    except RollbackUnsupported as e:
        return None, f"MTP off: {e}"
    kinds.add_head(*decoder.head_layer_shape())  # its history: a layer of every cache
    return MTP(decoder), f"MTP on: depth {depth}; {got.message}"
