"""How admitted requests share the model: mlx-lm's BatchGenerator, driven one step at a time.

Each `step` decodes one token for every request in the decode batch and prefills one chunk
(`prefill_step_tokens`) of every request still reading its prompt, so a short request that
arrives during a long prefill gets its first token after one chunk, not after the whole
prompt. `serial` and `hyper` use the same path with one request at a time.

A request enters with its own restored cache (RAM bank or SSD) and leaves with the cache of
everything it read and wrote, which the engine commits. Stop strings and cancellation are
checked here, on the detokenized text, after each token; so are tool calls, which the
request's `Decoding` (worker/decoding.py) parses out of the text before it is sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvbank.v1 import api_pb2, worker_pb2
from worker.decoding import Decoding, token_logprob

PREFILL_STEP_TOKENS = 512


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
    decoding: Decoding
    completion: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0
    first_token_at: float | None = None
    finish: int = api_pb2.FINISH_REASON_LENGTH
    stop_sequence: str = ""  # the stop string that ended the answer
    uid: int = -1
    followers: list = field(default_factory=list)  # jobs waiting for this prompt's KV


class BatchScheduler:
    def __init__(self, model, *, max_active: int, eos_token_ids: list[int], decode,
                 prefill_step_tokens: int = PREFILL_STEP_TOKENS):
        """`decode`: the tokenizer's ids -> text, for the tokens of log-probabilities."""
        from mlx_lm.generate import BatchGenerator

        self.max_active = max_active
        self.decode = decode
        self.gen = BatchGenerator(model, stop_tokens=[[t] for t in eos_token_ids],
                                  completion_batch_size=max_active,
                                  prefill_batch_size=max_active,
                                  prefill_step_size=prefill_step_tokens)
        self.running: dict[int, Running] = {}
        self._prefix_ready: list[Running] = []

    def __len__(self) -> int:
        return len(self.running)

    def add(self, r: Running, cache: list, max_tokens: int) -> None:
        d = r.decoding
        (r.uid,) = self.gen.insert(
            [r.tokens[r.cached:].tolist()], max_tokens=[max_tokens], caches=[cache],
            samplers=[d.sampler], logits_processors=[d.processors],
            # the penalties look back into the prompt, as mlx-lm's server has them do
            all_tokens=[r.tokens[:r.cached].tolist() if d.processors else []])
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
                if r.followers:
                    self._prefix_ready.append(r)
            r.completion.append(resp.token)
            if resp.finish_reason == "stop":  # an end-of-turn token: no text of its own
                r.finish = api_pb2.FINISH_REASON_STOP
            else:
                r.detok.add_token(resp.token)
                r.text += r.detok.last_segment
                if self._emit(r, resp):
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

    def prefilling(self) -> list[Running]:
        """Requests still reading their prompt (no first token yet)."""
        return [r for r in self.running.values() if r.first_token_at is None]

    def take_prefix_ready(self) -> list[Running]:
        """Requests others wait for whose prompt was read by the last step (and still run)."""
        ready, self._prefix_ready = self._prefix_ready, []
        return [r for r in ready if r.uid in self.running]

    def prompt_cache(self, r: Running) -> list:
        """A running request's cache as it is now (a copy, without the batch's padding)."""
        return self.gen.extract_cache([r.uid])[r.uid][0]

    def drop(self, r: Running) -> None:
        """Take a request out without a commit (it failed)."""
        if self.running.pop(r.uid, None) is not None:
            self.gen.remove([r.uid])

    def _emit(self, r: Running, resp) -> bool:
        """Send what may be sent of the text, with the token; True when a stop string was
        found (the stop string and what follows it are not sent)."""
        cut, hit = stop_cut(r.text, r.stops)
        text = ""
        if cut > r.sent:
            text, r.sent = r.text[r.sent:cut], cut
        elif hit:
            r.stop_sequence = hit
            return True
        msg = worker_pb2.WorkerGenerateResponse(token_ids=[resp.token])
        if r.decoding.logprobs:
            msg.logprobs.append(token_logprob(resp.logprobs, resp.token,
                                              r.decoding.top_logprobs, self.decode))
        self._send(r, msg, text)
        r.stop_sequence = hit
        return bool(hit)

    def _flush_text(self, r: Running) -> None:
        """The end of the answer: the detokenizer's last text and any held-back tool call."""
        text = ""
        if not r.stop_sequence:
            r.detok.finalize()
            r.text += r.detok.last_segment
            end, hit = stop_cut(r.text, r.stops)
            if end > r.sent:
                text, r.sent = r.text[r.sent:end], end
            if hit:
                r.stop_sequence, r.finish = hit, api_pb2.FINISH_REASON_STOP
        self._send(r, worker_pb2.WorkerGenerateResponse(), text, final=True)

    @staticmethod
    def _send(r: Running, msg, text: str, final: bool = False) -> None:
        """Text through the tool-call parser (when the request has tools), then out."""
        tools = r.decoding.tools
        if tools is not None:
            text, calls = tools.feed(text)
            if final:
                rest, more = tools.finish()
                text, calls = text + rest, calls + more
            msg.tool_calls.extend(calls)
        msg.text = text
        if msg.text or msg.token_ids or msg.tool_calls:
            r.job.emit(msg)


def stop_cut(text: str, stops: list[str]) -> tuple[int, str]:
    """How much of `text` may be sent, and the stop string found ("" : none).

    Text that could still grow into a stop string is held back.
    """
    if not stops:
        return len(text), ""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if found:
        return min(found)
    hold = max(len(s) for s in stops) - 1
    return max(0, len(text) - hold), ""
