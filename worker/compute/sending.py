"""What of an answer reaches its client, token by token: the text past any stop string (text
that could still grow into one held back), the reasoning and the tool calls split out of it,
the token's log-probabilities. The scheduler calls these for each token a request takes and
once at its end (worker/compute/scheduler.py `_take`); they act on the request's `Running`
alone."""

from __future__ import annotations

from kvbank.v1 import api_pb2, worker_pb2
from kvbank.worker.compute.decoding import token_logprob


def send_token(r, token: int, logprobs, decode) -> bool:
    """Send what may be sent of the text, with the token; True when a stop string was found
    (the stop string and what follows it are not sent). `decode`: ids -> text, for the
    tokens of log-probabilities."""
    cut, hit = stop_cut(r.text, r.stops)
    text = ""
    if cut > r.sent:
        text, r.sent = r.text[r.sent:cut], cut
    elif hit:
        r.stop_sequence = hit
        return True
    msg = worker_pb2.WorkerGenerateResponse(token_ids=[token])
    if r.decoding.logprobs:
        msg.logprobs.append(token_logprob(logprobs, token, r.decoding.top_logprobs, decode))
    r.quiet = 0 if _send(r, msg, text) else r.quiet + 1
    r.stop_sequence = hit
    return bool(hit)


def send_end(r) -> None:
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
    _send(r, worker_pb2.WorkerGenerateResponse(), text, final=True)


def _send(r, msg, text: str, final: bool = False) -> bool:
    """Text through the reasoning split (chat input, a model with think markers), the rest
    through the tool-call parser (when the request has tools), then out. Whether the client
    gets something to show (text, reasoning or a tool call)."""
    harmony = r.decoding.harmony
    if harmony is not None:
        msg.reasoning, text, calls = harmony.feed(text)
        if final:
            more, rest, last = harmony.finish()
            msg.reasoning, text, calls = msg.reasoning + more, text + rest, calls + last
        msg.tool_calls.extend(calls)
    reasoning = r.decoding.reasoning
    if reasoning is not None:
        msg.reasoning, text = reasoning.feed(text)
        if final:
            more, rest = reasoning.finish()
            msg.reasoning, text = msg.reasoning + more, text + rest
    tools = r.decoding.tools
    if tools is not None:
        text, calls = tools.feed(text)
        if final:
            rest, more = tools.finish()
            text, calls = text + rest, calls + more
        msg.tool_calls.extend(calls)
    msg.text = text
    if msg.text or msg.reasoning or msg.token_ids or msg.tool_calls:
        r.job.emit(msg)
    return bool(msg.text or msg.reasoning or msg.tool_calls)


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
