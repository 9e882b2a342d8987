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
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import numpy as np

logger = logging.getLogger(__name__)

_MARK = "\ue000kvbank-assistant-end\ue000"  # private-use characters: never in real text
ANSWERS_KEPT = 16384
RENDERS_KEPT = 4096  # PromptTokenizer._answer_renders


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


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


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
        self._renders: OrderedDict[bytes, tuple | None] = OrderedDict()
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    def tool_markers(self) -> tuple[bool, list[str]]:
        """Whether the chat template renders `tools`, and the special tokens in it that look
        like a tool syntax's markers (for a refusal that says what the template has)."""
        template = self.tok.chat_template if isinstance(self.tok.chat_template, str) else ""
        words = ("tool", "call", "function")
        markers = sorted(t.content for t in self.tok.added_tokens_decoder.values()
                         if t.special and t.content in template
                         and any(w in t.content.lower() for w in words))
        return "tools" in template, markers

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (a run of spaces, say): a text of B
        bytes is at least B / this many tokens, known without tokenizing it."""
        ids = [[i] for i in range(len(self.tok))]
        # one call for the whole vocabulary where the tokenizer is a Rust one: 0.045 s against
        # 0.13 s a token at a time for 49K tokens, at every router start
        fast = getattr(self.tok, "backend_tokenizer", None)
        texts = (fast.decode_batch(ids, skip_special_tokens=False) if fast is not None
                 else map(self.tok.decode, ids))
        return max(1, max(len(t.encode()) for t in texts))

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
             tools: list[dict] | None = None, template: dict | None = None,
             cut: str | None = None) -> list[int]:
        """A whole conversation, ready for the assistant's next turn. An assistant message
        whose generated tokens `answer_tokens(message_key, prompt)` knows, as the answer to
        the tokens before it, goes in as those tokens, tool calls and all; the text around
        the spliced answers is tokenized in pieces, as each turn's prompt was.

        Where an answer stands in the render is read off the template itself, whatever its
        generation prompt ends with (`<think>\n`, an empty thought channel, harmony's
        `<|start|>assistant`): the conversation up to it with the generation prompt (the
        prompt it answered) and up to its end, both prefixes of the whole render. The
        template's text there is the model's answer written back its own way (`False` for
        `false`, a newline dropped), then, where the template ends a message with a special
        token the answer did not (its stop token, harmony's `<|end|>`), that token. An
        answer is not spliced where the template changes the history (reasoning it drops):
        the model's input is then what the template writes.

        `cut`: a text in the last message; the tokens of the render before it (none where the
        render lacks it)."""
        plain = self.render(messages, tools, template)
        stop = len(plain) if cut is None else plain.find(cut)
        if stop < 0:
            return []
        if answer_tokens is None or not any(m["role"] == "assistant" for m in messages):
            return self.encode(plain[:stop])
        gen = self._generation_prompt(tools, template)
        out: list[int] = []
        pos = 0  # text of `plain` before it is in `out`
        chain = hashlib.blake2b(json.dumps([tools, template], sort_keys=True, default=str)
                                .encode(), digest_size=16)
        for k, m in enumerate(messages):
            chain.update(json.dumps(m, sort_keys=True, default=str).encode())
            if m["role"] != "assistant":
                continue
            found: dict = {}

            def prompt(k=k, m=m, out=out, pos=pos, found=found, key=chain.digest()
                       ) -> list[int]:
                if "ids" not in found:
                    span = self._answer_span(messages, k, m, plain, gen, pos, tools, template,
                                             key)
                    found["span"] = span
                    found["ids"] = [] if span is None else \
                        out + self.encode(plain[pos:span[0]] + span[2])
                return found["ids"]

            ids = answer_tokens(message_key(m), prompt)
            if ids and prompt() and found["span"] is not None:
                start, end, _ = found["span"]
                last = self.tok.decode(ids[-1:])
                tail = plain[start:end]
                end = start + self._answer_end(tail, last)
                out, pos = prompt() + ids, end
        return out + self.encode(plain[pos:stop])

    def next_query(self, messages: list[dict], answer: dict,
                   answer_tokens: Callable[[str, Callable[[], list[int]]], list[int] | None]
                   | None = None,
                   tools: list[dict] | None = None, template: dict | None = None) -> list[int]:
        """The history the conversation's next query will carry, as its template renders it
        then: `messages`, the `answer` as the client sends it back, and a user turn, up to and
        including the last special token before the user's text (what follows it depends on
        that text: a tokenizer splits at special tokens only). [] where it cannot be told."""
        probe = [*messages, answer, {"role": "user", "content": _MARK}]
        try:
            ids = self.chat(probe, answer_tokens, tools=tools, template=template, cut=_MARK)
        except Exception:  # a template that refuses the probe: nothing to pre-render
            return []
        specials = self._special_ids()
        last = max((i for i, t in enumerate(ids) if t in specials), default=-1)
        return ids[:last + 1]

    def _special_ids(self) -> frozenset[int]:
        if not hasattr(self, "_special_id_set"):
            self._special_id_set = frozenset(
                i for i, t in self.tok.added_tokens_decoder.items() if t.special)
        return self._special_id_set

    def _generation_prompt(self, tools, template) -> str:
        """The text the template ends a prompt with after a user message ("" where unknown)."""
        probe = [{"role": "user", "content": _MARK}]
        try:
            with_gen = self.render(probe, tools, template)
            without = self._render_open(probe, tools, template)
        except Exception:  # a template that cannot render a lone user message
            return ""
        return with_gen[len(without):] if with_gen.startswith(without) else ""

    def _answer_renders(self, messages, k, gen, tools, template, key) -> tuple | None:
        """What `_answer_span` reads of the renders before answer k (with the generation
        prompt) and up to its end: (where they part, the generation prompt's length there,
        the text before only, the text up to the end only, the length and digest of the
        second). Kept by the conversation up to the answer, so the next request of a tool loop
        renders only its newest answer's (each render grows with the history)."""
        if key in self._renders:
            self._renders.move_to_end(key)
            return self._renders[key]
        try:
            before = self.render(messages[:k], tools, template)
            upto = self.render(messages[:k + 1], tools, template)
            if gen and upto.endswith(gen):
                upto = upto[:len(upto) - len(gen)]
            opened = self._render_open(messages[:k], tools, template)
        except Exception:  # a template that cannot render a partial conversation
            got = None
        else:
            common = len(os.path.commonprefix([before, upto]))
            own_gen = len(before) - len(opened) if before.startswith(opened) else 0
            got = (common, len(before) - own_gen, before[common:], upto[common:], len(upto),
                   _digest(upto))
        self._renders[key] = got
        while len(self._renders) > RENDERS_KEPT:
            self._renders.popitem(last=False)
        return got

    def _answer_span(self, messages, k, m, plain, gen, pos, tools, template, key):
        """(start, end, unsaid) of assistant message k in `plain`, or None where the template
        does not render the conversation before it and up to its end as prefixes of the
        whole. `unsaid`: the end of the generation prompt the answer followed that the
        template does not write back (Gemma 4's empty thought channel): the model's input,
        put back before the answer's tokens."""
        renders = self._answer_renders(messages, k, gen, tools, template, key)
        if renders is None:
            return None
        common, history_end, unsaid, answer, end, digest = renders
        if not (common >= pos and common >= history_end and len(plain) >= end
                and _digest(plain[:end]) == digest):
            return None
        reasoning = m.get("reasoning_content") or m.get("thinking") or ""
        if reasoning.strip() and reasoning.strip() not in answer:
            return None  # the template drops this reasoning: the model's input changes
        return common, end, unsaid

    def _answer_end(self, text: str, last: str) -> int:
        """Where the answer ends in the template's `text` of it: before the special token the
        template closes the message with, unless the answer itself ends with that token."""
        body = text.rstrip()
        for special in self._specials():
            if body.endswith(special) and not last.endswith(special):
                return len(body) - len(special)
        return len(text)

    def _specials(self) -> list[str]:
        if not hasattr(self, "_special_texts"):
            texts = {t.content for t in self.tok.added_tokens_decoder.values() if t.special}
            self._special_texts = sorted(texts, key=len, reverse=True)
        return self._special_texts

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
