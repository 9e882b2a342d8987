"""Which conversation a request continues, found by its tokens alone.

Most agent clients send no session name. Such a request continues the anonymous conversation
whose committed history its prompt extends, token for token; when none does, it starts a new
one. Either way it gets a session key like a named one, so every tier and guarantee (record,
write-behind, protection, write-out, restore after a crash) applies unchanged.

The index maps an *anchor* to the conversations that have it: the chained id of the last full
block that lies at least `slack` tokens before the end of the history (the tenant's root when
there is none). A prompt's own block ids are walked from the longest prefix down, so a lookup
costs one dict probe per block of the prompt plus a token check of the few candidates. A
matching anchor is a hash chain over every token up to it, so only the tokens after it (fewer
than `block_tokens + slack`) are compared: each record keeps that `tail`, not its history.
`slack` lets a client that re-renders the last few tokens of an answer differently (a turn end
written another way) still continue its conversation.

An anonymous conversation's id is `~` and 12 hex digits of a hash of its first prompt (salted
by tenant and model, as block ids are): short enough to type in `kvbank admin release`.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Mapping

import numpy as np

from kvbank.blocks import (ANONYMOUS_PREFIX, BlockId, common_prefix_len, is_anonymous,
                           tail_block_id)

SessionKey = tuple[str, str]  # (tenant, session_id)

CONTINUE_SLACK_TOKENS = 16


class Lineages:
    """The content index of anonymous conversations (engine thread only)."""

    def __init__(self, *, root_for: Callable[[str], BlockId], block_tokens: int,
                 slack: int = CONTINUE_SLACK_TOKENS):
        self.root_for = root_for
        self.block_tokens = block_tokens
        self.slack = slack
        self._by_anchor: dict[BlockId, set[SessionKey]] = {}
        self._anchor_of: dict[SessionKey, BlockId] = {}

    def __len__(self) -> int:
        return len(self._anchor_of)

    def anchor_at(self, n_tokens: int) -> int:
        """Where a history of `n_tokens` is anchored: its tail starts there."""
        return max(0, n_tokens - self.slack) // self.block_tokens * self.block_tokens

    def set(self, key: SessionKey, n_tokens: int, block_ids: list[BlockId]) -> None:
        """The conversation's committed history is now `n_tokens` long, with these chained
        ids of its full blocks; it is filed under the last one at least `slack` tokens before
        its end (the tenant's root when there is none)."""
        self.drop(key)
        full = self.anchor_at(n_tokens) // self.block_tokens
        a = block_ids[full - 1] if full else self.root_for(key[0])
        self._anchor_of[key] = a
        self._by_anchor.setdefault(a, set()).add(key)

    def drop(self, key: SessionKey) -> None:
        a = self._anchor_of.pop(key, None)
        if a is not None:
            keys = self._by_anchor[a]
            keys.discard(key)
            if not keys:
                del self._by_anchor[a]

    def find(self, tokens: np.ndarray, ids: list[BlockId], tenant: str,
             histories: Mapping[SessionKey, object],
             busy: Callable[[SessionKey], bool]) -> SessionKey | None:
        """The idle conversation whose history `tokens` (chained block ids `ids`) extends, all
        but `slack` of its last tokens, the longest first. A conversation with a request
        running is not continued by a second request at once: that one starts its own. Found
        under block `k`, the prompt's first k blocks are the history's (the chain proves it):
        the record's `tail` is compared with the prompt from there."""
        root = self.root_for(tenant)
        for k in range(len(ids), -1, -1):
            keys = self._by_anchor.get(ids[k - 1] if k else root)
            if not keys:
                continue
            best, best_n = None, -1
            for key in keys:
                info = histories.get(key)
                if info is None or busy(key):
                    continue
                start = k * self.block_tokens
                n = start + common_prefix_len(info.tail, tokens[start:])
                if n >= info.n_tokens - self.slack and n > best_n:
                    best, best_n = key, n
            if best is not None:
                return best
        return None

    def new_id(self, tokens: np.ndarray, tenant: str, taken: Callable[[SessionKey], bool]) -> str:
        """A fresh id from the first prompt's content (a counter breaks ties with a
        conversation that began with the same prompt)."""
        seed = tail_block_id(self.root_for(tenant), tokens)
        for n in range(1 << 20):
            h = hashlib.blake2b(seed + n.to_bytes(4, "little"), digest_size=6).hexdigest()
            sid = ANONYMOUS_PREFIX + h
            if not taken((tenant, sid)):
                return sid
        raise RuntimeError("no free anonymous conversation id")

    def clear(self) -> None:
        self._by_anchor.clear()
        self._anchor_of.clear()
