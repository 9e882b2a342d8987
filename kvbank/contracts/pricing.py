"""The price list: what a request will cost in bytes, before it allocates anything. The worker
measures its numbers at start and publishes them in its Info; the router prices a request with
the same list to refuse at once what can never fit."""

from __future__ import annotations

from dataclasses import dataclass

ROOM_STEP_TOKENS = 256  # mlx-lm's KVCache grows by as many tokens at a time
# What a busy spell's frees leave in the coldstore past `coldstore_write_bytes`: within 64 MiB
# with Qwen3.6-27B's 16 MB blocks and 154 MB checkpoints (`bench scale`, Dec 2026; trimmed at
# `coldstore_write_bytes` alone its page faults were 4.5x and its CPU a GB 1.4x). The
# coldstore trims past both (coldstore/server.py `_bound_heap`); a memory limit leaves it
# beside the worker's budget (`bench compare`'s rule), a budget's slack is not for it.
WRITE_KEEP_MARGIN_BYTES = 64 << 20


def coldstore_write_bytes(largest_block: int) -> int:
    """What the coldstore's writes hold beyond the blocks handed to it: LMDB's copy of the
    block it commits and the freed pages it keeps for the next, two of the largest blocks.
    The worker's ledger counts it while a write is staged (worker/link/writer.py
    `staged_bytes`)."""
    return 2 * largest_block


@dataclass
class Pricing:
    """What a request will cost in bytes, before it allocates anything.

    MLX on CPU does not enforce a memory limit and a failed allocation kills the process, so
    every byte is priced up front.

    A request on its own cache holds its KV once, in a buffer up to one growth step
    (ROOM_STEP_TOKENS) longer: mlx-lm's cache grows a layer at a time and the old layer's
    buffer goes as the grown one is written (measured on the default model: a returning turn
    of 1,100 restored, 150 new and 32 answered tokens peaked 14 MB beyond its 59 MB history).
    Joining mlx-lm's batch copies its cache into the batch's, with a growth step, and pads it
    to the longest there. The copy is held while the join runs (`join_bytes`), the padding
    until the request ends (`padding_bytes`); its own cache goes once copied. Members leaving
    the batch are copied out of it a layer at a time (`leave_bytes`).

    A forward's transients (attention scores, activations, the last prompt forward's logits)
    are measured once at start and grow with the context it attends to. The worker runs one
    forward at a time, so of the running requests' only the largest is held
    (worker/tiers/bank.py `reserve_active`); a request read in mlx-lm's batch with others
    holds its own. A request past its prompt holds a decode step's (`decode_transient`).
    """

    kv_bytes_per_token: int
    fixed_bytes: int  # weights, runtime, interpreter: measured at start
    chunk_tokens: int
    transient_base: int = 0  # one forward at an empty context: a chunk, or the last one
    transient_per_context_token: float = 0.0
    # Resident memory the ledger does not explain (allocator caches, fragmentation), measured
    # against RSS every guard tick and counted as held, so the budget is the real one.
    unaccounted_bytes: int = 0
    # A request's window and recurrent caches (worker/kv/cache_kinds.py), whatever its length,
    # and the checkpoints it takes of them: twice their largest size.
    state_bytes: int = 0
    # The full-attention layers the KV spans: mlx-lm gathers a batch's rows a layer at a time.
    kv_layers: int = 1
    # A query's logits over the vocabulary, in float32 (an upper bound where a model computes
    # them in half precision): mlx-lm keeps a batch row's log-probabilities for two steps.
    logits_bytes_per_query: int = 0

    def cache_bytes(self, tokens: int) -> int:
        """A cache of `tokens` on its own: its buffer, with the room a growth step leaves."""
        return self.kv_bytes_per_token * (tokens + ROOM_STEP_TOKENS) + self.state_bytes

    def join_bytes(self, tokens: int, *, batch_len: int = 0, batch_size: int = 0) -> int:
        """What joining mlx-lm's batch adds to a request of `tokens` on its own cache while the
        join runs: its copy in the batch's cache, with a growth step, and the padding
        (`padding_bytes`), held twice (copied, then kept). Measured on the default model, a
        1,500-token answer's join peaked at its copy plus 3 MB, and its own cache went with
        the step."""
        padding = self.padding_bytes(tokens, batch_len=batch_len, batch_size=batch_size)
        return self.kv_bytes_per_token * (tokens + ROOM_STEP_TOKENS) + 2 * padding

    def padding_bytes(self, tokens: int, *, batch_len: int = 0, batch_size: int = 0) -> int:
        """What a request of `tokens` joining the batch pads, for as long as it runs: itself to
        the longest member's `batch_len`, or each of the `batch_size` members to its own."""
        padding = batch_size * max(0, tokens - batch_len) + max(0, batch_len - tokens)
        return self.kv_bytes_per_token * padding

    def leave_bytes(self, members: list[int]) -> int:
        """Members of mlx-lm's batch (`members`: each one's tokens) leaving it: their rows are
        copied out and the rest gathered into a new buffer, a layer at a time, each layer's
        old buffer going as both are made (worker/compute/scheduler.py `_copy_out`): one
        layer of every row, padded to the longest with a growth step."""
        if not members:
            return 0
        rows = len(members) * (max(members) + ROOM_STEP_TOKENS)
        return self.kv_bytes_per_token * rows // max(self.kv_layers, 1)

    def prefill_transient(self, context_tokens: int) -> int:
        return int(self.transient_base + self.transient_per_context_token * context_tokens)

    def decode_transient(self, context_tokens: int, tokens: int) -> int:
        """A decode step's working memory: `tokens` queries (every row of a full batch, each
        with its drafts) at `context_tokens`, the measured chunk's share of them (its
        activations, scores and logits are per query token), and the log-probabilities
        mlx-lm keeps for each, this step's and the last's (on the tiny model's 49K vocabulary,
        1.2 MB for three rows, unpriced until 2026-12-07)."""
        share = self.prefill_transient(context_tokens) * tokens / max(self.chunk_tokens, 1)
        return int(share) + 2 * tokens * self.logits_bytes_per_query

    def max_fit_tokens(self, budget: int, prompt_tokens: int | None = None) -> int:
        """The longest prompt + max_tokens that fits the budget with nothing else held
        (for a prompt of `prompt_tokens`; None: a prompt as long as the whole request)."""
        room = (budget - self.fixed_bytes - self.transient_base - self.state_bytes
                - self.kv_bytes_per_token * ROOM_STEP_TOKENS)
        if prompt_tokens is None:
            per_token = self.kv_bytes_per_token + self.transient_per_context_token
            return max(0, int(room / max(per_token, 1)))
        room -= self.transient_per_context_token * prompt_tokens
        return max(0, int(room / max(self.kv_bytes_per_token, 1)))

    def request_bytes(self, prompt_tokens: int, max_tokens: int, *, joins: bool = False,
                      batch_len: int = 0, batch_size: int = 0) -> int:
        """The request alone: its cache (`own_bytes`) and its prefill transient."""
        return (self.own_bytes(prompt_tokens, max_tokens, joins=joins, batch_len=batch_len,
                               batch_size=batch_size)
                + self.prefill_transient(prompt_tokens))

    def own_bytes(self, prompt_tokens: int, max_tokens: int, *, joins: bool = False,
                  batch_len: int = 0, batch_size: int = 0) -> int:
        """The request's cache; with `joins` (a request that runs in mlx-lm's batch from its
        start), its join too (`join_bytes`, for the batch as it is)."""
        total = prompt_tokens + max_tokens
        join = self.join_bytes(total, batch_len=batch_len, batch_size=batch_size) if joins else 0
        return self.cache_bytes(total) + join
