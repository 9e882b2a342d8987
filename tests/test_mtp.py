"""Speculative decoding with a checkpoint's own MTP head (kvbank/mtp_head.py,
worker/compute/mtp/, worker/kv/rollback.py): the head is read where mlx-lm drops it,
answers equal plain decoding token for token, every
cache stands after a rejected draft exactly where plain decoding leaves it, and sampled
answers are distributed as plain sampling.

Two tiny qwen3_5 models: one with a random head (almost every draft rejected) and one whose
head was trained by self-distillation (kvbank/testing/tiny_mtp.py: most drafts kept), so that full,
partial and no acceptance all happen."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest


@pytest.fixture(scope="module")
def random_path(tmp_path_factory, cache_dir) -> Path:
    from kvbank.testing.tiny import make_arch_model

    return make_arch_model(tmp_path_factory.mktemp("mtp") / "random", "qwen3_5", seed=1,
                           mtp=True, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def trained_path(cache_dir) -> Path:
    from kvbank.testing.tiny_mtp import mtp_model

    return mtp_model("tiny", cache_dir)


def _load(path: Path):
    from mlx_lm import load

    from kvbank.mtp_head import read_head

    model, _ = load(str(path))
    return model, read_head(model, path).head


@pytest.fixture(scope="module")
def models(random_path, trained_path) -> dict:
    return {"random": _load(random_path), "trained": _load(trained_path)}


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 49000, length).tolist() for _ in range(n)]


_PLAIN: dict = {}


def _plain(model, prompt, max_tokens, processors=None):
    """mlx-lm's own greedy decoding from scratch: [(token, logprobs)] (kept per model and
    prompt for the tests that ask again)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    key = (id(model), tuple(prompt), max_tokens)
    if processors or key not in _PLAIN:
        out = list(generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                 logits_processors=processors))
        if processors:
            return out
        _PLAIN[key] = out
    return _PLAIN[key]


def _assert_same(got, want):
    """Tokens equal; the trunk's logprobs within 1e-4 of plain decoding's."""
    import mlx.core as mx

    assert [t for t, _ in got] == [t for t, _ in want]
    worst = max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(got, want))
    assert worst <= 1e-4, worst


# -- the head ------------------------------------------------------------------------------

def _rewrite(folder: Path, edit) -> None:
    import mlx.core as mx

    f = folder / "model.safetensors"
    weights = edit(dict(mx.load(str(f))))
    mx.save_safetensors(str(f), weights, metadata={"format": "mlx"})


def test_the_head_is_read_where_mlx_lm_drops_it_and_refused_with_the_reason(
        random_path, tmp_path):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from kvbank.mtp_head import read_head

    model, _ = load(str(random_path))
    assert not [k for k, _ in tree_flatten(model.parameters()) if "mtp" in k]  # mlx-lm: none
    saved = {k[4:]: v for k, v in mx.load(str(random_path / "model.safetensors")).items()
             if k.startswith("mtp.")}
    got = read_head(model, random_path)
    assert got.tensors == len(saved) == 15
    head = dict(tree_flatten(got.head.parameters()))
    assert all(mx.array_equal(head[k], v).item() for k, v in saved.items())

    # A sidecar folder (model_type qwen3_5_mtp, tensors without the prefix) gives the same.
    side = tmp_path / "sidecar"
    side.mkdir()
    (side / "config.json").write_text(json.dumps({"model_type": "qwen3_5_mtp"}))
    mx.save_safetensors(str(side / "model.safetensors"), saved)
    head = dict(tree_flatten(read_head(model, random_path, sidecar=side).head.parameters()))
    assert all(mx.array_equal(head[k], v).item() for k, v in saved.items())

    # As Hugging Face publishes it (conv1d in PyTorch's layout, RMSNorm weights stored
    # zero-centred): the head's norms get the +1 the trunk's get, once.
    raw = tmp_path / "raw"
    shutil.copytree(random_path, raw)
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
             ".q_norm.weight", ".k_norm.weight", "pre_fc_norm_embedding.weight",
             "pre_fc_norm_hidden.weight", "mtp.norm.weight")
    _rewrite(raw, lambda w: {k: (v.moveaxis(2, 1) if "conv1d" in k else
                                 v - 1.0 if k.endswith(norms) and v.ndim == 1 else v)
                             for k, v in w.items()})
    model_raw, _ = load(str(raw))
    got = read_head(model_raw, raw)
    assert "shifted" in got.message
    head = dict(tree_flatten(got.head.parameters()))
    assert all(mx.allclose(head[k], v, atol=1e-6).item() for k, v in saved.items())

    # A head that does not fit the trunk is refused, naming the tensor; none is not guessed.
    bad = tmp_path / "bad"
    shutil.copytree(random_path, bad)
    _rewrite(bad, lambda w: {**w, "mtp.fc.weight": w["mtp.fc.weight"][:, :-1]})
    got = read_head(model, bad)
    assert got.head is None and "fc.weight" in got.message and "MTP off" in got.message
    _rewrite(bad, lambda w: {k: v for k, v in w.items() if not k.startswith("mtp.")})
    got = read_head(model, bad)
    assert got.head is None and "declares 1 MTP layer(s) but holds no mtp.* tensors" in got.message


# -- greedy: exact -------------------------------------------------------------------------

@pytest.mark.parametrize("which,depth,draft_bits", [
    ("trained", 1, "auto"), ("trained", 2, "auto"),
    ("trained", 3, 4),  # a GPU's drafts: a 4-bit copy of the LM head (decode.draft_bits_for)
    ("random", 3, "auto")])
def test_greedy_answers_equal_plain_decoding(models, which, depth, draft_bits):
    """Tokens equal mlx-lm's greedy decoding from scratch and logprobs within 1e-4, whatever
    the head drafts; on the trained head every round kind happens (all drafts kept, some,
    none), and answers cut by max_tokens or a stop token inside a round end exactly there."""
    from kvbank.worker.compute.mtp.decode import MTPDecoder
    from kvbank.worker.compute.mtp.sampling import Sampling

    model, head = models[which]
    dec = MTPDecoder(model, head, depth, draft_bits=draft_bits)
    # Every round of the random head rejects: two answers exercise it.
    for i, prompt in enumerate(_prompts(2 if which == "random" else 3, 24, seed=1)):
        n = 40 + i  # budgets that end inside a round
        want = _plain(model, prompt, n)
        _assert_same(list(dec.generate(prompt, Sampling(), max_tokens=n)), want)
    stop = want[25][0]
    got = list(dec.generate(prompt, Sampling(), max_tokens=n, stop_tokens=[stop]))
    _assert_same(got, want[:[t for t, _ in want].index(stop) + 1])
    kept = dec.stats.kept
    if which == "trained":
        assert dec.stats.rates()[0] >= 0.5, dec.stats
        assert kept[0] and kept[depth] and (depth == 1 or sum(kept[1:depth])), kept
    else:
        assert kept[0] > 0.9 * dec.stats.rounds, kept


def test_penalties_and_logit_bias_apply_to_drafts_and_verify_exactly(models):
    from mlx_lm.sample_utils import make_logits_processors

    from kvbank.worker.compute.mtp.decode import MTPDecoder
    from kvbank.worker.compute.mtp.sampling import Sampling

    model, head = models["trained"]
    prompt = _prompts(1, 24, seed=9)[0]
    procs = make_logits_processors({prompt[3]: 3.0}, repetition_penalty=1.5,
                                   presence_penalty=0.5)
    want = _plain(model, prompt, 40, procs)
    dec = MTPDecoder(model, head, 2)
    _assert_same(list(dec.generate(prompt, Sampling(processors=procs), max_tokens=40)), want)
    assert dec.stats.accepted > 0


def test_a_second_turn_continues_exactly_and_the_head_history_is_the_conversations(models):
    """Turn 2 on turn 1's caches equals mlx-lm's greedy decoding of the whole conversation
    from scratch; the head's KV cache holds exactly the pairs of every token but the last
    (its hidden waits), as folding the conversation's pairs in one pass gives."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from kvbank.worker.compute.mtp.decode import MTPDecoder, MTPState
    from kvbank.worker.compute.mtp.sampling import Sampling

    model, head = models["trained"]
    dec = MTPDecoder(model, head, 3)
    first, second = _prompts(2, 20, seed=11)
    cache, state = make_prompt_cache(model), MTPState()
    turn1 = [t for t, _ in dec.generate(first, Sampling(), max_tokens=23, cache=cache,
                                        state=state)]
    dec.finish(turn1[-1], cache, state)
    got = list(dec.generate(second, Sampling(), max_tokens=30, cache=cache, state=state))
    _assert_same(got, _plain(model, first + turn1 + second, 30))
    dec.finish(got[-1][0], cache, state)

    tokens = first + turn1 + second + [t for t, _ in got]
    hidden = dec.trunk.hidden(mx.array([tokens]), None)
    fresh = KVCache()
    head(hidden[:, :-1], dec.trunk.embed(mx.array([tokens[1:]])), fresh)
    assert state.cache.offset == fresh.offset == len(tokens) - 1
    for a, b in zip(_cache_arrays([state.cache]), _cache_arrays([fresh])):
        assert mx.allclose(a, b, atol=1e-4).item()
    assert mx.allclose(state.hidden, hidden[:, -1:], atol=1e-4).item()


def test_the_heads_history_goes_to_ssd_and_comes_back_with_the_conversation(models):
    """The head's KV rows and the hidden state it pairs with the next token are a layer and
    a checkpoint array of the conversation's cache (worker/kv: HeadKind, HiddenKind): frozen
    as the bank keeps them, encoded as SSD blocks, decoded and restored, they equal the ones
    the request left, bit for bit, and the restored conversation drafts and answers as the
    one that never left."""
    import mlx.core as mx

    from kvbank.worker.compute.mtp.decode import MTPDecoder, MTPState
    from kvbank.worker.compute.mtp.sampling import Sampling
    from kvbank.worker.kv import arrays, codec
    from kvbank.worker.kv.cache_kinds import CacheKinds

    model, head = models["trained"]
    kinds = CacheKinds.of(model)
    dec = MTPDecoder(model, head, 2, kinds=kinds)
    kinds.add_head(*dec.head_layer_shape())
    assert kinds.layout.endswith(",mtp,mtp-hidden")  # in the fingerprint: never misread
    [prompt] = _prompts(1, 40, seed=9)
    cache = kinds.new_cache()  # as the scheduler reads a prompt
    state = MTPState(cache=kinds.head_cache(cache), hidden=dec.unknown_hidden(),
                     tokens=prompt[:1])
    h = dec.read(prompt, prompt[1:], cache, state)
    kinds.keep_hidden(cache, h[:, -1:])
    n, B = len(prompt), 16
    layers, end = kinds.freeze(cache, n)
    views = arrays.layer_views(layers)
    frames = [codec.encode_views(views, "float32", s, min(s + B, n), layout=kinds.layout,
                                 state=kinds.checkpoint_views(end) if min(s + B, n) == n
                                 else None) for s in range(0, n, B)]
    restored = kinds.restore(codec.decode_blocks(frames, capacity=64),
                             kinds.checkpoint_from_arrays(codec.decode_state(frames[-1])), n,
                             owned=True)
    for got, want in zip(kinds.head_cache(restored).state[:2], state.cache.state[:2]):
        assert mx.array_equal(got[..., :n, :], want[..., :n, :]).item()
    assert mx.array_equal(kinds.kept_hidden(restored), state.hidden).item()

    def answer(c):
        dec.stats.__init__()
        s = MTPState(cache=kinds.head_cache(c), hidden=kinds.kept_hidden(c))
        out = [t for t, _ in dec.generate([700, 701], Sampling(), max_tokens=24, cache=c,
                                          state=s)]
        return out, dec.stats.accepted, dec.stats.drafted

    assert answer(restored) == answer(cache)


def test_blocks_written_with_mtp_off_are_read_with_it_on_and_the_other_way(models, tmp_path):
    """--mtp on and off name a conversation's blocks alike (the head is not in the model
    fingerprint): a store written without the head restores with it on, the head's rows zero
    where no block carried them and kept where one did, counted, and the answer is plain
    decoding's; a worker without the head reads blocks that carry it. A store holding one is
    stamped HEAD_STORE_FORMAT, so a kvbank from before refuses it."""
    import mlx.core as mx

    from kvbank import metrics
    from kvbank.blocks import chain_block_ids, chain_root
    from kvbank.coldstore.store import ColdStore
    from kvbank.contracts.store_layout import HEAD_STORE_FORMAT, STORE_FORMAT, StoreReader
    from kvbank.worker.compute.mtp.decode import MTPDecoder, MTPState
    from kvbank.worker.compute.mtp.sampling import Sampling
    from kvbank.worker.compute.served_model import fingerprint
    from kvbank.worker.kv import arrays, codec
    from kvbank.worker.kv.cache_kinds import CacheKinds
    from kvbank.worker.tiers.restore import Restorer

    model, head = models["trained"]
    off, on = CacheKinds.of(model), CacheKinds.of(model)
    dec = MTPDecoder(model, head, 2, kinds=on)
    on.add_head(*dec.head_layer_shape())
    prints = {fingerprint(tmp_path, {"model_type": "qwen3_5"}, k, k.measure()[2],
                          k.model_bytes_per_token, 16) for k in (off, on)}
    assert len(prints) == 1 and off.layout != on.layout
    root = chain_root(prints.pop(), "t")
    [prompt] = _prompts(1, 48, seed=21)
    n, B = len(prompt), 16
    ids = chain_block_ids(np.array(prompt, dtype=np.uint32), root, B)

    plain = off.new_cache()  # the conversation as a worker without the head read it
    model(mx.array([prompt]), cache=plain)
    with_head = on.new_cache()  # and as one with it
    state = MTPState(cache=on.head_cache(with_head), hidden=dec.unknown_hidden(),
                     tokens=prompt[:1])
    h = dec.read(prompt, prompt[1:], with_head, state)
    on.keep_hidden(with_head, h[:, -1:])
    written = {}
    for name, kinds, cache in (("off", off, plain), ("on", on, with_head)):
        layers, end = kinds.freeze(cache, n)
        views = arrays.layer_views(layers)
        written[name] = [codec.encode_views(views, "float32", s, s + B, layout=kinds.layout,
                                            state=kinds.checkpoint_views(end)
                                            if s + B == n else None) for s in range(0, n, B)]

    def store_of(name: str, frames: list) -> tuple[int, Path]:
        """A store whose conversation's blocks are `frames`: its format, and where it is."""
        store = ColdStore(tmp_path / name)
        store.put_session_tokens("t", "s", np.array(prompt, dtype=np.uint32), B)
        for i, (bid, frame) in enumerate(zip(ids, frames)):
            assert store.commit_block("t", "s", root, bid, i * B, frame) is not None
        store.close()
        reader = StoreReader(tmp_path / name, readonly=True)
        version = reader.format_version
        reader.close()
        return version, tmp_path / name

    def restored(store_dir: Path, kinds) -> list:
        reader = Restorer(kinds=kinds, bank=None, client=None, store_dir=store_dir,
                          root_for=lambda tenant: root, block_tokens=B)
        layers, checkpoint, got = reader.ssd_prefix(
            np.array(prompt), ids, "t", ("t", "s"), better_than=0, limit=n)
        reader.close()
        assert got == n
        return kinds.restore(layers, checkpoint, n, owned=True)

    def missing() -> float:
        return metrics.MTP_HISTORY_MISSING._value.get()

    def head_rows(cache):
        return on.head_cache(cache).state[0][..., :n, :]

    # A store written with --mtp off, read with it on: the model's caches as written, the
    # head's rows zero, no hidden state, every token counted; the answer plain decoding's.
    version, store = store_of("off", written["off"])
    assert version == STORE_FORMAT
    before = missing()
    cache = restored(store, on)
    assert missing() - before == n
    assert not mx.any(head_rows(cache)).item() and on.kept_hidden(cache) is None
    for got, want in zip(_cache_arrays(on.model_caches(cache)), _cache_arrays(plain)):
        assert mx.array_equal(got, want).item()
    dec.stats.__init__()
    s = MTPState(cache=on.head_cache(cache), hidden=dec.unknown_hidden())
    answer = [t for t, _ in dec.generate([700, 701], Sampling(), max_tokens=16, cache=cache,
                                         state=s)]
    assert answer == [t for t, _ in _plain(model, prompt + [700, 701], 16)]
    assert dec.stats.drafted > 0

    # A chain of both (two blocks from before, the last one since the head ran): the head's
    # rows where a block carried them, zeros before, and the hidden state of its checkpoint.
    version, store = store_of("mixed", written["off"][:2] + written["on"][2:])
    assert version == HEAD_STORE_FORMAT
    before = missing()
    cache = restored(store, on)
    assert missing() - before == 2 * B
    want = head_rows(with_head)
    assert not mx.any(head_rows(cache)[..., :2 * B, :]).item()
    assert mx.array_equal(head_rows(cache)[..., 2 * B:, :], want[..., 2 * B:, :]).item()
    assert mx.array_equal(on.kept_hidden(cache), on.kept_hidden(with_head)).item()

    # Blocks that carry the head, read by a worker without it: its layer checked, not kept.
    version, store = store_of("on", written["on"])
    assert version == HEAD_STORE_FORMAT
    cache = restored(store, off)
    assert len(cache) == len(plain)
    for got, want in zip(_cache_arrays(cache), _cache_arrays(on.model_caches(with_head))):
        assert mx.array_equal(got, want).item()


# -- rollback ------------------------------------------------------------------------------

def _cache_arrays(caches) -> list:
    """What a cache holds for the tokens it stands at (a window: the last W in time order)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    out = []
    for c in caches:
        if isinstance(c, KVCache):
            out += [c.keys[..., :c.offset, :], c.values[..., :c.offset, :]]
        elif isinstance(c, RotatingKVCache):
            keys, values, offset, keep, size, idx = c.state
            assert keep == 0
            if idx != keys.shape[2]:  # a ring after one-token steps: time order first
                keys, values = (mx_roll(x, idx) for x in (keys, values))
            n = min(offset, size)
            out += [keys[..., -n:, :], values[..., -n:, :]]
        else:
            out += list(c.cache)
    return out


def mx_roll(x, idx):
    import mlx.core as mx

    return mx.concatenate([x[..., idx:, :], x[..., :idx, :]], axis=2)


QWEN3_NEXT = {  # a tiny Qwen3-Next (kvbank/testing/tiny.py has no such arch): GDN + MoE
    "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 64,
    "num_hidden_layers": 4, "full_attention_interval": 4, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [], "moe_intermediate_size": 32, "rms_norm_eps": 1e-6,
    "vocab_size": 1024, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    "max_position_embeddings": 4096, "tie_word_embeddings": True}


def _arch_model(arch: str):
    from kvbank.testing.tiny import arch_config, build_model

    config = QWEN3_NEXT if arch == "qwen3_next" else arch_config(arch, vocab=1024, window=16)
    return build_model(config, seed=1)[0]


def test_answers_beside_each_other_draft_as_each_measures_and_answer_as_plain(models,
                                                                              trained_path):
    """Two answers on their own caches at once (contexts apart: not batched), through the
    worker's scheduler with the trained head: the one that comes second drafts beside the
    first from its first step (`Pace` tries drafting until it has a figure), the first takes
    undrafted steps beside it too (tried until measured), and both answers are mlx-lm's
    greedy decoding from scratch, token for token."""
    model, _ = models["trained"]
    s, kinds, _ = _scheduler(model, trained_path, own_lead_tokens=1,
                             may_join=lambda joining: False)
    a_prompt, b_prompt = _prompts(1, 40, seed=31)[0], _prompts(1, 90, seed=32)[0]
    a, b = _greedy(a_prompt), _greedy(b_prompt)
    s.add(a, kinds.new_cache(), 80)
    while len(a.completion) < 4:  # alone: it drafts
        s.step()
    assert a.drafted > 0
    s.add(b, kinds.new_cache(), 16)
    ended = []
    while b not in ended:
        ended += [r for r, _ in s.step()]
    assert a not in ended and b.drafted > 0  # b drafted, all of its answer beside a
    while s:
        s.step()
    for r, prompt, n in ((a, a_prompt, 80), (b, b_prompt, 16)):
        assert r.completion == [t for t, _ in _plain(model, prompt, n)]


def test_an_answer_decoded_in_the_batch_keeps_its_heads_history_and_drafts_once_alone(
        models, trained_path):
    """An answer that drafts alone, then decodes in mlx-lm's batch beside another, then is
    left alone there when the other ends: it goes back to its own cache and drafts again.
    The answer is mlx-lm's greedy decoding, and the cache its turn leaves holds the head's
    pairs of every token it fed (the batch's included), and the hidden state after the last,
    as one pass over the whole conversation gives them: its next turn drafts as if it had
    decoded alone (before, the batch's rows were zeros, and it stayed in the batch)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvbank.worker.compute.mtp.serving import FOLD_EVERY

    model, _ = models["trained"]
    s, kinds, mtp = _scheduler(model, trained_path, may_join=lambda joining: True)
    a_prompt, b_prompt = _prompts(2, 40, seed=41)
    n_b = FOLD_EVERY + 10  # the batch past one fold
    n = n_b + 40  # and some left for a alone after it
    a, b = _greedy(a_prompt), _greedy(b_prompt)
    s.add(a, kinds.new_cache(), n)
    while len(a.completion) < 4:  # alone: it drafts
        s.step()
    assert a.drafted > 0 and a.uid < 0
    s.add(b, kinds.new_cache(), n_b)
    caches, batched, drafted = {}, 0, None
    while s:
        batched += a.uid >= 0 and id(a) not in caches
        caches.update({id(r): cache for r, cache in s.step()})
        if id(b) in caches and drafted is None:
            drafted = a.drafted  # b ended: a is alone in the batch
    assert batched > FOLD_EVERY, batched  # in the batch beside b
    assert a.uid < 0 and a.drafted > drafted  # then on its own cache, drafting
    assert a.completion == [t for t, _ in _plain(model, a_prompt, n)]

    cache = caches[id(a)]
    fed = (a_prompt + a.completion)[:kinds.position(cache)]
    dec = mtp.decoder
    hidden = dec.trunk.hidden(mx.array([fed]), None)
    whole = KVCache()  # the first token's pair has no hidden state before it: zeros
    before = mx.concatenate([dec.unknown_hidden(), hidden[:, :-1]], axis=1)
    dec.head(before, dec.trunk.embed(mx.array([fed])), whole)
    head = kinds.head_cache(cache)
    assert head.offset == whole.offset == len(fed)
    for got, want in zip(_cache_arrays([head]), _cache_arrays([whole])):
        assert mx.allclose(got, want, atol=1e-4).item()
    assert mx.allclose(kinds.kept_hidden(cache), hidden[:, -1:], atol=1e-4).item()


def _scheduler(model, trained_path, **kwargs):
    """(the worker's scheduler with the trained head at depth 2, its cache kinds, its MTP)."""
    from kvbank.worker.compute.mtp.serving import load_mtp
    from kvbank.worker.compute.scheduler import BatchScheduler
    from kvbank.worker.kv.cache_kinds import CacheKinds

    kinds = CacheKinds.of(model)
    mtp, message = load_mtp(model, trained_path, kinds, mode="auto", depth=2)
    assert mtp is not None, message
    return BatchScheduler(model, max_active=4, eos_token_ids=[], decode=lambda ids: "",
                          prefill_step_tokens=64, kinds=kinds, mtp=mtp, **kwargs), kinds, mtp


def _greedy(prompt: list[int]):
    """A greedy request as the scheduler runs it (no client: its events go nowhere)."""
    import time

    from kvbank.v1 import api_pb2, worker_pb2
    from kvbank.worker import commands as cmd
    from kvbank.worker.compute.decoding import Decoding, make_request_sampler
    from kvbank.worker.compute.scheduler import Running

    job = cmd.Generate(worker_pb2.WorkerGenerateRequest(), emit=lambda ev: None)
    return Running(job=job, tokens=np.array(prompt, dtype=np.uint32), bank_key=("", "t"),
                   session=None, cached=0, source=api_pb2.CACHE_SOURCE_NONE, known=0,
                   started=time.monotonic(), stops=[], detok=_Detok(),
                   decoding=Decoding(make_request_sampler(0.0, 0.0, None)))


class _Detok:
    """A detokenizer that keeps no text (the scheduler checks stops on it)."""

    text = last_segment = ""

    def reset(self):
        pass

    def add_token(self, token):
        pass

    def finalize(self):
        pass


def test_pace_takes_the_cheaper_way_and_measures_the_other_again():
    """`Pace` (worker/compute/mtp/serving.py): each way is tried until it has a figure, then
    the cheaper a token is taken, and after PACE_RETRY steps one way the other is tried once."""
    from kvbank.worker.compute.mtp.serving import PACE_RETRY, Pace

    p = Pace()
    assert p.speculates() is True  # no figure for drafting yet
    p.drafted(0.3, 3)  # 0.1 s a token
    assert p.speculates() is False  # no figure for a plain step yet
    p.plain(0.2)
    choices = [p.speculates() for _ in range(PACE_RETRY + 2)]
    assert choices[:PACE_RETRY - 1] == [True] * (PACE_RETRY - 1)
    assert False in choices  # the plain way measured again
    p.drafted(3.0, 1)  # drafting turned costly (a head that drafts badly here)
    assert [p.speculates() for _ in range(3)] == [False] * 3


def test_qwen3_next_greedy_answers_equal_plain_decoding():
    """Qwen3-Next's head (its MoE layer: router, experts, shared expert) and its own Gated
    DeltaNet class: tokens equal mlx-lm's greedy decoding, logprobs within 1e-4."""
    from kvbank.mtp_head import Trunk, make_head
    from kvbank.testing.tiny import mtp_head_weights
    from kvbank.worker.compute.mtp.decode import MTPDecoder
    from kvbank.worker.compute.mtp.sampling import Sampling

    model = _arch_model("qwen3_next")
    head = make_head(Trunk(model))
    rng = np.random.default_rng(2)
    head.load_weights([(k.removeprefix("mtp."), v)
                       for k, v in mtp_head_weights(model, seed=2).items()], strict=True)
    prompt = rng.integers(0, 1024, 24).tolist()
    dec = MTPDecoder(model, head, 3)
    _assert_same(list(dec.generate(prompt, Sampling(), max_tokens=30)), _plain(model, prompt, 30))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "gemma3_text"])
def test_a_draft_rejected_at_each_position_leaves_every_cache_as_plain_decoding(arch):
    """Gated DeltaNet conv and recurrent states (qwen3_5's and qwen3_next's classes),
    full-attention KV, and a wrapped sliding window (gemma3_text, window 16): after a verify
    of 4 tokens that keeps n, every array equals plain decoding's of those n tokens, and the
    rejected tokens leave no trace (another rejected tail gives the same arrays, bit for
    bit)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from kvbank.worker.compute import few_rows
    from kvbank.worker.kv.cache_kinds import CacheKinds
    from kvbank.worker.kv.rollback import Speculation, install

    model = _arch_model(arch)
    install(model.layers)
    few_rows.install(model)  # as MTPDecoder: a verify's rows round as plain decoding's
    rng = np.random.default_rng(5)
    prompt = mx.array([rng.integers(0, 1024, 40).tolist()])
    fed = rng.integers(0, 1024, 4).tolist()

    def prefilled():
        c = make_prompt_cache(model)
        mx.eval(model(prompt, cache=c))
        return c

    def verified(tokens, n):
        c = prefilled()
        spec = Speculation(CacheKinds.of(model), c)
        with spec.recording(len(tokens)), few_rows.verifying():
            mx.eval(model(mx.array([tokens]), cache=c))
        spec.keep(n)
        return c

    for n in range(1, 5):
        plain = prefilled()
        for t in fed[:n]:
            mx.eval(model(mx.array([[t]]), cache=plain))
        kept = verified(fed, n)
        other = verified(fed[:n] + [7, 8, 9][:4 - n], n)
        for a, b, c in zip(_cache_arrays(kept), _cache_arrays(plain), _cache_arrays(other)):
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()
            assert mx.array_equal(a, c).item()
        step = [model(mx.array([[5]]), cache=x)[0, -1] for x in (kept, plain)]
        assert mx.allclose(step[0], step[1], atol=1e-5).item()


# -- sampling: exact in distribution ---------------------------------------------------------

ALPHA = 1e-3  # each chi-square test's false-alarm rate (six tests: at most 0.6 % together)
RUNS = 500


def _chi2_critical(df: int, alpha: float) -> float:
    """Wilson-Hilferty's approximation of the chi-square quantile (no scipy here)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _chi2(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic, cells expecting fewer than 5 draws pooled."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.fixture(scope="module")
def small_vocab():
    """A qwen3_5 of 16 tokens (one GDN layer, one attention layer) and a random head, its
    embeddings scaled so that logits span a few units, as a trained model's do: the head's
    q and the trunk's p are far apart, so a wrong rule shows."""
    from kvbank.mtp_head import Trunk, make_head
    from kvbank.testing.tiny import arch_config, build_model, mtp_head_weights

    config = arch_config("qwen3_5", vocab=16)
    config.update(num_hidden_layers=2, full_attention_interval=2)
    model, _ = build_model(config, 3)
    embed = model.language_model.model.embed_tokens
    embed.weight = embed.weight * 12.5
    head = make_head(Trunk(model))
    head.load_weights([(k[4:], v) for k, v in mtp_head_weights(model, 3).items()])
    return model, head


def _sampling_dist(model, rows: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """What plain sampling draws the next token from, after each row of tokens (mlx-lm's
    log-softmax, its top-p filter, the temperature)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_p

    logits = model(mx.array(rows))[:, -1]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if top_p:
        lp = apply_top_p(lp, top_p)
    return np.asarray(mx.softmax(lp / temperature, axis=-1, precise=True), np.float64)


SMALL_PROMPT = [1, 5, 9]


def test_drafts_and_verify_draw_from_the_head_and_trunk_distributions(small_vocab):
    """What the rule is given in a round: q, the head's distributions over the conversation's
    pairs folded in one pass and then chained on its own drafts, and p, the trunk's after each
    fed token, both with the request's temperature and top-p, as plain sampling has them."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvbank.worker.compute.mtp.decode import MTPDecoder
    from kvbank.worker.compute.mtp.sampling import Sampling

    model, head = small_vocab
    seen = []

    class Recording(Sampling):
        def accept(self, drafts, q, p_logprobs, targets=None):
            seen.append((list(drafts), q.copy(), np.asarray(p_logprobs)))
            return super().accept(drafts, q, p_logprobs, targets)

    dec = MTPDecoder(model, head, 2, draft_bits=None)  # q from the trunk's own LM head
    s = Recording(temperature=0.7, top_p=0.9, seed=0)
    tokens = [t for t, _ in dec.generate(SMALL_PROMPT, s, max_tokens=2)]
    drafts, q, p_lp = seen[0]
    fed = SMALL_PROMPT + tokens[:1]
    p = np.exp(p_lp)
    for j in range(3):
        want = _sampling_dist(model, np.array([fed + drafts[:j]]), 1.0, 0.0)[0]
        assert np.allclose(p[j], want, atol=1e-5)  # the trunk's logprobs: unfiltered
    trunk, ref = dec.trunk, Recording(temperature=0.7, top_p=0.9)
    cache = KVCache()
    g = head(trunk.hidden(mx.array([SMALL_PROMPT]), None), trunk.embed(mx.array([fed[1:]])),
             cache)[:, -1:]
    for j in range(2):
        want = np.asarray(ref.probs(ref.logprobs(trunk.logits(g[:, 0]), None)), np.float64)[0]
        assert np.allclose(q[j], want, atol=1e-5), j
        g = head(g, trunk.embed(mx.array([[drafts[j]]])), cache)



# make test: temperature 1.0 with top-p, the path that also truncates; 0.7 in make test-all
@pytest.mark.parametrize("temperature,top_p",
                         [pytest.param(0.7, 0.0, marks=pytest.mark.matrix), (1.0, 0.9)])
def test_sampled_answers_are_distributed_as_plain_sampling(small_vocab, temperature, top_p):
    """On a 16-token vocabulary, the distribution of the 2nd, 3rd and 4th tokens drawn with
    MTP at depth 2 (the first round: drafts kept, rejected and resampled from the residual,
    and the bonus token) equals plain sampling's, computed exactly by enumerating every
    prefix through the trunk. Seeded; a chi-square test per position at ALPHA. (At RUNS it
    fails a rule that resamples from p instead of the residual; the rule's subtler faults
    are the next test's, with 40x the draws.)"""
    from kvbank.worker.compute.mtp.decode import MTPDecoder
    from kvbank.worker.compute.mtp.sampling import Sampling

    model, head = small_vocab
    # Exact marginals of tokens 1..4 by enumeration (16, 256, 4096 prefixes).
    prefixes, weights, marginals = np.zeros((1, 0), np.int64), np.ones(1), []
    for _ in range(4):
        rows = np.concatenate([np.tile(SMALL_PROMPT, (len(prefixes), 1)), prefixes], axis=1)
        p = _sampling_dist(model, rows, temperature, top_p)
        marginals.append(weights @ p)
        prefixes = np.concatenate([np.repeat(prefixes, 16, axis=0),
                                   np.tile(np.arange(16), len(prefixes))[:, None]], axis=1)
        weights = (weights[:, None] * p).reshape(-1)

    dec = MTPDecoder(model, head, 2)
    counts = np.zeros((4, 16))
    for seed in range(RUNS):
        sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
        for pos, (t, _) in enumerate(dec.generate(SMALL_PROMPT, sampling, max_tokens=4)):
            counts[pos, t] += 1
    kept = dec.stats.kept
    assert kept[0] and kept[1] and kept[2], kept  # rejected, partly kept, all kept (bonus)
    for pos in (1, 2, 3):
        stat, df = _chi2(counts[pos], RUNS * marginals[pos])
        assert stat < _chi2_critical(df, ALPHA), (pos, stat, df, counts[pos])


def test_the_acceptance_rule_reproduces_the_target_distribution():
    """Sampling.accept alone, on fixed p and q that differ a lot: the first token out is
    distributed as p (kept drafts plus residual draws), 20,000 draws, chi-square at ALPHA.
    It fails a rule that resamples from p, one that ignores q in the ratio, and one that
    reuses the acceptance uniform for the residual draw."""
    import mlx.core as mx

    from kvbank.worker.compute.mtp.sampling import Sampling

    rng = np.random.default_rng(0)
    v = 8
    p_logits = rng.normal(size=(2, v)) * 2
    q = np.abs(rng.normal(size=(1, v))) ** 3
    q /= q.sum()
    s = Sampling(temperature=1.0, seed=1)
    p = np.asarray(s.probs(mx.array(p_logits, mx.float32)), np.float64)
    n = 20000
    counts = np.zeros(v)
    for _ in range(n):
        d = int(rng.choice(v, p=q[0]))
        a, z = s.accept([d], q, mx.array(p_logits, mx.float32))
        counts[d if a else z] += 1
    stat, df = _chi2(counts, n * p[0])
    assert stat < _chi2_critical(df, ALPHA), (stat, counts, n * p[0])
