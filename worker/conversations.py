"""The conversations the worker knows: their records (token history, durable extent) and the
content index that finds an unnamed one by its tokens (worker/lineage.py). Engine thread
only; `records` is replaced whole on every change, so a snapshot may share it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import numpy as np

from kvbank.blocks import BlockId
from kvbank.contracts.store_layout import StoreReader
from worker.commands import SessionInfo, SessionKey
from worker.lineage import Lineages, is_anonymous

logger = logging.getLogger(__name__)


class Conversations:
    def __init__(self, *, root_for: Callable[[str], BlockId], block_tokens: int):
        self.records: dict[SessionKey, SessionInfo] = {}
        self.lineages = Lineages(root_for=root_for, block_tokens=block_tokens)
        self._deleted_at: dict[SessionKey, float] = {}  # deleted while a turn ran on it

    def load(self, store: StoreReader | None) -> None:
        """Every record in the store, and the index of the unnamed ones (at start)."""
        if store is None:
            return
        records = {}
        for meta in store.list_sessions():
            got = store.get_session(meta.tenant, meta.session_id)
            if got is not None:
                meta, toks = got
                records[(meta.tenant, meta.session_id)] = SessionInfo(
                    toks.copy(), meta.durable_tokens, meta.created_at, meta.updated_at)
        self.records = records
        self.lineages.rebuild((k, i.tokens) for k, i in records.items())
        logger.info("loaded %d session records from the store (%d anonymous)", len(records),
                    len(self.lineages))

    def get(self, key: SessionKey) -> SessionInfo | None:
        return self.records.get(key)

    def __contains__(self, key: SessionKey) -> bool:
        return key in self.records

    def resolve(self, tokens: np.ndarray, ids: list[BlockId], tenant: str, name: str, *,
                busy: Callable[[SessionKey], bool],
                in_ram: Callable[[SessionKey], bool]) -> SessionKey:
        """The conversation a request continues: its name, else the idle one its tokens
        extend, else a new anonymous one."""
        if name:
            return (tenant, name)
        found = self.lineages.find(tokens, ids, tenant, self.records, busy)
        if found is not None:
            return found
        return (tenant, self.lineages.new_id(
            tokens, tenant, lambda k: k in self.records or in_ram(k) or busy(k)))

    def set(self, key: SessionKey, info: SessionInfo | None) -> None:
        records = dict(self.records)
        if info is None:
            records.pop(key, None)
        else:
            records[key] = info
        self.records = records

    def committed(self, key: SessionKey, tokens: np.ndarray, durable_tokens: int,
                  recorded: bool, block_ids: list[BlockId]) -> None:
        """A turn's full history is the conversation's record now."""
        now = time.time()
        old = self.records.get(key)
        self.set(key, SessionInfo(tokens, durable_tokens, old.created_at if old else now, now,
                                  recorded=recorded))
        if is_anonymous(key[1]):
            self.lineages.set(key, len(tokens), block_ids)

    def durable(self, key: SessionKey, durable_tokens: int, lowered: bool = False) -> None:
        """The coldstore committed up to `durable_tokens` (or, `lowered`, took some back)."""
        info = self.records.get(key)
        if info is not None and (durable_tokens > info.durable_tokens or lowered):
            self.set(key, replace(info, durable_tokens=durable_tokens))

    def deleted(self, key: SessionKey, while_running: bool) -> None:
        if while_running:  # its running turn must not bring it back
            self._deleted_at[key] = time.monotonic()
        self.lineages.drop(key)
        self.set(key, None)

    def deleted_since(self, key: SessionKey, started: float) -> bool:
        """The conversation was deleted after a turn started on it: the turn is answered, not
        kept."""
        if self._deleted_at.get(key, -1.0) >= started:
            self._deleted_at.pop(key, None)
            return True
        return False

    def retired(self, key: SessionKey, removed: str, at: float, kept: int = 0) -> bool:
        """The coldstore retired this conversation's KV (an anonymous one's whole record), or
        all of it past `kept` tokens (a corrupt block). A turn committed since then keeps it.
        True when the record changed."""
        info = self.records.get(key)
        if info is None or info.updated_at > at:
            return False
        if removed == "record":
            self.lineages.drop(key)
            self.set(key, None)
        else:
            self.set(key, replace(info, durable_tokens=min(kept, info.durable_tokens)))
        return True
