"""SessionBank restores with the real tiny model: a restore is isolated and continues like a
recomputation, and a returning turn takes its conversation's entry and writes in place.
(Split from tests/test_bank.py, which holds the pure bank policies.)"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvbank.blocks import chain_block_ids
from tests.test_bank import TENANT, make_bank, root_for, toks
from kvbank.worker.kv import arrays
from kvbank.worker.kv.kinds import FullKind

pytestmark = pytest.mark.unit  # make test-fast


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from mlx_lm import load

    return load(str(tiny_model))


def _last_logits(model, tokens: np.ndarray, cache) -> np.ndarray:
    out = model(mx.array(tokens[None].astype(np.int32)), cache=cache)
    mx.eval(out)
    return np.array(out[0, -1].astype(mx.float32))


def _snapshot(layers) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array(k), np.array(v)) for k, v in layers]


def _same(layers, snap) -> bool:
    return all(np.array_equal(np.array(k), sk) and np.array_equal(np.array(v), sv)
               for (k, v), (sk, sv) in zip(layers, snap))


def test_restore_is_isolated_and_continues_like_recomputation(model_and_tokenizer):
    """A restored conversation continues exactly as if it had been prefilled from scratch,
    and one request's generation never changes another's restored KV or the bank."""
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = model_and_tokenizer
    prompt = np.asarray(tokenizer.encode("You are a helpful assistant. Tell me about the sea."),
                        np.uint32)
    assert len(prompt) >= 8
    bank = make_bank(block_tokens=4)
    cache = make_prompt_cache(model)
    _last_logits(model, prompt, cache)
    entry = bank.insert((TENANT, "s"), prompt, FullKind().freeze_layers(cache, len(prompt)))
    n = len(prompt)
    assert entry.nbytes == arrays.layers_nbytes(entry.layers)
    assert entry.layers[0][0].shape[2] == n
    snap = _snapshot(entry.layers)

    more = np.asarray(tokenizer.encode(" And the mountains?"), np.uint32)
    full = toks(prompt, more)
    hit = bank.lookup(full, TENANT)
    assert hit.entry is entry and hit.n_tokens == n

    first = FullKind().restore_layers(hit.entry.layers, hit.n_tokens)
    second = FullKind().restore_layers(hit.entry.layers, hit.n_tokens)
    from_ram = _last_logits(model, more, first)  # extends `first` by len(more) tokens
    assert first[0].offset == n + len(more)
    reference = _last_logits(model, full, make_prompt_cache(model))
    assert np.allclose(from_ram, reference, atol=1e-4), np.abs(from_ram - reference).max()

    assert all(c.offset == n for c in second)
    assert _same([(c.keys, c.values) for c in second], snap)
    assert _same(entry.layers, snap)
    # `second` still continues exactly (nothing `first` wrote leaked into it).
    assert np.allclose(_last_logits(model, more, second), reference, atol=1e-4)

    # A full hit leaves the last token to compute; trimming a restored cache and writing
    # over the trimmed positions must not touch the bank either.
    third = FullKind().restore_layers(entry.layers, n - 1)
    last = _last_logits(model, prompt[n - 1:], third)
    ref_prompt = _last_logits(model, prompt, make_prompt_cache(model))
    assert np.allclose(last, ref_prompt, atol=1e-4)
    fourth = FullKind().restore_layers(entry.layers, n)
    for c in fourth:
        c.trim(3)
    _last_logits(model, np.asarray([1, 2, 3], np.uint32), fourth)
    assert _same(entry.layers, snap)


def _data_ptr(a: mx.array) -> int:
    return np.array(a, copy=False).ctypes.data


def test_returning_turn_takes_its_entry_and_writes_in_place(model_and_tokenizer, tmp_path):
    """A prompt that continues the whole of its conversation's entry takes the entry out of
    the bank (its KV is the request's while it runs) and writes its new tokens into the
    entry's buffer: no copy of the history. Given back (the request failed), the entry is as it
    was. Other conversations get slices; readers that hold the buffer (a write-out's views)
    see it unchanged; the answers are exact either way."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvbank.worker.kv.cache_kinds import CacheKinds
    from kvbank.worker.tiers.restore import Restorer

    model, tokenizer = model_and_tokenizer
    prompt = np.asarray(tokenizer.encode("You are a helpful assistant. Tell me about the sea."),
                        np.uint32)
    more = np.asarray(tokenizer.encode(" And the mountains?"), np.uint32)
    full = toks(prompt, more)
    n = len(prompt)
    cache = make_prompt_cache(model)
    _last_logits(model, prompt, cache)
    room = [(0, 0), (0, 0), (0, len(more) + 4), (0, 0)]  # the room a kept turn buffer has
    layers = [(mx.pad(c.keys[..., :n, :], room), mx.pad(c.values[..., :n, :], room))
              for c in cache]
    mx.eval(layers)
    bank = make_bank(block_tokens=4)
    entry = bank.insert((TENANT, "s"), prompt, layers)
    snap = _snapshot([(k[..., :n, :], v[..., :n, :]) for k, v in entry.layers])
    reference = _last_logits(model, full, make_prompt_cache(model))
    restorer = Restorer(kinds=CacheKinds.of(model), bank=bank, client=None, store_dir=tmp_path,
                        root_for=root_for, block_tokens=4)

    def restore(tokens, session):  # the steps the KV manager takes: look, read SSD, take
        ids = chain_block_ids(tokens, root_for(TENANT), 4)
        look = restorer.look(tokens, ids, TENANT, False)
        ssd = restorer.read_ssd(look, tokens, ids, TENANT, (TENANT, session))
        return restorer.take(look, ssd, (TENANT, session))

    def unchanged() -> bool:
        return _same([(k[..., :n, :], v[..., :n, :]) for k, v in entry.layers], snap)

    taken, cached, _, handed = restore(full, "s")
    assert handed is entry and cached == n
    assert entry.key not in bank.entries and bank.total_nbytes == 0  # the request's now
    before = _data_ptr(entry.layers[0][0])
    assert np.allclose(_last_logits(model, more, taken), reference, atol=1e-4)
    assert _data_ptr(taken[0].keys) == before  # written in place: no copy
    assert unchanged()

    bank.take_back(entry)  # the request failed: the conversation's KV is back, as it was
    assert bank.lookup(full, TENANT).entry is entry and bank.total_nbytes == entry.nbytes
    assert unchanged()

    # Another conversation sharing the prefix gets slices: its writes go to its own copy.
    other, cached, _, handed = restore(full, "t")
    assert handed is None and cached == n and entry.key in bank.entries
    assert np.allclose(_last_logits(model, more, other), reference, atol=1e-4)
    assert unchanged()

    # A write-out's views taken before the turn writes keep their bytes (the turn copies
    # rather than write under them).
    views = arrays.layer_views(entry.layers)
    kept = [(k.copy(), v.copy()) for k, v in views]
    again, _, _, handed = restore(full, "s")
    assert handed is entry
    _last_logits(model, np.asarray([7, 8, 9, 10], np.uint32), again)
    assert all(np.array_equal(k, kk) and np.array_equal(v, vv)
               for (k, v), (kk, vv) in zip(views, kept))
    bank.take_back(entry)

    # A prompt that leaves the entry before its end does not take it (it would write over it).
    fork = toks(prompt[:n - 2], more)
    _, cached, _, handed = restore(fork, "s")
    assert handed is None and cached == n - 2 and entry.key in bank.entries
