"""`kvbank bench prefill`: prefill throughput and how its scheduling costs decode, as the worker
runs it.

The goal: batched prefill throughput (tokens/s) is at least single-stream throughput, and the
scheduling (chunk size, one prefill at a time or interleaved, decode between chunks) is chosen
from numbers. Every run drives the worker's own BatchScheduler (worker/compute/scheduler.py): a request
alone takes its solo path, requests together take mlx-lm's BatchGenerator, one `step` at a time,
so the numbers are what a request pays. Greedy, EOS is no stop token, prompts are seeded random
token ids (what a prompt says does not change its cost), each request with a fresh cache.

1. single: one prompt alone, at each chunk size: tokens / time to first token.
2. batch: `--batch` prompts admitted together (`batched`, the worker's way: one chunk of one
   prompt a step, each on its own cache), or read together in one forward by mlx-lm's
   BatchGenerator (`in_batch`, the worker's way before; mlx-lm's server reads prompts so),
   against the same prompts one after another alone (`single`): total prompt tokens / time
   until every one has its first token. `--history N`:
   each prompt continues its own N-token conversation (returning agents), restored as the bank
   restores one.
3. interleave: a request decoding while the long prompt arrives: its interval between tokens
   during the other's prefill (each step decodes it once, then prefills one chunk), and the long
   prompt's time to first token against the same prompt alone (1). This is the worker run with
   `--decode-wait-s 0`; by default its answers pause while a prompt is read (up to 10 s).

The machine is shared and noisy: compared runs alternate in order, repeat by repeat (the second
repeat runs the chunks and modes backwards), and ratios are the median of the repeats' ratios.
Every request ends with its prompt and first token in its cache (`cache_tokens`), and a prompt
gets the same first token from every path (`same_first_tokens`): facts the test checks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

GOAL = 1.0  # the worker's way (batched) over single-stream tokens/s, prompts admitted together
DECODER_PROMPT = 64  # (3) the decoding request's own prompt
DECODER_SOLO = 8  # (3) tokens it decodes alone before the long prompt arrives
MODES = ("single", "batched", "in_batch")
SEED = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvbank.apps.flags import model_flag

    model_flag(p)
    p.add_argument("--tokens", type=int, default=512,
                   help="tokens per prompt (default: %(default)s)")
    p.add_argument("--chunks", default="128,256,512",
                   help="prefill chunk sizes for a prompt alone and beside a decoding "
                        "request, comma-separated (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4,
                   help="prompts admitted together (default: %(default)s)")
    p.add_argument("--batch-chunk", type=int, default=None,
                   help="the chunk size for prompts admitted together (default: the "
                        "worker's, 512)")
    p.add_argument("--history", type=int, default=1600,
                   help="(2): each prompt continues a conversation of this many tokens, "
                        "restored as from the bank, as returning agents' do (default: "
                        "%(default)s; 0: fresh prompts)")
    p.add_argument("--repeats", type=int, default=2,
                   help="repeats, order alternating (default: %(default)s)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="print the result as JSON (to FILE if given)")


class _Bench:
    """The model, its tokenizer, and runs through fresh BatchSchedulers. `histories`: for (2),
    each prompt's conversation so far, (tokens, KV layers), restored as the bank would."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.histories: list | None = None

    def request(self, tokens, in_batch: bool = False):
        from kvbank.v1 import api_pb2, worker_pb2
        from kvbank.worker import commands as cmd
        from kvbank.worker.compute.decoding import Decoding, make_request_sampler
        from kvbank.worker.compute.scheduler import Running

        job = cmd.Generate(worker_pb2.WorkerGenerateRequest(), emit=lambda ev: None)
        return Running(job=job, tokens=tokens, bank_key=("", "bench"), session=None, cached=0,
                       source=api_pb2.CACHE_SOURCE_NONE, known=0, started=time.monotonic(),
                       stops=[], detok=self.tokenizer.detokenizer,
                       decoding=Decoding(make_request_sampler(0.0, 0.0, None),
                                         # a logits processor takes the batch from the start
                                         processors=[lambda _, x: x] if in_batch else None))

    def scheduler(self, chunk: int, max_active: int):
        from kvbank.worker.compute.scheduler import BatchScheduler

        # decode_wait_s=0: answers step between chunks, what (3) measures
        return BatchScheduler(self.model, max_active=max_active, eos_token_ids=[],
                              decode=self.tokenizer.decode, prefill_step_tokens=chunk,
                              decode_wait_s=0.0)

    def add(self, s, r, max_tokens: int, history=None) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        from kvbank.worker.kv.kinds import FullKind

        if history is None:
            s.add(r, make_prompt_cache(self.model), max_tokens)
        else:
            s.add(r, FullKind().restore_layers(history[1], len(history[0])), max_tokens)

    def history(self, n: int, rng) -> tuple:
        """A conversation of n tokens, prefilled in chunks: its tokens and frozen KV."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from kvbank.worker.kv.kinds import FullKind

        tokens = rng.integers(256, self.tokenizer.vocab_size, size=n, dtype=np.uint32)
        cache = make_prompt_cache(self.model)
        for i in range(0, n, 512):
            self.model(mx.array(tokens[i:i + 512])[None], cache=cache)
            mx.eval([c.state for c in cache])
        return tokens, FullKind().freeze_layers(cache, n)

    @staticmethod
    def drain(s) -> dict[int, int]:
        """Step until every request ended: tokens in each one's cache, by id(request)."""
        out = {}
        while s:
            out.update({id(r): cache[0].offset for r, cache in s.step()})
        return out

    def first_tokens(self, prompts, chunk: int, mode: str, histories=None) -> dict:
        """(1), (2): each prompt to its first token; `single`: one after another, each alone.
        With `histories`, each prompt continues its own conversation."""
        hs = histories or [None] * len(prompts)
        rs = [self.request(p if h is None else np.concatenate([h[0], p]), mode == "in_batch")
              for p, h in zip(prompts, hs)]
        for r, h in zip(rs, hs):
            r.cached = 0 if h is None else len(h[0])
        t0 = time.monotonic()  # all admitted now; each mode ends at the last first token
        if mode == "single":  # back to back, each alone, as a scheduler of one would
            s, cached = self.scheduler(chunk, 1), {}
            for r, h in zip(rs, hs):
                self.add(s, r, 1, h)
                cached.update(self.drain(s))
        else:
            s = self.scheduler(chunk, len(rs))
            for r, h in zip(rs, hs):
                self.add(s, r, 1, h)
            cached = self.drain(s)
        ttft = [r.first_token_at - t0 for r in rs]
        wall = max(ttft)
        s.gen.close()
        return {"tok_s": sum(len(p) for p in prompts) / wall, "wall_s": wall,
                "mean_ttft_s": statistics.mean(ttft), "first_tokens": [r.completion[0] for r in rs],
                "cache_tokens": [cached[id(r)] for r in rs]}

    def interleave(self, decoder_prompt, prompt, chunk: int) -> dict:
        """(3) A request decodes alone, then `prompt` arrives: the decoder's token intervals
        before and during its prefill, the prompt's time to first token."""
        s = self.scheduler(chunk, 2)
        a, b, stamps = self.request(decoder_prompt), self.request(prompt), []
        self.add(s, a, DECODER_SOLO + len(prompt) + 64)  # never runs out here

        def step():
            n = len(a.completion)
            done = s.step()
            if len(a.completion) > n:
                stamps.append(time.monotonic())
            return done

        while len(a.completion) < DECODER_SOLO:
            step()
        t0 = time.monotonic()
        self.add(s, b, 1)
        cached = {}
        while b.first_token_at is None or not cached:
            cached.update({id(r): cache[0].offset for r, cache in step()})
        s.drop(a)
        s.gen.close()
        gaps = [(y, y - x) for x, y in zip(stamps, stamps[1:])]
        during = [g for y, g in gaps if y > t0]
        return {"ttft_s": b.first_token_at - t0, "first_token": b.completion[0],
                "cache_tokens": cached[id(b)], "decoder_tokens": len(during),
                "alone_ms": statistics.median(g for y, g in gaps if y <= t0) * 1e3,
                "median_ms": statistics.median(during) * 1e3, "max_ms": max(during) * 1e3}


def _med(xs) -> float:
    return round(statistics.median(xs), 4)


def run(*, model: str | None, tokens: int, chunks: list[int], batch: int,
        batch_chunk: int | None, repeats: int, history: int = 0) -> dict:
    from kvbank.config import preload_openblas
    from kvbank.models import prepare_model

    model_dir = prepare_model(model)
    preload_openblas()  # before the first `import mlx` in this process
    from mlx_lm import load

    from kvbank.worker.compute.scheduler import PREFILL_STEP_TOKENS

    batch_chunk = batch_chunk or PREFILL_STEP_TOKENS
    mlx_model, tokenizer = load(str(model_dir))
    rng = np.random.default_rng(SEED)
    prompts = rng.integers(256, tokenizer.vocab_size, size=(batch + 1, tokens), dtype=np.uint32)
    decoder, prompts = prompts[-1, :DECODER_PROMPT], list(prompts[:-1])
    b = _Bench(mlx_model, tokenizer)
    warm = [p[:min(tokens, 2 * chunks[0] + 1)] for p in prompts[:2]]
    for mode in ("single", "batched"):  # first-use kernels and buffers of both paths
        b.first_tokens(warm, chunks[0], mode)

    firsts: dict[int, set] = {i: set() for i in range(batch)}  # every path's first tokens
    cache_ok = True
    alone: dict[int, list] = {c: [] for c in chunks}
    inter: dict[int, list] = {c: [] for c in chunks}
    for i in range(repeats):  # (1) and (3)
        for c in chunks if i % 2 == 0 else chunks[::-1]:
            for kind in ("alone", "inter") if i % 2 == 0 else ("inter", "alone"):
                if kind == "alone":
                    r = b.first_tokens(prompts[:1], c, "single")
                    alone[c].append(r)
                    firsts[0].add(r["first_tokens"][0])
                    cache_ok &= r["cache_tokens"] == [tokens + 1]
                else:
                    r = b.interleave(decoder, prompts[0], c)
                    inter[c].append(r)
                    firsts[0].add(r["first_token"])
                    cache_ok &= r["cache_tokens"] == tokens + 1
    runs: dict[str, list] = {m: [] for m in MODES}
    histories = [b.history(history, rng) for _ in prompts] if history else None
    with_history: dict[int, set] = {i: set() for i in range(batch)}
    for i in range(repeats):  # (2)
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            r = b.first_tokens(prompts, batch_chunk, mode, histories)
            runs[mode].append(r)
            for j, t in enumerate(r["first_tokens"]):
                (firsts[j] if not histories else with_history[j]).add(t)
            cache_ok &= r["cache_tokens"] == [history + tokens + 1] * batch

    single = {str(c): {"tok_s": _med(r["tok_s"] for r in alone[c]),
                       "ttft_s": _med(r["wall_s"] for r in alone[c]),
                       "runs_tok_s": [round(r["tok_s"], 3) for r in alone[c]]} for c in chunks}
    interleave = {str(c): {
        "ttft_s": _med(r["ttft_s"] for r in inter[c]),
        "alone_ttft_s": single[str(c)]["ttft_s"],
        "ttft_over_alone": _med(x["ttft_s"] / y["wall_s"] for x, y in zip(inter[c], alone[c])),
        "decode_ms_alone": _med(r["alone_ms"] for r in inter[c]),
        "decode_ms_median": _med(r["median_ms"] for r in inter[c]),
        "decode_ms_max": round(max(r["max_ms"] for r in inter[c]), 4),
        "decoder_tokens": [r["decoder_tokens"] for r in inter[c]]} for c in chunks}
    ratios = {m: [x["tok_s"] / y["tok_s"] for x, y in zip(runs[m], runs["single"])]
              for m in ("batched", "in_batch")}
    batched = {
        "chunk": batch_chunk, "requests": batch, "prompt_tokens": batch * tokens,
        "modes": {m: {"tok_s": _med(r["tok_s"] for r in runs[m]),
                      "wall_s": _med(r["wall_s"] for r in runs[m]),
                      "mean_ttft_s": _med(r["mean_ttft_s"] for r in runs[m]),
                      "runs_tok_s": [round(r["tok_s"], 3) for r in runs[m]],
                      "first_tokens": runs[m][0]["first_tokens"],
                      "cache_tokens": runs[m][0]["cache_tokens"]} for m in MODES},
        "batched_over_single": _med(ratios["batched"]),
        "in_batch_over_single": _med(ratios["in_batch"]),
        "ratios": [round(x, 4) for x in ratios["batched"]],
    }
    return {"model": str(model_dir),
            "args": {"tokens": tokens, "chunks": chunks, "batch": batch,
                     "batch_chunk": batch_chunk, "repeats": repeats, "history": history,
                     "decoder_prompt": DECODER_PROMPT, "decoder_solo": DECODER_SOLO},
            "single": single, "interleave": interleave, "batched": batched,
            "fastest_chunk": max(chunks, key=lambda c: single[str(c)]["tok_s"]),
            "same_first_tokens": all(len(s) <= 1 for s in [*firsts.values(),
                                                           *with_history.values()]),
            "cache_tokens_ok": cache_ok,
            "goal": GOAL, "within_goal": batched["batched_over_single"] >= GOAL}


def print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    a = result["args"]
    t = Table(title=f"kvbank bench prefill: one prompt of {a['tokens']} tokens, "
                    f"{Path(result['model']).name}, {a['repeats']} repeats", title_justify="left")
    for col in ("chunk", "tok/s", "TTFT s", "+decoder TTFT s", "/ alone", "decode ms",
                "in prefill med/max"):
        t.add_column(col, justify="right")
    for c, s in result["single"].items():
        i = result["interleave"][c]
        t.add_row(c, f"{s['tok_s']:.1f}", f"{s['ttft_s']:.2f}", f"{i['ttft_s']:.2f}",
                  f"{i['ttft_over_alone']:.3f}", f"{i['decode_ms_alone']:.0f}",
                  f"{i['decode_ms_median']:.0f} / {i['decode_ms_max']:.0f}")
    t.caption = (f"alone: tok/s, TTFT; +decoder: TTFT while another request decodes, whose ms "
                 f"per token are given alone and while the prompt is read; fastest chunk alone: "
                 f"{result['fastest_chunk']}")
    b = result["batched"]
    t2 = Table(title=f"{b['requests']} prompts x {a['tokens']} tokens admitted together"
                     f"{', each after ' + str(a['history']) + ' of history' if a['history'] else ''}, "
                     f"chunk {b['chunk']}", title_justify="left")
    for col in ("mode", "tok/s", "wall s", "mean TTFT s", "tok/s runs"):
        t2.add_column(col, justify="right")
    for m, r in b["modes"].items():
        t2.add_row(m, f"{r['tok_s']:.1f}", f"{r['wall_s']:.2f}", f"{r['mean_ttft_s']:.2f}",
                   ", ".join(f"{x:.1f}" for x in r["runs_tok_s"]))
    t2.caption = (f"batched/single {b['batched_over_single']:.3f} (runs {b['ratios']}), "
                  f"in_batch/single {b['in_batch_over_single']:.3f}; goal (batched, the worker's "
                  f"way) >= {result['goal']}: "
                  f"{result['within_goal']}; same first tokens: {result['same_first_tokens']}")
    console = Console(stderr=True)
    console.print(t)
    console.print(t2)


def run_cli(args: argparse.Namespace) -> int:
    from kvbank.apps.bench.report import write_json

    try:
        chunks = [int(x) for x in args.chunks.split(",") if x.strip()]
    except ValueError:
        chunks = []
    if (not chunks or min(chunks) < 1 or args.tokens < 2 or args.batch < 1 or args.repeats < 1
            or (args.batch_chunk is not None and args.batch_chunk < 1)):
        sys.stderr.write("kvbank bench prefill: --chunks takes sizes >= 1 (e.g. 256,512), "
                         "--tokens >= 2, --batch, --batch-chunk and --repeats >= 1\n")
        return 2
    result = run(model=args.model, tokens=args.tokens, chunks=chunks, batch=args.batch,
                 batch_chunk=args.batch_chunk, repeats=args.repeats, history=max(0, args.history))
    print_summary(result)
    write_json(result, args.json)
    return 0
