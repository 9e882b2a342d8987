"""Records at scale: the worker's record of a conversation holds no history the store has
(worker/tiers/conversations.py). A store holds many conversations of 80-100K tokens; held for each
in RAM, their tokens alone cost 4 bytes a token (400 KB a conversation of 100K).
"""

from __future__ import annotations

import gc
import sys
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np

from kvbank.coldstore.store import ColdStore
from kvbank.blocks import chain_block_ids, chain_root
from kvbank.contracts.store_layout import StoreReader
from kvbank.contracts.vocabulary import TrimReason
from tests.coldstore_rig import B, ColdstoreProc, Link, caches_holding, make_kv
from tests.conftest import start_stack
from kvbank.worker.tiers.conversations import Conversations
from kvbank.worker.tiers.lineage import CONTINUE_SLACK_TOKENS

TENANT = "acme"
LONG = 100_000  # tokens: an agent's conversation late in its life
BT = 256  # the default --block-tokens
# What a record may cost beyond its tokens: its fields, its dict slot, its key, the lineage
# index's entry and an anonymous one's tail (under BT + slack tokens, 4 bytes each): about
# 1 KB seen. 4 KB is a hundredth of the history's 400 KB.
RECORD_BOUND = 4096


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1000, 20_000, n).astype(np.uint32)


def _root(tenant: str):
    return chain_root(b"records-test", tenant)


def _found(c: Conversations, prompt: np.ndarray):
    ids = chain_block_ids(prompt, _root(TENANT), BT)
    return c.resolve(prompt, ids, TENANT, "", busy=lambda k: False, in_ram=lambda k: False)


def _stored(path: Path, sids: list[str]) -> dict:
    """A store holding a conversation of LONG tokens under each id: their histories."""
    histories = {}
    w = ColdStore(path)
    for i, sid in enumerate(sids):
        histories[(TENANT, sid)] = _tokens(LONG, i)
        w.put_session_tokens(TENANT, sid, histories[(TENANT, sid)], BT)
    w.close()
    return histories


def _load(reader: StoreReader) -> tuple[Conversations, int]:
    """The worker's records loaded from the store, and the bytes they keep (tracemalloc)."""
    c = Conversations(root_for=_root, block_tokens=BT, store=lambda: reader)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    c.load()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return c, held


def test_records_loaded_from_a_store_of_long_conversations_hold_about_a_kilobyte_each(tmp_path):
    """Eight conversations of 100K tokens (half named, half anonymous) loaded at start: what
    the records keep is under RECORD_BOUND each (it was 400 KB), and still an anonymous one is
    found by its tokens, a named one's tokens come back (GetSession reads them there)."""
    histories = _stored(tmp_path / "store",
                        [f"~{i:012x}" if i % 2 else f"named-{i}" for i in range(8)])
    reader = StoreReader(tmp_path / "store", readonly=True)
    try:
        c, held = _load(reader)
        assert len(c.records) == 8 and len(c.lineages) == 4
        assert held < 8 * RECORD_BOUND, f"{held / 8:.0f} bytes a record"
        for info in c.records.values():
            assert info.held is None and info.n_tokens == LONG
            assert info.tail is None or len(info.tail) < BT + CONTINUE_SLACK_TOKENS

        for key, history in histories.items():
            assert np.array_equal(c.history(key), history)  # what GetSession answers
            if key[1].startswith("~"):
                more = np.concatenate([history, _tokens(50, 99)])
                assert _found(c, more) == key, "an anonymous conversation, by its tokens"
                # The client wrote the end of the last answer another way: still this one.
                rewritten = np.concatenate([history[:-CONTINUE_SLACK_TOKENS + 1],
                                            _tokens(30, 98)])
                assert _found(c, rewritten) == key
                # Past the slack, it is a branch: a new conversation.
                branch = np.concatenate([history[:-CONTINUE_SLACK_TOKENS - 1], _tokens(30, 97)])
                assert _found(c, branch) not in histories
    finally:
        reader.close()


def test_a_record_keeps_its_tokens_only_while_the_store_lacks_them(tmp_path):
    """Committed through a coldstore, a record keeps no tokens: they are read from the bank
    entry while it is in RAM, from LMDB after it left. A turn the coldstore did not record (it
    was down) keeps its history in the record until the record is sent again."""
    proc = ColdstoreProc(tmp_path / "data")
    link = Link(proc.layout)
    h = link.kv
    try:
        key, toks = (TENANT, "named"), _tokens(40, 1)
        link.turn("named", toks.copy(), make_kv(40, 1))  # the entry's own, as a turn's are
        info = h.conversations.get(key)
        assert info.held is None and info.recorded
        assert h.conversations.history(key) is h.bank.terminal(key).tokens  # RAM's, shared
        h.eviction.release_sessions(None, reason=TrimReason.ADMIN_RELEASE,
                                    write_out_before_release=True)
        assert not h.bank.entries
        gc.collect()
        assert info.ram() is None  # the entry's tokens went with it
        assert np.array_equal(h.conversations.history(key), toks)  # from LMDB

        proc.kill9()
        more = np.concatenate([toks, _tokens(8, 2)])
        assert not h.commit(key, more, caches_holding(make_kv(48, 2)))  # not durable
        info = h.conversations.get(key)
        assert not info.recorded and np.array_equal(info.held, more)
        assert h.conversations.history(key) is info.held  # the store has the turn before it
        assert np.array_equal(link.disk.record("named")[1], toks)

        proc = ColdstoreProc(tmp_path / "data")
        link.set_busy(True)
        assert h.retry_writes() == 1
        info = h.conversations.get(key)
        assert info.recorded and info.held is None
        assert np.array_equal(link.disk.record("named")[1], more)
        assert np.array_equal(h.conversations.history(key), more)
    finally:
        link.close()
        proc.stop()



def test_get_session_answers_the_history_from_ram_and_from_lmdb(tiny_model, tmp_path,
                                                                 cache_dir):
    """Through the worker's API: a named conversation's tokens come back whether its KV is in
    RAM (the entry's tokens) or only on SSD (read from LMDB on the engine's thread), and an
    unnamed one released from RAM is still continued by its tokens."""
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False)
    try:
        with s.client() as c:
            c.generate(session_id="named", token_ids=_tokens(60, 1).tolist(), max_tokens=4)
            got = c.get_session("named")
            history = list(got.token_ids)
            assert len(history) == got.token_count > 60
            s.wait_durable("named")
            c.release("named")
            assert c.get_session("named").ram_bytes == 0
            assert list(c.get_session("named").token_ids) == history
            assert [x.token_count for x in c.list_sessions() if x.session_id == "named"] == [
                len(history)]

            first = c.generate(token_ids=_tokens(50, 2).tolist(), max_tokens=4)
            anon = first.usage["session_id"]
            s.wait_durable(anon)
            c.release(anon)
            prompt = list(c.get_session(anon).token_ids) + _tokens(10, 3).tolist()
            again = c.generate(token_ids=prompt, max_tokens=4)
            assert again.usage["session_id"] == anon and again.usage["cache_source"] == "ssd"
    finally:
        s.stop()

if __name__ == "__main__":  # the bytes a record keeps: python -m tests.test_records [N]
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    for kind, sid in (("named", "named-{}"), ("anonymous", "~{:012x}")):
        with tempfile.TemporaryDirectory() as d:
            _stored(Path(d), [sid.format(i) for i in range(n)])
            reader = StoreReader(Path(d), readonly=True)
            held = _load(reader)[1]
            reader.close()
        print(f"{n} {kind} conversations of {LONG} tokens, --block-tokens {BT}: "
              f"{held / n:.0f} bytes a record ({held / n / LONG:.4f} a token)")
