"""A damaged store: its data file cut short (or its tail zeroed) while the stack is stopped,
LMDB's map full.

Real processes and real LMDB files. A file cut short was SIGBUS at the coldstore's first read
(its supervisor restarted it into the same death); now the coldstore finds it before LMDB maps
it, sets it aside and salvages what verifies (coldstore/salvage.py). A full map refuses the
block that does not fit (`map_full`) while the worker serves and keeps it in RAM.
"""

from __future__ import annotations

import json
import os
import random

import lmdb
import numpy as np
import pytest

from kvbank.apps.store_verify import verify
from kvbank.coldstore.pages import DataFile, Walk, check
from kvbank.v1 import api_pb2
from tests.conftest import matrix, start_stack
from tests.test_faults import _turn
from tests.waiting import wait_until


def _events(s, kind: str) -> list[dict]:
    lines = s.layout.events_path.read_text().splitlines() if s.layout.events_path.exists() else []
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _alive(s) -> None:
    """Every process of the stack runs, none was restarted since it started."""
    for name in ("coldstore", "worker", "router"):
        os.kill(s.pid(name), 0)
    assert "exited with" not in s.log.read_text()


def _restores_what_is_stored(c, name: str, history: list[int], seed: int):
    """The conversation's next turn, its whole history sent: it restores what the store holds
    of it (its record's durable tokens) and computes the rest, and answers as from scratch."""
    known = {x.session_id: x.durable_tokens for x in c.list_sessions()}.get(name, 0)
    prompt = history + np.random.default_rng(seed).integers(1000, 20000, 8).tolist()
    t = c.generate(session_id=name, token_ids=prompt, max_tokens=4)
    assert (t.usage["cache_source"], t.usage["cached_tokens"]) == (
        "ssd" if known else "none", known), (name, known, t.usage)
    assert t.token_ids == c.generate(token_ids=prompt, max_tokens=4, no_cache=True).token_ids
    return known


# -- the page reader the check and the salvage stand on -------------------------------------

def test_the_page_reader_reads_what_lmdb_reads(tmp_path):
    """Entries, counts and look-ups as LMDB gives them, over a store that LMDB left shorter
    than its meta's page count (pages freed in the transaction that took them)."""
    env = lmdb.open(str(tmp_path), map_size=1 << 28, max_dbs=4)
    a, b = env.open_db(b"a"), env.open_db(b"b")
    rnd, keys, short = random.Random(0), [], 0
    for _ in range(3000):
        with env.begin(write=True) as txn:
            for _ in range(rnd.randint(1, 6)):
                if rnd.random() < 0.5 or not keys:
                    keys.append(rnd.randbytes(16))
                    txn.put(keys[-1], rnd.randbytes(rnd.choice([100, 3000, 8300])), db=a)
                    txn.put(keys[-1], b"x" * rnd.randint(1, 400), db=b)
                else:
                    k = keys.pop(rnd.randrange(len(keys)))
                    txn.delete(k, db=a)
                    txn.delete(k, db=b)
        f = DataFile(tmp_path / "data.mdb")
        if f.size < f.needed_bytes:
            short += 1
            assert check(tmp_path / "data.mdb") is None  # nothing it uses is missing
        f.close()
    assert short  # the case the size alone would take for damage
    f = DataFile(tmp_path / "data.mdb")
    with env.begin() as txn:
        for name, tree in f.named().items():
            db = env.open_db(name, txn=txn, create=False)
            walk = Walk()
            assert list(f.items(tree, walk)) == list(txn.cursor(db=db))
            s = txn.stat(db)
            assert walk.matches(tree) and not walk.missing
            assert (s["branch_pages"], s["leaf_pages"], s["overflow_pages"], s["entries"]) == (
                tree.branch, tree.leaf, tree.overflow, tree.entries)
            for k, v in list(txn.cursor(db=db))[::7]:
                assert f.get(tree, k) == v
            assert f.get(tree, b"\0absent") is None
    f.close()
    env.close()


# -- a data file cut short while the stack is stopped ---------------------------------------

def _cut(store_dir, how: str) -> None:
    """Half the file, or its last pages: as few as lose a page the store uses; or its second
    half zeroed at the same length (a file system's tail after a crash: LMDB aborts on it)."""
    path = store_dir / "data.mdb"
    size, psize = path.stat().st_size, DataFile(path).psize
    if how in ("half", "zeroed"):
        os.truncate(path, size // 2)
        if how == "zeroed":
            os.truncate(path, size)
        return
    for k in range(1, 65):
        os.truncate(path, size - k * psize)
        if check(path) is not None:
            return
    raise AssertionError("no cut of the last 64 pages loses a page the store uses")


def _small_store(path, conversations):
    """A real ColdStore of (name, blocks) conversations of 16-token blocks, each record and
    block its own commit; and each one's tokens."""
    from kvbank.coldstore.store import ColdStore
    from kvbank.blocks import BlockHeader, chain_block_ids, chain_root, encode_block

    B, root, rng = 16, chain_root(b"fp", ""), np.random.default_rng(0)
    header = BlockHeader("float32", B, (((B, 2, 16), (B, 2, 16)),) * 2)
    store, want = ColdStore(path), {}
    for name, n in conversations:
        toks = rng.integers(0, 1 << 20, n * B).astype(np.uint32)
        store.put_session_tokens("", name, toks, B)
        for i, bid in enumerate(chain_block_ids(toks, root, B)):
            arrays = [rng.standard_normal((B, 2, 16), dtype=np.float32) for _ in range(4)]
            store.commit_block("", name, root, bid, i * B, encode_block(header, arrays))
        want[name] = n * B
    return store, want


def test_a_salvage_takes_from_the_commit_before_what_the_newest_lost(tmp_path):
    """The newest commit's blocks tree lost its root page (zeroed): the salvage takes the
    blocks from the commit before it (LMDB reuses none of its pages before the next commit)
    and the records from the newest, so the conversations come back whole, and the one the
    newest commit deleted stays deleted."""
    from kvbank.coldstore.salvage import open_store

    store, want = _small_store(tmp_path, (("a", 5), ("b", 5), ("d", 4)))
    store.delete_session("", "d")  # the newest commit: its blocks go, the blocks tree changes
    store.close()
    path = tmp_path / "data.mdb"
    f = DataFile(path)
    newest = f.named()[b"blocks"].root
    f.use_meta(1)
    assert f.named()[b"blocks"].root != newest  # copied on write: the older root stands
    psize = f.psize
    f.close()
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, bytes(psize), newest * psize)
    os.close(fd)
    assert check(path).trees == ["blocks"]

    store, report = open_store(tmp_path)
    got = {m.session_id: m.durable_tokens for m in store.list_sessions()}
    assert got == {"a": want["a"], "b": want["b"]}  # whole, and "d" not back
    assert (report.records_whole, report.records_cut, report.records) == (2, 0, 2)
    store.close()


def test_a_record_whose_newest_version_was_lost_counts_what_it_lacks(tmp_path):
    """The newest commit extended a's record over its last block, and that record's page is
    lost (zeroed): a comes back from the commit before, one block short of what the store
    held, and the report counts that block as computed again (it did not: `whole`, 0)."""
    from kvbank.coldstore.salvage import open_store

    B = 16
    store, want = _small_store(tmp_path, (("b", 3), ("a", 5)))  # the newest commit: a's last block
    store.close()
    path = tmp_path / "data.mdb"
    f = DataFile(path)
    newest = f.named()[b"sessions"].root
    f.use_meta(1)
    assert f.named()[b"sessions"].root != newest
    psize = f.psize
    f.close()
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, bytes(psize), newest * psize)
    os.close(fd)
    assert check(path).trees == ["sessions"]

    store, report = open_store(tmp_path)
    got = {m.session_id: m.durable_tokens for m in store.list_sessions()}
    assert got == {"a": want["a"] - B, "b": want["b"]}
    assert (report.records_whole, report.records_cut, report.tokens_recomputed) == (1, 1, B)
    store.close()


def test_a_salvage_stopped_midway_goes_on_at_the_next_start(tmp_path):
    """Killed after the damaged file moved aside (the marker names it), the next start
    salvages from the file set aside: records whose blocks verify come back whole, one is cut
    short at its block past the end, a stored response is kept; the marker goes."""
    from kvbank.coldstore.salvage import SALVAGING, set_aside, open_store

    store, want = _small_store(tmp_path, (("a", 5), ("b", 5), ("c", 6)))  # "c": the file's last
    store.put_response("", "resp_1", 1.0, b'{"id": "resp_1"}')
    store.close()
    path = tmp_path / "data.mdb"
    os.truncate(path, path.stat().st_size - DataFile(path).psize)
    state = set_aside(tmp_path, check(path))  # and the coldstore is killed here

    store, report = open_store(tmp_path)
    got = {m.session_id: m.durable_tokens for m in store.list_sessions()}
    assert got["a"] == want["a"] and got["b"] == want["b"] and got["c"] < want["c"]
    assert store.get_response("", "resp_1") == b'{"id": "resp_1"}'
    assert (report.records_whole, report.records_cut, report.tokens_recomputed) == (
        2, 1, want["c"] - got["c"])
    assert report.set_aside == state["set_aside"] and os.path.exists(state["set_aside"])
    assert not (tmp_path / SALVAGING).exists()
    store.close()
    store, report = open_store(tmp_path)
    assert report is None  # the fresh store is whole
    store.close()


# make test: a tail cut (a crash mid-write) and a zeroed half; a file cut in half, the same
# "past its end" path as the tail cut with more to salvage, in make test-all.
@pytest.mark.parametrize("how", matrix(["last-pages", "half", "zeroed"],
                                       keep=("last-pages", "zeroed")))
def test_a_data_file_cut_short_is_set_aside_and_what_verifies_restores(
        tiny_model, tmp_path, cache_dir, how):
    """The coldstore finds the file short before LMDB maps it, keeps it aside, salvages what
    verifies into a fresh store and says so; the stack serves: each conversation restores
    what was salvaged of it, computes the rest, answers as from scratch, and is written
    whole again; `kvbank store verify` reports the damage before, a clean store after."""
    data = tmp_path / "data"
    s = start_stack(tiny_model, data, cache_dir=cache_dir, shim=False)
    try:
        with s.client() as c:
            for i, n in enumerate((80, 120, 60)):
                _turn(c, f"c{i}", n, seed=i)
            histories = {f"c{i}": list(s.wait_durable(f"c{i}").token_ids) for i in range(3)}
    finally:
        s.stop()
    _cut(s.layout.store_dir, how)
    assert "damaged" in verify(s.layout)  # reported, where a read through the map was SIGBUS

    s = start_stack(tiny_model, data, cache_dir=cache_dir, shim=False)
    try:
        [ev] = _events(s, "store_damaged")
        assert ("zeroed" if how == "zeroed" else "past its end") in ev["found"]
        assert os.path.exists(ev["set_aside"])
        assert "delete it once you no longer need it" in s.log_tail(20000)
        with s.client() as c:
            salvaged = {x.session_id for x in c.list_sessions()}
            assert ev["records_whole"] + ev["records_cut"] == len(salvaged)
            kept = {n: _restores_what_is_stored(c, n, h, seed=10 + i)
                    for i, (n, h) in enumerate(histories.items())}
            assert ev["tokens_recomputed"] == sum(len(histories[n]) - kept[n] for n in salvaged)
            for n in histories:
                done = s.wait_durable(n)
                assert done.durable_tokens == done.token_count
        _alive(s)
    finally:
        s.stop()
    report = verify(s.layout)
    assert "damaged" not in report and report["blocks_corrupt"] == 0
    assert report["blocks_ok"] > 0


# -- LMDB's map full -------------------------------------------------------------------------

def test_a_full_map_refuses_kv_but_still_takes_records_and_deletions(tmp_path):
    """LMDB cannot even delete in a map that is full to the last page; at its ceiling only KV
    is refused (StoreFull), while records and deletions take a little more, so the store
    shrinks and a block fits again right after a deletion (its pages are reused two commits
    on: the store commits once more before it gives up)."""
    from kvbank.coldstore.store import ColdStore, StoreFull
    from kvbank.blocks import chain_block_ids, chain_root

    B, root, rng = 16, chain_root(b"fp", ""), np.random.default_rng(0)
    store = ColdStore(tmp_path, map_max_bytes=1 << 20)

    def fill(name: str) -> int:
        toks = rng.integers(0, 1 << 20, 200 * B).astype(np.uint32)
        store.put_session_tokens("", name, toks, B)
        for i, bid in enumerate(chain_block_ids(toks, root, B)):
            try:
                store.commit_block("", name, root, bid, i * B, rng.bytes(8000))
            except StoreFull:
                return i
        raise AssertionError("the map never filled")

    assert fill("a") > 0
    for i in range(300):  # records fill the map to its last page, and past it
        store.put_session_tokens("", f"r{i}", rng.integers(0, 1 << 20, 900).astype(np.uint32), B)
    used = store.stats()["used_bytes"]
    assert used > 1 << 20 and store.env.info()["map_size"] == used  # no room past it for KV
    # KV is refused at once, but for a block that lands in pages the records' own commits
    # freed (LMDB reuses them; how many there are depends on the records' page layout)
    assert fill("c") <= 2
    assert store.delete_session("", "a")
    assert fill("b") > 0  # room again, until it is full again
    store.close()

def test_a_full_map_refuses_the_block_keeps_serving_and_writes_resume_once_room_is_made(
        tiny_model, tmp_path, cache_dir):
    """A map of 1 MiB (--store-map-bytes) and a cap above it (so the cap does not retire
    first): the block that does not fit is refused `map_full`, with an event and a log line
    that say what to change; the coldstore stays up, the worker answers from RAM and keeps the
    conversation unwritten and protected; what is stored still restores. Once a conversation
    is deleted the worker's next send is written whole."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False,
                    extra=["--store-map-bytes", str(1 << 20), "--store-max-bytes", str(1 << 30)])
    try:
        with s.client() as c:
            _turn(c, "old", 700, seed=1)  # 44 blocks of 16 tokens, 12 KiB of pages each
            s.wait_durable("old")
            _turn(c, "big", 800, seed=2)  # with "old", more than the map holds
            [ev] = wait_until(lambda: _events(s, "store_full"), "a store_full event")
            assert "--store-map-bytes" in ev["message"] and ev["map_bytes"] == 1 << 20
            assert "refused (map_full)" in s.log_tail(20000)
            text = httpx.get(s.metrics_url("coldstore"), timeout=10).text
            assert any(m.labels.get("reason") == "map_full" and m.value >= 1
                       for f in text_string_to_metric_families(text) for m in f.samples
                       if m.name == "kvbank_coldstore_refusals_total")

            big = c.get_session("big")
            assert big.state == "resident-dirty" and big.durable_tokens < big.token_count
            t = _turn(c, "big", 8, seed=3)  # served from RAM
            assert t.usage["cache_source"] == "ram"
            prompt = list(c.get_session("big").token_ids)[:-len(t.token_ids)]
            assert t.token_ids == c.generate(token_ids=prompt, max_tokens=4,
                                             no_cache=True).token_ids
            c.release("old")  # what is stored still restores
            assert _turn(c, "old", 8, seed=4).usage["cache_source"] == "ssd"

            c.sessions.Delete(api_pb2.DeleteSessionRequest(session_id="old"), timeout=10)
            done = s.wait_durable("big", timeout_s=60)  # the worker sends it again (5 s)
            assert done.durable_tokens == done.token_count
        _alive(s)
    finally:
        s.stop()
    assert verify(s.layout)["blocks_corrupt"] == 0


def test_with_a_map_ceiling_the_cap_retires_old_conversations_before_the_map_fills(
        tiny_model, tmp_path, cache_dir):
    """--store-map-bytes alone: the cap defaults to half of it, so a conversation that would
    not fit beside an old one retires the old one's KV (`store_cap`) and is written whole; the
    map never fills."""
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False,
                    extra=["--store-map-bytes", str(1 << 20)])
    try:
        with s.client() as c:
            _turn(c, "old", 700, seed=1)
            s.wait_durable("old")
            _turn(c, "big", 800, seed=2)
            done = s.wait_durable("big")
            assert done.durable_tokens == done.token_count
            assert c.get_session("old").durable_tokens == 0  # its history stays
        assert any(e["session_id"] == "old" and e["reason"] == "store_cap"
                   for e in _events(s, "conversation_retired"))
        assert not _events(s, "store_full")
        _alive(s)
    finally:
        s.stop()
