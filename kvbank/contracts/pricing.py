"""The price list: what a request will cost in bytes, before it allocates anything. The worker
measures its numbers at start and publishes them in its Info; the router prices a request with
the same list to refuse at once what can never fit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pricing:
    """What a request will cost in bytes, before it allocates anything.

    MLX on CPU does not enforce a memory limit and a failed allocation kills the process, so
    every byte is priced up front. A running request's cache grows by concatenation, which
    briefly holds the old and the new buffer: it is priced at twice its final size. A prefill
    chunk's transients (attention scores, activations, logits) are measured once at start and
    grow with the context the chunk attends to.
    """

    kv_bytes_per_token: int
    fixed_bytes: int  # weights, runtime, interpreter: measured at start
    chunk_tokens: int
    transient_base: int = 0  # one chunk at an empty context
    transient_per_context_token: float = 0.0
    # Resident memory the ledger does not explain (allocator caches, fragmentation), measured
    # against RSS every guard tick and counted as held, so the budget is the real one.
    unaccounted_bytes: int = 0
    # A request's window and recurrent caches (worker/kv/cache_kinds.py), whatever its length,
    # and the checkpoints it takes of them: twice their largest size.
    state_bytes: int = 0

    def cache_bytes(self, tokens: int) -> int:
        return 2 * self.kv_bytes_per_token * tokens + self.state_bytes

    def prefill_transient(self, context_tokens: int) -> int:
        return int(self.transient_base + self.transient_per_context_token * context_tokens)

    def max_fit_tokens(self, budget: int, prompt_tokens: int | None = None) -> int:
        """The longest prompt + max_tokens that fits the budget with nothing else held
        (for a prompt of `prompt_tokens`; None: a prompt as long as the whole request)."""
        room = budget - self.fixed_bytes - self.transient_base - self.state_bytes
        if prompt_tokens is None:
            per_token = 2 * self.kv_bytes_per_token + self.transient_per_context_token
            return max(0, int(room / max(per_token, 1)))
        room -= self.transient_per_context_token * prompt_tokens
        return max(0, int(room / max(2 * self.kv_bytes_per_token, 1)))

    def request_bytes(self, prompt_tokens: int, max_tokens: int, *, batch_len: int = 0,
                      batch_size: int = 0) -> int:
        """The request's cache, its prefill transient, and the padding it adds to a batch
        (mlx-lm pads every batched cache to the longest one)."""
        total = prompt_tokens + max_tokens
        padding = batch_size * max(0, total - batch_len) + max(0, batch_len - total)
        return (self.cache_bytes(total + padding)
                + self.prefill_transient(min(prompt_tokens, max(batch_len, prompt_tokens))))
