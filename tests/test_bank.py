"""SessionBank: what leaves first, what is found, and what a restore gives back.

Real SessionBank and its eviction rules (worker/tiers/eviction.py), real MLX arrays, no
coldstore (no writer: nothing is ever written; a "queued write" is modelled by the bank
recording a job by hand, `write_queued`). Eviction-order tests size entries by hand; the
restores with the real tiny model are in tests/test_bank_restore.py. Time is the test's own
`Clock`: no test sleeps to let a pin or a recency pass.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from kvbank.blocks import chain_root, common_prefix_len
from kvbank.contracts.receipts import ShrinkReceipt
from kvbank.worker.kv import arrays
from kvbank.worker.tiers.bank import SessionBank
from kvbank.worker.tiers.eviction import EvictionPolicy

pytestmark = pytest.mark.unit  # make test-fast

TENANT = "acme"
FINGERPRINT = b"test-fingerprint"
PIN_S = 0.3  # active_pin_s where a test needs both active and idle sessions


def root_for(tenant: str):
    return chain_root(FINGERPRINT, tenant)


class Clock:
    """The bank's monotonic clock, moved by the test. Every reading is one `tick` later than
    the one before, so uses are strictly ordered (as on a real clock); `advance` jumps."""

    def __init__(self, start: float = 1000.0, tick: float = 1e-6):
        self.now, self.tick = start, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_bank(*, block_tokens: int = 4, active_pin_s: float = 0.0,
              max_bytes: int = 1 << 30, clock: Clock | None = None) -> SessionBank:
    return SessionBank(block_tokens=block_tokens, root_for=root_for, max_bytes=max_bytes,
                       active_pin_s=active_pin_s, clock=clock or Clock())


def policy(bank: SessionBank, **kw) -> EvictionPolicy:
    """The rules of who leaves the bank (no writer: no coldstore here)."""
    return EvictionPolicy(bank, **kw)


def layers_of(nbytes: int) -> arrays.Layers:
    """One layer whose K and V together hold exactly `nbytes` (a multiple of 8)."""
    assert nbytes % 8 == 0
    k = mx.zeros((nbytes // 8,), dtype=mx.float32)
    v = mx.ones((nbytes // 8,), dtype=mx.float32)
    mx.eval(k, v)
    return [(k, v)]


def toks(*parts) -> np.ndarray:
    out: list[int] = []
    for p in parts:
        out.extend(p)
    return np.asarray(out, dtype=np.uint32)


def own_tokens(i: int, n: int = 6) -> np.ndarray:
    """Tokens no other session shares (distinct first token per i)."""
    return np.arange(1000 * (i + 1), 1000 * (i + 1) + n, dtype=np.uint32)


def put(bank: SessionBank, sid: str, tokens: np.ndarray, nbytes: int = 800, *,
        tenant: str = TENANT, durable_tokens: int = 0, prefetched: bool = False):
    return bank.insert((tenant, sid), tokens, layers_of(nbytes), durable_tokens=durable_tokens,
                       prefetched=prefetched)


def log_ids(bank: SessionBank) -> list[str]:
    return [ev.session_id for ev in bank.eviction_log]


def pause_past_pin(bank: SessionBank) -> None:
    """Everything used before this call is idle after it; what is used next is active."""
    bank.clock.advance(bank.active_pin_s + 0.05)


def check_invariants(bank: SessionBank) -> None:
    assert bank.total_nbytes == sum(e.nbytes for e in bank.entries.values())
    assert bank.total_nbytes == sum(arrays.layers_nbytes(e.layers) for e in bank.entries.values())
    for e in bank.entries.values():
        assert e in bank.session_entries(e.session)
        hit = bank.lookup(e.tokens, e.session[0])
        assert hit is not None and hit.n_tokens == e.n_tokens, (e.session, e.n_tokens, hit)
        assert np.array_equal(hit.entry.tokens[: hit.n_tokens], e.tokens)


# -- 1, 2: eviction order, dynamic ceiling ---------------------------------------------------


def test_shrink_to_zero_evicts_idle_lru_then_active_lru_in_exact_order():
    """A trim takes idle conversations (least recently used first) before active ones, and
    never a conversation with a request running."""
    bank = make_bank(active_pin_s=PIN_S)
    put(bank, "idle-1", own_tokens(1))
    put(bank, "idle-2", own_tokens(2))
    put(bank, "idle-3", own_tokens(3))
    put(bank, "idle-1", toks(own_tokens(1), [7, 7]))  # idle-1's next turn: now its newest
    pause_past_pin(bank)
    put(bank, "busy", own_tokens(4))
    bank.begin_request((TENANT, "busy"))
    a1 = put(bank, "active-1", own_tokens(5))
    put(bank, "active-2", own_tokens(6))
    bank.touch(a1)  # active-1 used after active-2
    assert not bank.is_active((TENANT, "idle-3")) and bank.is_active((TENANT, "active-2"))

    receipt = policy(bank).shrink_to_bytes(0, reason="critical")

    assert log_ids(bank) == ["idle-2", "idle-3", "idle-1", "active-2", "active-1"]
    assert [ev.prefix_tokens for ev in bank.eviction_log] == [6, 6, 8, 6, 6]
    assert {ev.reason for ev in bank.eviction_log} == {"critical"}
    assert receipt.evicted_entries == 5 and receipt.evicted_bytes == 5 * 800
    assert [e.session[1] for e in bank.entries.values()] == ["busy"]
    assert bank.total_nbytes == receipt.bytes_after == 800
    check_invariants(bank)


def test_protect_active_keeps_active_session_above_target():
    """Dynamic ceiling: a trim never makes an active conversation re-prefill, so the bank may
    stay above its ceiling; the receipt says where it stopped."""
    bank = make_bank(active_pin_s=PIN_S)
    put(bank, "idle-old", own_tokens(1), 1600)
    put(bank, "idle-new", own_tokens(2), 800)
    pause_past_pin(bank)
    active = put(bank, "active", own_tokens(3), 2400)
    bank.ceiling_bytes = 1000
    assert bank.effective_max_bytes == 1000

    receipt = policy(bank).shrink_to_bytes(bank.effective_max_bytes, reason="dynamic_ceiling",
                                           protect_active=True)

    assert log_ids(bank) == ["idle-old", "idle-new"]
    assert receipt.evicted_entries == 2
    assert list(bank.entries.values()) == [active]
    assert bank.total_nbytes == 2400 > bank.effective_max_bytes
    assert receipt.at > 0
    assert receipt == ShrinkReceipt(reason="dynamic_ceiling", target_bytes=1000,
                                    evicted_entries=2, evicted_bytes=2400, unwritten_kept=0,
                                    unwritten_dropped=0, bytes_after=2400,
                                    kind="shrink_to_bytes", at=receipt.at)
    assert bank.receipts[-1].evicted_entries == 2  # it left the bank as a receipt too
    check_invariants(bank)


def test_shrink_stops_as_soon_as_under_target():
    """A trim takes only what it must: the most recently used idle entry stays."""
    bank = make_bank()
    for i in range(4):
        put(bank, f"s{i}", own_tokens(i), 800)
    policy(bank).shrink_to_bytes(1600, reason="warning")
    assert log_ids(bank) == ["s0", "s1"]
    assert sorted(e.session[1] for e in bank.entries.values()) == ["s2", "s3"]
    check_invariants(bank)


# -- 3: protect_unwritten ----------------------------------------------------------------------


def _unwritten_bank() -> tuple[SessionBank, dict[str, object]]:
    """Five idle entries, oldest first. No coldstore here: the bank records a job by hand
    (`write_queued`, as it does the writer's report) to model a write that is queued and not
    yet committed."""
    bank = make_bank()
    e = {}
    e["unwritten-1"] = put(bank, "unwritten-1", own_tokens(1))
    bank.write_queued(e["unwritten-1"], 1)  # queued, nothing durable: RAM holds the only copy
    e["durable"] = put(bank, "durable", own_tokens(2), durable_tokens=6)
    e["written"] = put(bank, "written", own_tokens(3), durable_tokens=6)
    bank.write_queued(e["written"], 3)  # committed, ack not yet cleared: not awaiting anything
    e["unwritten-2"] = put(bank, "unwritten-2", own_tokens(4), durable_tokens=4)
    bank.write_queued(e["unwritten-2"], 4)  # half written
    e["never-queued"] = put(bank, "never-queued", own_tokens(5))  # anonymous-like: no write
    return bank, e


def test_protect_unwritten_keeps_queued_writes_and_takes_durable_ones():
    """At `warning` a trim never drops KV whose SSD write is still queued; it stops above
    target and says how many it kept. At `critical` everything idle goes, and the receipt
    counts the unwritten losses."""
    bank, e = _unwritten_bank()
    assert [x.awaits_queued_write for x in e.values()] == [True, False, False, True, False]

    warn = policy(bank).shrink_to_bytes(0, reason="warning", protect_unwritten=True)
    assert log_ids(bank) == ["durable", "written", "never-queued"]
    assert [ev.durable for ev in bank.eviction_log] == [True, True, False]
    assert warn.unwritten_kept == 2 and warn.unwritten_dropped == 0
    assert warn.evicted_entries == 3
    assert bank.total_nbytes == warn.bytes_after == 1600 > 0
    assert set(bank.entries) == {e["unwritten-1"].key, e["unwritten-2"].key}
    check_invariants(bank)

    crit = policy(bank).shrink_to_bytes(0, reason="critical")
    assert log_ids(bank)[3:] == ["unwritten-1", "unwritten-2"]
    assert crit.unwritten_dropped == 2 and crit.unwritten_kept == 0
    assert bank.total_nbytes == 0 and not bank.entries
    check_invariants(bank)


def test_critical_trim_takes_everything_idle_in_lru_order_and_counts_unwritten():
    bank, _ = _unwritten_bank()
    crit = policy(bank).shrink_to_bytes(0, reason="critical")
    assert log_ids(bank) == ["unwritten-1", "durable", "written", "unwritten-2", "never-queued"]
    assert crit.unwritten_dropped == 2 and crit.evicted_entries == 5
    assert bank.total_nbytes == 0


# -- 4: shrink_for_admission -------------------------------------------------------------------


BASE = [1, 2, 3, 4, 5, 6]


def _branch_bank():
    """Sessions with branches (two diverging histories: both stay). Oldest first:
    A1 C1 B D1 A2 C2 D2; A1, C1, D1 are non-terminal (shorter than their session's newest).
    D has a request running."""
    bank = make_bank()
    e = {}

    def sess(name, tail):
        return toks([100 * ord(name)], BASE, tail)

    e["A1"] = put(bank, "A", sess("A", [10, 11]))
    e["C1"] = put(bank, "C", sess("C", [10, 11]))
    e["B"] = put(bank, "B", sess("B", [10, 11]))
    e["D1"] = put(bank, "D", sess("D", [10, 11]))
    e["A2"] = put(bank, "A", sess("A", [20, 21, 22]))
    e["C2"] = put(bank, "C", sess("C", [20, 21, 22]))
    e["D2"] = put(bank, "D", sess("D", [20, 21, 22]))
    assert len(bank.entries) == 7  # diverging turns are not superseded
    assert bank.terminal((TENANT, "A")) is e["A2"]
    bank.begin_request((TENANT, "D"))
    return bank, e


def test_admission_takes_non_terminal_first_then_terminal_never_restore_source_or_busy():
    """Before a prefill the bank frees abandoned branches first, then whole idle turns; the
    KV the incoming prompt restores from and a conversation mid-request are never taken."""
    bank, e = _branch_bank()
    incoming = toks(e["C1"].tokens, [99, 98])  # C's user goes back to the C1 branch
    assert bank.lookup(incoming, TENANT).entry is e["C1"]

    got = policy(bank).shrink_for_admission(0, protect_tokens=incoming, reason="admission",
                                            tenant=TENANT)

    assert (got.non_terminal_evicted, got.terminal_evicted) == (1, 3)
    assert log_ids(bank) == ["A", "B", "A", "C"]
    assert [ev.prefix_tokens for ev in bank.eviction_log] == [9, 9, 10, 10]  # A1, B, A2, C2
    assert set(bank.entries) == {e["C1"].key, e["D1"].key, e["D2"].key}
    check_invariants(bank)


def test_admission_prefers_a_newer_non_terminal_over_an_older_terminal():
    """Freeing a little room takes an abandoned branch even when an idle conversation's
    latest turn is older."""
    bank, e = _branch_bank()
    target = bank.total_nbytes - 800  # one entry must go
    got = policy(bank).shrink_for_admission(target, protect_tokens=None, reason="admission")
    assert (got.non_terminal_evicted, got.terminal_evicted) == (1, 0)
    assert [(ev.session_id, ev.prefix_tokens) for ev in bank.eviction_log] == [("A", 9)]
    assert e["B"].key in bank.entries and e["A1"].key not in bank.entries

    got = policy(bank).shrink_for_admission(target - 800, protect_tokens=None, reason="admission")
    assert (got.non_terminal_evicted, got.terminal_evicted) == (1, 0)  # C1 (D1 is busy)
    assert log_ids(bank) == ["A", "C"]
    check_invariants(bank)


# -- 5, 6: lookup --------------------------------------------------------------------------------


def brute_common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = 0
    while n < min(len(a), len(b)) and int(a[n]) == int(b[n]):
        n += 1
    return n


@pytest.mark.parametrize("system_len", [4, 8, 10, 11, 13])  # block_tokens=4: 10, 11, 13 mid-block
def test_shared_system_prompt_is_found_across_sessions(system_len):
    """A new conversation with the same system prompt restores that prompt from another
    session's KV: exactly the shared tokens, no more, no fewer."""
    bank = make_bank(block_tokens=4)
    system = np.arange(500, 500 + system_len, dtype=np.uint32)
    a = put(bank, "A", toks(system, [1, 2, 3, 4, 5, 6, 7]))
    put(bank, "X", own_tokens(9, 20))  # unrelated
    query = toks(system, [9, 8, 7, 6, 5])  # B's first turn, differs right after the prompt

    hit = bank.lookup(query, TENANT)

    assert hit is not None and hit.entry is a
    assert hit.n_tokens == brute_common_prefix(a.tokens, query) == system_len
    assert np.array_equal(hit.entry.tokens[: hit.n_tokens], query[: hit.n_tokens])
    assert hit.entry.tokens[hit.n_tokens] != query[hit.n_tokens]

    # The prompt alone (shorter than A's entry) is a hit of the whole prompt.
    hit = bank.lookup(system, TENANT)
    assert hit is not None and hit.entry is a and hit.n_tokens == system_len


def test_shared_system_prompt_shorter_than_one_block_is_found():
    """A system prompt shorter than one block (the default block is 256 tokens) is shared
    across sessions too."""
    bank = make_bank(block_tokens=16)
    system = np.arange(500, 510, dtype=np.uint32)  # 10 tokens < 16
    a = put(bank, "A", toks(system, range(1, 21)))  # 30 tokens: one full block
    query = toks(system, [99, 98, 97])
    hit = bank.lookup(query, TENANT)
    assert hit is not None and hit.entry is a and hit.n_tokens == 10


def test_lookup_returns_the_longest_verified_prefix_among_sessions():
    bank = make_bank(block_tokens=4)
    system = list(range(500, 510))
    put(bank, "A", toks(system, [1, 2, 3, 4, 5, 6]))
    b = put(bank, "B", toks(system, [1, 2, 3, 9, 9, 9]))
    put(bank, "C", toks(system, [1, 7]))
    query = toks(system, [1, 2, 3, 9, 5])
    hit = bank.lookup(query, TENANT)
    assert hit.entry is b and hit.n_tokens == 14 == brute_common_prefix(b.tokens, query)


def test_session_id_never_selects_kv_and_tenants_are_isolated():
    """Only tokens select KV: a prompt sharing nothing with a session's entry is a miss, and
    another tenant's identical prompt never sees this tenant's KV."""
    bank = make_bank(block_tokens=4)
    long_entry = put(bank, "s1", own_tokens(1, 10))
    short_entry = put(bank, "s2", own_tokens(2, 3))  # shorter than one block
    assert bank.lookup(own_tokens(7, 10), TENANT) is None  # s1's next prompt, nothing shared

    for entry in (long_entry, short_entry):
        assert bank.lookup(entry.tokens, TENANT).entry is entry  # control
        assert bank.lookup(entry.tokens, "other-tenant") is None
        assert bank.lookup(toks(entry.tokens, [1]), "other-tenant") is None
    # Another tenant's copy of the same tokens is its own entry.
    theirs = put(bank, "s1", own_tokens(1, 10), tenant="other-tenant")
    assert bank.lookup(own_tokens(1, 10), "other-tenant").entry is theirs
    assert bank.lookup(own_tokens(1, 10), TENANT).entry is long_entry


# -- 7: superseding and the ledger ------------------------------------------------------------


def test_next_turn_supersedes_the_previous_prefix_entry():
    """A session's next turn replaces its previous turn's entry (it serves every prefix of
    it), so RAM holds one copy of the conversation; the durable extent carries over."""
    bank = make_bank(block_tokens=4)
    t1 = own_tokens(1, 10)
    first = put(bank, "s", t1, 800, durable_tokens=8)
    t2 = toks(t1, [5, 6, 7, 8, 9])
    second = put(bank, "s", t2, 1600)

    assert bank.session_entries((TENANT, "s")) == [second]
    assert first.key not in bank.entries
    assert bank.total_nbytes == 1600
    assert second.durable_tokens == 8
    assert not bank.eviction_log  # superseding is not an eviction
    hit = bank.lookup(toks(t1, [42]), TENANT)
    assert hit.entry is second and hit.n_tokens == 10
    check_invariants(bank)


def test_a_prerendered_entry_leaves_first_and_its_querys_commit_supersedes_it():
    """The history a next query will carry, computed ahead of it (worker/compute/prerender.py):
    a guess, so it leaves RAM before any conversation's turn, even one idle longer; and once
    that query's turn (another session key) commits over all of it, it goes."""
    bank = make_bank(active_pin_s=PIN_S)
    put(bank, "old", own_tokens(1))
    guess = bank.insert((TENANT, "next:s"), own_tokens(2, 8), layers_of(800), prerendered=True)
    put(bank, "s", own_tokens(3))
    assert not bank.is_active((TENANT, "next:s"))  # never pinned as active
    policy(bank).shrink_to_bytes(bank.total_nbytes - 1, reason="critical")
    assert log_ids(bank) == ["next:s"] and guess.key not in bank.entries

    guess = bank.insert((TENANT, "next:t"), own_tokens(4, 8), layers_of(800), prerendered=True)
    query = put(bank, "~query", toks(own_tokens(4, 8), [1, 2, 3]))
    assert guess.key not in bank.entries and query.key in bank.entries
    assert bank.prerendered_entries(TENANT) == []
    check_invariants(bank)


def test_random_operations_keep_the_ledger_and_index_consistent():
    """Seeded random inserts, branches, lookups, trims, admissions and releases: after every
    step the byte ledger equals the live entries and every entry is findable by its tokens."""
    rng = random.Random(64)
    bank = make_bank(block_tokens=4)
    sessions = [(t, f"s{i}") for t in ("t1", "t2") for i in range(4)]
    history: dict = {}
    system = [900 + i for i in range(6)]
    for step in range(400):
        op = rng.random()
        s = rng.choice(sessions)
        if op < 0.45:
            prev = history.get(s)
            if prev is not None and rng.random() < 0.6:
                cut = rng.randint(0, len(prev)) if rng.random() < 0.3 else len(prev)
                new = list(prev[:cut]) + [rng.randint(0, 9) for _ in range(rng.randint(1, 7))]
            else:
                new = (system[: rng.randint(0, 6)]
                       + [rng.randint(0, 9) for _ in range(rng.randint(1, 12))])
            history[s] = new
            e = bank.insert(s, np.asarray(new, np.uint32), layers_of(8 * rng.randint(1, 40)),
                            durable_tokens=rng.choice([0, len(new)]))
            if rng.random() < 0.3:
                bank.write_queued(e, step)  # models a queued write (no coldstore here)
        elif op < 0.7:
            q = np.asarray(system[: rng.randint(0, 6)]
                           + [rng.randint(0, 9) for _ in range(rng.randint(1, 12))], np.uint32)
            hit = bank.lookup(q, s[0])
            if hit is not None:
                assert hit.entry.session[0] == s[0]
                assert 0 < hit.n_tokens == common_prefix_len(hit.entry.tokens, q)
        elif op < 0.8:
            busy_keys = {k for k, e in bank.entries.items() if bank.is_busy(e.session)}
            policy(bank).shrink_to_bytes(rng.randint(0, max(1, bank.total_nbytes)), reason="r",
                                         protect_active=rng.random() < 0.5,
                                         protect_unwritten=rng.random() < 0.5)
            assert busy_keys <= set(bank.entries)  # a request's KV is never trimmed
        elif op < 0.88:
            q = history.get(s)
            protect = None if q is None else np.asarray(q, np.uint32)
            source = None if q is None else bank.lookup(protect, s[0])
            policy(bank).shrink_for_admission(rng.randint(0, max(1, bank.total_nbytes)),
                                              protect_tokens=protect,
                                              reason="admission", tenant=s[0])
            assert source is None or source.entry.key in bank.entries  # restore source stays
        elif op < 0.93:
            policy(bank).release_sessions(
                rng.choice([None, rng.randint(0, max(1, bank.total_nbytes))]), reason="release")
        elif bank.is_busy(s):
            bank.end_request(s)
        else:
            bank.begin_request(s)
        check_invariants(bank)
    assert len(bank.eviction_log) > 20  # the run did exercise eviction


# -- 9: release_sessions ---------------------------------------------------------------------


def _release_bank():
    """Idle sessions (oldest first): dirty-old, durable-old, branchy (one durable entry and
    one not), durable-new; a busy durable session and a durable session to keep."""
    bank = make_bank()
    put(bank, "dirty-old", own_tokens(1), 800)
    put(bank, "durable-old", own_tokens(2), 1600, durable_tokens=6)
    put(bank, "branchy", toks(own_tokens(3), [1, 1]), 800, durable_tokens=8)
    put(bank, "branchy", toks(own_tokens(3), [2, 2, 2]), 2400)
    put(bank, "durable-new", own_tokens(4), 800, durable_tokens=6)
    put(bank, "busy", own_tokens(5), 800, durable_tokens=6)
    put(bank, "keep", own_tokens(6), 800, durable_tokens=6)
    bank.begin_request((TENANT, "busy"))
    return bank


def test_release_all_idle_sessions_durable_first_then_lru():
    """Releasing idle conversations frees those already on SSD first (nothing lost), then the
    least recently used; a conversation mid-request and a kept one stay whole."""
    bank = _release_bank()
    r = policy(bank).release_sessions(None, reason="idle_release",
                                      keep_sessions=[(TENANT, "keep")],
                                      write_out_before_release=False)

    rows = [(w.session_id, w.entries, w.held_bytes, w.on_ssd_entries, w.dropped_entries,
             w.written_out_entries) for w in r.rows]
    assert rows == [
        ("durable-old", 1, 1600, 1, 0, 0),
        ("durable-new", 1, 800, 1, 0, 0),
        ("dirty-old", 1, 800, 0, 1, 0),
        ("branchy", 2, 3200, 1, 1, 0),
    ]
    assert log_ids(bank) == ["durable-old", "durable-new", "dirty-old", "branchy", "branchy"]
    assert [ev.prefix_tokens for ev in bank.eviction_log][-2:] == [8, 9]  # shorter entry first
    assert [ev.durable for ev in bank.eviction_log] == [True, True, False, True, False]
    assert {ev.reason for ev in bank.eviction_log} == {"idle_release"}
    assert all(ev.release_write_out is None for ev in bank.eviction_log)
    assert r.skipped_busy_sessions == 1
    assert r.released_entries == 5 and r.released_bytes == 6400
    assert r.unwritten_dropped == 2 and r.written_out_entries == 0 and r.write_out_s == 0.0
    assert sorted(e.session[1] for e in bank.entries.values()) == ["busy", "keep"]
    assert bank.total_nbytes == 1600
    check_invariants(bank)


def test_release_with_target_stops_once_under_target():
    """A release to a byte target frees whole conversations only until the bank fits."""
    bank = _release_bank()
    target = bank.total_nbytes - 1600 - 1  # durable-old alone is not enough
    r = policy(bank).release_sessions(target, reason="admission_release")
    assert [w.session_id for w in r.rows] == ["durable-old", "durable-new"]
    assert r.skipped_busy_sessions == 0  # stopped before reaching the busy session
    assert bank.total_nbytes <= target
    assert sorted({e.session[1] for e in bank.entries.values()}) == [
        "branchy", "busy", "dirty-old", "keep"]

    r = policy(bank).release_sessions(bank.total_nbytes, reason="admission_release")
    assert r.rows == [] and r.released_bytes == 0
    check_invariants(bank)


def test_hinted_conversations_stay_longest_and_the_last_hinted_goes_first():
    """Agents that said they will come back (a live prefetch hint, worker/tiers/prefetch.py) keep
    their KV longer than conversations without a hint, even more recently used ones. Of two
    hinted, the one hinted last leaves first: its tool call started last, and least recently
    used would send away the agent due back soonest. A prefetched entry whose hint lapsed,
    not used since, leaves before all."""
    clock = Clock()
    bank = make_bank(clock=clock)
    hints: dict = {}
    for i, name in enumerate(["back-first", "back-second", "no-hint", "lapsed"]):
        put(bank, name, own_tokens(i + 1), durable_tokens=6, prefetched=name == "lapsed")
        clock.advance(1)
    hints[(TENANT, "back-first")], hints[(TENANT, "back-second")] = 10.0, 20.0
    for left in (3, 2, 1, 0):
        policy(bank, hinted_at=hints.get).shrink_to_bytes(800 * left, reason="test")
    assert log_ids(bank) == ["lapsed", "no-hint", "back-second", "back-first"]


# -- one writer per field ---------------------------------------------------------------------


def test_an_entrys_fields_have_one_writer_the_bank():
    """Every field of a BankEntry is written by the bank alone: to any other module an entry
    is frozen (assigning a field raises), and no module of the worker but bank.py goes around
    that (`object.__setattr__`). The writer reports a job's fate and the coldstore its durable
    extent; the bank records them (`write_queued`, `write_ended`, `mark_durable`, ...)."""
    import ast
    import dataclasses
    from pathlib import Path

    bank = make_bank()
    e = put(bank, "s", own_tokens(1))
    for f in dataclasses.fields(e):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(e, f.name, getattr(e, f.name))
    bank.write_queued(e, 7)
    bank.mark_durable(e.session, 4)
    assert (e.write_job, e.write_pending, e.durable_tokens) == (7, False, 4)
    bank.write_ended(e.session, 7, "refused")  # a retry outcome: sent again, protected
    assert (e.write_job, e.write_pending) == (None, True) and e.awaits_queued_write

    root = Path(__file__).resolve().parents[1] / "worker"
    around = [f"{p.relative_to(root)}:{n.lineno}" for p in sorted(root.rglob("*.py"))
              if p.name != "bank.py" for n in ast.walk(ast.parse(p.read_text()))
              if isinstance(n, ast.Attribute) and n.attr == "__setattr__"]
    assert not around, around


def test_only_the_eviction_rules_take_kv_out_of_the_bank():
    """Who leaves RAM is decided in one module: only worker/tiers/eviction.py tells the bank
    to evict (a request taking its entry, or giving it back, is not a leaving)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "worker"
    callers = {str(p.relative_to(root)) for p in root.rglob("*.py")
               for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr == "evict"}
    assert callers == {"tiers/eviction.py"}, callers


def test_running_requests_hold_their_caches_and_the_largest_forward_once():
    """The engine runs one forward at a time: the ledger holds each running request's cache
    and, of their forwards' working memory, the largest; it goes with the last request."""
    bank = make_bank()
    a, b = (TENANT, "a"), (TENANT, "b")
    for s, own, forward in ((a, 1000, 300), (b, 2000, 500)):
        bank.begin_request(s)
        bank.reserve_active(s, own, forward)
    assert bank.ledger()["held_bytes"] == 1000 + 2000 + 500
    bank.end_request(b)
    assert bank.ledger()["held_bytes"] == 1000 + 300
    bank.end_request(a)
    assert bank.ledger()["held_bytes"] == 0


def test_a_request_past_its_prompt_holds_a_decode_steps_memory_not_its_prompt_forwards():
    """Once a request has read its prompt it runs decode steps: the ledger holds their working
    memory for it, so another prompt forward or a batch join finds that room; while a second
    request of the same conversation runs (it may be reading its prompt), nothing changes."""
    bank = make_bank()
    a, b = (TENANT, "a"), (TENANT, "b")
    for s, own, forward in ((a, 1000, 300), (b, 2000, 500)):
        bank.begin_request(s)
        bank.reserve_active(s, own, forward)
    bank.settle_forward(b, 20)
    assert bank.ledger()["forward_bytes"] == 300  # a still reads its prompt
    bank.settle_forward(a, 10)
    assert bank.ledger()["held_bytes"] == 1000 + 2000 + 20
    bank.begin_request(a)  # a second request of a's, its prompt's forward
    bank.reserve_active(a, 0, 400)
    bank.settle_forward(a, 10)
    assert bank.ledger()["forward_bytes"] == 400
