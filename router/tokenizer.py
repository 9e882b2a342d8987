"""Prompt text and chat messages to token ids, with the model's own tokenizer (no weights).

A returning turn must extend the committed history token for token, or the cached KV would
not match. Re-rendering a whole conversation can tokenize the earlier assistant turns
differently from what the model generated, so:
- append mode renders only what is new: the text a chat template puts after an assistant
  message, up to the next generation prompt;
- a client that sends the whole conversation back (every OpenAI client) gets each assistant
  message it was answered with spliced in as the tokens the model generated (`AnswerTokens`
  remembers them by the prompt they answered and their text and tool calls, `answer_key`),
  and the template's text around them tokenized in pieces. A tool call comes back as JSON the client re-serialized, so it
  is keyed by its parsed arguments, not their spelling.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
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


def lift_system(messages: list[dict]) -> list[dict] | None:
    """The messages with every system message after the first (Claude Code's environment
    block) joined to the leading one, for a template that takes a system message only first;
    None when there is none to move."""
    later = [m for m in messages[1:] if m["role"] == "system"]
    if not later:
        return None
    head = messages[:1] if messages[0]["role"] == "system" else []
    text = "\n\n".join(m["content"] for m in head + later)
    return [{"role": "system", "content": text}, *(m for m in messages if m["role"] != "system")]


def _arguments_text(args) -> str:
    return args if isinstance(args, str) else json.dumps(args)


class AnswerTokens:
    """The tokens behind recent answers, by tenant, text and the prompt they answered (a
    bounded LRU).

    The prompt is part of the key: two answers with one text (an agent's "Done.", the same
    tool call twice) can be different tokens, and a conversation that moved here from another
    machine has its earlier answers tokenized from text in what this worker holds. Splicing
    another turn's tokens in there would break the prompt's match with that history."""

    def __init__(self, capacity: int = ANSWERS_KEPT):
        self.capacity = capacity
        self._ids: OrderedDict[bytes, tuple[bytes, np.ndarray]] = OrderedDict()
        self._texts: dict[bytes, int] = {}  # entries per (tenant, text): most texts are unknown
        # The router's loop puts; a large prompt is rendered on the tokenizing thread, which
        # gets (router/server.py `LargePrompts`): the one state those two share.
        self._lock = threading.Lock()

    @staticmethod
    def _text_key(tenant: str, text: str) -> bytes:
        return hashlib.blake2b(f"{tenant}\0{text}".encode(), digest_size=16).digest()

    @staticmethod
    def _key(text_key: bytes, prompt: list[int]) -> bytes:
        h = hashlib.blake2b(text_key, digest_size=16)
        h.update(np.asarray(prompt, dtype=np.uint32).tobytes())
        return h.digest()

    def put(self, tenant: str, prompt: list[int], text: str, token_ids: list[int]) -> None:
        tk = self._text_key(tenant, text)
        key = self._key(tk, prompt)
        with self._lock:
            if key not in self._ids:
                self._texts[tk] = self._texts.get(tk, 0) + 1
            self._ids[key] = (tk, np.asarray(token_ids, dtype=np.uint32))
            self._ids.move_to_end(key)
            while len(self._ids) > self.capacity:
                _, (old, _) = self._ids.popitem(last=False)
                self._texts[old] -= 1
                if not self._texts[old]:
                    del self._texts[old]

    def get(self, tenant: str, text: str, prompt: Callable[[], list[int]]) -> list[int] | None:
        """The tokens answering `prompt()` with `text` (the prompt is built only for a text
        some answer had)."""
        tk = self._text_key(tenant, text)
        with self._lock:
            if tk not in self._texts:
                return None
        key = self._key(tk, prompt())  # built outside the lock: it may tokenize
        with self._lock:
            got = self._ids.get(key)
        return None if got is None else got[1].tolist()


class PromptTokenizer:
    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (a run of spaces, say): a text of B
        bytes is at least B / this many tokens, known without tokenizing it."""
        return max(1, max(len(self.tok.decode([i]).encode()) for i in range(len(self.tok))))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               template: dict | None = None) -> str:
        """`template`: the template's own switches (`enable_thinking`)."""
        return self.tok.apply_chat_template(messages, tools=tools or None,
                                            add_generation_prompt=True, tokenize=False,
                                            **(template or {}))

    def checkpoints(self, messages: list[dict], prompt: list[int],
                    tools: list[dict] | None = None, template: dict | None = None) -> list[int]:
        """Where in `prompt` (the whole rendered conversation) its next turns come back to:
        the end of the system and tools part, and the end of the prompt before the
        generation prompt (a template that strips earlier reasoning changes the history
        right after it). Positions the renders do not confirm token for token are left out."""
        out = []
        try:
            with_gen = self.render(messages, tools, template)
            without = self._render_open(messages, tools, template)
        except Exception:  # a template that cannot render a partial conversation
            return out
        if with_gen.startswith(without) and len(with_gen) > len(without):
            gen = self.encode(with_gen[len(without):])
            if gen and len(gen) < len(prompt) and prompt[len(prompt) - len(gen):] == gen:
                out.append(len(prompt) - len(gen))
        head = self.shared_end(messages, prompt, tools, template)
        return sorted(set(out + ([head] if head else [])))

    def shared_end(self, messages: list[dict], prompt: list[int],
                   tools: list[dict] | None = None, template: dict | None = None) -> int:
        """Where the system and tools part of `prompt` ends, the prefix other conversations
        share (0: none, or the render does not confirm it token for token)."""
        n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), 0)
        if not n_system:
            return 0
        try:
            head = self.encode(self._render_open(messages[:n_system], tools, template))
        except Exception:  # a template that cannot render a partial conversation
            return 0
        return len(head) if 0 < len(head) < len(prompt) and prompt[:len(head)] == head else 0

    def _render_open(self, messages: list[dict], tools: list[dict] | None,
                     template: dict | None = None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None,
                                            add_generation_prompt=False, tokenize=False,
                                            **(template or {}))

    def chat(self, messages: list[dict],
             answer_tokens: Callable[[str, Callable[[], list[int]]], list[int] | None]
             | None = None,
             tools: list[dict] | None = None, template: dict | None = None) -> list[int]:
        """A whole conversation, ready for the assistant's next turn. An assistant message
        whose generated tokens `answer_tokens(message_key, prompt)` knows, as the answer to
        the tokens before it, goes in as those tokens, tool calls and all; the text around
        the spliced answers is tokenized in pieces, as each turn's prompt was."""
        plain = self.render(messages, tools, template)
        answers = [m for m in messages if m["role"] == "assistant"]
        if answer_tokens is None or not answers:
            return self.encode(plain)
        marks = [f"\ue000kvbank-answer-{i}\ue000" for i in range(len(answers))]
        it = iter(marks)
        marked = self.render([{"role": "assistant", "content": next(it)}
                              if m["role"] == "assistant" else m for m in messages], tools,
                             template)
        # The template's text between answers (`pieces`), and each answer as the plain render
        # has it (`rendered`), by aligning the two renders.
        pieces, rest = [], marked
        for mark in marks:
            before, found, rest = rest.partition(mark)
            if not found:  # a template that rewrites assistant content
                return self.encode(plain)
            pieces.append(before)
        pieces.append(rest)
        rendered, at = [], len(pieces[0])
        if not plain.startswith(pieces[0]) or not plain.endswith(pieces[-1]):
            return self.encode(plain)
        for piece in pieces[1:-1]:
            end = plain.find(piece, at)
            if end < 0:
                return self.encode(plain)
            rendered.append(plain[at:end])
            at = end + len(piece)
        rendered.append(plain[at:len(plain) - len(pieces[-1])])

        out: list[int] = []
        pending = pieces[0]  # text not tokenized yet, since the last spliced answer
        for i, m in enumerate(answers):
            built: list[list[int]] = []  # the prompt before this answer, once built

            def prompt(out=out, pending=pending, built=built) -> list[int]:
                if not built:
                    built.append(out + self.encode(pending))
                return built[0]

            ids = answer_tokens(message_key(m), prompt)
            if ids:
                out = prompt() + ids
                pending = pieces[i + 1]
            else:
                pending += rendered[i] + pieces[i + 1]
        return out + self.encode(pending)

    def chat_append(self, history: list[int], messages: list[dict],
                    eos_token_ids: set[int], tools: list[dict] | None = None,
                    template: dict | None = None) -> list[int]:
        """Tokens to append to `history` (which ends after an assistant turn) for `messages`.
        With tools, the first turn renders them (a template puts them in the system turn);
        later turns' deltas follow an assistant message, after that part."""
        if not history:
            return self.chat(messages, tools=tools, template=template)
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        text = self.render(probe + messages, tools, template)
        at = text.find(_MARK)
        if at < 0:  # a template that rewrites assistant content: fall back to the messages
            logger.warning("chat template hides assistant content; appending messages alone")
            return self.chat(messages, tools=tools, template=template)
        delta = text[at + len(_MARK):]
        if history[-1] in eos_token_ids:  # the model already generated the end-of-turn token
            eos_text = self.tok.decode([history[-1]])
            if delta.startswith(eos_text):
                delta = delta[len(eos_text):]
        return self.encode(delta)
