"""The idle pre-render: the history a conversation's next query will carry, computed while its
user reads the answer.

Some chat templates (Qwen3.5/3.6, GLM-4.5/4.6, gpt-oss) drop the reasoning of earlier turns
once a new user message follows, so at a new query the history the model reads is no longer
the one it computed: every server recomputes the whole tool loop then, while the user waits.
When a turn ends without a tool call, the router renders that history (the messages, the
answer as the client sends it back, a new user turn: up to the last special token before the
user's text) and sends it here (the Prefetch RPC, `prefill`). What RAM does not hold of it is
computed one prefill chunk at a time, only while no request runs or waits (the engine's loop:
`step` runs when the worker is otherwise idle), so a request that arrives waits for one chunk
at most. The result goes into the bank as a `prerendered` entry of a key of its own
(`key_for`): the next query's prompt starts with its tokens, so the bank's prefix lookup
restores it like any entry; it is the first entry to leave RAM (worker/tiers/eviction.py) and
the next turn's commit supersedes it (worker/tiers/bank.py).

It never takes memory from anything: a pre-render starts only where the bank has room for it
without an eviction and no request waits for memory, and one under way is dropped when a
request needs the memory it holds (`make_room`). A request of the conversation that arrives
before it ends takes what it computed so far (`hand_over`).

Engine thread only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from kvbank import events, metrics
from kvbank.blocks import chain_block_ids, common_prefix_len
from kvbank.worker.commands import PrefetchReport
from kvbank.worker.memory.allocator import drop_stale_buffers
from kvbank.worker.tiers.bank import SessionKey

logger = logging.getLogger(__name__)

KEY_PREFIX = "next:"  # a pre-render's bank key: (tenant, KEY_PREFIX + the conversation's id)
# Fewer tokens than this missing from RAM: not worth a pre-render. The next query's own forward
# (its user text and generation prompt, tens of tokens) takes them in at little cost, while a
# pre-render copies the whole held history into an entry of its own. A one-call tool loop's
# dropped reasoning and short result are ~230 tokens: recomputed by its query, they cost 3.3x
# a RAM hit's time to first token (`kvbank bench prerender --steps 1 --listing 20`).
MIN_MISSING_TOKENS = 32


def key_for(tenant: str, session_id: str) -> SessionKey:
    return (tenant, KEY_PREFIX + session_id)


@dataclass(eq=False)
class _Job:
    key: SessionKey
    tokens: np.ndarray
    need: int  # bytes reserved while it runs (as admission prices a prompt of its size)
    asked_at: float = field(default_factory=time.monotonic)
    prompt_cache: Any = None  # its mlx-lm caches, restored at its first step
    at_rest: Any = None
    position: int = 0  # tokens its cache stands on
    restored: int = 0
    seconds: float = 0.0  # of compute


class Prerenders:
    def __init__(self, *, model, kinds, kv, pricing, chunk_tokens: int, stream,
                 off_reason: str | None = None):
        """`kv`: the engine's KVManager (its bank, restorer, eviction rules and room).
        `off_reason`: why pre-renders are refused on this worker (None: they run)."""
        self.model, self.kinds, self.kv, self.pricing = model, kinds, kv, pricing
        self.chunk_tokens, self.stream = chunk_tokens, stream
        self.off_reason = off_reason
        self.jobs: deque[_Job] = deque()

    @property
    def waiting(self) -> bool:
        """Work to do in idle time."""
        return bool(self.jobs)

    @property
    def busy(self) -> bool:
        """One is under way (its cache holds memory). Read by other threads: a hint only."""
        return bool(self.jobs) and self.jobs[0].prompt_cache is not None

    # -- asked -------------------------------------------------------------------------------

    def ask(self, tenant: str, session_id: str, tokens: np.ndarray) -> PrefetchReport:
        """Queue the history `tokens` of the conversation `session_id`'s next query: status
        `prerendering`, or why not (`in_ram`: RAM holds it already, `no_room`, `off`,
        `unknown`: no conversation named)."""
        if self.off_reason is not None:
            return self._skipped(tenant, session_id, tokens, PrefetchReport("off"))
        if not session_id or len(tokens) < 2:
            return self._skipped(tenant, session_id, tokens, PrefetchReport("unknown"))
        key = key_for(tenant, session_id)
        self._forget(key)  # the conversation went on: an older guess is worth nothing now
        ram = self._held(tokens, tenant)
        if len(tokens) - ram < MIN_MISSING_TOKENS:
            return self._skipped(tenant, session_id, tokens, PrefetchReport("in_ram", ram))
        need = self.pricing.request_bytes(len(tokens), 1)
        room = self.kv.room_for_hints()
        if room is None or need > room:
            return self._skipped(tenant, session_id, tokens, PrefetchReport("no_room", ram))
        self.jobs.append(_Job(key, np.asarray(tokens, dtype=np.uint32), need))
        events.emit("prerender_queued", tenant=tenant, session_id=session_id,
                    tokens=len(tokens), ram_tokens=ram)
        return self._counted(PrefetchReport("prerendering", ram))

    def _held(self, tokens: np.ndarray, tenant: str) -> int:
        """The prefix of `tokens` RAM restores (at a checkpoint, for a model with them)."""
        ids = chain_block_ids(tokens, self.kv.root_for(tenant), self.kv.block_tokens)
        hit = self.kv.bank.lookup(tokens, tenant, ids)
        return hit.n_tokens if hit else 0

    # -- idle time ---------------------------------------------------------------------------

    def step(self) -> None:
        """One prefill chunk of the oldest pre-render (the engine calls it only while no request
        runs or waits); at its last chunk, the entry goes into the bank."""
        job = self.jobs[0]
        try:
            if job.prompt_cache is None and not self._begin(job):
                self.jobs.popleft()
                return
            t0 = time.monotonic()
            n = min(self.chunk_tokens, len(job.tokens) - job.position)
            drop_stale_buffers()
            with mx.stream(self.stream):
                self.model(mx.array(job.tokens[job.position:job.position + n])[None],
                           cache=self.kinds.model_caches(job.prompt_cache))
                mx.eval([c.state for c in job.prompt_cache])
            job.position += n
            job.seconds += time.monotonic() - t0
            events.emit("prerender_chunk", tenant=job.key[0], session_id=_conversation(job.key),
                        position=job.position, tokens=len(job.tokens))
            if job.position == len(job.tokens):
                self.jobs.popleft()
                self._keep(job, job.position)
        except Exception:
            logger.exception("the pre-render of %s failed", job.key[1])
            self._drop(job)

    def _begin(self, job: _Job) -> bool:
        """Its cache, restored from what RAM holds of its tokens now (never SSD: a read would
        hold the engine); False when there is nothing worth computing, or no room, any more."""
        tenant = job.key[0]
        ids = chain_block_ids(job.tokens, self.kv.root_for(tenant), self.kv.block_tokens)
        look = self.kv.restorer.look(job.tokens, ids, tenant, False)
        if len(job.tokens) - look.ram_n < MIN_MISSING_TOKENS:
            return False  # its query came and its turn holds it, or another guess does
        room = self.kv.room_for_hints()
        if room is None or job.need > room:
            return False
        if look.ram_n:
            e = look.hit.entry
            job.prompt_cache = self.kinds.restore(e.layers, e.checkpoints.get(look.ram_n), look.ram_n)
        else:
            job.prompt_cache = self.kinds.new_cache()
        job.position = job.restored = look.ram_n
        job.at_rest = self.kinds.at_rest(job.prompt_cache)
        self.kv.bank.reserve_active(job.key, job.need)
        return True

    def _keep(self, job: _Job, n: int) -> None:
        """The job's cache, standing at `n`, into the bank as a pre-rendered entry."""
        self.kv.bank.unreserve_active(job.key, job.need)
        cache, job.prompt_cache = job.prompt_cache, None
        checkpoint = self.kinds.snapshot(cache)
        layers = self.kinds.full_layers(cache, n, job.at_rest)
        e = self.kv.bank.insert(job.key, job.tokens[:n], layers,
                                checkpoints={n: checkpoint} if checkpoint is not None else None,
                                prerendered=True)
        self.kv.eviction.keep_within_cap(keep_sessions=())  # over the cap: it goes first
        self.kv.refresh()
        metrics.PRERENDERED_TOKENS.inc(n - job.restored)
        events.emit("prerender_done", tenant=job.key[0], session_id=_conversation(job.key),
                    tokens=n, computed=n - job.restored, seconds=round(job.seconds, 4),
                    bytes=e.nbytes, waited_s=round(time.monotonic() - job.asked_at, 4),
                    in_bank=e.in_bank)

    # -- requests come first -----------------------------------------------------------------

    def hand_over(self, tokens: np.ndarray, tenant: str) -> None:
        """A request is about to start: a pre-render under way whose tokens so far begin its
        prompt ends here, what it computed kept for the request to restore (its query came
        sooner than the pre-render finished)."""
        for job in list(self.jobs):
            if (job.prompt_cache is not None and job.key[0] == tenant and job.position > job.restored
                    and common_prefix_len(job.tokens[:job.position], tokens) == job.position):
                self.jobs.remove(job)
                self._keep(job, job.position)

    def make_room(self) -> int:
        """A request waits for memory: every pre-render under way is dropped (it holds the
        memory it reserved). Returns how many."""
        under_way = [j for j in self.jobs if j.prompt_cache is not None]
        for job in under_way:
            self._drop(job)
        return len(under_way)

    def _drop(self, job: _Job) -> None:
        if job in self.jobs:
            self.jobs.remove(job)
        if job.prompt_cache is not None:
            job.prompt_cache = None
            self.kv.bank.unreserve_active(job.key, job.need)
        events.emit("prerender_dropped", tenant=job.key[0], session_id=_conversation(job.key),
                    position=job.position, tokens=len(job.tokens))

    def _forget(self, key: SessionKey) -> None:
        """The conversation's queued, running and kept pre-renders go."""
        for job in [j for j in self.jobs if j.key == key]:
            self._drop(job)
        for e in self.kv.bank.session_entries(key):
            self.kv.bank.withdraw(e)

    def _skipped(self, tenant: str, session_id: str, tokens: np.ndarray,
                 report: PrefetchReport) -> PrefetchReport:
        """Not queued, and why: logged, so whoever waits for this pre-render stops waiting."""
        events.emit("prerender_skipped", tenant=tenant, session_id=session_id,
                    status=report.status, tokens=len(tokens), ram_tokens=report.ram_tokens)
        return self._counted(report)

    @staticmethod
    def _counted(report: PrefetchReport) -> PrefetchReport:
        metrics.PRERENDERS.labels(report.status).inc()
        return report


def _conversation(key: SessionKey) -> str:
    return key[1][len(KEY_PREFIX):]


def off_reason(mtp) -> str | None:
    """Why this worker cannot pre-render (None: it can): a model that speculates with its MTP
    head keeps that head's KV beside the model's, which a pre-render does not compute."""
    return "the model speculates with its MTP head (--mtp)" if mtp is not None else None

