"""Faults outside kvbank: a full disk, a coldstore that stops answering, a slow disk.

Real processes throughout. The full disk is real (a ballast file fills the store's disk
below the coldstore's free-disk floor); the stopped coldstore is SIGSTOP; the slow disk is
a coldstore on a slow disk (tests/slow_coldstore.py, a stand-in for a throttled disk).
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import numpy as np

from tests.conftest import start_stack
from tests.waiting import wait_until


def _turn(c, session, n, seed, **kw):
    toks = np.random.default_rng(seed).integers(1000, 20000, n).tolist()
    return c.generate(session_id=session, token_ids=toks, append=True, max_tokens=4, **kw)


def _state(c, session):
    return c.get_session(session)


def test_full_disk_refuses_writes_keeps_serving_and_recovers(tiny_model, tmp_path, cache_dir):
    # Wide margins both ways: other tests write and delete files on this disk meanwhile.
    free = shutil.disk_usage(tmp_path).free
    if free < 16 << 30:
        pytest.skip(f"needs 16 GiB free on {tmp_path} for its ballast; {free >> 20} MiB free")
    floor = free - (4 << 30)  # 4 GiB of room above the floor
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False,
                    extra=["--free-disk-floor-bytes", str(floor)])
    ballast = tmp_path / "ballast"
    try:
        with s.client() as c:
            _turn(c, "before", 60, seed=1)
            s.wait_durable("before")

            fd = os.open(ballast, os.O_CREAT | os.O_WRONLY)
            os.posix_fallocate(fd, 0, 8 << 30)  # the disk is now 4 GiB below the floor
            os.close(fd)
            t = _turn(c, "during", 60, seed=2)
            assert t.usage["durable"]  # the record (tokens) is small and still committed
            wait_until(lambda: "disk_floor" in s.log_tail(20000),
                       "the coldstore to refuse a write (disk_floor in its log)", every_s=0.1)
            assert _state(c, "during").state == "resident-dirty"
            assert _turn(c, "during", 8, seed=3).usage["cache_source"] == "ram"

            # What is on SSD keeps restoring.
            c.release("before")
            assert _turn(c, "before", 8, seed=4).usage["cache_source"] == "ssd"
            assert _state(c, "before").state in ("resident-dirty", "resident-clean")

            ballast.unlink()  # room returns: the refused conversation is written
            done = s.wait_durable("during", timeout_s=60)
            assert done.durable_tokens == done.token_count
    finally:
        ballast.unlink(missing_ok=True)
        s.stop()


def test_a_stopped_coldstore_does_not_stop_serving_and_writes_resume(tiny_model, tmp_path,
                                                                     cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False,
                    extra=["--active-pin-s", "0"])
    pid = s.pid("coldstore")
    try:
        with s.client() as c:
            _turn(c, "steady", 40, seed=5)
            s.wait_durable("steady")
            os.kill(pid, signal.SIGSTOP)
            t = _turn(c, "away", 40, seed=6)
            assert not t.usage["durable"] and t.usage["completion_tokens"] > 0
            t2 = _turn(c, "away", 8, seed=7)  # served from RAM while the coldstore is away
            assert t2.usage["cache_source"] == "ram" and not t2.usage["durable"]
            history = list(c.get_session("away").token_ids)

            c.set_pressure("warning")  # the only copy of "away" is in RAM: it stays
            wait_until(lambda: any(json.loads(r).get("kind") == "pressure_trim"
                                   for r in c.status().recent_receipts_json),
                       "a pressure_trim receipt", every_s=0.1)
            assert _state(c, "away").ram_bytes > 0
            c.set_pressure("auto")

            os.kill(pid, signal.SIGCONT)
            done = s.wait_durable("away", timeout_s=60)
            assert list(done.token_ids) == history  # every answered turn is on disk
        assert s.pid("coldstore") == pid  # it was never restarted: it resumed
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        s.stop()


def test_a_slow_disk_makes_a_release_give_up_at_its_deadline(tiny_model, tmp_path, cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False,
                    slow_disk_s=0.2, extra=["--quiet-grace-s", "3600", "--max-dirty-s", "3600",
                                            "--write-out-deadline-s", "1"])
    try:
        with s.client() as c:
            _turn(c, "big", 300, seed=8)  # ~19 blocks of 16 tokens: ~4 s on this disk
            r = c.release("big")
            assert r.written_out_entries == 0 and r.dropped_unwritten_entries == 1
            events = [json.loads(x) for x in s.layout.events_path.read_text().splitlines()]
            (ev,) = [e for e in events if e["kind"] == "kv_evicted" and e["session_id"] == "big"]
            assert ev["write_out"] == "deadline" and ev["now"] == "gone"
            # All or nothing: the blocks committed before the deadline were taken back (the
            # release returned at its deadline; the coldstore's word follows within a block).
            wait_until(lambda: not c.get_session("big").durable_tokens,
                       "the committed blocks to be taken back (durable_tokens 0)", timeout_s=10,
                       every_s=0.1)
            # The history is kept; the next turn recomputes what never reached SSD.
            t = _turn(c, "big", 8, seed=9)
            assert t.usage["completion_tokens"] > 0
    finally:
        s.stop()


def test_a_block_corrupted_on_disk_is_recomputed_deleted_and_written_again(
        tiny_model, tmp_path, cache_dir):
    """One byte of a stored block flips while the stack is stopped (a disk's fault). The next
    turn restores the blocks before it, recomputes from it and answers as from scratch; the
    coldstore deletes the block and cuts the record short of it; the turn's write-behind
    writes the conversation whole again, so the store verifies clean."""
    import httpx
    import lmdb
    from prometheus_client.parser import text_string_to_metric_families

    from kvbank.apps.store_verify import verify
    from kvbank.contracts.store_layout import StoreReader

    data = tmp_path / "data"
    s = start_stack(tiny_model, data, cache_dir=cache_dir, shim=False)
    try:
        with s.client() as c:
            _turn(c, "flip", 80, seed=5)
            s.wait_durable("flip")
    finally:
        s.stop()
    reader = StoreReader(s.layout.store_dir, readonly=True)
    meta, _ = reader.get_session("", "flip")
    reader.close()
    bad = bytes.fromhex(meta.blocks[2])
    env = lmdb.open(str(s.layout.store_dir), max_dbs=8)
    with env.begin(write=True) as txn:
        db = env.open_db(b"blocks", txn=txn)
        raw = bytearray(txn.get(bad, db=db))
        raw[-5] ^= 0x40
        txn.put(bad, bytes(raw), db=db)
    env.close()
    assert verify(s.layout)["blocks_corrupt"] == 1

    s = start_stack(tiny_model, data, cache_dir=cache_dir, shim=False)
    try:
        with s.client() as c:
            t = _turn(c, "flip", 8, seed=6)
            assert (t.usage["cache_source"], t.usage["cached_tokens"]) == ("ssd", 32)
            prompt = list(c.get_session("flip").token_ids)[:-len(t.token_ids)]
            scratch = c.generate(token_ids=prompt, max_tokens=4, no_cache=True)
            assert t.token_ids == scratch.token_ids
            text = httpx.get(s.metrics_url("worker"), timeout=10).text
            [corrupt] = [m.value for f in text_string_to_metric_families(text)
                         for m in f.samples if m.name == "kvbank_corrupt_blocks_total"]
            assert corrupt == 1
            done = s.wait_durable("flip")
            assert done.durable_tokens == done.token_count
        events = [json.loads(line) for line in s.layout.events_path.read_text().splitlines()]
        assert any(e["kind"] == "kv_corrupt_block" and e["block_id"] == bad.hex()
                   for e in events)
        assert any(e["kind"] == "conversation_retired" and e["reason"] == "corrupt_block"
                   for e in events)
    finally:
        s.stop()
    report = verify(s.layout)
    assert report["blocks_corrupt"] == 0 and bad.hex() not in report["corrupt"]


def test_a_token_record_corrupted_on_disk_is_refused_and_its_kv_still_restores(
        tiny_model, tmp_path, cache_dir):
    """One byte of an unnamed conversation's stored token record flips while the stack is
    stopped. The record fails its checksum: `kvbank store verify` names it, and the worker
    never continues it from those tokens (the next turn is found as a new conversation), yet
    the turn restores the KV from SSD by its own tokens and answers as from scratch."""
    import lmdb

    from kvbank.apps.store_verify import verify
    from kvbank.contracts.store_layout import session_key

    data = tmp_path / "data"
    prompt = np.random.default_rng(7).integers(1000, 20000, 80).tolist()
    s = start_stack(tiny_model, data, cache_dir=cache_dir, shim=False)
    try:
        with s.client() as c:
            first = c.generate(token_ids=prompt, max_tokens=4)
            session = first.usage["session_id"]
            s.wait_durable(session)
    finally:
        s.stop()
    env = lmdb.open(str(s.layout.store_dir), max_dbs=8)
    with env.begin(write=True) as txn:  # a token id's high byte, as a disk might
        db = env.open_db(b"tokens", txn=txn)
        raw = bytearray(txn.get(session_key("", session), db=db))
        raw[4 * 10 + 3] ^= 0x01
        txn.put(session_key("", session), bytes(raw), db=db)
    env.close()
    report = verify(s.layout)
    assert report["records_corrupt"] == [session] and report["blocks_corrupt"] == 0

    s = start_stack(tiny_model, data, cache_dir=cache_dir, shim=False)
    try:
        with s.client() as c:
            longer = prompt + first.token_ids + [1234, 4321]
            t = c.generate(token_ids=longer, max_tokens=4)
            assert t.usage["session_id"] != session  # not continued from a record it can't trust
            assert t.usage["cache_source"] == "ssd" and t.usage["cached_tokens"] >= 64
            scratch = c.generate(token_ids=longer, max_tokens=4, no_cache=True)
            assert t.token_ids == scratch.token_ids
    finally:
        s.stop()
