"""The few-rows matmul form (worker/compute/few_rows.py): outside a verify it gives mlx-lm's
bits, so every answer is unchanged; inside one, each of a verify's rows rounds as that row
alone, as plain decoding computes it."""

import os

import pytest

from tests.conftest import blas_threads

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("arch", ["qwen3_5", "gpt_oss"])  # Linear layers without bias; with
def test_a_model_with_the_few_rows_form_gives_the_same_bits(arch, request):
    import mlx.core as mx

    from kvbank.testing.tiny import arch_config, build_model
    from kvbank.worker.compute import few_rows

    blas_threads(os.cpu_count())  # the worker's threads (conftest gives pytest one)
    request.addfinalizer(lambda: blas_threads(1))
    # SmolLM2-135M's widths (at the tiny ones a bias added after the product rounds the same
    # as one added inside it, and the test could not see the difference), four of its layers.
    config = arch_config(arch, size="default", vocab=512)
    config["num_hidden_layers"] = 4
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:4]
    model, _ = build_model(config, seed=3)
    shapes = [(1, 2), (1, 3), (2, 1), (3, 1), (1, 4), (2, 2)]
    inputs = [mx.random.randint(0, 512, s, key=mx.random.key(i)) for i, s in enumerate(shapes)]
    want = [model(ids) for ids in inputs]
    mx.eval(want)
    assert few_rows.install(model, force=True) > 0
    for ids, w in zip(inputs, want):
        got = model(ids)
        assert mx.array_equal(w, got).item(), (arch, ids.shape, mx.abs(w - got).max().item())


@pytest.mark.parametrize("threads", [1, 2])
def test_in_a_verify_each_row_rounds_as_it_does_alone(threads, request):
    """Every Linear width of the tiny qwen3_5 test models and the default size's, 2-4 rows:
    where `install` found that the form keeps each row's own bits on this machine, a verify's
    rows equal the rows alone (the depth-3 verify whose logprobs left the 1e-4 bound without
    it, on a 2-core AMD EPYC); elsewhere they are MLX's `x @ W.T`, as without the form."""
    import mlx.core as mx
    import mlx.nn as nn

    from kvbank.testing.tiny import arch_config, build_model
    from kvbank.worker.compute import few_rows

    blas_threads(threads)
    request.addfinalizer(lambda: blas_threads(1))
    tiny, _ = build_model(arch_config("qwen3_5", vocab=512), seed=3)
    widths = {m.weight.shape[::-1] for _, m in tiny.named_modules() if type(m) is nn.Linear}
    widths |= {(576, 1536), (1536, 576), (576, 1024), (576, 512), (1024, 576), (576, 2048)}
    for fan_in, fan_out in sorted(widths):
        layer = nn.Linear(fan_in, fan_out, bias=False)
        few_rows.install(layer, force=True)
        for rows in few_rows.VERIFY_ROWS:
            x = mx.random.normal((1, rows, fan_in), key=mx.random.key(rows))
            with few_rows.verifying():
                together = layer(x)
            if getattr(layer, "alone", False):
                want = mx.concatenate([layer(x[:, i:i + 1]) for i in range(rows)], axis=1)
            else:
                want = x @ layer.weight.T
            assert mx.array_equal(together, want).item(), (fan_in, fan_out, rows)
