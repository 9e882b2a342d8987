"""The conversations the worker knows: their records (length, durable extent) and the content
index that finds an unnamed one by its tokens (worker/tiers/lineage.py). Engine thread only;
`records` is replaced whole on every change, so a snapshot may share it.

A record holds no history the store has: a store holds many conversations of 80-100K tokens,
4 bytes a token each. `history` reads it from the bank entry while the conversation is in RAM,
else from LMDB (the coldstore commits a record before the turn is answered); the record keeps
the tokens itself only while the store may lack them (the coldstore did not answer), and an
anonymous one keeps the short tail its lineage check compares.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import replace
from typing import Callable

import numpy as np

from kvbank.blocks import BlockId, chain_block_ids
from kvbank.contracts.store_layout import StoreReader
from kvbank.worker.commands import SessionInfo, SessionKey
from kvbank.worker.tiers.lineage import Lineages, is_anonymous

logger = logging.getLogger(__name__)


class Conversations:
    def __init__(self, *, root_for: Callable[[str], BlockId], block_tokens: int,
                 store: Callable[[], StoreReader | None] = lambda: None):
        """`store`: the worker's read-only view (one process opens an LMDB env once)."""
        self.root_for, self.block_tokens, self._store = root_for, block_tokens, store
        self.records: dict[SessionKey, SessionInfo] = {}
        self.lineages = Lineages(root_for=root_for, block_tokens=block_tokens)
        self._deleted_at: dict[SessionKey, float] = {}  # deleted while a turn ran on it

    def load(self) -> None:
        """Every record in the store, and the index of the unnamed ones (at start)."""
        store = self._store()
        if store is None:
            return
        records = {}
        self.lineages.clear()
        for meta in store.list_sessions():
            got = store.get_session(meta.tenant, meta.session_id)
            if got is None:
                continue
            meta, toks = got
            key, tail = (meta.tenant, meta.session_id), None
            if is_anonymous(key[1]):
                self.lineages.set(key, len(toks), chain_block_ids(
                    toks, self.root_for(key[0]), self.block_tokens))
                tail = toks[self.lineages.anchor_at(len(toks)):].copy()
            records[key] = SessionInfo(len(toks), meta.durable_tokens, meta.created_at,
                                       meta.updated_at, tail=tail)
        self.records = records
        logger.info("loaded %d session records from the store (%d anonymous)", len(records),
                    len(self.lineages))

    def get(self, key: SessionKey) -> SessionInfo | None:
        return self.records.get(key)

    def history(self, key: SessionKey):
        """The conversation's committed tokens (np.ndarray), or None: RAM's (`history_in_ram`),
        else the store's (None when the coldstore retired the record and its word is on the
        way). Engine thread: LMDB is read here only (commands.History)."""
        info = self.records.get(key)
        if info is None:
            return None
        tokens = history_in_ram(info)
        if tokens is not None:
            return tokens
        store = self._store()
        got = store.get_session(*key) if store is not None else None
        return got[1] if got is not None else None

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
        anonymous = is_anonymous(key[1])
        tail = tokens[self.lineages.anchor_at(len(tokens)):].copy() if anonymous else None
        self.set(key, SessionInfo(len(tokens), durable_tokens, old.created_at if old else now,
                                  now, recorded=recorded, held=self._held(tokens, recorded),
                                  ram=weakref.ref(tokens), tail=tail))
        if anonymous:
            self.lineages.set(key, len(tokens), block_ids)

    def recorded_again(self, key: SessionKey, info: SessionInfo, durable_tokens: int) -> None:
        """The record `info` missed reached the store (KVManager.retry_writes)."""
        if self.records.get(key) is info:
            self.set(key, replace(info, recorded=True, durable_tokens=durable_tokens,
                                  held=self._held(info.held, True)))

    def _held(self, tokens, recorded: bool):
        """What the record keeps of its history: nothing once the store has it (and the
        worker can read the store)."""
        return None if recorded and self._store() is not None else tokens

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


def history_in_ram(info: SessionInfo):
    """The record's history where RAM holds it: its own while the store may lack it, the bank
    entry's while the conversation is in the bank; else None. Any thread (a snapshot's)."""
    if info.held is not None:
        return info.held
    return info.ram() if info.ram is not None else None
