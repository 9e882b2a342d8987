"""The worker's allocator settings: buffers come from glibc's heap, so a forward reuses what the
last one freed, and the trim the engine makes hands freed KV back to the OS (RSS follows the
ledger). Real MLX arrays in this process, with the worker's settings."""

import subprocess
import sys

import mlx.core as mx
import pytest

from kvbank import heap

from kvbank.worker.memory.allocator import give_back_freed_memory, serve_buffers_from_the_heap
from kvbank.contracts.pricing import Pricing
from kvbank.heap import resident_bytes
from kvbank.worker.memory.pricing import memory_budget_bytes, reconcile_rss, rss_slack

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


def test_the_budget_bounds_resident_memory_not_only_the_ledger():
    """What no ledger line itemizes (threads, the allocators' drift in a forward) is held back
    from the budget, and resident memory past the ledger counts as held at once. Before, RSS
    could pass the ledger by 5 % of the budget unheld: a worker sat 4 % past its
    --memory-budget and the memory limit sized from that budget killed it."""
    pricing = Pricing(512, 100 * MB, 16, transient_base=10 * MB)
    budget = memory_budget_bytes(1000 * MB, pricing)
    assert budget == 1000 * MB and rss_slack(budget) == 50 * MB
    pricing.fixed_bytes += rss_slack(budget)  # as the engine holds it
    reconcile_rss(pricing, 200 * MB, pricing.fixed_bytes + 200 * MB + 3 * MB)
    assert pricing.unaccounted_bytes == 3 * MB
    reconcile_rss(pricing, 200 * MB, pricing.fixed_bytes + 150 * MB)
    assert pricing.unaccounted_bytes == 0

    # "+N": N bytes for KV beyond the model, a chunk's working memory and the slack.
    plus = Pricing(512, 100 * MB, 16, transient_base=10 * MB)
    budget = memory_budget_bytes(f"+{20 * MB}", plus)
    assert budget - plus.fixed_bytes - plus.transient_base - rss_slack(budget) >= 20 * MB


_ONE_HEAP_PROBE = """
import threading
from kvbank import heap
from kvbank.worker.memory.allocator import one_heap, serve_buffers_from_the_heap
one_heap()  # as the worker's start does, before any thread
import numpy as np
serve_buffers_from_the_heap()
MB = 1 << 20
held = []
t = threading.Thread(target=lambda: held.extend(np.ones(MB // 2) for _ in range(48)))
t.start(); t.join()  # 192 MB taken on another thread (a restore's decode)
before = heap.resident_bytes()
held.clear()  # freed by this thread (the engine's, as the answer's cache outgrows them)
grown = [np.ones(int(4.5 * MB) // 8) for _ in range(48)]  # 216 MB, each a little larger
print((heap.resident_bytes() - before) // MB)
"""


@pytest.mark.skipif(not heap.glibc(), reason="glibc's arenas")
def test_buffers_another_thread_took_are_reused_once_freed():
    """The worker's allocator setting (`one_heap`, at its start): buffers a restore thread
    took and the engine thread frees are reused by the engine's next allocations. With an
    arena per thread they stayed resident beside the new ones until a trim (here 143 MB more
    for 216 MB allocated where 192 MB were freed; in the worker the conversation held twice
    as its answer outgrew its buffer, past the budget)."""
    out = subprocess.run([sys.executable, "-c", _ONE_HEAP_PROBE], capture_output=True,
                         text=True, check=True, timeout=120)
    assert int(out.stdout.split()[-1]) < 64, out.stdout


def test_the_memory_calibration_is_kept_per_model_and_chunk_size(tmp_path, tiny_model):
    """Measured at a first start (five prefill chunks of the real tiny model, and what a
    first request leaves behind), read at the next: no chunk runs and no warm-up. Another
    model's, another chunk size's or a damaged file is measured again."""
    from mlx_lm import load

    from kvbank.contracts.pricing import Pricing
    from kvbank.worker.memory.pricing import calibrate
    from kvbank.worker.memory.calibration import CalibrationFile, measured

    model, _ = load(str(tiny_model))
    runs, left_behind = [], []

    def start(file: CalibrationFile, chunk: int) -> Pricing:
        def calibrated(pricing, on_chunk):
            runs.append(chunk)
            calibrate(model, pricing, on_chunk, last_forward_tokens=64)

        def warm_up():  # what a first request leaves allocated: 16 MB, kept
            left_behind.append(mx.ones((4 << 20,), dtype=mx.float32))
            mx.eval(left_behind[-1])

        return measured(Pricing(512, 0, chunk), file, calibrate=calibrated, warm_up=warm_up)

    a = CalibrationFile(tmp_path, b"\x01" * 16, 16)
    first = start(a, 16)
    kept = a.read()
    assert runs == [16] and first.transient_base > 0 and kept["warm_up_bytes"] >= 0
    again = start(a, 16)
    assert runs == [16] and len(left_behind) == 1  # read, not measured: no chunk, no warm-up
    assert (again.transient_base, again.transient_per_context_token) == \
        (first.transient_base, first.transient_per_context_token)
    # the fixed part counts what the skipped warm-up would have left behind
    assert again.fixed_bytes - kept["warm_up_bytes"] <= resident_bytes() + MB
    start(CalibrationFile(tmp_path, b"\x01" * 16, 8), 8)
    start(CalibrationFile(tmp_path, b"\x02" * 16, 16), 16)
    assert runs == [16, 8, 16]
    a.path.write_text("{not json")
    start(a, 16)
    assert runs == [16, 8, 16, 16] and a.read() is not None


def test_the_default_budget_is_a_share_of_the_containers_limit_not_the_hosts_ram():
    """In a memory cgroup (a container), psutil still reports the host's RAM: the default
    --memory-budget takes its 60 % of the cgroup's limit where that is lower, so a worker in a
    1 GB container budgets 600 MB instead of most of the host's memory (and is OOM-killed)."""
    import subprocess
    import sys

    import psutil

    from kvbank.apps.bench.cgroup import CgroupUnavailable, MemoryCgroup
    from kvbank.worker.memory.pricing import default_memory_budget

    code = ("from kvbank.worker.memory.pricing import default_memory_budget as d; "
            "print(d())")
    try:
        group = MemoryCgroup.create("kvbank-test-budget", 1_000_000_000)
    except CgroupUnavailable as e:
        pytest.skip(f"no memory cgroup here: {e}")
    try:
        out = subprocess.run([sys.executable, "-c", code], preexec_fn=group.preexec,
                             capture_output=True, text=True, check=True).stdout
    finally:
        group.remove()
    limit = group.limit_bytes
    assert int(out) == int(limit * 0.6) < psutil.virtual_memory().total * 0.6
    assert default_memory_budget() > int(out)  # this process: no such limit


def test_a_cgroup_v2_limit_bounds_every_cgroup_below_it(tmp_path):
    """cgroup v2 (the layout read where v1's memory controller is not mounted): the lowest
    `memory.max` of the process's cgroup and its ancestors; `max` is no limit."""
    from kvbank.worker.memory.pricing import cgroup_memory_limit

    root = tmp_path / "cgroup"
    leaf = root / "user.slice" / "app"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "user.slice" / "memory.max").write_text("2000000000\n")
    (leaf / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("0::/user.slice/app\n")
    assert cgroup_memory_limit(proc, root) == 2_000_000_000
    (leaf / "memory.max").write_text("500000000\n")
    assert cgroup_memory_limit(proc, root) == 500_000_000
    proc.write_text("0::/\n")
    assert cgroup_memory_limit(proc, root) is None
    assert cgroup_memory_limit(tmp_path / "missing", root) is None
