"""The model the worker serves: its weights and tokenizer, its cache kinds and their sizes,
and the fingerprint that keeps its KV apart from every other model's."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from kvbank.worker.compute import few_rows
from kvbank.worker.compute.mtp.serving import DEFAULT_DEPTH, load_mtp
from kvbank.worker.kv import codec
from kvbank.worker.kv.cache_kinds import CHECKPOINT_EVERY, CacheKinds, UnsupportedModel

logger = logging.getLogger(__name__)


@dataclass
class ServedModel:
    path: Path
    model: object
    tokenizer: object
    config: dict
    kinds: CacheKinds
    kv_bytes_per_token: int  # full-attention caches' K and V, as a request holds them
    checkpoint_bytes: int  # window and recurrent caches at one position, at their largest
    kv_dtype: str
    fingerprint: bytes
    kv_rest_bytes_per_token: int = 0  # as the bank and SSD hold them (--kv-bits: quantized)
    kv_bits: int | None = None
    mtp: object = None  # worker/compute/mtp/serving.py MTP, when the model drafts with its head
    mtp_message: str = ""

    @property
    def max_context_tokens(self) -> int:
        return int(self.config.get("max_position_embeddings", 8192))

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or len(self.tokenizer.vocab))

    def checkpoint_every(self, tokens: int | None, block_tokens: int) -> int:
        """Tokens between a long prompt's checkpoints, on block ends (a checkpoint there goes
        to SSD with its block). None: every 2048 tokens, or further apart where one
        checkpoint would outweigh a quarter of the KV between two of them (a Qwen3.6-27B
        checkpoint is ~150 MiB: ~9.6K tokens)."""
        if tokens is None:
            tokens = CHECKPOINT_EVERY
            if self.kv_bytes_per_token:
                tokens = max(tokens, 4 * self.checkpoint_bytes // self.kv_bytes_per_token)
        return -(-tokens // block_tokens) * block_tokens


def load_served_model(path: Path, block_tokens: int, kv_bits: int | None = None, *,
                      mtp: str = "off", mtp_depth: int = DEFAULT_DEPTH,
                      mtp_head: Path | None = None) -> ServedModel:
    """Load and measure; UnsupportedModel for a cache kind kvbank cannot restore exactly
    (or, with `kv_bits`, a head_dim it cannot quantize). `mtp`: `--mtp`; the head, when it
    runs, is read first: its KV is a layer of every cache, measured and fingerprinted."""
    from mlx_lm import load

    t0 = time.monotonic()
    logger.info("loading the model %s ...", path)
    model, tokenizer = load(str(path))
    config = json.loads((path / "config.json").read_text())
    kinds = CacheKinds(model, model_type(config), kv_bits)
    if n := few_rows.install(model):
        logger.info("%d linear layers multiply a few rows as (W @ x.T).T, where it keeps their "
                    "bits (a CPU; OpenBLAS on %d threads: worker/compute/few_rows.py)", n,
                    few_rows.openblas_threads())
    head, message = load_mtp(model, path, kinds, mode=mtp, depth=mtp_depth, sidecar=mtp_head)
    logger.info("%s", message)
    try:
        per_token, checkpoint, dtype = kinds.measure()
    except ValueError as e:  # a head_dim --kv-bits cannot quantize
        raise UnsupportedModel(str(e)) from None
    served = ServedModel(path, model, tokenizer, config, kinds, per_token, checkpoint, dtype,
                         fingerprint(path, config, kinds, dtype, kinds.model_bytes_per_token,
                                     block_tokens),
                         kinds.rest_bytes_per_token, kv_bits, head, message)
    logger.info("model %s loaded in %.1fs: %d KV bytes/token (%d at rest%s), %d bytes a "
                "checkpoint (%s), caches %s, fingerprint %s", path, time.monotonic() - t0,
                per_token, served.kv_rest_bytes_per_token,
                f", --kv-bits {kv_bits}" if kv_bits else "", checkpoint, dtype, kinds.layout,
                served.fingerprint.hex()[:12])
    return served


def fingerprint(path: Path, config: dict, kinds: CacheKinds, dtype: str, per_token: int,
                block_tokens: int) -> bytes:
    """Nothing restores across model, weights, KV dtype, cache kinds, block size or
    --kv-bits (a block's header names its bits too: never read as another setting).
    `per_token`: the model's own caches' bytes a token. The MTP head's history is not in it
    (`CacheKinds.model_layout`): with --mtp on or off a conversation's blocks are the same
    ids, and each reader keeps the layers it has slots for (worker/kv/codec.py)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(config, sort_keys=True).encode())
    for f in sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
    h.update(f"{dtype}:{per_token}:{block_tokens}".encode())
    h.update(codec.BLOCK_LAYOUT.encode())
    if kinds.checkpointed:  # a full-attention model's stores from before still read
        h.update(f"caches:{kinds.model_layout}".encode())
    if kinds.quantized:  # full precision's fingerprint is as it was: its stores still read
        h.update(kinds.quantized.encode())
    return h.digest()


def model_type(config: dict) -> str:
    return str(config.get("model_type") or config.get("text_config", {}).get("model_type", "?"))
