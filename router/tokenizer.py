"""Prompt text and chat messages to token ids, with the model's own tokenizer (no weights).

Append mode must extend the committed history token for token, or the cached KV would not
match. Re-rendering the whole conversation can tokenize the earlier assistant turns
differently from what the model generated, so we render only what is new: the text a chat
template puts after an assistant message, up to the next generation prompt.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

_MARK = "\ue000kvbank-assistant-end\ue000"  # private-use characters: never in real text


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

    def render(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def chat(self, messages: list[dict]) -> list[int]:
        """A whole conversation, ready for the assistant's next turn."""
        return self.encode(self.render(messages))

    def chat_append(self, history: list[int], messages: list[dict],
                    eos_token_ids: set[int]) -> list[int]:
        """Tokens to append to `history` (which ends after an assistant turn) for `messages`."""
        if not history:
            return self.chat(messages)
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        text = self.render(probe + messages)
        at = text.find(_MARK)
        if at < 0:  # a template that rewrites assistant content: fall back to the messages
            logger.warning("chat template hides assistant content; appending messages alone")
            return self.chat(messages)
        delta = text[at + len(_MARK):]
        if history[-1] in eos_token_ids:  # the model already generated the end-of-turn token
            eos_text = self.tok.decode([history[-1]])
            if delta.startswith(eos_text):
                delta = delta[len(eos_text):]
        return self.encode(delta)
