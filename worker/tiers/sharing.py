"""Concurrent prefill sharing: requests that start together (agents sharing a system prompt)
compute their common prefix once.

A request whose prompt shares at least a block that kvbank does not hold yet with a request
still reading its prompt waits for it, rather than computing the same KV beside it in the
batch (on a CPU, prefill is compute-bound: two copies take twice the time). When that request
has read its prompt, its prompt's KV goes into the bank as its conversation's entry (its turn's
commit supersedes it), and the waiting request restores the shared part from RAM and computes
only what is its own. Requests behind a waiting one in line may start meanwhile.

A request that arrives after the other has read its prompt, while it is still answering (agents
whose first turns overlap, one back from a tool call while another answers), does not wait: the
answering request's prompt KV goes into the bank at once, and the newcomer restores from it.
Without this the shared prompt is computed again whenever turns overlap, which is most of the
time once the answers of a round pause for each other's prompts.

Engine thread only.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvbank import metrics
from kvbank.blocks import BlockId, common_prefix_len
from kvbank.worker.tiers.bank import SessionBank
from kvbank.worker.tiers.restore import Restorer

# The scheduler (worker/compute/scheduler.py) and its requests, as this module uses them; the
# tiers sit below compute and never import it.
BatchScheduler = Any  # prefilling(), answering(), prompt_cache(r), kinds
Running = Any  # scheduler.Running: tokens, uid, job, session, followers, checkpoints, handed...

PREFIX_WAIT_MAX_S = 60.0  # past this a request computes the shared prefix itself


def _best_source(requests: list[Running], tokens: np.ndarray, ids: list[BlockId], tenant: str,
                 restorer: Restorer, block_tokens: int) -> Running | None:
    """Of `requests` (one tenant's), the one sharing the longest prefix with `tokens`, if it
    shares at least a block beyond what RAM or SSD holds. Counted in tokens, not whole blocks:
    the taker restores the source's prompt entry token by token, and a bank that holds a few
    tokens of it (a chat template's opening) must not hide a shared system prompt of 300
    tokens behind block rounding."""
    shared = [(common_prefix_len(r.tokens, tokens), r.uid, r)
              for r in requests if r.job.request.tenant == tenant]
    n, _, source = max(shared, default=(0, 0, None), key=lambda x: x[:2])
    if n < block_tokens or n - max(restorer.held(tokens, ids, tenant)) < block_tokens:
        return None
    return source


def wait_for_prefix(job, tokens: np.ndarray, ids: list[BlockId], batch: BatchScheduler,
                    restorer: Restorer, block_tokens: int) -> bool:
    """Whether `job` (a commands.Generate) should wait for a request still reading a prompt
    that shares at least a block with `tokens` beyond what RAM or SSD holds; if so it is
    that request's follower."""
    if time.monotonic() - job.queued_at > PREFIX_WAIT_MAX_S:
        return False
    leader = _best_source(batch.prefilling(), tokens, ids, job.request.tenant, restorer,
                          block_tokens)
    if leader is None:
        return False
    if not any(j is job for j in leader.followers):
        leader.followers.append(job)
        metrics.PREFIX_WAITS.inc()
    return True


def share_answered_prefix(tokens: np.ndarray, ids: list[BlockId], tenant: str,
                          batch: BatchScheduler, bank: SessionBank, restorer: Restorer,
                          block_tokens: int, bytes_per_token: int) -> bool:
    """A new request shares at least a block, beyond what RAM or SSD holds, with a request
    that has read its prompt and is answering: that request's prompt KV goes into the bank now
    (its commit supersedes it), for the new one's restore to find. Only into room the bank
    has: a copy that pushed other conversations out, or made the new request wait for memory,
    would cost more than computing the prefix. Whether it did."""
    source = _best_source(batch.answering(), tokens, ids, tenant, restorer, block_tokens)
    if source is None or (bank.total_nbytes + len(source.tokens) * bytes_per_token
                          > bank.effective_max_bytes):
        return False
    share_prefix(source, batch, bank, takers=1)
    return True


def share_prefix(r: Running, batch: BatchScheduler, bank: SessionBank,
                 takers: int | None = None) -> None:
    """`r` has read its prompt and others want it (its followers, or `takers`): its prompt's
    KV goes into the bank as `r.shared`. Its commit supersedes the entry; a turn that ends
    without one takes it out (`withdraw_shared`)."""
    kinds = batch.kinds
    checkpoints = {}
    if kinds.checkpointed:  # only where the prompt's read ended, if a checkpoint stands there
        n = len(r.tokens)
        if n not in r.checkpoints:
            return
        checkpoints[n] = r.checkpoints[n]
    cache = batch.prompt_cache(r)
    n = min(len(r.tokens), kinds.position(cache) or len(r.tokens))
    durable = 0  # what LMDB holds of it: of the entry it continues, if it took one
    if r.handed is not None:
        durable = min(r.handed.durable_tokens, common_prefix_len(r.handed.tokens, r.tokens[:n]))
    r.shared = bank.insert(r.session, r.tokens[:n], kinds.full_layers(cache, n, r.at_rest),
                           checkpoints=checkpoints, durable_tokens=durable)
    metrics.PREFIX_SHARED_TOKENS.inc(n * (len(r.followers) if takers is None else takers))


def withdraw_shared(r: Running, bank: SessionBank) -> None:
    """`r` ended without a commit over its shared prompt entry (failed, cancelled, or its
    conversation was deleted meanwhile): the entry goes, so a turn the client never saw is not
    kept, and the entry it restored from comes back whole (`take_back`)."""
    if r.shared is not None:
        bank.withdraw(r.shared)
        r.shared = None
