"""The allocators under MLX: how much freed memory MLX keeps for reuse, when its buffer cache
is emptied, and glibc's settings that make resident memory follow the ledger.
"""

from __future__ import annotations

import logging

from kvbank import heap

logger = logging.getLogger(__name__)

MLX_CACHE_MAX_BYTES = 512 << 20


def mlx_cache_limit(budget: int, fixed_bytes: int) -> int:
    """How much freed memory MLX may keep for reuse: 4 % of what the budget leaves beyond the
    model, at most 512 MB; reserved in the budget's fixed part. A prefill chunk's transients
    (attention scores, activations) are freed every layer and allocated again by the next;
    kept, they are reused warm instead of faulted in afresh (measured: `bench compare`'s
    kvbank wall 106.5 s with 8 MB, 98.7 s with 512 MB)."""
    return max(0, min(MLX_CACHE_MAX_BYTES, (budget - fixed_bytes) // 25))


def drop_stale_buffers() -> None:
    """Empty MLX's buffer cache before a prompt forward.

    MLX's CPU cache takes a freed buffer only while it has room, never evicting, and hands one
    back only for a request of nearly its size. A prompt forward's transients are sized by its
    context, which grows with every chunk: kept, they fill the cache with sizes no later
    forward asks for, and then every layer of every forward faults its transients in afresh.
    Emptied first, a forward faults in its first layer's and the other layers reuse them
    (prefilling 4,096 tokens: 0.44 M page faults against 1.8-2.5 M, and 8-15 % faster;
    docs/decisions.md)."""
    import mlx.core as mx

    mx.clear_cache()


MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc takes


def one_heap() -> None:
    """Every thread allocates from glibc's one heap. Call it first, before any thread starts
    (OpenBLAS and MLX start theirs as they load): an arena is a thread's for life.

    A restore decodes a conversation's KV on a thread of its own, so its buffers came from
    that thread's arena; when the answer outgrew them mid-turn (mlx-lm's cache grows by a
    copy), the engine thread freed them into that arena, whose pages no engine allocation
    could take, and nothing trimmed them until the turn ended: the worker held the
    conversation twice (+610 MiB in one decode step at 2K tokens of 270 KB, past its budget:
    `bench compare --arch llama --size wide-kv --memory-limit 2.4GB`, Dec 2026; mlx-lm's cache
    alone grows by its 256-token step, +68 MiB)."""
    if heap.glibc() and not heap.mallopt(heap.M_ARENA_MAX, 1):
        logger.warning("glibc refused one arena: buffers freed by another thread than the "
                       "one that took them stay resident until a trim")


def serve_buffers_from_the_heap() -> None:
    """Buffers up to 32 MB from glibc's heap, at a threshold that never moves.

    A forward's transients (attention scores, activations) go back to glibc when MLX's cache
    is emptied before the next prompt forward (`drop_stale_buffers`). From the heap the next
    forward reuses those pages at once; mapped one by one, as at glibc's 128 KB, every buffer
    is unmapped and faulted in afresh: a returning turn's 16-token forward on a 2K cache took
    1.10x mlx-lm's beside it at 128 KB and 1.01-1.05x at 32 MB (`kvbank bench turn`). Fixed,
    the threshold does not drift with what was freed last. The heap keeps freed pages until
    `give_back_freed_memory`, which the engine calls after every turn and whenever the ledger
    shrinks, so RSS still follows the ledger."""
    if heap.glibc() and not heap.mallopt(heap.M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        logger.warning("glibc refused an mmap threshold of %d bytes", MMAP_THRESHOLD_BYTES)


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the OS, so resident memory follows the ledger (glibc
    keeps them otherwise)."""
    heap.give_back_freed_pages()
