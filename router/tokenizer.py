"""Prompt text and chat messages to token ids, with the model's own tokenizer (no weights).

A returning turn must extend the committed history token for token, or the cached KV would
not match. Re-rendering a whole conversation can tokenize the earlier assistant turns
differently from what the model generated, so:
- append mode renders only what is new: the text a chat template puts after an assistant
  message, up to the next generation prompt;
- a client that sends the whole conversation back (every OpenAI client) gets each assistant
  message it was answered with spliced in as the tokens the model generated (`AnswerTokens`
  remembers them by their text and tool calls, `answer_key`), and the template's text around
  them tokenized in pieces. A tool call comes back as JSON the client re-serialized, so it
  is keyed by its parsed arguments, not their spelling.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)

_MARK = "\ue000kvbank-assistant-end\ue000"  # private-use characters: never in real text
ANSWERS_KEPT = 16384


def answer_key(content: str, calls: list[tuple[str, str]] = ()) -> str:
    """What identifies an answer the client sends back: its text, and its calls by name and
    arguments (parsed, so a client's own JSON spelling still matches)."""
    if not calls:
        return content
    def canon(args: str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return content + "\0" + json.dumps([[n, canon(a)] for n, a in calls], sort_keys=True)


def message_key(m: dict) -> str:
    """`answer_key` of an assistant message as the template gets it."""
    calls = [(c["function"]["name"], _arguments_text(c["function"].get("arguments", {})))
             for c in m.get("tool_calls") or ()]
    return answer_key(m.get("content") or "", calls)


def _arguments_text(args) -> str:
    return args if isinstance(args, str) else json.dumps(args)


class AnswerTokens:
    """The tokens behind recent answers, by tenant and text (a bounded LRU)."""

    def __init__(self, capacity: int = ANSWERS_KEPT):
        self.capacity = capacity
        self._ids: OrderedDict[bytes, np.ndarray] = OrderedDict()

    @staticmethod
    def _key(tenant: str, text: str) -> bytes:
        return hashlib.blake2b(f"{tenant}\0{text}".encode(), digest_size=16).digest()

    def put(self, tenant: str, text: str, token_ids: list[int]) -> None:
        key = self._key(tenant, text)
        self._ids[key] = np.asarray(token_ids, dtype=np.uint32)
        self._ids.move_to_end(key)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def get(self, tenant: str, text: str) -> list[int] | None:
        ids = self._ids.get(self._key(tenant, text))
        return None if ids is None else ids.tolist()


class PromptTokenizer:
    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None,
                                            add_generation_prompt=True, tokenize=False)

    def chat(self, messages: list[dict],
             answer_tokens: Callable[[str], list[int] | None] | None = None,
             tools: list[dict] | None = None) -> list[int]:
        """A whole conversation, ready for the assistant's next turn. Assistant messages
        whose generated tokens `answer_tokens` knows (by `message_key`) go in as those
        tokens, tool calls and all."""
        plain = lambda: self.encode(self.render(messages, tools))  # noqa: E731
        if answer_tokens is None:
            return plain()
        spliced: list[list[int]] = []
        marked = []
        for m in messages:
            ids = answer_tokens(message_key(m)) if m["role"] == "assistant" else None
            if ids:
                m = {"role": "assistant",
                     "content": f"\ue000kvbank-answer-{len(spliced)}\ue000"}
                spliced.append(ids)
            marked.append(m)
        if not spliced:
            return plain()
        text = self.render(marked, tools)
        out: list[int] = []
        for i, ids in enumerate(spliced):
            before, found, text = text.partition(f"\ue000kvbank-answer-{i}\ue000")
            if not found:  # a template that rewrites assistant content
                return plain()
            out += self.encode(before) + ids
        return out + self.encode(text)

    def chat_append(self, history: list[int], messages: list[dict],
                    eos_token_ids: set[int], tools: list[dict] | None = None) -> list[int]:
        """Tokens to append to `history` (which ends after an assistant turn) for `messages`.
        With tools, the first turn renders them (a template puts them in the system turn);
        later turns' deltas follow an assistant message, after that part."""
        if not history:
            return self.chat(messages, tools=tools)
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        text = self.render(probe + messages, tools)
        at = text.find(_MARK)
        if at < 0:  # a template that rewrites assistant content: fall back to the messages
            logger.warning("chat template hides assistant content; appending messages alone")
            return self.chat(messages, tools=tools)
        delta = text[at + len(_MARK):]
        if history[-1] in eos_token_ids:  # the model already generated the end-of-turn token
            eos_text = self.tok.decode([history[-1]])
            if delta.startswith(eos_text):
                delta = delta[len(eos_text):]
        return self.encode(delta)
