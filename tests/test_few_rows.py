"""The few-rows matmul form (worker/compute/few_rows.py) changes speed, never a bit of output:
a model with it answers exactly as mlx-lm's own, so every exactness test still holds."""

import os

import pytest

from tests.conftest import blas_threads

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("arch", ["qwen3_5", "gpt_oss"])  # Linear layers without bias; with
def test_a_model_with_the_few_rows_form_gives_the_same_bits(arch, request):
    import mlx.core as mx

    from kvbank.testing.tiny import arch_config, build_model
    from kvbank.worker.compute import few_rows

    blas_threads(os.cpu_count())  # the threads the form is for (conftest gives pytest one)
    request.addfinalizer(lambda: blas_threads(1))
    # SmolLM2-135M's widths: at the tiny ones a bias added after the product rounds the same
    # as one added inside it, and the test could not see the difference.
    config = arch_config(arch, size="default", vocab=512)
    plain, _ = build_model(config, seed=3)
    formed, _ = build_model(config, seed=3)
    assert few_rows.install(formed, force=True) > 0
    rng = mx.random.key(7)
    for batch, tokens in [(1, 1), (1, 2), (1, 3), (2, 1), (3, 1), (1, 4), (2, 2), (1, 9)]:
        ids = mx.random.randint(0, 512, (batch, tokens), key=rng)
        want, got = plain(ids), formed(ids)
        assert mx.array_equal(want, got).item(), (arch, batch, tokens,
                                                   mx.abs(want - got).max().item())


def test_on_one_blas_thread_nothing_is_installed():
    from kvbank.testing.tiny import arch_config, build_model
    from kvbank.worker.compute import few_rows

    blas_threads(1)
    model, _ = build_model(arch_config("qwen3_5", vocab=512), seed=3)
    assert few_rows.install(model) == 0
