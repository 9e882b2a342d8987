"""`--kv-bits 8|4`: full-attention K/V quantized at rest (bank and SSD), full precision while a
request runs (worker/kv/cache_kinds.py, docs/decisions.md).

First the seam on its own (a fake model with a full-attention and a window cache, head_dim
64): bytes per token, a cut at any token, a commit that quantizes only the tokens its turn
added, blocks that round-trip bit-exactly, fingerprints apart by bits. Then real stacks on
tiny models (head_dim 32: qwen3, and gemma3_text and qwen3_5 with window and recurrent layers)
against tests/test_model_kinds.py's Reference, whose restored prefix is what the worker keeps:
dequantize(quantize(KV)) of each token as its turn computed it, and the other layers' full
precision checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvbank.blocks import CorruptBlock, decode_header
from kvbank.worker.kv import arrays, codec, quant
from kvbank.worker.kv.cache_kinds import CacheKinds
from kvbank.worker.kv.kinds import FullKind

HEADS, DIM, WINDOW = 2, 64, 4


class Proj:
    """K and V of each token: a random projection of its embedding, (1, HEADS, S, DIM)."""

    def __init__(self, seed: int = 0, dtype=mx.float32, window: bool = False):
        rng = np.random.default_rng(seed)
        self.emb = mx.array(rng.standard_normal((50, 2 * HEADS * DIM))).astype(dtype)
        self.window = window

    def make_cache(self):
        return [KVCache()] + ([RotatingKVCache(max_size=WINDOW)] if self.window else [])

    def __call__(self, x, cache):
        e = self.emb[x[0]].reshape(1, x.shape[1], 2, HEADS, DIM).transpose(2, 0, 3, 1, 4)
        for c in cache:
            c.update_and_fetch(e[0], e[1])
        return e[0].sum()


def _kinds(bits, dtype=mx.float32, window=False):
    return CacheKinds(Proj(dtype=dtype, window=window), "fake", bits)


def _run(kinds, tokens, cache=None):
    cache = cache if cache is not None else kinds.new_cache()
    kinds.model(mx.array([list(map(int, tokens))]), cache)
    return cache


def _eq(a, b) -> bool:
    return all(bool(mx.array_equal(x, y)) for x, y in zip(a, b))


@pytest.mark.parametrize("bits,ratio", [(8, 3.5), (4, 6.0)])
def test_a_token_costs_its_quantized_bytes_and_window_layers_stay_full(bits, ratio):
    full, packed = _kinds(None, window=True), _kinds(bits, window=True)
    per_token, _, dtype = packed.measure()
    full.measure()
    assert dtype == "float32" and per_token == full.rest_bytes_per_token  # running: full
    # 64 values per head in one group: words, one scale, one bias
    assert packed.rest_bytes_per_token == 2 * HEADS * (DIM * bits // 8 + 2 * 4)
    assert per_token / packed.rest_bytes_per_token > ratio
    tokens = list(range(1, 12))
    layers, checkpoint = packed.freeze(_run(packed, tokens), 11)
    assert arrays.layers_nbytes(layers) == 11 * packed.rest_bytes_per_token
    assert all(a.dtype == mx.float32 for a in checkpoint.flat())  # the window: as it ran


@pytest.mark.parametrize("bits", [8, 4])
def test_an_entry_cuts_at_any_token_and_restores_dequantized(bits):
    kinds = _kinds(bits)
    tokens = list(range(1, 20))
    cache = _run(kinds, tokens)
    keys = cache[0].keys[..., :19, :]
    layers, _ = kinds.freeze(cache, 19)
    for n in range(1, 20):
        cut = kinds.cut(layers, n)
        assert arrays.layers_nbytes(cut) * 19 == arrays.layers_nbytes(layers) * n
        # each token quantized on its own: the first n of the entry are n tokens' quantization
        assert _eq(cut[0][0], quant.quantize(keys[..., :n, :], bits))
        restored = kinds.restore(layers, None, n)
        assert type(restored[0]) is KVCache and restored[0].offset == n
        assert mx.array_equal(restored[0].keys, quant.dequantize(quant.quantize(keys[..., :n, :], bits),
                                                              bits))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_commit_quantizes_only_the_tokens_its_turn_added(bits):
    """quantize(dequantize(q)) is not q: a commit that quantized the restored prefix again
    would move it a little every turn. The prefix stays bit for bit what was kept."""
    kinds = _kinds(bits)
    first, layers = list(range(1, 10)), None
    layers, _ = kinds.freeze(_run(kinds, first), 9)
    cache = kinds.restore(layers, None, 9)
    prefix = kinds.at_rest(cache)
    assert prefix is not None and prefix[1] == 9
    kinds.with_room(cache, 14)
    _run(kinds, [20, 21, 22, 23, 24], cache)
    again, _ = kinds.freeze(cache, 14, prefix)
    for j in (0, 1):
        assert _eq(arrays.cut(again[0][j], 9), layers[0][j])  # kept as it was
        new = quant.quantize((cache[0].keys, cache[0].values)[j][..., 9:14, :], bits)
        assert _eq(tuple(a[..., 9:, :] for a in again[0][j]), new)
    requantized, _ = kinds.freeze(cache, 14)  # what a commit without its prefix would keep
    assert not _eq(arrays.cut(requantized[0][0], 9), layers[0][0])
    assert kinds.at_rest(_kinds(None).restore(FullKind().freeze_layers([cache[0]], 14), None, 14)) is None


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_block_round_trips_bit_exactly_and_refuses_a_flipped_byte(bits, dtype):
    kinds = _kinds(bits, dtype)
    n, B = 10, 4
    layers, _ = kinds.freeze(_run(kinds, list(range(1, n + 1))), n)
    views = arrays.layer_views(layers)
    name = arrays.dtype_name(layers)
    assert name == str(dtype).split(".")[-1]
    frames = [codec.encode_views(views, name, s, min(s + B, n), bits=bits) for s in range(0, n, B)]
    for s, f in zip(range(0, n, B), frames):
        header, _ = decode_header(f)
        assert bytes(f[:4]) == b"KVB3" and header.quant == (bits, 64)
        assert header.kv_shapes[0] == ((min(s + B, n) - s, HEADS, DIM),) * 2
        assert len(f) == codec.encoded_views_nbytes(views, name, s, min(s + B, n), bits=bits)
        kinds.check_block(header)
        for other in (None, 12 - bits):  # a worker at another setting never decodes it
            with pytest.raises(CorruptBlock, match="quantized at"):
                _kinds(other).check_block(header)
    back = codec.decode_blocks(frames, capacity=64)
    for (k, v), (k2, v2) in zip(layers, back):
        assert _eq(k, k2) and _eq(v, v2)
        assert all(a.dtype == b.dtype for a, b in zip(k, k2))
    assert _eq(kinds.restore(back, None, n)[0].state, kinds.restore(layers, None, n)[0].state)
    full = codec.encode_views(arrays.layer_views(FullKind().freeze_layers([_run(_kinds(None, dtype), [1, 2])[0]], 2)),
                           name, 0, 2)
    assert bytes(full[:4]) == b"KVB2" and decode_header(full)[0].quant is None  # as before
    bad = bytearray(frames[1])
    bad[-3] ^= 0x10
    with pytest.raises(CorruptBlock, match="checksum"):
        codec.decode_blocks([frames[0], bytes(bad), frames[2]])


def test_a_store_with_a_quantized_block_is_stamped_so_an_older_kvbank_refuses_it(tmp_path):
    """A full-precision store keeps its format (older kvbanks still read it); the first
    quantized block stamps QUANTIZED_STORE_FORMAT, which this kvbank reads."""
    from kvbank.coldstore.store import ColdStore
    from kvbank.blocks import chain_block_ids
    from kvbank.contracts.store_layout import (QUANTIZED_STORE_FORMAT, STORE_FORMAT,
                                               StoreReader)
    from tests.test_bank import TENANT, root_for

    tokens = np.arange(1, 9, dtype=np.uint32)
    for name, bits in (("full", None), ("q", 8)):
        kinds = _kinds(bits)
        layers, _ = kinds.freeze(_run(kinds, tokens.tolist()), 8)
        store = ColdStore(tmp_path / name)
        store.put_session_tokens(TENANT, "s", tokens, 8)
        frame = codec.encode_views(arrays.layer_views(layers), "float32", 0, 8, bits=bits)
        bid = chain_block_ids(tokens, root_for(TENANT), 8)[0]
        assert store.commit_block(TENANT, "s", root_for(TENANT), bid, 0, frame) is not None
        store.close()
        reader = StoreReader(tmp_path / name, readonly=True)
        assert reader.format_version == (STORE_FORMAT if bits is None
                                         else QUANTIZED_STORE_FORMAT)
        back = reader.get_blocks([bid], decode=codec.decode_blocks)
        assert _eq(back[0][0] if bits else back[0][:1], layers[0][0] if bits
                   else layers[0][:1])
        reader.close()


def test_the_fingerprint_differs_by_bits_and_a_head_dim_it_cannot_group_is_refused(tmp_path):
    from kvbank.worker.compute.served_model import fingerprint

    prints = {bits: fingerprint(tmp_path, {"model_type": "fake"}, _kinds(bits), "float32",
                                1024, 16) for bits in (None, 8, 4)}
    assert len(set(prints.values())) == 3
    with pytest.raises(ValueError, match="kv_bits"):
        _kinds(6)

    class Narrow(Proj):
        def __call__(self, x, cache):
            e = mx.ones((1, HEADS, x.shape[1], 16))
            for c in cache:
                c.update_and_fetch(e, e)
            return e.sum()

    with pytest.raises(ValueError, match="head_dim 16"):
        CacheKinds(Narrow(), "narrow", 8).measure()


# -- a real stack against mlx-lm ---------------------------------------------------------------


class AtRest:
    """tests/test_model_kinds.py's Reference, with the worker's quantized bank: each token's
    K/V of a full-attention layer quantized (mx.quantize, groups of 32 here) once, as the turn
    that computed it left it; a restore reads them dequantized. Window and recurrent layers
    are what the worker keeps of them, in full precision: the cache as it stood where a
    forward stopped (a checkpoint), restored there, not replayed (a replay would compute them
    over full-precision K/V where the worker's turn read dequantized ones)."""

    def __new__(cls, model_dir: Path, bits: int):
        from tests.test_model_kinds import Reference

        class _AtRest(Reference):
            kept: list | None = None  # per cache: a KVCache's quantized (K, V), else None

            def __init__(self, model_dir):
                super().__init__(model_dir)
                self.checkpoints: dict[int, list] = {}  # position -> the others' state there

            def restored(self, prompt, cached):
                from mlx_lm.models.cache import make_prompt_cache

                cache = make_prompt_cache(self.model)
                if not cached:
                    return cache, []
                full = all(type(c) is KVCache for c in cache)  # then any token restores
                states = [None] * len(cache) if full else self.checkpoints[cached]
                for c, pair, state in zip(cache, self.kept, states):
                    if pair is None:
                        c.state = _copied(state)
                        continue
                    c.keys, c.values = (mx.dequantize(*(x[..., :cached, :] for x in q),
                                                      group_size=32, bits=bits) for q in pair)
                    c.offset = cached
                return cache, [(0, cached)]

            def stood(self, cache, pos):
                self.checkpoints[pos] = [None if type(c) is KVCache else _copied(c.state)
                                         for c in cache]
                mx.eval([a for state in self.checkpoints[pos] if state
                         for a in _arrays(state)])

            def committed(self, cache, cached, n_tokens):
                self.stood(cache, n_tokens)
                new = [tuple(mx.quantize(a[..., cached:n_tokens, :], group_size=32, bits=bits)
                             for a in (c.keys, c.values)) if type(c) is KVCache else None
                       for c in cache]
                if cached:
                    new = [qs and tuple(tuple(mx.concatenate([o[..., :cached, :], x], axis=2)
                                              for o, x in zip(old, q))
                                        for old, q in zip(pair, qs))
                           for pair, qs in zip(self.kept, new)]
                mx.eval(new)
                self.kept = new

        return _AtRest(model_dir)


def _copied(state):
    """A cache's state with arrays of its own: mlx-lm writes a window's ring in place."""
    if isinstance(state, mx.array):
        return state[...]
    if isinstance(state, (list, tuple)):
        return type(state)(_copied(x) for x in state)
    return state


def _arrays(state):
    if isinstance(state, mx.array):
        yield state
    elif isinstance(state, (list, tuple)):
        for x in state:
            yield from _arrays(x)


@pytest.mark.parametrize("arch,bits", [  # make test: 4 bits beside recurrent state
    pytest.param("qwen3", 8, marks=pytest.mark.matrix),
    pytest.param("qwen3", 4, marks=pytest.mark.matrix),
    pytest.param("gemma3_text", 4, marks=pytest.mark.matrix), ("qwen3_5", 4)])
def test_a_quantized_conversation_continues_exactly_from_ram_ssd_and_after_kill_9(
        arch, bits, tmp_path_factory, cache_dir, capsys):
    """Five unnamed turns with --kv-bits: from RAM, from SSD after a release, from SSD after
    a kill -9, from RAM after a prefetch hint read it back from SSD. Each answer equals
    mlx-lm's with the same forwards and the restored prefix replaced by
    dequantize(quantize(KV)) where the worker keeps it quantized: full attention alone
    (qwen3), beside sliding windows (gemma3_text) and beside Gated DeltaNet (qwen3_5), whose
    checkpoints stay full precision, and every prompt token comes back. `kvbank status`
    names the setting."""
    from kvbank.apps.cli import main
    from kvbank.testing.tiny import make_arch_model
    from tests.conftest import start_stack
    from tests.test_model_kinds import MAX_TOKENS, TEMPLATES, WINDOW, _check, send_back

    template = (TEMPLATES / "qwen_tools.jinja").read_text()
    model = make_arch_model(tmp_path_factory.mktemp(f"{arch}-hd32") / "model", arch, seed=1,
                            context=4096, window=WINDOW, template=template,
                            cache_dir=cache_dir, head_dim=32)
    ref = AtRest(model, bits)
    s = start_stack(model, tmp_path_factory.mktemp(f"{arch}-kvbits{bits}"),
                    cache_dir=cache_dir, shim=False, extra=["--kv-bits", str(bits)])
    try:
        assert main(["status", "--address", s.address]) == 0
        assert f"KV at rest: {bits} bits" in capsys.readouterr().out
        messages = [{"role": "system", "content": "You are a careful coding agent."},
                    {"role": "user", "content": "Read the parser and list its three bugs."}]
        previous = 0
        for turn, where in enumerate(("first", "ram", "ssd after a release", "ssd after kill -9",
                                      "ram after a prefetch")):
            with s.client() as c:
                send_back(s, c, session if turn else None, where)
                if where == "ram after a prefetch":
                    s.wait_durable(session)
                    c.release(session)
                    hint = c.prefetch(messages=messages)
                    assert hint.status == "restored" and hint.restored_tokens > 0, hint
                    previous = hint.restored_tokens
                prompt = c.render(messages=messages, max_tokens=MAX_TOKENS)
                got = c.generate(messages=messages, max_tokens=MAX_TOKENS, logprobs=True)
            session = got.usage["session_id"]
            assert got.usage["cache_source"] == ("none" if turn == 0 else where.split()[0])
            assert got.usage["cached_tokens"] >= previous, got.usage
            assert got.usage["prefix_lost_tokens"] == 0, got.usage
            _check(ref, got, prompt, ref.prompts.checkpoints(messages, prompt),
                   arch != "qwen3", f"{arch} kv-bits {bits} turn {turn} ({where})",
                   unsplit=False)  # full precision may answer otherwise: that is the bench's
            previous = len(prompt) + got.usage["completion_tokens"]
            messages += [{"role": "assistant", "content": got.text},
                         {"role": "user", "content": f"Now fix bug {turn + 1}."}]
    finally:
        s.stop()


def test_bench_kvbits_quick_counts_from_the_ledger(tmp_path_factory, cache_dir, monkeypatch,
                                                   capsys):
    """`kvbank bench kvbits --quick` on a tiny qwen3 (4 layers, 2 KV heads of 32): the JSON's
    shape and what the ledger must say whatever the timing."""
    import json

    from kvbank.apps.cli import main
    from kvbank.testing.tiny import make_arch_model

    monkeypatch.setenv("KVBANK_CACHE_DIR", str(cache_dir))
    model = make_arch_model(tmp_path_factory.mktemp("qwen3-hd32b") / "model", "qwen3", seed=1,
                            context=4096, cache_dir=cache_dir, head_dim=32)
    assert main(["bench", "kvbits", "--model", str(model), "--quick", "--bank-bytes",
                 str(1 << 20), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    per_token = {"full": 4 * 2 * 2 * 32 * 4, "8bit": 4 * 2 * 2 * (32 + 8),
                 "4bit": 4 * 2 * 2 * (16 + 8)}  # one group of 32: words, scale, bias
    assert {k: doc["ram_bytes_per_token"][k] for k in per_token} == per_token
    assert doc["held"] == {k: (1 << 20) // (512 * v) for k, v in per_token.items()} | {
        k: doc["held"][k] for k in doc["held"] if k.endswith("bf16")}
    assert doc["held"]["full"] < doc["held"]["8bit"] < doc["held"]["4bit"]
    assert all(doc["ssd_bytes_per_token"][k] > v for k, v in per_token.items())  # headers
    # agreement: the same history quantized on both sides, turn 1 (nothing restored) not
    # scored, every figure with its interval over conversations
    a = doc["agreement"]
    assert (a["conversations"], a["turns"], a["scored_turns"]) == (2, 2, 2)
    assert set(a["sides"]) == {"kvbank_8bit", "kvbank_4bit", "mlx_lm_8bit", "mlx_lm_4bit"}
    for side in a["sides"].values():
        for key in ("turns_equal", "token_agreement", "kl_per_token"):
            lo, hi = side[key + "_ci95"]
            assert lo <= hi and (0 <= side[key] <= 1 or key == "kl_per_token")
        assert side["kl_per_token"] >= -1e-4  # a KL from full precision, never below 0
    assert a["scored_tokens"] > 0 and set(a["scope"]) == {"kvbank", "mlx_lm"}
    assert doc["provenance"]["argv"][:4] == ["kvbank", "bench", "kvbits", "--model"]
    assert set(doc["decode_ms"]) == {"full", "mlx_lm_8bit", "mlx_lm_4bit"}


def test_a_store_written_at_other_bits_is_recomputed_never_misread(tmp_path_factory,
                                                                    cache_dir):
    """One data dir, three workers: --kv-bits 8, then full precision, then 8 again. The full
    precision worker never reads the 8-bit blocks (other ids: the bits are in the
    fingerprint): it recomputes, answers as mlx-lm does, and says why in its log. Its record
    replaces the first one's blocks, so the third worker finds what is left of its own (the
    system prompt's block) and answers exactly from there."""
    from kvbank.testing.tiny import make_arch_model
    from tests.conftest import start_stack
    from tests.test_model_kinds import MAX_TOKENS, TEMPLATES, Reference, _check

    template = (TEMPLATES / "qwen_tools.jinja").read_text()
    model = make_arch_model(tmp_path_factory.mktemp("qwen3-hd32c") / "model", "qwen3", seed=1,
                            context=4096, template=template, cache_dir=cache_dir, head_dim=32)
    data = tmp_path_factory.mktemp("switch")
    messages = [{"role": "system", "content": "You are a careful coding agent."},
                {"role": "user", "content": "Read the parser and list its three bugs."}]
    ref = AtRest(model, 8)
    for turn, extra in enumerate((["--kv-bits", "8"], [], ["--kv-bits", "8"])):
        s = start_stack(model, data, cache_dir=cache_dir, shim=False, extra=extra)
        try:
            with s.client() as c:
                prompt = c.render(messages=messages, max_tokens=MAX_TOKENS)
                got = c.generate(messages=messages, max_tokens=MAX_TOKENS, logprobs=True)
                s.wait_durable(got.usage["session_id"])
                assert c.status().kv_bits == (8 if extra else 0)  # 0: full precision
            log = s.log_tail(200_000)
        finally:
            s.stop()
        u = got.usage
        if turn == 1:
            assert (u["cache_source"], u["cached_tokens"]) == ("none", 0), u
            _check(Reference(model), got, prompt, [], False, "full precision after 8 bits")
            assert "holds KV written with --kv-bits" in log
        else:
            assert u["cache_source"] == ("none" if turn == 0 else "ssd"), u
            _check(ref, got, prompt, [], False, f"8 bits, worker {turn}", unsplit=False)
        messages += [{"role": "assistant", "content": got.text},
                     {"role": "user", "content": f"Now fix bug {turn + 1}."}]
