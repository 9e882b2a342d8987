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
rejected: those requests decode plainly, and exactly as without MTP). A request speculates
only while it decodes alone, on its own cache; while others decode beside it, it takes one
token a step as before, its head's history kept current, and speculates again when it is
alone. A request that joins mlx-lm's batch decodes plainly to its end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from kvbank.mtp_head import read_head
from kvbank.worker.compute.mtp.decode import MAX_DEPTH, MTPDecoder, MTPState
from kvbank.worker.compute.mtp.sampling import Sampling
from kvbank.worker.kv.rollback import RollbackUnsupported, Speculation

logger = logging.getLogger(__name__)

MODES = ("auto", "off")
DEFAULT_DEPTH = 2


@dataclass
class MTPRun:
    """One request's speculation: the head's history, its verifies' rollback, its sampling
    (the speculative-sampling rule's), and what it drafted and kept."""

    state: MTPState
    spec: Speculation
    sampling: Sampling
    drafted: int = 0
    accepted: int = 0


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
