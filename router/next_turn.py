"""What the router does with an answer once it is out, for the conversation's next turn.

A client sends the answer back as text (and tool calls) in its next request. The router keeps
the tokens the model generated for it (`remember_answer`), so that request renders with them
and reads its whole history from cache, however the template writes the text back. And when
the turn ended with no tool call, the user reads now: the history their next query will carry
is rendered and handed to the worker to compute in idle time (`prerender`), since a template
that drops earlier reasoning at a new query changes that history.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvbank.router.tokenizer import PromptTokenizer, answer_key
from kvbank.router.validation import ValidRequest
from kvbank.v1 import worker_pb2

if TYPE_CHECKING:
    from kvbank.router.server import Backend

logger = logging.getLogger(__name__)


def remember_answer(b: Backend, tenant: str, prompt: list[int], text: str,
                    calls: list[tuple[str, str]], ids: list[int]) -> None:
    """Keep the answer's tokens under the prompt it followed. Only an answer that is all of
    its tokens is kept: no stop string cut it, and its text ends its tokens' unless tool calls
    were parsed out of them. A character cut at max_tokens ends both in U+FFFD (mlx-lm's
    detokenizer and the tokenizer's decode both replace it), so that answer is kept too.
    mlx-lm's detokenizer drops the space an answer's first token begins with, so its tokens
    may say more whitespace at the start than the text the client got."""
    if ids and (calls or (text and same_answer(b.tokenizer.decode(ids), text))):
        b.answers.put(tenant, prompt, answer_key(text, calls), ids)


def same_answer(decoded: str, text: str) -> bool:
    """The answer's tokens end with `text`: before it, leading whitespace the client never
    saw, or the reasoning the worker split off (sent back apart, as `reasoning_content`)."""
    return decoded.endswith(text)


def prerender(b: Backend, v: ValidRequest, tenant: str, text: str, reasoning: str,
              session_id: str) -> None:
    """The turn ended with no tool call: render the history the next query will carry and
    let the worker compute what RAM lacks of it in idle time (worker/compute/prerender.py).
    Only where an answer carries reasoning (else the template has none to drop), and for
    whole-conversation clients (append mode renders only what is new). Runs beside the
    answer; a failure costs only the pre-render."""
    if not (b.prerender and v.kind == "chat" and not v.append and session_id):
        return
    if not (reasoning.strip() or any(m.get("reasoning_content") for m in v.messages)):
        return
    answer = {"role": "assistant", "content": text}
    if reasoning:
        answer["reasoning_content"] = answer["thinking"] = reasoning
    tools = list(v.tools) or None

    def work(tok: PromptTokenizer) -> list[int]:
        return tok.next_query(list(v.messages), answer, tools=tools, template=v.template,
                              answer_tokens=lambda key, prompt: b.answers.get(tenant, key,
                                                                             prompt))

    async def run() -> None:
        try:
            ids = await b.tokenize(work, v.text_bytes)
            if not ids:
                return
            r = await b.stub.Prefetch(worker_pb2.PrefetchRequest(
                tenant=tenant, session_id=session_id, token_ids=ids, prefill=True), timeout=30)
            logger.debug("pre-render of %s: %s (%d tokens, %d in RAM)", session_id, r.status,
                         len(ids), r.ram_tokens)
        except Exception as e:  # the answer is out; only the guess is lost
            logger.warning("pre-render of %s failed: %s", session_id, e)

    b.in_background(run())
