"""How admitted requests share the model: prompts read one chunk a step on their own caches,
answers decoded together in mlx-lm's BatchGenerator.

Each `step` reads one chunk (`prefill_step_tokens`) of one prompt and decodes one token for
every request past its prompt, unless those answers are pausing for the prompts being read
(at most `decode_wait_s` between tokens: then all decode together, see `_answers_wait`).
Tenants' prompts are read by turns; of a tenant's, the one with the fewest forwards left,
less the steps a later request was read instead (a short request that arrives during a long
prefill gets its first token after one chunk; a long one is not starved; of equal prompts,
the first to come is read through first, not all of them by turns). A prompt is read on the
request's own cache, the model called as mlx-lm's own generate does: its chunks without
logits, then its last <= 64 tokens and its first token in one forward, handed out at once.
Reading prompts in the batch would pad them to the longest, copy every cache in and out of
the batch (merge, split), and hand each token out one step after computing it (mlx-lm does
so; on a CPU the batch's tokens are taken as they are computed, `_take_ahead`); on this CPU
four 512-token prompts on 1,600-token histories read together ran at 0.85 of one after
another (docs/decisions.md). A request whose prompt is read decodes alone on its own cache
while nothing else decodes, and joins the batch when a second one would (the batch is then
worth its copies), unless their contexts differ by `own_lead_tokens` or more: then it decodes
on its own cache beside the batch (`_close`). Answers pause for prompts of their own tenant
only (an API key's flood of prompts never stalls another key's stream), and while two tenants
have requests running a prompt is read in forwards of about `shared_forward_s`, no longer than
another tenant's streaming answer's step (`_step_tokens`, `_shared_s`), so another's request
waits that long at most for the forward in flight, and in none while the batch takes rows in
or another tenant's client waits for text (`_read_waits`). `hyper` (and `serial`, its alias) use
the same path with one request at a time. After a request's first token the next forward waits
5 ms, so the token reaches its client before the forward takes the cores (`_hand_off`).

A request enters with its own restored cache (RAM bank or SSD) and leaves with the cache of
everything it read and wrote, which the engine commits. Cancellation is checked here before
each step, stop strings after each token, on the detokenized text, where the token's text is
sent (worker/compute/sending.py: the reasoning and tool calls that the request's `Decoding`
parses out of it, too). A request with logits processors (penalties, logit_bias, a grammar) reads its prompt as any other and
takes the batch for its last prompt forward: mlx-lm applies them there. (Read whole in the
batch, a long constrained prompt put a 512-token chunk into every step of another tenant's
stream.)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from kvbank.config import DEFAULT_DECODE_WAIT_S, DEFAULT_SHARED_FORWARD_S, SHARED_WINDOW_S
from kvbank.v1 import api_pb2, worker_pb2
from kvbank.worker.memory.allocator import drop_stale_buffers
from kvbank.worker.kv.cache_kinds import CacheKinds
from kvbank.worker import commands as cmd
from kvbank.worker.compute.decoding import Decoding, make_request_sampler
from kvbank.worker.compute.mtp.serving import (FOLD_EVERY, LEAVE_TOKENS, BatchHistory,
                                               BatchTap)
from kvbank.worker.compute.sending import send_end, send_token

logger = logging.getLogger(__name__)

PREFILL_STEP_TOKENS = 512
LAST_FORWARD_TOKENS = 64  # a prompt's last forward, the one with logits, reads at most this
# A decoder whose context is this share of the weights (in KV bytes) longer or shorter than
# another's decodes on its own cache rather than batched with it (`_close`). On a GPU a decode
# step reads the weights once for the whole batch, so a second forward is a second read of
# them: it costs less than the padding only past all of the weights. On a CPU the matmuls cost
# by the row, batched or not: a quarter already paid here (docs/decisions.md).
OWN_LEAD_OF_WEIGHTS = {"gpu": 1.0, "cpu": 0.25}
HANDOFF_S = 0.005  # after a first token, before the next forward (`_hand_off`)
# While another tenant runs a request, or sent one within SHARED_WINDOW_S (kvbank/config.py),
# a prompt forward lasts about `shared_forward_s` (`_step_tokens`).
MIN_SHARED_STEP = 8  # tokens: below this a forward is mostly reading the weights
SHORT_PROMPT_TOKENS = 32  # a new prompt this short is one forward, shared or not (`_chunk`)


@dataclass
class Running:
    """One admitted request, from restore to commit."""

    job: Any  # commands.Generate
    tokens: Any  # np.ndarray, the whole prompt
    bank_key: tuple[str, str]
    session: tuple[str, str] | None
    cached: int
    source: int
    known: int  # prompt tokens the session's history already had
    started: float  # restored, handed to the scheduler
    stops: list[str]
    detok: Any
    decoding: Decoding
    completion: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    first_token_at: float | None = None
    finish: int = api_pb2.FINISH_REASON_LENGTH
    stop_sequence: str = ""  # the stop string that ended the answer
    uid: int = -1
    followers: list = field(default_factory=list)  # jobs waiting for this prompt's KV
    handed: Any = None  # its conversation's bank entry, out of the bank while it runs
    shared: Any = None  # its prompt's KV, put in the bank for others (worker/tiers/sharing.py)
    restore_s: float = 0.0  # of the time before `started`
    split_at: tuple[int, ...] = ()  # prompt positions a forward stops at, for a checkpoint
    checkpoints: dict = field(default_factory=dict)  # position -> cache_kinds.Checkpoint
    prefix_lost: int = 0  # prompt tokens held but not restorable (no checkpoint there)
    at_rest: Any = None  # the quantized KV its cache was restored from (CacheKinds.at_rest)
    head_cache: Any = None  # its MTP head's KV while mlx-lm's batch runs it (CacheKinds.with_head)
    history: Any = None  # its head's history kept in the batch (mtp.serving.BatchHistory), or None
    drafted: int = 0  # tokens its MTP head drafted (worker/compute/mtp/serving.py)
    accepted: int = 0  # of them, those the model kept
    ahead: str = ""  # "taken"/"stopped": its batch token was taken when computed (`_take_ahead`)
    join_copy: int = 0  # bytes its join into mlx-lm's batch holds until made (BatchJoins.may_join)
    quiet: int = 0  # its last tokens that gave its client nothing to show (sending.py)


@dataclass(eq=False)  # found in lists by identity
class _Own:
    """A request on its own cache, outside the batch: reading its prompt, or decoding (alone,
    or beside a batch of contexts far from its own length)."""

    r: Running
    cache: list
    prompt: list[int]  # prompt tokens not in the cache yet
    max_tokens: int
    passed: int = 0  # steps a prompt that came later was read instead
    mtp: Any = None  # its speculation (mtp.serving.MTPRun), when it has one


class BatchScheduler:
    def __init__(self, model, *, max_active: int, eos_token_ids: list[int], decode,
                 kinds: CacheKinds | None = None,
                 prefill_step_tokens: int = PREFILL_STEP_TOKENS,
                 decode_wait_s: float = DEFAULT_DECODE_WAIT_S,
                 shared_forward_s: float = DEFAULT_SHARED_FORWARD_S,
                 own_lead_tokens: int | None = None, mtp=None,
                 may_join=lambda joining: True):
        """`decode`: the tokenizer's ids -> text, for the tokens of log-probabilities.
        `decode_wait_s`: how long answers may pause for prompts being read (`_answers_wait`).
        `shared_forward_s`: how long a prompt forward lasts while tenants share (`_step_tokens`).
        `own_lead_tokens`: contexts this far apart decode on their own caches, not batched
        together (`_close`; default: `OWN_LEAD_OF_WEIGHTS` of the weights in KV bytes).
        `mtp`: the model's MTP head (worker/compute/mtp/serving.py), or None.
        `may_join(requests)`: whether answers on their own caches may join the batch now (the
        engine's memory for the join's copy); if not, they decode beside it."""
        from mlx_lm.generate import BatchGenerator

        self.max_active = max_active
        self.decode = decode
        self.model = model
        self.mtp = mtp
        self.may_join = may_join
        self.kinds = kinds or CacheKinds.of(model)  # what the caches hold
        self.decode_wait_s = decode_wait_s
        self.shared_forward_s = shared_forward_s
        self._decoded_at = 0.0  # when answers last took a step (or had none to take)
        self._reads = 0  # prompt forwards so far
        self._read_turn: dict[str, int] = {}  # tenant -> when its prompt was last read
        self.prefill_step_tokens = prefill_step_tokens
        self.last_forward_tokens = min(LAST_FORWARD_TOKENS, prefill_step_tokens)
        self.eos = frozenset(eos_token_ids)
        self._readers: list[_Own] = []  # in arrival order
        self._decoders: list[_Own] = []  # past their prompt, on their own caches
        self.own_lead_tokens = (own_lead_tokens if own_lead_tokens is not None
                                else _own_lead(model, self.kinds))
        self._own_uids = itertools.count(-1, -1)  # the batch's uids are >= 0
        # with a head, the batch's forwards keep their hidden states for it (`_keep_histories`)
        self._tap = BatchTap(model, mtp.decoder.trunk) if mtp is not None else None
        self.gen = BatchGenerator(model if self._tap is None else self._tap,
                                  stop_tokens=[[t] for t in eos_token_ids],
                                  completion_batch_size=max_active,
                                  prefill_batch_size=max_active,
                                  prefill_step_size=prefill_step_tokens)
        self.running: dict[int, Running] = {}
        self._prefix_ready: list[Running] = []
        self._prompts_read: list[Running] = []  # first tokens since the last look
        self._joining: list[tuple[Running, bool]] = []  # joined from beside; merged yet?
        self._joined: list[Running] = []  # their join's copies made, since the last look
        self._failed: list[tuple[Running, Exception]] = []  # see take_failed
        self._first_token_out = False  # since the last forward (`_hand_off`)
        self._tenant_seen: dict[str, float] = {}  # tenant -> when its last request came in
        # `_shared_forward`: prompt tokens a second while tenants share, first guessed
        self._shared_rate = max(MIN_SHARED_STEP, prefill_step_tokens // 4) / shared_forward_s
        self._decode_s = 0.0  # the answers' last step, batch and own caches (`_shared_s`)
        # `_take_ahead`: on a CPU, where evaluating waits for every forward queued before it
        self.takes_ahead = mx.default_device().type == mx.DeviceType.cpu
        self._entering = False  # rows inserted since the batch's last step
        self._join_steps = 0  # steps left that read no prompt chunk (`_read_waits`)
        self._reads_waited = 0  # steps in a row that read none for a join

    def __len__(self) -> int:
        return len(self.running)

    def add(self, r: Running, cache: list, max_tokens: int) -> None:
        self._tenant_seen[r.job.request.tenant] = time.monotonic()
        o = _Own(r, cache, r.tokens[r.cached:].tolist(), max_tokens)
        if r.cached and r.cached in r.job.request.checkpoint_at:
            # restored where the router marked (a shared system prompt's end): its commit
            # names that checkpoint too, so a stored anchor lives while a record holds it
            self._checkpoint(o, r.cached, always=True)
        if r.decoding.processors and self._chunk(o) == 0:
            self._insert(r, o.prompt, cache, max_tokens)  # one forward: mlx-lm's, with them
            return
        self.kinds.with_room(cache, len(r.tokens))  # a buffer of a size MLX has kept
        r.uid = next(self._own_uids)
        o.mtp = (self.mtp.run_for(r.job.request, cache, r.decoding.processors,
                                  int(r.tokens[r.cached])) if self.mtp is not None else None)
        self._readers.append(o)
        self.running[r.uid] = r

    def _insert(self, r: Running, prompt: list[int], cache: list, max_tokens: int) -> None:
        d = r.decoding
        self._entering = True  # the batch's next step takes it in (`_read_waits`)
        r.head_cache = self.kinds.head_cache(cache)  # the batch runs the model's caches only
        (r.uid,) = self.gen.insert(
            [prompt], max_tokens=[max_tokens], caches=[self.kinds.model_caches(cache)],
            samplers=[d.sampler], logits_processors=[d.processors],
            # the penalties look back into the prompt, as mlx-lm's server has them do
            all_tokens=[r.tokens[:len(r.tokens) - len(prompt)].tolist() if d.processors
                        else []])
        self.running[r.uid] = r

    def _in_batch(self) -> bool:
        return any(uid >= 0 for uid in self.running)

    def _decodes(self, o: _Own) -> None:
        """`o` has read its prompt and answers on: in the batch when its context is close to
        every one there (`_close`); with no batch, in a new one with the decoders on their own
        caches close to it; else on its own cache (alone, or beside the batch)."""
        self._readers.remove(o)
        batch = [r for uid, r in self.running.items() if uid >= 0]
        if batch:
            mates = [o] if all(self._close(o.r, r) for r in batch) else []
        else:
            mates = [d for d in self._decoders if self._close(o.r, d.r)]
            mates = mates + [o] if mates else []
        if not mates or not self.may_join([d.r for d in mates]):
            self._decoders.append(o)
            return
        self._join(mates)

    def join_beside(self) -> bool:
        """Answers decoding on their own caches beside each other (or the batch), left there
        because `may_join` refused the copy, join now as many as it lets: the caller asks when
        memory was freed since (a prompt read, writes landed, an answer ended), not only when
        another prompt ends. Returns whether any joined."""
        if not self._decoders:
            return False
        batch = [r for uid, r in self.running.items() if uid >= 0]
        if batch:
            mates = [d for d in self._decoders if all(self._close(d.r, r) for r in batch)]
        else:
            mates = [d for d in self._decoders if self._close(self._decoders[0].r, d.r)]
        mates.sort(key=lambda d: _context(d.r))  # the smallest copies first
        # as many as the memory allows: two batched, two beside beat four beside; one alone
        # starts a batch the others join later, a copy at a time
        for n in range(len(mates), 0 if batch or len(mates) > 1 else 1, -1):
            if self.may_join([d.r for d in mates[:n]]):
                self._join(mates[:n])
                return True
        return False

    def _join(self, mates: list[_Own]) -> None:
        for d in mates:
            self._decoders = [x for x in self._decoders if x is not d]
            r = self.running.pop(d.r.uid)  # its last token is sampled, not in the cache yet
            r.history = (BatchHistory(d.mtp.state, d.max_tokens) if d.mtp is not None
                         else None)
            self._insert(r, r.completion[-1:], d.cache, d.max_tokens - len(r.completion))
            self._joining.append((r, False))

    def _settle_joins(self) -> None:
        """After a batch step: a row mlx-lm took into its running batch a step ago has had
        both its copies made (the merge into a new batch's cache, evaluated with that step's
        forward, then the extend into the running batch's, with this one's)."""
        rows = set(self.gen._generation_batch.uids)  # mlx-lm pinned: its running rows
        joining = []
        for r, merged in self._joining:
            if self.running.get(r.uid) is not r:
                continue  # ended, or left
            if merged:
                self._joined.append(r)
            else:
                joining.append((r, r.uid in rows))
        self._joining = joining

    def take_joined(self) -> list[Running]:
        """Answers whose join into the batch made its copies since the last look (their own
        caches are gone)."""
        joined, self._joined = self._joined, []
        return joined

    def _close(self, a: Running, b: Running) -> bool:
        """Whether two answers decode together in the batch: their contexts differ by less than
        `own_lead_tokens`. In the batch the shorter attends over the longer's length (padding)
        and joining copies both caches into one (mlx-lm's merge): bench restore, 4K tokens beside
        a short answer, a batch step took 0.40-0.45 s against 0.34 for two forwards on their own
        caches, and the join's step 1.3-1.9 s, no token out (docs/decisions.md)."""
        return abs(_context(a) - _context(b)) < self.own_lead_tokens

    def take_cancelled(self) -> list[Running]:
        """Requests whose client went away, taken out before the next step (in prefill too)."""
        gone = [r for r in self.running.values() if r.job.cancelled.is_set()]
        if gone:
            self._forget(gone)
        return gone

    def take_failed(self) -> list[tuple[Running, Exception]]:
        """Requests whose own forward failed in the last step, with the error (the others
        went on)."""
        failed, self._failed = self._failed, []
        return failed

    def _forget(self, gone: list[Running]) -> None:
        ids = {id(r) for r in gone}
        self._readers = [o for o in self._readers if id(o.r) not in ids]
        self._decoders = [o for o in self._decoders if id(o.r) not in ids]
        batch = [r.uid for r in gone if r.uid >= 0]
        if batch:
            self.gen.remove(batch)
        for r in gone:
            del self.running[r.uid]

    def step(self, between: Callable[[], None] = lambda: None) -> list[tuple[Running, list]]:
        """One chunk of one prompt, and one decode token for each request past its prompt
        unless answers wait for the prompts being read (`_answers_wait`); `between` the two,
        the caller may `add` what came meanwhile, read first if its tenant's turn. Returns the
        requests that ended, each with its cache."""
        done: list[tuple[Running, list]] = []
        joined = False
        if not self._answers_wait():
            t0 = time.perf_counter()
            joined, self._entering = self._entering and self._in_batch(), False
            done = self._batch_step() if self._in_batch() else []
            self._settle_joins()
            for o in list(self._decoders):
                done += self._own_step(o)
            if not joined:  # a join's step is two (`_read_waits`): not the answers' pace
                self._decode_s = time.perf_counter() - t0
        between()
        if not self._read_waits(joined) and self._readers:
            done += self._own_step(self._next_reader())
        return done

    def _read_waits(self, joined: bool) -> bool:
        """Whether no prompt chunk is read this step: the step whose batch took rows in, and
        the next, while another tenant's answer streams and every prompt waiting is of a
        tenant with an answer running too (a tenant with nothing running is never held back:
        its first token would wait those two steps).
        mlx-lm runs the new rows' first forward apart and copies every row into one cache in
        the next forward, each step about two steps' time; a chunk on top had that answer wait
        three to four (bench tenants full_queue: 0.30-0.34 s against a 0.09 s step). Nor in
        a step whose text another tenant's client waits for (`_text_owed`). Never three steps
        in a row: joins as frequent as every step still leave the prompts a step in three."""
        owed = False
        if not self._reading_for_every_answer():
            answering = {r.job.request.tenant for r in self.answering()}
            if all(o.r.job.request.tenant in answering for o in self._readers):
                if joined:
                    self._join_steps = 2
                owed = self._text_owed()
        waits = (self._join_steps > 0 or owed) and self._reads_waited < 2
        self._join_steps = max(0, self._join_steps - 1)
        self._reads_waited = self._reads_waited + 1 if waits else 0
        return waits

    def _text_owed(self) -> bool:
        """Whether another tenant's client waits on a token that showed it nothing (a lone
        space, part of a character, text that may begin a stop string): its next token brings
        two steps' text, and a prompt chunk between them made that gap three steps' time (bench
        tenants full_queue: 0.44 s against a 0.13 s step). Only the first such token: a held
        tool call shows nothing for many steps whatever is read beside it."""
        readers = {o.r.job.request.tenant for o in self._readers}
        return any(r.quiet == 1 and r.job.request.tenant not in readers
                   for r in self.answering())

    def _next_reader(self) -> _Own:
        """The prompt read next: the tenant whose prompt was read longest ago takes its turn
        (one tenant's long prompts never keep another's first token waiting more than a
        forward), and of its prompts the one with the fewest forwards left, less the times
        a later one was read instead."""
        tenants = {o.r.job.request.tenant for o in self._readers}
        tenant = min(tenants, key=lambda t: self._read_turn.get(t, -1))
        mine = [o for o in self._readers if o.r.job.request.tenant == tenant]
        o = min(mine, key=lambda o: self._forwards_left(o) - o.passed)  # first of equals
        for other in mine[:mine.index(o)]:
            other.passed += 1  # overtaken by a later one; the others wait their turn
        self._reads += 1
        self._read_turn[tenant] = self._reads
        return o

    def _answers_wait(self) -> bool:
        """Whether requests past their prompt skip this step: while prompts are read, for at
        most `decode_wait_s` since they last took one. A decode step costs about the same for
        one request as for four (the weights are read once either way), so tokens taken one
        at a time beside each prompt forward add steps that the batch, once every prompt is
        read, would have taken together; and every answer that joins the batch alone copies
        its caches in again. mlx-lm's own server reads every waiting prompt first, unbounded;
        the bound keeps an answer streaming behind a stream of long prompts."""
        now = time.monotonic()
        answering = bool(self._decoders) or self._in_batch()
        prompts_in_batch = any(r.first_token_at is None  # the batch reads them in its step
                               for uid, r in self.running.items() if uid >= 0)
        if (answering and self._readers and not prompts_in_batch
                and now - self._decoded_at < self.decode_wait_s
                and self._reading_for_every_answer()):
            return True
        self._decoded_at = now
        return False

    def _reading_for_every_answer(self) -> bool:
        """Answers pause only for their own tenant's prompts: while one tenant's long prompts
        were read, another's stream stalled for seconds."""
        reading = {o.r.job.request.tenant for o in self._readers}
        return all(r.job.request.tenant in reading for r in self.answering())

    def _hand_off(self) -> None:
        """A first token just sent waits here, not behind the next forward. The token goes out
        through the worker's event loop, the router and the client, each needing a core, and a
        forward takes both cores for a tenth of a second or more: `bench turn` measured 8.5 ms
        between the worker's first token and the client's at 2K without this pause, 3 ms
        with it (and the same with 30 ms). Later tokens stream behind their forwards as before."""
        if self._first_token_out:
            self._first_token_out = False
            time.sleep(HANDOFF_S)

    def _forwards_left(self, o: _Own) -> int:
        """Forwards until `o`'s first token: its chunks, then the last one with logits."""
        step = self._step_tokens(o)
        return math.ceil(max(0, len(o.prompt) - self._last_tokens(o, step)) / step) + 1

    def _last_tokens(self, o: _Own, step: int) -> int:
        """The tokens a prompt's last forward (with logits) reads, short of a fold (`_chunk`);
        while tenants share, half a step: with its logits a token costs about two of a chunk's
        (on this CPU a 43-token last forward took 0.20 s against 0.10-0.13 for 24-34-token
        chunks, in another tenant's stream)."""
        last = min(self.last_forward_tokens, step)
        return max(1, last // 2) if self._shares(o) else last

    def _step_tokens(self, o: _Own) -> int:
        """A chunk of `o`'s prompt: `prefill_step_tokens`, or, while another tenant has a
        request running or sent one in the last SHARED_WINDOW_S, what is read in about
        `_shared_s` (`_shared_forward`). A request that comes waits for the forward in
        flight (it cannot be cut short): one tenant's long prompts made another's 8-token
        request wait a whole 512-token chunk at every step (about 2 s on 2 CPU cores), and a
        quarter chunk still 0.5 s, four times its own forward."""
        if not self._shares(o):
            return self.prefill_step_tokens
        return max(MIN_SHARED_STEP, min(self.prefill_step_tokens,
                                        round(self._shared_rate * self._shared_s(o))))

    def _shares(self, o: _Own) -> bool:
        """Whether another tenant has a request running or sent one lately."""
        tenant = o.r.job.request.tenant
        now = time.monotonic()
        return (any(x.job.request.tenant != tenant for x in self.running.values())
                or any(t != tenant and now - at < SHARED_WINDOW_S
                       for t, at in self._tenant_seen.items()))

    def _shared_s(self, o: _Own) -> float:
        """How long a forward of `o`'s prompt lasts while tenants share: `shared_forward_s`,
        and while another tenant's answer streams, no longer than the answers' own step, so
        that stream's tokens come at most about twice as far apart as without the prompt.
        A fixed 0.15 s was one to two of this CPU's steps as its speed moved (0.065-0.16 s),
        and the stream's longest gap 3.3x its median step (bench tenants full_queue)."""
        tenant = o.r.job.request.tenant
        if self._decode_s and any(r.job.request.tenant != tenant for r in self.answering()):
            return min(self.shared_forward_s, self._decode_s)
        return self.shared_forward_s

    def _shared_forward(self, o: _Own, tokens: int, seconds: float) -> None:
        """A forward of `o`'s prompt read `tokens` in `seconds` while sharing: the rate the
        next step is sized by, as if time grew with tokens. A forward's fixed part (the
        weights, read once) makes that estimate fall short of the target from above and from
        below alike, so the step settles on it without overshooting, and follows the context
        as it grows. Any forward over the target bounds the rate; one under it raises the
        rate only if it read a whole step. On a GPU a whole chunk is inside the target."""
        rate = tokens / max(seconds, 1e-6)
        if seconds > self._shared_s(o):
            self._shared_rate = min(self._shared_rate, rate)
        elif tokens >= self._step_tokens(o):
            self._shared_rate = rate

    def _batch_step(self) -> list[tuple[Running, list]]:
        self._hand_off()
        tap = self._tap is not None
        before = list(self.gen._generation_batch.uids) if tap else []  # mlx-lm pinned: its rows
        _, responses = self.gen.next()
        if tap:
            self._keep_histories(before, responses)
        done: list[tuple[Running, list]] = []
        stopped: list[int] = []
        left: list[list] = []  # caches of rows mlx-lm took out of its batch (`_copy_out`)
        for resp in responses:
            if resp.finish_reason is not None:
                left.append(resp.prompt_cache)
            r = self.running.get(resp.uid)
            if r is None:
                continue
            ahead, r.ahead = r.ahead, ""
            if ahead == "stopped" or (not ahead and self._take(r, resp)):
                stopped.append(resp.uid)
                continue
            if resp.finish_reason is not None:
                r = self.running.pop(resp.uid)
                done.append((r, self._with_history(r, resp.prompt_cache)))
        if stopped:
            caches = self.gen.remove(stopped, return_prompt_caches=True)
            left += [caches[uid][0] for uid in stopped]
            for uid in stopped:
                r = self.running.pop(uid)
                done.append((r, self._with_history(r, caches[uid][0])))
        self._copy_out(left)
        for r, _ in done:
            send_end(r)
        if self.takes_ahead:
            self._take_ahead()
        if tap:
            self._leave_alone()
        return done

    def _leave_alone(self) -> None:
        """An answer that drafts, left alone in mlx-lm's batch (the others ended, none
        waiting to join or to be read), goes back to its own cache to draft there: alone, a
        round of drafts gives more tokens a second than the batch's one-token steps. Its
        head's history comes with it (`BatchHistory`), its next token (taken as computed,
        not fed yet) is the one its first round starts from, as for an answer that just read
        its prompt."""
        rows = self.gen._generation_batch.uids  # mlx-lm pinned: its rows
        if (len(rows) != 1 or self._readers or self._decoders or self._joining
                or self.gen._unprocessed_sequences or len(self.gen._prompt_batch)):
            return
        r = self.running.get(rows[0])
        if (r is None or r.history is None
                or r.history.max_tokens - len(r.completion) < LEAVE_TOKENS):
            return
        if not r.ahead:  # a GPU's batch hands its token out a step late: taken now
            self._take_ahead()
        if r.ahead != "taken" or r.completion[-1] in self.eos:  # it ends at the next step
            return
        caches = self.gen.remove([r.uid], return_prompt_caches=True)
        cache = self._with_history(r, caches[r.uid][0])
        self._copy_out([caches[r.uid][0]])
        o = _Own(r, cache, [], r.history.max_tokens)
        o.mtp = self.mtp.run_for(r.job.request, cache, r.decoding.processors, r.completion[-1])
        del self.running[r.uid]
        r.uid, r.ahead, r.history, r.head_cache = next(self._own_uids), "", None, None
        self.running[r.uid] = r
        self._decoders.append(o)

    def _keep_histories(self, before: list[int], responses) -> None:
        """The batch's step for its requests' head histories. mlx-lm's `next` ran a one-token
        forward over the rows it had (`before`, in order: each fed the token its response
        reports), then one over the rows that joined (their first step, whose token their
        history holds), and prompt chunks, if any, after both. A forward whose rows do not
        match what was expected drops those rows' histories: their rows are then zeros, as
        for an answer the head never saw (drafting, never an answer, is what that changes)."""
        steps, self._tap.steps = self._tap.steps, []
        if not any(r.history is not None for r in self.running.values()):
            return
        fed = {resp.uid: resp.token for resp in responses}
        had = set(before)
        joined = [uid for uid in self.gen._generation_batch.uids if uid not in had]
        forwards = [(uids, main) for uids, main in ((before, True), (joined, False)) if uids]
        for i, (uids, main) in enumerate(forwards):
            h = steps[i] if i < len(steps) else None
            for row, uid in enumerate(uids):
                r = self.running.get(uid)
                if r is None or r.history is None:
                    continue
                if h is None or h.shape[0] != len(uids) or (main and uid not in fed):
                    r.history = None
                    continue
                r.history.step(fed[uid] if main else None, h[row:row + 1])
                r.history.fold(self.mtp.decoder, every=FOLD_EVERY)

    def _with_history(self, r: Running, cache: list) -> list:
        """A cache back from mlx-lm's batch with its head's history: kept current there
        (`BatchHistory`: every pair folded, the last hidden state kept for the checkpoint),
        or as the batch took it (zeros for the rest)."""
        if r.history is None:
            return self.kinds.with_head(cache, r.head_cache)
        r.history.fold(self.mtp.decoder)
        out = self.kinds.with_head(cache, r.history.state.cache)
        if r.history.state.hidden is not None:
            self.kinds.keep_hidden(out, r.history.state.hidden[:, -1:])
        return out

    def _copy_out(self, left: list[list]) -> None:
        """Rows that left mlx-lm's batch this step (`left`: their caches, copied out of it) and
        the rest (gathered into a new buffer), made a layer at a time: each layer's old
        buffer goes as both are made. Left to the next forward, every layer's old buffer
        lived beside the copies: two of three answers of 1,300-1,500 tokens ending at one
        step peaked 129 MB over the batch on the default model, 7 MB this way."""
        if not left:
            return
        rest = self.gen._generation_batch.prompt_cache  # mlx-lm pinned: its running rows
        for i in range(len(left[0])):
            mx.eval([c[i].state for c in left] + ([rest[i].state] if rest else []))

    def _take_ahead(self) -> None:
        """Each batch row's next token, taken as soon as it is computed rather than at the next
        step. mlx-lm hands a token out one step after its forward, so that on a GPU the host's
        work overlaps the next forward; on a CPU evaluating waits for the forward anyway, and
        the lag only made every batched token a step late, and an answer joining the batch
        (whose last token came from its own cache) wait two steps for its next: under `bench
        tenants` full_queue, 0.25-0.38 s against a 0.08 s step. The next step hands the same
        token out again: only its end is news then (`_batch_step`)."""
        rows = self.gen._generation_batch  # mlx-lm pinned: its pending tokens, in row order
        if not rows.uids:
            return
        tokens = rows._next_tokens.reshape(-1).tolist()
        for uid, token, logprobs in zip(rows.uids, tokens, rows._next_logprobs):
            r = self.running.get(uid)
            if r is None or r.ahead:
                continue
            finish = "stop" if token in self.eos else None  # an end of turn: no text (`_take`)
            r.ahead = ("stopped" if self._take(r, SimpleNamespace(
                uid=uid, token=token, logprobs=logprobs, finish_reason=finish)) else "taken")

    def prefilling(self) -> list[Running]:
        """Requests still reading their prompt (no first token yet)."""
        return [r for r in self.running.values() if r.first_token_at is None]

    def answering(self) -> list[Running]:
        """Requests past their prompt, still running."""
        return [r for r in self.running.values() if r.first_token_at is not None]

    def take_prompts_read(self) -> list[Running]:
        """Requests whose prompt was read (their first token) since the last look."""
        read, self._prompts_read = self._prompts_read, []
        return read

    def take_prefix_ready(self) -> list[Running]:
        """Requests others wait for whose prompt was read by the last step (and still run)."""
        ready, self._prefix_ready = self._prefix_ready, []
        return [r for r in ready if r.uid in self.running]

    def prompt_cache(self, r: Running) -> list:
        """A running request's cache as it is now (a copy, without the batch's padding)."""
        for o in self._readers + self._decoders:
            if o.r is r:  # views: MLX copies on write
                return self.kinds.view(o.cache)
        return self.kinds.with_head(self.gen.extract_cache([r.uid])[r.uid][0], r.head_cache)

    def _take(self, r: Running, resp) -> bool:
        """A request's new token: kept, its text sent; True when a stop string ends it."""
        if r.first_token_at is None:
            r.first_token_at = time.monotonic()
            self._first_token_out = True
            self._prompts_read.append(r)
            if r.followers:
                self._prefix_ready.append(r)
        r.completion.append(resp.token)
        if resp.finish_reason == "stop":  # an end-of-turn token: no text of its own
            r.finish = api_pb2.FINISH_REASON_STOP
            return False
        r.detok.add_token(resp.token)
        r.text += r.detok.last_segment
        if send_token(r, resp.token, resp.logprobs, self.decode):
            r.finish = api_pb2.FINISH_REASON_STOP
            return True
        return False

    def _own_step(self, o: _Own) -> list[tuple[Running, list]]:
        """One forward of a request on its own cache: a prompt chunk without logits, or the
        last prompt tokens and the next token, or one decode token. A failed forward fails
        this request only (`take_failed`)."""
        r = o.r
        self._hand_off()
        try:
            if o.prompt:  # a prompt forward, its transients sized by its context
                drop_stale_buffers()
            with mx.stream(self.gen.stream):
                if o.mtp is not None and not o.prompt and self._speculates(o):
                    return self._speculate(o)
                # A chunk without logits: a long last chunk's would cost more than one forward.
                n = self._chunk(o)
                reads = len(o.prompt) if o.prompt and self._shares(o) else 0  # timed, if so
                t0 = time.perf_counter()
                if n:
                    chunk, o.prompt = o.prompt[:n], o.prompt[n:]
                    self._forward(o, chunk, r.tokens[len(r.tokens) - len(o.prompt) - n + 1:
                                                     len(r.tokens) - len(o.prompt) + 1].tolist())
                    mx.eval([c.state for c in o.cache])
                    if reads:
                        self._shared_forward(o, n, time.perf_counter() - t0)
                    self._checkpoint(o, len(r.tokens) - len(o.prompt))
                    return []
                if r.decoding.processors:  # its checkpoints taken: the rest where mlx-lm
                    self._readers.remove(o)  # applies the processors
                    del self.running[r.uid]
                    self._insert(r, o.prompt, o.cache, o.max_tokens)
                    return []
                x, o.prompt = (o.prompt or r.completion[-1:]), []
                logits = self._forward(o, x, x[1:] if not r.completion else [])[:, -1, :]
                if not r.completion:
                    self._checkpoint(o, len(r.tokens), always=True)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                token = r.decoding.sampler(logprobs)
                mx.eval(token, logprobs)
                if reads:
                    self._shared_forward(o, reads, time.perf_counter() - t0)
                token = int(token.item())
                if o.mtp is not None:
                    o.mtp.state.tokens = [token]  # the pending row's next token
                    if len(x) == 1 and r.completion:  # a decode step it took undrafted
                        o.mtp.pace.plain(time.perf_counter() - t0)
            finish = ("stop" if token in self.eos
                      else "length" if len(r.completion) + 1 >= o.max_tokens else None)
            resp = SimpleNamespace(uid=r.uid, token=token, logprobs=logprobs[0],
                                   finish_reason=finish)
            if not self._take(r, resp) and finish is None:
                if any(x is o for x in self._readers):
                    self._decodes(o)
                return []
            return self._end_own(o, token)
        except Exception as e:
            logger.exception("generation step failed")
            if r.uid in self.running:
                self._forget([r])
            self._failed.append((r, e))
            return []

    def _forward(self, o: _Own, tokens: list[int], next_tokens: list[int]) -> mx.array:
        """The model over `tokens` on `o`'s cache: mlx-lm's logits, or, for a request that
        speculates, the trunk's hidden states with its head's history kept current (the
        same logits come of them: `Trunk.logits`)."""
        if o.mtp is None:
            return self.model(mx.array(tokens)[None], cache=self.kinds.model_caches(o.cache))
        dec = self.mtp.decoder
        hidden = dec.read(tokens, next_tokens, o.cache, o.mtp.state)
        self.kinds.keep_hidden(o.cache, hidden[:, -1:])  # a checkpoint here keeps it
        return dec.trunk.logits(hidden)

    def _end_own(self, o: _Own, token: int) -> list[tuple[Running, list]]:
        """An answer on its own cache ended at `token`: the cache holds that token too, as a
        turn's commit wants it."""
        r = o.r
        self._hand_off()
        with mx.stream(self.gen.stream):
            self._forward(o, [token], [])
            mx.eval([c.state for c in o.cache])
        self._forget([r])
        send_end(r)
        return [(r, o.cache)]

    def _speculates(self, o: _Own) -> bool:
        """Whether `o` drafts this step: always while it decodes alone (no batch, no other
        answer on its own cache); beside others, while a drafted token has cost it less than
        an undrafted one (`Pace`: each answer on its own cache runs its own forwards, so its
        choice is its own). Not in mlx-lm's batch: its rows would each keep their own number
        of drafts, and oMLX measured MTP per row inside a batch slower than plain batched
        decode."""
        if not self._in_batch() and len(self._decoders) == 1:
            return True
        return o.mtp.pace.speculates()

    def _speculate(self, o: _Own) -> list[tuple[Running, list]]:
        """One speculative round of `o` (worker/compute/mtp/decode.py): its tokens taken one
        by one as plain decoding's would be (stop strings, max_tokens, the stream), then every
        cache rolled back to the last one kept."""
        r, run, dec = o.r, o.mtp, self.mtp.decoder
        accepted = dec.stats.accepted
        t0 = time.perf_counter()
        out = dec.speculate(r.completion[-1], None, run.sampling, o.cache, run.state, run.spec,
                            o.max_tokens - len(r.completion), self.eos)
        kept, ended = 0, False
        for token, logprobs in out:
            kept += 1
            finish = ("stop" if token in self.eos
                      else "length" if len(r.completion) + 1 >= o.max_tokens else None)
            resp = SimpleNamespace(uid=r.uid, token=token, logprobs=logprobs,
                                   finish_reason=finish)
            if self._take(r, resp) or finish is not None:
                ended = True
                break
        dec.settle(run.state, run.spec, kept)
        run.pace.drafted(time.perf_counter() - t0, kept)
        r.drafted += dec.depth
        r.accepted += min(dec.stats.accepted - accepted, kept)
        return self._end_own(o, r.completion[-1]) if ended else []

    def _chunk(self, o: _Own) -> int:
        """How many prompt tokens the next forward reads without logits (0: the rest, with
        them): a step's worth (`_step_tokens`), short of the last forward's, and never past a
        split."""
        if not o.prompt:  # a decode step: no tenants to look at
            return 0
        r, step = o.r, self._step_tokens(o)
        pos = len(r.tokens) - len(o.prompt)
        # A new prompt of up to two steps (or SHORT_PROMPT_TOKENS) is read in one forward,
        # within the logits the pricing allows: a short prompt's first token is then one
        # forward, not two or three with other forwards between them (a 17-token prompt at an
        # 11-token step waited 0.6 s so, against 0.3 s; at an 8-token step, in forwards of 8,
        # 4 and 5, 0.63 s); its forward, at a short context, is about a long prompt's chunk.
        short = pos == r.cached and len(o.prompt) <= min(self.last_forward_tokens,
                                                         max(2 * step, SHORT_PROMPT_TOKENS))
        last = self._last_tokens(o, step)
        n = 0 if short or len(o.prompt) <= last else min(step, len(o.prompt) - last)
        split = next((p for p in r.split_at if pos < p < len(r.tokens)), None)
        if split is not None and (n == 0 or split < pos + n):
            n = split - pos
        return n

    def _checkpoint(self, o: _Own, position: int, always: bool = False) -> None:
        """The window and recurrent caches, standing at `position`, kept for the commit."""
        if self.kinds.checkpointed and (always or position in o.r.split_at):
            snap = self.kinds.snapshot(o.cache)
            req = o.r.job.request
            if position in req.checkpoint_at:
                snap = dataclasses.replace(snap, anchored=True,
                                           shared=position == req.shared_checkpoint_at)
            o.r.checkpoints[position] = snap

    def drop(self, r: Running) -> None:
        """Take a request out without a commit (it failed)."""
        if r.uid in self.running:
            self._forget([r])


def _context(r: Running) -> int:
    """A running request's context: its prompt and its answer so far."""
    return len(r.tokens) + len(r.completion)


def _own_lead(model, kinds: CacheKinds) -> int:
    """`OWN_LEAD_OF_WEIGHTS` of the model's weights, in tokens of a running request's KV: the
    padding past which a second forward costs less than the batch (SmolLM2-135M on a CPU:
    ~2.9K tokens; Qwen3.6-27B in 4 bits on a GPU, 16 of its 64 layers with KV: ~230K, more
    than its context, so always batched there)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    share = OWN_LEAD_OF_WEIGHTS["cpu" if mx.default_device().type == mx.DeviceType.cpu
                                else "gpu"]
    weights = sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))
    per_token = kinds.measure()[0]
    return int(share * weights / per_token) if per_token else 1 << 62


def warm_up(batch: "BatchScheduler", kinds, tokenizer, chunk_tokens: int) -> None:
    """One short request through the scheduler, so the memory a first request leaves behind
    (kernels, allocator, buffers) is in the fixed part of the budget."""
    tokens = np.arange(1000, 1000 + 2 * chunk_tokens + 1, dtype=np.uint32)
    job = cmd.Generate(worker_pb2.WorkerGenerateRequest(max_tokens=2), emit=lambda ev: None)
    r = Running(job=job, tokens=tokens, bank_key=("", "warm-up"), session=None, cached=0,
                source=api_pb2.CACHE_SOURCE_NONE, known=0, started=time.monotonic(),
                stops=[], detok=tokenizer.detokenizer,
                # a logits processor sends its last forward through mlx-lm's BatchGenerator,
                # whose first-use buffers belong in the fixed part too (its chunks: the solo path)
                decoding=Decoding(make_request_sampler(0.0, 0.0, None),
                                  processors=[lambda tokens, logits: logits]))
    batch.add(r, kinds.new_cache(), 2)
    while batch:
        batch.step()
    mx.clear_cache()
