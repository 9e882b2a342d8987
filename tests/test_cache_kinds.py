"""The cache-kind seam on its own: a fake model (a test seam, not a real architecture) whose
caches are one of each kind kvbank serves, and the bank, restore and store around it, with no
stack and no weights.

`Fake` computes in plain MLX what a real layer would keep: a full-attention cache (K/V of
every token), a sliding window of 4 tokens and a recurrent state, and logits that read all
three. Any slip in what a checkpoint holds (the ring's order, the window's length, the state at
the wrong position) changes its logits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from kvbank.blocks import CorruptBlock, chain_block_ids, tail_block_id
from tests.test_bank import TENANT, make_bank, root_for
from kvbank.worker.kv import arrays, codec
from kvbank.worker.kv.cache_kinds import CacheKinds, Kind, UnsupportedModel
from kvbank.worker.kv.kinds import FullKind

pytestmark = pytest.mark.unit  # make test-fast

VOCAB, WINDOW, B = 50, 4, 4


class Fake:
    """A model with a FULL, a WINDOW and a STATE cache (mlx-lm's own cache classes)."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.emb = mx.array(rng.standard_normal((VOCAB, 2)).astype(np.float32))
        self.out = mx.array(rng.standard_normal((6, VOCAB)).astype(np.float32))

    def make_cache(self):
        return [KVCache(), RotatingKVCache(max_size=WINDOW), ArraysCache(1)]

    def parts(self, cache):
        """Its full-attention, window and state caches."""
        return cache[0], cache[1], cache[2]

    def __call__(self, x, cache):
        full, window, recurrent = self.parts(cache)
        e = self.emb[x[0]][None, None]  # (1, 1, S, 2)
        S = e.shape[2]
        full_k, _ = full.update_and_fetch(e, e)
        mask = window.make_mask(S, window_size=WINDOW)
        win_k, _ = window.update_and_fetch(e * 2, e * 2)
        state = recurrent[0] if recurrent[0] is not None else mx.zeros((1, 2))
        rows = []
        for i in range(S):  # every position reads what its caches show it
            n_full = full_k.shape[2] - S + i + 1
            L = win_k.shape[2]
            if isinstance(mask, mx.array):
                w = (mask[i] if mask.ndim == 2 else mask).astype(mx.float32)
            elif mask == "causal":
                w = (mx.arange(L) <= L - S + i).astype(mx.float32)
            else:
                w = mx.ones((L,))
            seen = (win_k[0, 0] * w[:, None]).sum(0)[None]
            state = state * 0.5 + e[0, 0, i][None]
            rows.append(mx.concatenate([full_k[0, 0, :n_full].mean(0)[None], seen, state],
                                       axis=1))
        recurrent[0] = state
        return (mx.concatenate(rows)[None] @ self.out)


class FakeList(Fake):
    """The same layers, its state and full attention as one layer's `CacheList` (as
    Falcon-H1's and Baichuan-M1's are), the window after it."""

    def make_cache(self):
        return [CacheList(ArraysCache(1), KVCache()), RotatingKVCache(max_size=WINDOW)]

    def parts(self, cache):
        return cache[0][1], cache[1], cache[0][0]


LAYOUTS = {"kinds": "full,window:4:0,state:1", "list": "list(state:1+full),window:4:0"}


def _continues(kinds, cache, tokens, suffix) -> bool:
    """`cache`, standing before `suffix`, gives the logits recomputation of `tokens` (which end
    with it) gives at every position of the suffix."""
    got = _logits(kinds.model, cache, list(suffix), last=len(suffix))
    want = _logits(kinds.model, kinds.new_cache(), list(tokens), last=len(suffix))
    return bool(mx.allclose(got, want, atol=1e-5))


def _logits(model, cache, tokens, chunk=3, last=1):
    """The logits of the last `last` positions (each reads the window as it stands there),
    read in forwards of `chunk` tokens and then one token at a time."""
    out = []
    for s in range(0, len(tokens) - 1, chunk):
        part = tokens[s:min(s + chunk, len(tokens) - 1)]
        out.append(model(mx.array(part)[None], cache)[0])
    out.append(model(mx.array(tokens[-1:])[None], cache)[0])
    return mx.concatenate(out)[-last:]


@pytest.fixture(params=["kinds", "list"])
def kinds(request):
    """The seam over each fake: its kinds one cache each, and with a `CacheList`."""
    return CacheKinds(Fake() if request.param == "kinds" else FakeList(), "fake")


def _run(kinds, tokens):
    cache = kinds.new_cache()
    for t in tokens:  # one token at a time: decode, the ring wraps
        kinds.model(mx.array([int(t)])[None], cache)
    return cache


def test_the_seam_names_each_kind_and_refuses_what_it_does_not_know(kinds):
    if isinstance(kinds.model, FakeList):
        assert [s.kind for s in kinds.slots] == [Kind.LIST, Kind.WINDOW]
    else:
        assert [s.kind for s in kinds.slots] == [Kind.FULL, Kind.WINDOW, Kind.STATE]
    assert kinds.layout == LAYOUTS["list" if isinstance(kinds.model, FakeList) else "kinds"]
    assert kinds.checkpointed and kinds.has_full

    class Other(Fake):
        def make_cache(self):
            from mlx_lm.models.cache import ChunkedKVCache

            return [KVCache(), ChunkedKVCache(8)]

    with pytest.raises(UnsupportedModel, match="'other'.*ChunkedKVCache"):
        CacheKinds(Other(), "other")


@pytest.mark.parametrize("n", [3, 4, 9])  # before the window fills, at it, past it (wrapped)
def test_a_checkpoint_restores_what_recomputation_gives(kinds, n):
    tokens = list(range(1, n + 1))
    layers, checkpoint = kinds.freeze(_run(kinds, tokens), n)
    more = [7, 8, 9, 10, 11]
    assert _continues(kinds, kinds.restore(layers, checkpoint, n), tokens + more, more)
    # the restored cache's writes never reach the checkpoint the bank keeps
    assert _continues(kinds, kinds.restore(layers, checkpoint, n), tokens + more, more)


def test_the_bank_restores_only_at_a_checkpoint(kinds):
    bank = make_bank(block_tokens=B)
    bank.restore_point = kinds.restore_point
    tokens = np.arange(1, 13, dtype=np.uint32)
    cache = _run(kinds, tokens[:5])
    at5 = kinds.snapshot(cache)
    for t in tokens[5:]:
        kinds.model(mx.array([int(t)])[None], cache)
    layers, end = kinds.freeze(cache, 12)
    e = bank.insert((TENANT, "s"), tokens, layers, checkpoints={5: at5, 12: end})
    assert e.nbytes == arrays.layers_nbytes(layers) + at5.nbytes + end.nbytes

    diverges_at_9 = np.concatenate([tokens[:9], [40, 41]]).astype(np.uint32)
    assert bank.lookup(diverges_at_9, TENANT).n_tokens == 5  # not 9: no state stands there
    diverges_at_3 = np.concatenate([tokens[:3], [40, 41]]).astype(np.uint32)
    assert bank.lookup(diverges_at_3, TENANT) is None
    whole = np.concatenate([tokens, [40]]).astype(np.uint32)
    assert bank.lookup(whole, TENANT).n_tokens == 12
    assert bank.lookup(tokens, TENANT, limit=11).n_tokens == 5  # the last token is computed

    hit = bank.lookup(diverges_at_9, TENANT)
    restored = kinds.restore(hit.entry.layers, hit.entry.checkpoints[5], 5)
    assert _continues(kinds, restored, diverges_at_9.tolist(), diverges_at_9[5:].tolist())


def test_a_longer_turn_keeps_the_checkpoints_it_supersedes_up_to_the_cap(kinds):
    bank = make_bank(block_tokens=B)
    bank.restore_point, bank.max_checkpoints = kinds.restore_point, 3
    tokens = np.arange(1, 30, dtype=np.uint32)
    cache = kinds.new_cache()
    snaps = {}
    for i, t in enumerate(tokens, 1):
        kinds.model(mx.array([int(t)])[None], cache)
        snaps[i] = kinds.snapshot(cache)
    layers = FullKind().freeze_layers(kinds.full_caches(cache), 29)
    for n in (6, 12, 18, 24):  # turns of one conversation, each superseding the last
        bank.insert((TENANT, "s"), tokens[:n], [(k[..., :n, :], v[..., :n, :])
                                                for k, v in layers],
                    checkpoints={n - 3: snaps[n - 3], n: snaps[n]})
    (e,) = bank.session_entries((TENANT, "s"))
    assert sorted(e.checkpoints) == [18, 21, 24]  # its end, then the newest
    assert e.nbytes == arrays.layers_nbytes(e.layers) + sum(c.nbytes for c in e.checkpoints.values())
    assert bank.total_nbytes == e.nbytes


def test_a_shared_checkpoint_outlives_newer_ones_at_the_cap(kinds):
    """The checkpoint ending the prefix other conversations share (the system prompt) is
    kept after the entry's end and before the newest others."""
    import dataclasses

    bank = make_bank(block_tokens=B)
    bank.restore_point, bank.max_checkpoints = kinds.restore_point, 2
    tokens = np.arange(1, 20, dtype=np.uint32)
    cache = kinds.new_cache()
    snaps = {}
    for i, t in enumerate(tokens, 1):
        kinds.model(mx.array([int(t)])[None], cache)
        snaps[i] = kinds.snapshot(cache)
    layers = FullKind().freeze_layers(kinds.full_caches(cache), 19)
    bank.insert((TENANT, "s"), tokens, layers, checkpoints={
        3: dataclasses.replace(snaps[3], shared=True), 10: snaps[10], 15: snaps[15],
        19: snaps[19]})
    (e,) = bank.session_entries((TENANT, "s"))
    assert sorted(e.checkpoints) == [3, 19]


def test_an_anchor_is_stored_once_and_lives_while_a_record_names_it(kinds, tmp_path):
    """A shared checkpoint inside a block goes to LMDB as an anchor (its partial block's KV
    and the checkpoint), content-addressed by the chain: two conversations name one stored
    value; it goes when the last record naming it does, and an edit before it drops it."""
    from kvbank.coldstore.store import ColdStore

    tokens = np.arange(1, 11, dtype=np.uint32)
    cache = kinds.new_cache()
    for i, t in enumerate(tokens[:6], 1):
        kinds.model(mx.array([int(t)])[None], cache)
    state = kinds.checkpoint_views(kinds.snapshot(cache))
    layers = FullKind().freeze_layers(kinds.full_caches(cache), 6)
    root = root_for(TENANT)
    ids = chain_block_ids(tokens, root, B)
    anchor = tail_block_id(ids[0], tokens[4:6])  # after the first block, 2 tokens in
    frame = codec.encode_views(arrays.layer_views(layers), "float32", 4, 6, layout=kinds.layout,
                            state=state)
    block = codec.encode_views(arrays.layer_views(layers), "float32", 0, 4, layout=kinds.layout)
    store = ColdStore(tmp_path / "s")
    for name in ("a", "b"):
        store.put_session_tokens(TENANT, name, tokens, B)
        store.commit_block(TENANT, name, root, ids[0], 0, block)
        meta = store.commit_anchor(TENANT, name, root, anchor, 4, frame)
        assert meta.anchors == [[anchor.hex(), 4, 2]] and meta.durable_tokens == B
    assert store.stats()["blocks"] == 2  # the first block and the anchor, once each
    assert store.commit_anchor(TENANT, "a", root, tail_block_id(ids[0], tokens[4:7]), 4,
                               frame) is None  # its id is not what the tokens give
    store.delete_session(TENANT, "a")
    assert store.has_block(anchor)  # b still names it
    store.put_session_tokens(TENANT, "b", np.concatenate([tokens[:5], [99]]), B)  # an edit
    assert not store.has_block(anchor) and store.stats()["blocks"] == 1
    store.close()


def test_blocks_carry_the_checkpoint_at_their_end_and_refuse_a_flipped_byte(kinds):
    n = 10
    tokens = list(range(1, n + 1))
    layers, end = kinds.freeze(_run(kinds, tokens), n)
    views = arrays.layer_views(layers)
    frames = [codec.encode_views(views, "float32", s, min(s + B, n), layout=kinds.layout,
                              state=kinds.checkpoint_views(end) if min(s + B, n) == n else None)
              for s in range(0, n, B)]
    state = kinds.checkpoint_from_arrays(codec.decode_state(frames[-1]))
    assert codec.decode_state(frames[0]) == []
    restored = kinds.restore(codec.decode_blocks(frames, capacity=16), state, n, owned=True)
    more = [3, 1, 4]
    assert _continues(kinds, restored, tokens + more, more)

    bad = bytearray(frames[1])
    bad[-5] ^= 0x40
    with pytest.raises(CorruptBlock, match="checksum"):
        codec.decode_blocks([frames[0], bytes(bad), frames[2]])


def test_a_restore_copies_the_blocks_read_so_far_while_it_reads_the_rest(kinds):
    """A restore's reads and copies overlap (kvbank/contracts/store_layout.py `Reading`,
    worker/kv/codec.py `decode_stream`): the read of the third block waits until the first
    one is copied, which only a restore that copies blocks as they come lets happen; the
    cache it gives continues as the one written. Event-driven: a restore that waited for
    every read first leaves the read waiting, the block missing, and the test failing."""
    import threading

    from kvbank.blocks import decode_header
    from kvbank.contracts.store_layout import MissingBlock, Reading

    n = 10
    tokens = list(range(1, n + 1))
    layers, end = kinds.freeze(_run(kinds, tokens), n)
    views = arrays.layer_views(layers)
    frames = [codec.encode_views(views, "float32", s, min(s + B, n), layout=kinds.layout,
                                 state=kinds.checkpoint_views(end) if min(s + B, n) == n
                                 else None) for s in range(0, n, B)]
    first_copied = threading.Event()
    order = []

    def get(i):
        order.append(i)
        if i == 1 and not first_copied.wait(timeout=30):  # the order: last, 0, then 1
            return None
        return frames[i]

    reading = Reading(len(frames))
    getter = threading.Thread(target=reading.get_all, args=(get,))
    getter.start()
    header = decode_header(reading[-1])[0]  # got first: where the restore stops
    try:
        got, headers = codec.decode_stream(
            reading.__getitem__, [B, B, header.n_tokens], header, capacity=16,
            done_with=lambda raw: first_copied.set() if raw is frames[0] else None)
    except MissingBlock:
        pytest.fail("the restore waited for every block to be read before it copied one")
    finally:
        getter.join()
    assert order == [2, 0, 1] and len(headers) == 3 and reading.nbytes == sum(map(len, frames))
    state = kinds.checkpoint_from_arrays(codec.decode_state(frames[-1]))
    more = [3, 1, 4]
    assert _continues(kinds, kinds.restore(got, state, n, owned=True), tokens + more, more)


def test_a_restore_from_lmdb_stands_at_the_last_block_that_carries_a_checkpoint(
        kinds, tmp_path):
    """Real LMDB: blocks through the coldstore's own writes, read back by the Restorer."""
    from kvbank.coldstore.store import ColdStore
    from kvbank.worker.tiers.restore import Restorer

    n, root = 10, root_for(TENANT)
    tokens = np.arange(1, n + 1, dtype=np.uint32)
    cache = _run(kinds, tokens[:8])
    at8 = kinds.snapshot(cache)
    for t in tokens[8:]:
        kinds.model(mx.array([int(t)])[None], cache)
    layers, end = kinds.freeze(cache, n)
    states = {8: at8, 10: end}
    store = ColdStore(tmp_path)
    store.put_session_tokens(TENANT, "s", tokens, B)
    ids = chain_block_ids(tokens, root, B)
    views = arrays.layer_views(layers)
    for s in range(0, n, B):
        e = min(s + B, n)
        bid = ids[s // B] if e - s == B else tail_block_id(ids[-1], tokens[s:e])
        frame = codec.encode_views(views, "float32", s, e, layout=kinds.layout,
                                state=kinds.checkpoint_views(states[e]) if e in states else None)
        assert store.commit_block(TENANT, "s", root, bid, s, frame) is not None
    store.close()

    restorer = Restorer(kinds=kinds, bank=make_bank(block_tokens=B), client=None,
                        store_dir=tmp_path, root_for=root_for, block_tokens=B)
    for prompt, at in ((np.concatenate([tokens, [5, 6]]), 10),  # the tail's checkpoint
                       (np.concatenate([tokens[:9], [5, 6]]), 8),  # the full block's
                       (np.concatenate([tokens[:6], [5, 6]]), None)):  # none stands before
        prompt = prompt.astype(np.uint32)
        got = restorer.ssd_prefix(prompt, chain_block_ids(prompt, root, B), TENANT,
                                  (TENANT, "s"), better_than=0)
        if at is None:
            assert got is None
            continue
        got_layers, checkpoint, got_n = got
        assert got_n == at
        restored = kinds.restore(got_layers, checkpoint, at, owned=True)
        assert _continues(kinds, restored, prompt.tolist(), prompt[at:].tolist())


def test_a_store_from_an_older_kvbank_reads_and_one_from_a_newer_is_refused(tmp_path):
    """KVB1 blocks (one K/V shape for every layer, no checksum) still decode; a store stamped
    with a newer format than this kvbank knows is never opened."""
    import json
    import struct

    import lmdb

    from kvbank.coldstore.store import ColdStore
    from kvbank.contracts.store_layout import (FORMAT_KEY, READ_FORMAT, STORE_FORMAT,
                                               StoreFormatError, StoreReader)

    k = np.arange(2 * 3 * 4, dtype=np.float32).reshape(3, 2, 4)  # (tokens, heads, dim)
    meta = json.dumps({"dtype": "float32", "n_layers": 2, "n_tokens": 3,
                       "k_shape": [3, 2, 4], "v_shape": [3, 2, 4]}).encode()
    pad = (-(8 + len(meta))) % 16
    v1 = (b"KVB1" + struct.pack("<I", len(meta) + pad) + meta + b" " * pad
          + (k.tobytes() + (k + 100).tobytes()) * 2)
    (keys, values), _ = codec.decode_blocks([v1])
    assert np.array_equal(np.array(keys[0]).transpose(1, 0, 2), k)
    assert np.array_equal(np.array(values[0]).transpose(1, 0, 2), k + 100)

    ColdStore(tmp_path / "s").close()  # a new store is stamped with this kvbank's format
    reader = StoreReader(tmp_path / "s", readonly=True)
    assert reader.format_version == STORE_FORMAT
    reader.close()
    env = lmdb.open(str(tmp_path / "s"), max_dbs=8)
    with env.begin(write=True) as txn:
        txn.put(FORMAT_KEY, struct.pack("<I", READ_FORMAT + 1), db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StoreFormatError, match="newer than this kvbank.*another --data-dir"):
        ColdStore(tmp_path / "s")


def test_a_flipped_byte_costs_the_blocks_from_it_on_and_store_verify_finds_it(kinds, tmp_path):
    """A restore reads the blocks before a corrupt one and recomputes from it; `kvbank store
    verify` names the block and the conversation offline."""
    import lmdb

    from kvbank.apps.store_verify import verify
    from kvbank.coldstore.store import ColdStore
    from kvbank import metrics
    from kvbank.config import Layout
    from kvbank.worker.tiers.restore import Restorer

    n, root = 12, root_for(TENANT)
    tokens = np.arange(1, n + 1, dtype=np.uint32)
    cache, states = kinds.new_cache(), {}
    for i, t in enumerate(tokens, 1):
        kinds.model(mx.array([int(t)])[None], cache)
        if i % B == 0:
            states[i] = kinds.snapshot(cache)
    layers = FullKind().freeze_layers(kinds.full_caches(cache), n)
    layout = Layout(tmp_path)
    store = ColdStore(layout.store_dir)
    store.put_session_tokens(TENANT, "s", tokens, B)
    ids = chain_block_ids(tokens, root, B)
    for s in range(0, n, B):
        frame = codec.encode_views(arrays.layer_views(layers), "float32", s, s + B, layout=kinds.layout,
                                state=kinds.checkpoint_views(states[s + B]))
        store.commit_block(TENANT, "s", root, ids[s // B], s, frame)
    store.close()
    env = lmdb.open(str(layout.store_dir), max_dbs=8)
    with env.begin(write=True) as txn:  # one byte of the third block's payload, as a disk might
        db = env.open_db(b"blocks", txn=txn)
        raw = bytearray(txn.get(ids[2], db=db))
        raw[-3] ^= 0x10
        txn.put(ids[2], bytes(raw), db=db)
    env.close()

    before = metrics.CORRUPT_BLOCKS._value.get()
    restorer = Restorer(kinds=kinds, bank=make_bank(block_tokens=B), client=None,
                        store_dir=layout.store_dir, root_for=root_for, block_tokens=B)
    prompt = np.concatenate([tokens, [5, 6]]).astype(np.uint32)
    got_layers, checkpoint, at = restorer.ssd_prefix(prompt, chain_block_ids(prompt, root, B),
                                                     TENANT, (TENANT, "s"), better_than=0)
    assert at == 8  # the two blocks before it, not the third
    assert metrics.CORRUPT_BLOCKS._value.get() == before + 1
    assert _continues(kinds, kinds.restore(got_layers, checkpoint, at, owned=True),
                      prompt.tolist(), prompt[at:].tolist())
    restorer.store().close()

    report = verify(layout)
    assert (report["blocks_ok"], report["blocks_corrupt"]) == (2, 1)
    assert list(report["corrupt"]) == [ids[2].hex()]
    assert report["sessions_affected"] == [f"{TENANT}/s"]
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvbank.apps.cli", "store", "verify", "--data-dir",
                          str(tmp_path), "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr  # a corrupt block: the command says so
    assert json.loads(out.stdout)["blocks_corrupt"] == 1


def test_a_prompt_read_stops_where_the_router_says_and_every_interval(kinds):
    assert kinds.splits(0, 5000, [100, 4999, 6000], 2048) == (100, 2048, 4096, 4999)
    assert kinds.splits(2100, 5000, [100, 3000], 2048) == (3000, 4096)  # past the restore
    assert kinds.splits(0, 5000, [100], 0) == (100,)  # the interval off
    full_only = CacheKinds(type("M", (Fake,), {"make_cache": lambda self: [KVCache()]})(),
                           "llama")
    assert full_only.splits(0, 5000, [100], 2048) == ()  # any prefix restores: no stops


def test_the_engines_commit_release_and_restore_over_the_fake_kind(kinds, tmp_path):
    """The engine's own KV manager (worker/tiers/manager.py: bank, records, writer, restorer, link)
    over the fake kind and a real coldstore process, no model and no stack: a turn committed,
    restored from RAM, released with its write-out, restored from LMDB. Each restore continues
    exactly as recomputation of the whole prompt does."""
    from kvbank.contracts.vocabulary import TrimReason
    from kvbank.v1 import api_pb2
    from tests.coldstore_rig import ColdstoreProc
    from kvbank.worker.tiers.manager import KVManager

    proc = ColdstoreProc(tmp_path / "data")
    h = KVManager(proc.layout, kinds=kinds, fingerprint=b"fake-kind", block_tokens=B,
                  bank_bytes=1 << 30, active_pin_s=0)
    try:
        session, tokens = (TENANT, "s"), np.arange(1, 11, dtype=np.uint32)  # 2 blocks + 2
        assert h.commit(session, tokens, _run(kinds, tokens)), "the record is not durable"
        more = [7, 8, 9]
        prompt = np.concatenate([tokens, more]).astype(np.uint32)
        ids = chain_block_ids(prompt, h.root_for(TENANT), B)

        t = h.restore(prompt, TENANT, session)
        assert (t.cached, t.source) == (10, api_pb2.CACHE_SOURCE_RAM)
        assert _continues(kinds, t.cache, prompt.tolist(), more)
        if t.handed is not None:  # the request ended without a commit: the entry comes back
            h.bank.take_back(t.handed)
        assert len(h.bank.entries) == 1

        r = h.release(session, write_out=True)
        assert (r.written_out_entries, r.unwritten_dropped, len(h.bank.entries)) == (1, 0, 0)
        assert h.conversations.get(session).durable_tokens == 10  # the coldstore's word, heard

        t = h.restore(prompt, TENANT, session)
        assert (t.cached, t.source, t.handed) == (10, api_pb2.CACHE_SOURCE_SSD, None)
        assert _continues(kinds, t.cache, prompt.tolist(), more)
    finally:
        h.close()
        proc.stop()


def test_the_restorable_length_is_a_fixed_point_over_the_kinds(kinds):
    """Each kind accepts a candidate length or lowers it: FULL any prefix, a window or a state
    only a checkpoint's position; a model of FULL caches alone restores any prefix."""
    assert kinds.restore_point([5, 12], 11) == 5
    assert kinds.restore_point([5, 12], 12) == 12
    assert kinds.restore_point([5, 12], 4) == 0
    full_only = CacheKinds(type("M", (Fake,), {"make_cache": lambda self: [KVCache()]})(),
                           "llama")
    assert full_only.restore_point([5], 11) == 11 and not full_only.checkpointed


def test_a_cache_takes_back_tokens_only_where_every_kind_can(kinds):
    """A rollback (`trim`) of a cache whose kinds all can take back tokens (full attention, a
    window before it wraps) leaves it as if they were never read; one with a state cannot."""
    full_window = type("M", (Fake,), {
        "make_cache": lambda self: [KVCache(), RotatingKVCache(max_size=WINDOW)],
        "parts": lambda self, cache: (cache[0], cache[1], _Stateless())})()
    fw = CacheKinds(full_window, "fake")
    cache = _run(fw, [1, 2])
    grown = _run(fw, [1, 2, 3])
    assert fw.trim(grown, 1) and fw.position(grown) == 2
    more = [4, 5]
    assert bool(mx.allclose(_logits(full_window, grown, more, last=2),
                            _logits(full_window, cache, more, last=2)))
    assert not fw.trim(_run(fw, [1, 2, 3, 4, 5, 6]), 1)  # the window wrapped: refused
    with_state = _run(kinds, [1, 2, 3])
    assert not kinds.trim(with_state, 1) and kinds.position(with_state) == 3  # untouched


class _Stateless:
    """A state that is never kept (for a model of full and window caches only)."""

    def __getitem__(self, i):
        return None

    def __setitem__(self, i, value):
        pass


def test_no_module_of_the_worker_writes_an_mlx_cache_outside_its_public_state():
    """Caches are restored through mlx-lm's `state` setters and constructors
    (worker/kv/kinds.py): nothing in the worker assigns a cache's fields or reads its
    private ones, so an mlx-lm upgrade that keeps `state` keeps kvbank working."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "worker"
    fields = {"keys", "values", "offset", "cache", "keep", "max_size", "caches"}
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for a in ast.walk(t):
                    if (isinstance(a, ast.Attribute) and a.attr in fields
                            and not (isinstance(a.value, ast.Name) and a.value.id == "self")):
                        bad.append(f"{path.relative_to(root)}:{node.lineno} assigns .{a.attr}")
            if isinstance(node, ast.Attribute) and node.attr in ("_idx", "_temporal_order"):
                bad.append(f"{path.relative_to(root)}:{node.lineno} reads .{node.attr}")
    assert not bad, bad


def test_a_turn_that_copies_its_history_holds_it_once_where_ssd_has_it(kinds, tmp_path):
    """A returning turn handed its conversation's entry, whose buffers have no room for its
    prompt, copies the history into buffers of its own (`with_room`). An entry still to be
    written stays whole, for its write and to come back, and the turn's reservation counts
    it; one all on SSD lets go of its arrays (the turn's copy is the only one in RAM), and a
    turn not committed then leaves the conversation on SSD alone, whence it restores."""
    from kvbank.v1 import api_pb2
    from tests.coldstore_rig import ColdstoreProc
    from kvbank.worker.tiers.manager import KVManager

    proc = ColdstoreProc(tmp_path / "data")
    h = KVManager(proc.layout, kinds=kinds, fingerprint=b"fake-kind", block_tokens=B,
                  bank_bytes=1 << 30, active_pin_s=0)
    try:
        session, tokens = (TENANT, "s"), np.arange(1, 11, dtype=np.uint32)
        h.commit(session, tokens, _run(kinds, tokens))
        prompt = np.concatenate([tokens, [7, 8, 9]]).astype(np.uint32)

        t = h.restore(prompt, TENANT, session)  # not on SSD yet
        assert t.source == api_pb2.CACHE_SOURCE_RAM and not t.handed.durable
        assert not kinds.has_room(t.handed.layers, len(prompt))
        h.copies_history(session, t.handed, len(prompt))
        assert h.ledger()["active_bytes"] == t.handed.nbytes and t.handed.layers
        h.abandon(session, t.handed)
        assert len(h.bank.entries) == 1 and h.ledger()["active_bytes"] == 0

        assert h.flush().written_entries == 1
        t = h.restore(prompt, TENANT, session)
        assert t.source == api_pb2.CACHE_SOURCE_RAM and t.handed.durable
        h.copies_history(session, t.handed, len(prompt))
        assert h.ledger()["active_bytes"] == 0 and not t.handed.layers
        assert _continues(kinds, t.cache, prompt.tolist(), [7, 8, 9])  # the turn's copy
        h.abandon(session, t.handed)
        assert len(h.bank.entries) == 0
        t = h.restore(prompt, TENANT, session)
        assert (t.cached, t.source) == (10, api_pb2.CACHE_SOURCE_SSD)
    finally:
        h.close()
        proc.stop()
