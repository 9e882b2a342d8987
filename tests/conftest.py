"""Shared fixtures: the tiny model, and a real kvbank stack (three processes) around it."""

from __future__ import annotations

import os
from pathlib import Path

from kvbank import transformers_scan
from kvbank.config import preload_openblas

_blas = preload_openblas()  # before anything imports mlx in this process
transformers_scan.install()  # as every kvbank process does: before transformers loads


def blas_threads(n: int) -> None:
    """This pytest process's OpenBLAS threads (the library MLX uses here; none: nothing)."""
    if _blas:
        import ctypes

        ctypes.CDLL(_blas).openblas_set_num_threads(n)


# This process's own forwards (the references from scratch, the in-process models) on one
# OpenBLAS thread: `make test` runs three processes on two cores beside the stacks, and a
# second thread mostly waited for the first (the busiest four files: 6-7 % less wall time in
# two alternated pairs). This sets the library in this process, not the environment: the
# stacks' count is `start_stack`'s. A test of the thread count sets its own.
blas_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _own_ports() -> None:
    """`make test` runs the suite in several pytest-xdist processes: each plans its stacks'
    ports in a slice of the range of its own, so two never pick the same one before either
    binds it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if not worker or "KVBANK_PORT_RANGE" in os.environ:
        return
    from kvbank.deploy.local import port_range

    low, high = port_range()
    n, i = int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), int(worker.removeprefix("gw"))
    step = (high - low) // n
    os.environ["KVBANK_PORT_RANGE"] = f"{low + i * step}-{low + (i + 1) * step}"


_own_ports()

import grpc  # noqa: E402
import pytest  # noqa: E402

from kvbank.deploy.local import LocalStack


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """Where the default model is imported: the user's cache, so runs share one import."""
    from kvbank.models import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, cache_dir) -> Path:
    from kvbank.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def tool_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with a chat template that has tools (kvbank/testing/templates/qwen_tools.jinja),
    so mlx-lm gives it a tool parser; the default model's template has none."""
    from kvbank.testing.agent_model import with_tools_template

    return with_tools_template(tiny_model, tmp_path_factory.mktemp("tool-model") / "model")


def matrix(values, keep) -> list:
    """`values` as parameters, those not in `keep` marked `matrix`: the same behaviour on more
    architectures or model families, run by `make test-all`; `make test` (CI) runs `keep`, one
    of each kind (cache kind, call format), so that it stays within its ten minutes."""
    return [v if v in keep else pytest.param(v, marks=pytest.mark.matrix) for v in values]


def start_stack(model: Path, data_dir: Path, *, extra: list[str] = (),
                cache_dir: Path | None = None, shim: bool = True,
                slow_disk_s: float | None = None, env: dict | None = None,
                wait: bool = True) -> LocalStack:
    """A stack with small blocks, a short quiet grace and no tail delay, as tests want it;
    with `slow_disk_s`, its coldstore commits each block that much later (tests/slow_coldstore.py);
    `env`: its processes' environment, over this one's; `wait=False`: returned as soon as it
    runs (then `wait_started`)."""
    env = {**({"KVBANK_CACHE_DIR": str(cache_dir)} if cache_dir else {}), **(env or {})}
    # One OpenBLAS thread in the worker too: three test processes' stacks share two cores
    # (2-5 % less wall on three stack-heavy files, two alternated pairs; half the system time).
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    launcher = (("-m", "tests.slow_coldstore", "--delay-s", str(slow_disk_s))
                if slow_disk_s else ("-m", "kvbank.apps.cli"))
    return LocalStack.start(model, data_dir, env=env, timeout_s=120, shim=shim,
                            launcher=launcher, wait=wait,
                            extra=["--block-tokens", "16", "--quiet-grace-s", "0.1",
                                   "--tail-delay-s", "0", *extra])


@pytest.fixture
def stack(tiny_model, tmp_path, cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def module_stack(tiny_model, tmp_path_factory, cache_dir):
    """One stack for a module's tests that neither kill nor reconfigure it, and whose
    conversations do not meet (each names or words its own)."""
    s = start_stack(tiny_model, tmp_path_factory.mktemp("module") / "data", cache_dir=cache_dir)
    yield s
    s.stop()


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def lark_accepts(tokenizer, definition: str, text: str) -> bool:
    """Whether a Lark grammar takes `text` whole, as llguidance (the worker's matcher) reads
    it; `tokenizer` is an llguidance LLTokenizer."""
    import llguidance as llg

    matcher = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_lark(definition), log_level=0)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()
