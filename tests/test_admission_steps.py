"""The admission's steps 3-5 (`make_room`) on a real SessionBank with real MLX arrays; entry
sizes are chosen by the test (pure policy: who leaves, who stays, what the receipt says)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.test_bank import TENANT, layers_of, make_bank, own_tokens, toks
from kvbank.contracts.pricing import Pricing
from kvbank.contracts.failures import Refused
from kvbank.heap import resident_bytes
from kvbank.worker.tiers.eviction import EvictionPolicy

pytestmark = pytest.mark.unit  # make test-fast

KV_PER_TOKEN = 8  # bytes: a cache of n tokens is priced 8 * (n + 256) (Pricing.cache_bytes)


def _fill(bank, sessions, nbytes=800):
    for i, session in enumerate(sessions):
        bank.insert(session, own_tokens(i), layers_of(nbytes))


def _room(bank, *, free: int, need: int, tokens, tenant=TENANT, session_id="incoming",
          chain_shed=False):
    pricing = Pricing(KV_PER_TOKEN, 0, 16)
    return EvictionPolicy(bank).make_room(
        pricing=pricing, budget=bank.total_nbytes + free, need=need, solo_need=need,
        tokens=np.asarray(tokens, np.uint32), tenant=tenant, session_id=session_id, running=0,
        chain_shed=chain_shed)


@pytest.mark.parametrize("chain_shed, shed", [(False, 1), (True, 4)])
def test_admission_chain_shed_uses_the_larger_target_and_says_so(chain_shed, shed):
    """--admission-chain-shed: step 4 also sheds room for the prompt's whole cache (44 tokens
    and a growth step: 2,400 bytes here), so three more 800-byte entries leave than the bytes
    missing need."""
    bank = make_bank(active_pin_s=600)  # recently used: the LRU step leaves them to the shed
    _fill(bank, [(TENANT, f"s{i}") for i in range(6)])
    r = _room(bank, free=1000, need=1800, tokens=range(44), chain_shed=chain_shed)
    assert r.decision == "admitted" and r.lru_evicted == 0
    assert r.shed_non_terminal + r.shed_terminal == shed
    assert r.shed_target_bytes == 4800 - 800 - (2400 if chain_shed else 0)
    assert len(bank.entries) == 6 - shed


def test_the_release_step_takes_the_prompts_restore_source_last_and_only_to_make_room():
    """Another conversation's entry that the prompt shares a prefix with (a system prompt)
    stays while other conversations' releases make room; when only it can, it goes (written
    out first, in the engine); when even it cannot, it stays and the request is refused."""
    bank = make_bank()
    source = bank.insert((TENANT, "other"), own_tokens(1, 40), layers_of(4000))
    with pytest.raises(Refused):  # releasing it would not make the room: it stays
        _room(bank, free=0, need=10_000, tokens=toks(own_tokens(1, 40), [7, 7]))
    assert source.key in bank.entries

    idle = bank.insert((TENANT, "idle"), own_tokens(2, 40), layers_of(4000))
    r = _room(bank, free=0, need=3_000, tokens=toks(own_tokens(1, 40), [7, 7]))
    assert r.decision == "admitted"
    assert source.key in bank.entries and idle.key not in bank.entries

    r = _room(bank, free=0, need=3_000, tokens=toks(own_tokens(1, 40), [7, 7]))
    assert r.decision == "admitted" and r.released_sessions == 1
    assert source.key not in bank.entries


def test_what_an_admission_releases_leaves_the_process_before_the_request_allocates():
    """MLX keeps the buffers it frees for reuse, and glibc its heap's pages, until the engine
    trims after the turn. Kept through the admission, a conversation released to make room
    and the one restored into that room were resident together: a worker went 2 % past its
    budget and the memory limit sized from it killed it."""
    MB = 1 << 20
    kept_before = mx.set_cache_limit(1 << 30)  # MLX keeps what is freed (the worker: <= 512 MB)
    try:
        bank = make_bank()
        layers = [(mx.zeros((MB,)), mx.ones((MB,))) for _ in range(12)]  # 96 MB in 4 MB arrays
        mx.eval(layers)
        bank.insert((TENANT, "idle"), own_tokens(2, 40), layers)
        del layers
        before = resident_bytes()
        r = _room(bank, free=0, need=80 * MB, tokens=own_tokens(3, 10))
        assert r.decision == "admitted" and r.lru_evicted + r.released_sessions == 1
        assert resident_bytes() < before - 64 * MB, "the released KV is still resident"
    finally:
        mx.set_cache_limit(kept_before)


def test_the_keep_list_is_the_requests_own_conversation_in_its_own_tenant():
    """Two tenants each have a conversation named "agent": tenant-a's request keeps its own,
    not tenant-b's."""
    bank = make_bank(active_pin_s=600)
    _fill(bank, [("tenant-a", "agent"), ("tenant-b", "agent")])
    with pytest.raises(Refused):
        _room(bank, free=0, need=10_000, tokens=[5, 6, 7], tenant="tenant-a",
              session_id="agent")
    left = {entry.session for entry in bank.entries.values()}
    assert left == {("tenant-a", "agent")}


def test_a_request_waits_for_writes_in_flight_rather_than_refused():
    """Nothing runs, but KV is on its way to the coldstore (staged): its acknowledgement frees
    the staging and makes entries releasable, so the request waits (first in line) instead
    of being refused; with nothing in flight, it is refused."""
    staged = [0]
    bank = make_bank(active_pin_s=600)
    bank.staged_bytes = lambda: staged[0]  # the writer's figure
    _fill(bank, [(TENANT, "incoming")])  # its own conversation's entry: it stays
    with pytest.raises(Refused):
        _room(bank, free=100, need=850, tokens=range(10))
    staged[0] = 500
    r = _room(bank, free=100, need=850, tokens=range(10))
    assert r.decision == "wait" and r.verdict == "after_the_conversation_cache_reaches_ssd"
