"""How admitted requests share the model: mlx-lm's BatchGenerator, driven one step at a time.

Each `step` decodes one token for every request in the decode batch and prefills one chunk
(`prefill_step_tokens`) of every request still reading its prompt, so a short request that
arrives during a long prefill gets its first token after one chunk, not after the whole
prompt. `serial` and `hyper` use the same path with one request at a time.

A request enters with its own restored cache (RAM bank or SSD) and leaves with the cache of
everything it read and wrote, which the engine commits. Stop strings and cancellation are
checked here, on the detokenized text, after each token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx

from kvbank.v1 import api_pb2, worker_pb2

PREFILL_STEP_TOKENS = 512


def make_request_sampler(temperature: float, top_p: float, seed: int | None) -> Callable:
    """A sampler of its own for each request; with a seed it draws from its own key, so the
    same request gives the same text whatever else runs in the batch."""
    from mlx_lm.sample_utils import apply_top_p, make_sampler

    if temperature <= 0 or seed is None:
        return make_sampler(temp=temperature, top_p=top_p)
    key = mx.random.key(seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * (1 / temperature), key=sub)

    return sample


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
    started: float
    stops: list[str]
    detok: Any
    completion: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    first_token_at: float | None = None
    finish: int = api_pb2.FINISH_REASON_LENGTH
    uid: int = -1


class BatchScheduler:
    def __init__(self, model, *, max_active: int, eos_token_ids: list[int],
                 prefill_step_tokens: int = PREFILL_STEP_TOKENS):
        from mlx_lm.generate import BatchGenerator

        self.max_active = max_active
        self.gen = BatchGenerator(model, stop_tokens=[[t] for t in eos_token_ids],
                                  completion_batch_size=max_active,
                                  prefill_batch_size=max_active,
                                  prefill_step_size=prefill_step_tokens)
        self.running: dict[int, Running] = {}

    def __len__(self) -> int:
        return len(self.running)

    def add(self, r: Running, cache: list, max_tokens: int, sampler: Callable) -> None:
        (r.uid,) = self.gen.insert([r.tokens[r.cached:].tolist()], max_tokens=[max_tokens],
                                   caches=[cache], samplers=[sampler])
        self.running[r.uid] = r

    def take_cancelled(self) -> list[Running]:
        """Requests whose client went away, taken out before the next step (in prefill too)."""
        gone = [r for r in self.running.values() if r.job.cancelled.is_set()]
        if gone:
            self.gen.remove([r.uid for r in gone])
            for r in gone:
                del self.running[r.uid]
        return gone

    def step(self) -> list[tuple[Running, list]]:
        """One decode token for each decoding request, one prefill chunk for the others.
        Returns the requests that ended, each with its cache."""
        _, responses = self.gen.next()
        done: list[tuple[Running, list]] = []
        stopped: list[int] = []
        for resp in responses:
            r = self.running.get(resp.uid)
            if r is None:
                continue
            if r.first_token_at is None:
                r.first_token_at = time.monotonic()
            r.completion.append(resp.token)
            if resp.finish_reason == "stop":  # an end-of-turn token: no text of its own
                r.finish = api_pb2.FINISH_REASON_STOP
            else:
                r.detok.add_token(resp.token)
                r.text += r.detok.last_segment
                if self._emit_text(r):
                    r.finish = api_pb2.FINISH_REASON_STOP
                    stopped.append(resp.uid)
                    continue
            if resp.finish_reason is not None:
                done.append((self.running.pop(resp.uid), resp.prompt_cache))
        if stopped:
            caches = self.gen.remove(stopped, return_prompt_caches=True)
            for uid in stopped:
                done.append((self.running.pop(uid), caches[uid][0]))
        for r, _ in done:
            self._flush_text(r)
        return done

    def drop(self, r: Running) -> None:
        """Take a request out without a commit (it failed)."""
        if self.running.pop(r.uid, None) is not None:
            self.gen.remove([r.uid])

    def _emit_text(self, r: Running) -> bool:
        """Send what may be sent; True when a stop string was found."""
        cut, hit = stop_cut(r.text, r.stops)
        if cut > r.sent:
            r.job.emit(worker_pb2.WorkerGenerateResponse(text=r.text[r.sent:cut],
                                                         token_ids=[r.completion[-1]]))
            r.sent = cut
        elif not hit:
            r.job.emit(worker_pb2.WorkerGenerateResponse(token_ids=[r.completion[-1]]))
        return hit

    def _flush_text(self, r: Running) -> None:
        if stop_cut(r.text, r.stops)[1]:
            return  # the stop string and what follows it are not sent
        r.detok.finalize()
        r.text += r.detok.last_segment
        end = stop_cut(r.text, r.stops)[0]
        if end > r.sent:
            r.job.emit(worker_pb2.WorkerGenerateResponse(text=r.text[r.sent:end]))
            r.sent = end


def stop_cut(text: str, stops: list[str]) -> tuple[int, bool]:
    """How much of `text` may be sent, and whether a stop string was found.

    Text that could still grow into a stop string is held back.
    """
    if not stops:
        return len(text), False
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if first >= 0:
        return first, True
    hold = max(len(s) for s in stops) - 1
    return max(0, len(text) - hold), False
