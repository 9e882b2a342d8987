"""The worker's allocator settings: buffers come from glibc's heap, so a forward reuses what the
last one freed, and the trim the engine makes hands freed KV back to the OS (RSS follows the
ledger). Real MLX arrays in this process, with the worker's settings."""

import mlx.core as mx
import pytest

from kvbank.worker.memory.allocator import give_back_freed_memory, serve_buffers_from_the_heap
from kvbank.worker.memory.pricing import resident_bytes

pytestmark = pytest.mark.unit  # make test-fast

MB = 1 << 20


def _kv_like(n: int) -> list:
    """n buffers of 1.5 MB each: one layer's keys of a 2K conversation of the default model."""
    arrays = [mx.ones((1, 3, 2048, 64), dtype=mx.float32) for _ in range(n)]
    mx.eval(arrays)
    return arrays


def test_freed_kv_below_live_kv_leaves_the_process_at_the_trim():
    serve_buffers_from_the_heap()
    # What MLX frees goes to glibc at once, as after the worker empties MLX's cache.
    cache_limit = mx.set_cache_limit(0)
    try:
        give_back_freed_memory()
        before = resident_bytes()
        released = _kv_like(100)  # a conversation the bank lets go of...
        kept = _kv_like(4)  # ...below one it keeps: its pages are inside the heap, not its top
        assert resident_bytes() - before > 120 * MB
        del released
        give_back_freed_memory()
        assert resident_bytes() - before < 40 * MB, "the released conversation's pages stayed"
        assert float(kept[0][0, 0, 0, 0]) == 1.0
    finally:
        mx.set_cache_limit(cache_limit)  # the tests after this one run as they would alone
