"""`kvbank bench kvbits`: what `--kv-bits 8|4` buys and costs, in this process (no stack).

- `held`: conversations of `--tokens` tokens that a bank of `--bank-bytes` holds at full
  precision, 8 and 4 bits, counted from the bank's own ledger (`SessionBank.total_nbytes`):
  entries made by the seam (`CacheKinds.freeze`) inserted until the next would pass the budget.
- `ram_bytes_per_token` (the ledger's) and `ssd_bytes_per_token` (blocks of `--block-tokens`
  as the writer encodes them, headers included), also for the model's KV in bf16 (a Mac).
- `restore_ms`: a whole entry into a request's own buffer, with room to grow, as a returning
  turn's restore and first write make it (dequantized at 8 and 4 bits);
  `commit_ms`: a turn of 256 new tokens into the entry (quantized once).
- `decode_ms`: one decode step at `--tokens` of context with mlx-lm's KVCache and with its
  QuantizedKVCache (quantized while running), the alternative kvbank did not take.
- `agreement` (kvbits_agreement.py): `--conversations` conversations of `--turns` turns, the
  same history quantized on both sides (kvbank at rest; mlx-lm's QuantizedKVCache from
  `quantized_kv_start` at the restored prefix), turn 1 excluded; per setting, the turns whose
  greedy answer equals full precision's, the answer tokens whose argmax does, and the KL from
  full precision per token, each with a 95 % interval over conversations.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

SETTINGS = (None, 8, 4)
CHUNK = 512
TURN_TOKENS = 256


def _name(bits: int | None) -> str:
    return "full" if bits is None else f"{bits}bit"


def run(*, model: str | None = None, tokens: int = 4096, bank_bytes: int = 4 << 30,
        block_tokens: int = 256, turns: int = 5, max_tokens: int = 48,
        conversations: int = 12, decode_steps: int = 8, seed: int = 0) -> dict:
    from kvbank.config import preload_openblas

    preload_openblas()  # before the first `import mlx`
    import mlx.core as mx
    from mlx_lm import load

    from kvbank.models import resolve_model
    from kvbank.worker.kv.cache_kinds import CacheKinds

    path = resolve_model(model)
    lm, tokenizer = load(str(path))
    out: dict = {"model": Path(path).name, "tokens": tokens, "bank_bytes": bank_bytes,
                 "block_tokens": block_tokens}
    rng = np.random.default_rng(seed)
    sizes, timing = {}, {}
    for dtype in (None, mx.bfloat16):
        for bits in SETTINGS:
            kinds = CacheKinds.of(lm, bits)
            sizes_key = _name(bits) + ("" if dtype is None else "_bf16")
            cache = _filled(kinds, tokens, rng, dtype)
            layers = kinds.full_layers(cache, tokens)
            sizes[sizes_key] = _sizes(kinds, layers, tokens, bank_bytes, block_tokens)
            if dtype is None:
                timing[_name(bits)] = _timing(kinds, layers, cache, tokens)
    out["held"] = {k: v.pop("held") for k, v in sizes.items()}
    out["ram_bytes_per_token"] = {k: v["ram"] for k, v in sizes.items()}
    out["ssd_bytes_per_token"] = {k: v["ssd"] for k, v in sizes.items()}
    out["held_vs_full"] = {k: round(n / max(out["held"]["full"], 1), 2)
                           for k, n in out["held"].items() if not k.endswith("bf16")}
    out["held_vs_full_bf16"] = {k: round(n / max(out["held"]["full_bf16"], 1), 2)
                                for k, n in out["held"].items() if k.endswith("bf16")}
    out["restore_ms"] = {k: v["restore_ms"] for k, v in timing.items()}
    out["commit_ms"] = {k: v["commit_ms"] for k, v in timing.items()}
    out["decode_ms"] = _decode_ms(lm, tokens, rng, decode_steps)
    from kvbank.apps.bench.components.kvbits_agreement import agreement

    out["agreement"] = agreement(lm, tokenizer, conversations=conversations, turns=turns,
                                 max_tokens=max_tokens, seed=seed)
    return out


def _filled(kinds, n: int, rng, dtype) -> list:
    """A request's cache standing at n tokens of a real forward's scale: the model's own
    first tokens repeated would do as well, for bytes and times (the content is not read)."""
    import mlx.core as mx

    cache = kinds.new_cache()
    kinds.model(mx.array([rng.integers(1000, 5000, size=min(n, 64)).tolist()]), cache=cache)
    for c in kinds.full_caches(cache):
        reps = -(-n // c.offset)
        k, v = (mx.concatenate([a[..., :c.offset, :]] * reps, axis=2)[..., :n, :]
                for a in (c.keys, c.values))
        if dtype is not None:
            k, v = k.astype(dtype), v.astype(dtype)
        c.state = (k, v, n)
    mx.eval([c.state for c in cache])
    return cache


def _sizes(kinds, layers, n: int, budget: int, block_tokens: int) -> dict:
    from kvbank.blocks import chain_root
    from kvbank.worker.kv import arrays, codec
    from kvbank.worker.tiers.bank import SessionBank

    root = chain_root(b"bench-kvbits", "")
    bank = SessionBank(block_tokens=block_tokens, root_for=lambda _t: root, max_bytes=budget)
    held = 0
    while True:  # one entry's arrays, inserted under many conversations: the ledger counts
        toks = np.arange(n, dtype=np.uint32) + np.uint32(held * 7 + 1)
        e = bank.insert(("", f"c{held}"), toks, layers)
        if bank.total_nbytes > budget:
            bank.withdraw(e)
            break
        held += 1
        if held > 1_000_000:
            break
    views, dtype = arrays.layer_views(layers), arrays.dtype_name(layers)
    ssd = sum(codec.encoded_views_nbytes(views, dtype, s, min(s + block_tokens, n),
                                      bits=kinds.kv_bits) for s in range(0, n, block_tokens))
    return {"held": held, "ram": round(arrays.layers_nbytes(layers) / n, 1),
            "ssd": round(ssd / n, 1)}


def _ms(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 2)


def _timing(kinds, layers, cache, n: int) -> dict:
    import mlx.core as mx

    def restore():  # as a returning turn's: the restore, then its own buffer with room
        c = kinds.restore(layers, None, n) if not kinds.checkpointed else []
        kinds.with_room(c, n)
        mx.eval([x.state for x in c])

    turn = max(1, min(TURN_TOKENS, n // 2))
    prefix = (kinds.full_layers(cache, n - turn), n - turn)  # what the turn restored from
    return {"restore_ms": _ms(restore),
            "commit_ms": _ms(lambda: kinds.full_layers(cache, n, prefix if kinds.kv_bits
                                                       else None))}


def _decode_ms(lm, n: int, rng, steps: int) -> dict:
    """One decode step at n tokens of context: mlx-lm's KVCache, and its QuantizedKVCache."""
    import mlx.core as mx

    from kvbank.apps.bench.components.kvbits_agreement import group_of
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array([rng.integers(1000, 5000, size=n).tolist()])
    out = {}
    for bits in SETTINGS:
        cache = make_prompt_cache(lm)
        for s in range(0, n, CHUNK):
            lm(prompt[:, s:s + CHUNK], cache=cache)
            mx.eval([c.state for c in cache])
        if bits:
            cache = [c.to_quantized(group_size=group_of(lm), bits=bits) for c in cache]
        token = mx.array([[1000]])
        times = []
        for _ in range(max(1, steps)):
            t0 = time.perf_counter()
            mx.eval(lm(token, cache=cache))
            times.append(time.perf_counter() - t0)
        out["full" if bits is None else f"mlx_lm_{bits}bit"] = round(
            float(np.median(times)) * 1e3, 2)
    return out


QUICK = dict(tokens=512, bank_bytes=64 << 20, block_tokens=64, turns=2, max_tokens=8,
             conversations=2, decode_steps=1)


def add_arguments(p) -> None:
    """`kvbank bench kvbits`'s flags."""
    from kvbank.apps.flags import model_flag

    model_flag(p)
    p.add_argument("--tokens", type=int, default=None,
                   help="a conversation's length (default: 4096)")
    p.add_argument("--bank-bytes", type=int, default=None, help="bank budget (default: 4 GiB)")
    p.add_argument("--block-tokens", type=int, default=None, help="(default: 256)")
    p.add_argument("--conversations", type=int, default=None,
                   help="conversations of the agreement run (default: 12)")
    p.add_argument("--turns", type=int, default=None,
                   help="turns of each, the first not scored (default: 5)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="answer tokens a turn (default: 48)")
    p.add_argument("--quick", action="store_true",
                   help="seconds, not minutes: 512 tokens, 2 conversations of 2 turns of 8 "
                        "tokens")
    p.add_argument("--json", action="store_true")


def _result(args) -> dict:
    kw = dict(QUICK) if args.quick else {}
    for key in ("tokens", "bank_bytes", "block_tokens", "turns", "max_tokens", "conversations"):
        value = getattr(args, key)
        if value is not None:
            kw[key] = value
    return run(model=args.model, **kw)


def run_cli(args) -> int:
    from kvbank.apps.bench.report import print_result

    print_result(args.bench, _result(args), args.json)
    return 0
