"""The worker's start, said as it goes: a line as each step begins and one with its seconds as
it ends, and progress lines every few seconds through a long one. A start of 45 s that printed
nothing between "model loaded" and "memory budget" looked hung.

The memory calibration (worker/memory/pricing.py `calibrate`: five prefill chunks; the warm-up's
request, whose leftovers are part of the fixed bytes) is kept on disk per model fingerprint
and chunk size (`CalibrationFile`, in kvbank's cache beside the imported models: it is the
model's and the machine's, not one deployment's), so a restart, after a crash too, serves as
soon as the model is loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path

from kvbank.heap import resident_bytes
from kvbank.worker.memory.pricing import CALIBRATION_CHUNKS, CALIBRATION_METHOD

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 2.0


class Progress:
    """`tick(done, total)` in a long step: a line at most every PROGRESS_EVERY_S."""

    def __init__(self, what: str, log: logging.Logger = logger):
        self.what, self.t0, self.log = what, time.monotonic(), log
        self._said = self.t0

    def tick(self, done: int, total: int, unit: str = "") -> None:
        now = time.monotonic()
        if now - self._said >= PROGRESS_EVERY_S:
            self._said = now
            self.log.info("%s: %d of %d%s (%.0f s)", self.what, done, total,
                          f" {unit}" if unit else "", now - self.t0)


@contextlib.contextmanager
def step(what: str, log: logging.Logger = logger):
    """One step of the start: `what ...` as it begins, `what: N s` as it ends (in `log`, the
    stepping module's logger)."""
    log.info("%s ...", what)
    progress = Progress(what, log)
    yield progress
    log.info("%s: %.1f s", what, time.monotonic() - progress.t0)


class CalibrationFile:
    """The memory calibration of one model (by fingerprint) at one prefill chunk size, on one
    MLX build and device: written once measured, read at every later start. A file that does
    not parse or names other settings is measured again (and replaced)."""

    def __init__(self, cache_dir: Path, fingerprint: bytes, chunk_tokens: int,
                 head: bool = False):
        """`cache_dir`: kvbank's (kvbank/models.py `default_cache_dir`). `head`: the model
        decodes with its MTP head, whose weights and layer change what a forward holds (the
        fingerprint leaves the head out: `CacheKinds.model_layout`)."""
        import mlx.core as mx

        self.path = (cache_dir / "calibration"
                     / f"{fingerprint.hex()[:24]}-{'mtp-' if head else ''}"
                       f"chunk{chunk_tokens}.json")
        self.key = {"fingerprint": fingerprint.hex(), "chunk_tokens": chunk_tokens,
                    **({"mtp": True} if head else {}),
                    "mlx": mx.__version__, "device": str(mx.default_device()),
                    "method": CALIBRATION_METHOD}

    def read(self) -> dict | None:
        """{"transient_base", "transient_per_context_token", "warm_up_bytes"} or None."""
        try:
            got = json.loads(self.path.read_text())
            if got.get("key") == self.key:
                return {"transient_base": int(got["transient_base"]),
                        "transient_per_context_token": float(got["transient_per_context_token"]),
                        "warm_up_bytes": int(got["warm_up_bytes"])}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return None

    def write(self, transient_base: int, transient_per_context_token: float,
              warm_up_bytes: int) -> None:
        """Atomically (a crash mid-write leaves the old file, or none)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({
                "key": self.key, "transient_base": transient_base,
                "transient_per_context_token": transient_per_context_token,
                "warm_up_bytes": warm_up_bytes, "at": time.time()}))
            tmp.replace(self.path)
        except OSError as e:  # a read-only cache: measured again at the next start
            logger.warning("could not keep the memory calibration in %s: %s", self.path, e)


def measured(pricing, file: CalibrationFile, *, calibrate, warm_up):
    """`pricing` with a prefill chunk's transient bytes (`calibrate(pricing, on_chunk)`, five
    chunks) and its fixed bytes: the process now, with what a first request leaves behind
    (`warm_up()`, one request). Both are read from `file` when an earlier start of this
    model at this chunk size measured them, else measured now and kept there."""
    kept = file.read()
    if kept is not None:
        pricing.transient_base = kept["transient_base"]
        pricing.transient_per_context_token = kept["transient_per_context_token"]
        pricing.fixed_bytes = resident_bytes() + kept["warm_up_bytes"]
        logger.info("memory calibration read from %s (measured at an earlier start)",
                    file.path)
        return pricing
    with step(f"calibrating memory: {CALIBRATION_CHUNKS} prefill chunks of "
              f"{pricing.chunk_tokens} tokens") as progress:
        calibrate(pricing, lambda i: progress.tick(i, CALIBRATION_CHUNKS, "chunks"))
    before = resident_bytes()
    with step("warming up: one request of two prefill chunks"):
        warm_up()
    pricing.fixed_bytes = resident_bytes()
    file.write(pricing.transient_base, pricing.transient_per_context_token,
               max(0, pricing.fixed_bytes - before))
    return pricing
