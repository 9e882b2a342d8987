"""What the worker holds of its conversations, apart from the model: the RAM bank, the
conversation records, the KV writer, the restorer and the link to the coldstore, and the one
function that commits a turn into them.

The engine owns a `Holdings` and calls it on its own thread. It needs no model, only the
model's cache kinds and fingerprint, so a test builds one over a fake cache kind and a real
coldstore process and drives the engine's own commit, restore and release.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from kvbank import events, metrics
from kvbank.blocks import BlockId, chain_root
from kvbank.config import Layout
from kvbank.contracts import coldstore_wire as wire
from kvbank.contracts.failures import ColdstoreUnavailable
from kvbank.contracts.vocabulary import Outcome, TrimReason
from kvbank.worker.tiers import upkeep
from kvbank.worker.tiers.bank import MAX_CHECKPOINTS, SessionBank, SessionKey
from kvbank.worker.kv.cache_kinds import CacheKinds
from kvbank.worker.tiers.conversations import Conversations
from kvbank.worker.link.kv_events import KVEvents
from kvbank.worker.tiers.lineage import is_anonymous
from kvbank.worker.link.client import ColdstoreClient
from kvbank.worker.tiers.restore import Restorer
from kvbank.worker.link.writer import KVWriter

logger = logging.getLogger(__name__)


class Holdings:
    def __init__(self, layout: Layout, *, kinds: CacheKinds, fingerprint: bytes,
                 block_tokens: int, bank_bytes: int, staging_max_bytes: int | None = None,
                 restore_via: str = "direct", active_pin_s: float = 600.0,
                 max_checkpoints: int = MAX_CHECKPOINTS,
                 write_out_deadline_s: float | None = None,
                 kv_events: KVEvents | None = None, wake: Callable[[], None] = lambda: None):
        """Connects to the coldstore at `layout` and loads its records. `wake`: the owner's
        loop turns once (the writer's inbox has mail)."""
        self.layout = layout.ensure()
        self.kinds, self.fingerprint, self.block_tokens = kinds, fingerprint, block_tokens
        self.coldstore = ColdstoreClient(layout, on_event=self._deliver)
        self.writer = KVWriter(self.coldstore, block_tokens=block_tokens, root_for=self.root_for,
                               kinds=kinds, staging_max_bytes=staging_max_bytes,
                               on_message=self._on_coldstore_message, wake=wake)
        self.coldstore.start()
        self.bank = SessionBank(block_tokens=block_tokens, root_for=self.root_for,
                                max_bytes=bank_bytes, writer=self.writer,
                                active_pin_s=active_pin_s, restore_point=kinds.restore_point,
                                max_checkpoints=max_checkpoints)
        self.bank.write_out_deadline_s = write_out_deadline_s
        self.restorer = Restorer(kinds=kinds, bank=self.bank, client=self.coldstore,
                                 store_dir=self.layout.store_dir, root_for=self.root_for,
                                 block_tokens=block_tokens, restore_via=restore_via)
        self.conversations = Conversations(root_for=self.root_for, block_tokens=block_tokens,
                                           store=self.restorer.store)
        self.conversations.load()
        self.kv_events = kv_events
        if kv_events is not None:  # several machines behind a router: say what we hold
            self.bank.listener = kv_events
            kv_events.ssd_tokens = self.conversations.history  # announced again from LMDB
            for key in self.conversations.records:
                self._ssd_changed(key)
            kv_events.announce_all()
        self.ram_bytes: dict[SessionKey, int] = {}  # per conversation, for the Snapshot
        self.checkpoint_bytes: dict[SessionKey, int] = {}  # the checkpoints' part of it
        self.bank_peak = 0  # kvbank_bank_peak_bytes: a benchmark reads it once, not polls

    def root_for(self, tenant: str) -> BlockId:
        return chain_root(self.fingerprint, tenant)

    def _deliver(self, msg) -> None:
        """The link's thread: into the writer's inbox, which the owner pumps."""
        self.writer.deliver(msg)

    # -- commit -----------------------------------------------------------------------------

    def commit(self, session: SessionKey, full: np.ndarray, cache: list,
               started: float = 0.0, handed=None, checkpoints=None, at_rest=None) -> bool:
        """The conversation's record (durable), then the bank entry, then the write-behind job.
        `checkpoints`: those its request took on the way (prompt splits, the prompt's end).
        `at_rest`: the quantized KV its cache was restored from, kept as it is.

        A conversation deleted while its turn ran stays deleted: the turn is answered, not
        kept."""
        if self.conversations.deleted_since(session, started):
            if handed is not None:
                self.bank.let_go(handed)
            return False
        layers, end = self.kinds.freeze(cache, len(full), at_rest)
        checkpoints = dict(checkpoints or {})
        if end is not None:
            checkpoints[len(full)] = end
        durable, durable_tokens = False, 0
        try:
            durable_tokens = upkeep.put_record(self.coldstore, session, full, self.block_tokens)
            durable = True
        except ColdstoreUnavailable as e:
            logger.warning("session %s: turn not durable: %s", session[1], e)
        anonymous = is_anonymous(session[1])
        entry = self.bank.insert(
            session, full, layers, checkpoints=checkpoints, durable_tokens=durable_tokens,
            supersede_slack=self.conversations.lineages.slack if anonymous else 0,
            handed=handed)
        # The entry's own tokens: the record reads them there while the entry lives.
        self.conversations.committed(session, entry.tokens, durable_tokens, durable,
                                     entry.block_ids)
        self._ssd_changed(session)
        events.emit("kv_resident", tenant=session[0], session_id=session[1],
                    tokens=len(full), bytes=entry.nbytes, durable_tokens=durable_tokens)
        if durable:
            self.writer.write_behind(entry)
        else:  # the coldstore is away: record and KV go when it is back
            entry.write_pending = True
        # Over --bank-bytes: entries on SSD leave first, unwritten ones are written out first.
        upkeep.keep_within_cap(self.bank, protect_keys=(entry.key,), keep_sessions=(session,))
        upkeep.write_ahead(self.bank)  # what the next commit's release would wait for
        self.refresh_ram_bytes()
        return durable

    def refresh_ram_bytes(self) -> None:
        self.ram_bytes = {s: self.bank.session_nbytes(s) for s in self.bank.sessions()}
        self.checkpoint_bytes = {s: self.bank.session_nbytes(s, checkpoints_only=True)
                                 for s in self.bank.sessions()}
        metrics.BANK_BYTES.set(self.bank.total_nbytes)
        self.bank_peak = max(self.bank_peak, self.bank.total_nbytes)
        metrics.BANK_PEAK_BYTES.set(self.bank_peak)
        metrics.BANK_ENTRIES.set(len(self.bank.entries))

    def delete(self, session: SessionKey) -> bool:
        """Gone from the bank, the records and the store; whether it existed."""
        existed = session in self.conversations or bool(self.bank.session_entries(session))
        self.bank.drop_session(session, reason=TrimReason.SESSION_DELETED)
        self.conversations.deleted(session, while_running=self.bank.is_busy(session))
        self.coldstore.delete_session(*session)
        self._ssd_changed(session)
        return existed

    def close(self) -> None:
        self.writer.close(timeout_s=5)  # what was handed over leaves before the link closes
        self.coldstore.close()
        self.restorer.close()
        if self.kv_events is not None:
            self.kv_events.publisher.close()

    # -- the coldstore's word (applied by the writer's pump, on the owner's thread) ----------

    def _on_coldstore_message(self, msg) -> None:
        """A write job's progress or end, or a conversation the coldstore retired."""
        kind = msg.WhichOneof("kind")
        if kind == "retired":
            r = msg.retired
            key = (r.tenant, r.session_id)
            if self.conversations.retired(key, r.removed, r.at, r.durable_tokens):
                self.bank.mark_durable(key, r.durable_tokens, lowered=True)
                self._ssd_changed(key)
                logger.info("the coldstore retired %s (%s)", r.session_id, r.reason)
            return
        if kind == "progress":
            p = msg.progress
            key = (p.tenant, p.session_id)
            self.conversations.durable(key, p.durable_tokens)
            self.bank.mark_durable(key, p.durable_tokens)
            self._ssd_changed(key)
            return
        d = msg.done
        if not d.session_id:  # an unknown job's answer names no conversation
            return
        key, outcome = (d.tenant, d.session_id), wire.outcome_of(d)
        # A write-out is all or nothing: a failed one's blocks were taken back.
        lowered = outcome == Outcome.DEADLINE or d.taken_back
        self.conversations.durable(key, d.durable_tokens, lowered=lowered)
        self.bank.mark_durable(key, d.durable_tokens, lowered=lowered)
        self._ssd_changed(key)
        self.bank.mark_write_done(key, d.job, outcome)
        if outcome == Outcome.WRITTEN:
            events.emit("kv_durable", tenant=key[0], session_id=key[1],
                        durable_tokens=d.durable_tokens)
        elif outcome not in (Outcome.SUPERSEDED, Outcome.CANCELLED):
            logger.warning("write of %s ended %s (%s): %s", key[1], outcome, d.reason, d.error)

    def _ssd_changed(self, key: SessionKey) -> None:
        """What LMDB holds of a conversation changed: the KV events follow."""
        if self.kv_events is not None:
            info = self.conversations.get(key)
            tokens = self.conversations.history(key) if info and info.durable_tokens else None
            self.kv_events.ssd_holds(key, tokens[:info.durable_tokens]
                                     if tokens is not None else None)
