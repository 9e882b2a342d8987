"""Restore: a request's own cache over the longest prefix kvbank holds, from the RAM bank or
from SSD, whichever covers more (engine thread)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from kvbank.blocks import BlockId, tail_block_id
from kvbank.contracts.store_layout import StoreReader
from kvbank.v1 import api_pb2
from worker import kv
from worker.bank import BankEntry, SessionBank, SessionKey
from worker.link import ColdstoreClient

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 3.0
RAM = api_pb2.CACHE_SOURCE_RAM


class Restorer:
    def __init__(self, *, model, bank: SessionBank, client: ColdstoreClient, store_dir: Path,
                 root_for, block_tokens: int, restore_via: str = "direct"):
        self.model, self.bank, self.client = model, bank, client
        self.store_dir = store_dir
        self.root_for = root_for
        self.block_tokens = block_tokens
        self.restore_via = restore_via
        self._store: StoreReader | None = None

    def store(self) -> StoreReader | None:
        """The store, read-only (the coldstore is its only writer); None until it exists."""
        if self._store is None and (self.store_dir / "data.mdb").exists():
            try:
                self._store = StoreReader(self.store_dir, readonly=True)
            except Exception as e:
                logger.warning("cannot open the store read-only yet: %s", e)
        return self._store

    def restore(self, tokens: np.ndarray, ids: list[BlockId], tenant: str,
                session: SessionKey, no_cache: bool) -> tuple[list, int, int, BankEntry | None]:
        """The request's own cache over the longest known prefix: (cache, tokens, source, the
        bank entry handed over to it, which its commit supersedes or its failure gives back)."""
        from mlx_lm.models.cache import make_prompt_cache

        none = (make_prompt_cache(self.model), 0, api_pb2.CACHE_SOURCE_NONE, None)
        if no_cache:
            return none
        limit = len(tokens) - 1  # leave one token to compute: its logits give the next token
        hit = self.bank.lookup(tokens, tenant, ids)
        ram_n = min(hit.n_tokens, limit) if hit else 0
        # SSD can only add when RAM leaves something to restore: skip its reads.
        # Room for the rest of the prompt and the first answer tokens (as a cache grows): the
        # request appends in place to the arrays it reads from SSD, no second copy.
        ssd = (self.ssd_prefix(tokens, ids, tenant, session, better_than=ram_n,
                               capacity=kv.capacity(len(tokens)))
               if ram_n < limit else None)
        if ssd is not None:
            layers, n = ssd
            n = min(n, limit)
            return kv.restore(layers, n, owned=True), n, api_pb2.CACHE_SOURCE_SSD, None
        if ram_n > 0:
            e = hit.entry
            self.bank.touch(e)
            if e.session == session and ram_n == e.n_tokens:
                # The conversation's next turn: its KV goes with the request, which writes its
                # new tokens in place when the buffer has room (no copy of the history).
                self.bank.hand_over(e)
                return kv.restore(e.layers, ram_n, owned=True), ram_n, RAM, e
            return kv.restore(e.layers, ram_n), ram_n, RAM, None
        return none

    def held(self, tokens: np.ndarray, ids: list[BlockId], tenant: str) -> tuple[int, int]:
        """How much of `tokens` RAM and LMDB hold (whole blocks on SSD), nothing restored."""
        hit = self.bank.lookup(tokens, tenant, ids)
        store = self.store()
        n_full = 0
        while store is not None and n_full < len(ids) and store.has_block(ids[n_full]):
            n_full += 1
        return (hit.n_tokens if hit else 0), n_full * self.block_tokens

    def ssd_prefix(self, tokens: np.ndarray, ids: list[BlockId], tenant: str,
                    session: SessionKey, better_than: int,
                    capacity: int = 0) -> tuple[kv.Layers, int] | None:
        """The longest prefix whose blocks are committed in LMDB, if it beats `better_than`
        (arrays with room for `capacity` tokens; 0: tight)."""
        store = self.store()
        if store is None:
            return None
        B = self.block_tokens
        root = self.root_for(tenant)
        n_full = 0
        while n_full < len(ids) and store.has_block(ids[n_full]):
            n_full += 1
        want = list(ids[:n_full])
        n = n_full * B
        got = store.get_session(*session)
        if got is not None:
            meta = got[0]
            if meta.tail and len(meta.blocks) == n_full and len(tokens) >= n + meta.tail_tokens:
                parent = ids[n_full - 1] if n_full else root
                if tail_block_id(parent, tokens[n : n + meta.tail_tokens]).hex() == meta.tail:
                    want.append(BlockId(bytes.fromhex(meta.tail)))
                    n += meta.tail_tokens
        if min(n, len(tokens) - 1) <= better_than:
            return None
        layers = self._read_blocks(store, want, capacity)
        if layers is None:  # collected since we looked: fall back
            return None
        return layers, n

    def _read_blocks(self, store: StoreReader, ids: list[BlockId],
                     capacity: int = 0) -> kv.Layers | None:
        """The blocks' KV: decoded straight from the read-only LMDB map (zero-copy; the
        default, `kvbank bench coldstore` measured it faster), or fetched through the coldstore
        process. None when a block is missing."""
        if self.restore_via == "direct":
            return store.get_blocks(ids, decode=lambda views: kv.decode_blocks(views, capacity))
        frames = self.client.get_blocks([bytes(b) for b in ids], timeout_s=READ_TIMEOUT_S)
        if len(frames) != len(ids) or not all(len(f) for f in frames):
            return None
        return kv.decode_blocks(frames, capacity)
