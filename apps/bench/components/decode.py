"""`kvbank bench decode --mtp`: decode tokens/s with and without the model's MTP head, one
agent, depth 1..3, in one run, alternated.

Plain decoding is mlx-lm's own `generate_step` (it overlaps the next forward's graph with
the current one's evaluation: the faster of the two plain paths kvbank has); MTP is
worker/compute/mtp/decode.py's `MTPDecoder`. Greedy, EOS is no stop token, prompts are seeded
random token ids, each run on a fresh cache; a run's decode speed is (tokens - 1) over the
time from its first token to its last (its prompt is read before the clock starts). Runs
alternate (plain, depth 1, 2, 3, then backwards) and speedups are the median of each
repeat's ratio to that repeat's plain run. Every MTP run's tokens must equal plain's.

Then one profiled run per depth evaluates each phase of a round on its own (draft, verify,
accept, rollback) and times a plain forward, a verify forward of k+1 tokens and a draft step
alone, for the ceiling the machine allows: (1 + a1 + a1 a2 + ...) / (round cost in plain
forwards), where a_j is the acceptance at draft position j given the drafts before it kept,
and the round costs k draft steps and one verify. What a round takes beyond that is ours
(Python, the rollback, sampling).

This machine is shared: each rate is also given per CPU second of this process
(`cpu_tok_s`, `cpu_speedup`), which others' load does not inflate, and the profile and the
forward costs are CPU seconds; the load average is recorded at the start and the end.

`--agents 1,2,4` measures what the worker does instead (`run_agents`): two stacks on the
model, `--mtp auto` at one depth and `--mtp off`, each sent N requests at once (greedy, seeded
prompts, no cache), by turns. A request's decode is the time from its first token (its
start plus its time to first token) to its end; the rate is the N requests' tokens after
their first over the span from the first first token to the last end. Several requests
decoding at once in mlx-lm's batch decode plainly: the goal there is never to be slower than
plain.

`--agents 2,4 --beside` measures answers on their own caches beside each other instead (as
the worker decodes them when their contexts are too far apart to batch, or the join's copy
does not fit): in this process, through the worker's scheduler (`run_beside`), with the MTP
head (each answer drafting or not per step, by what a token has cost it: `Pace`) and
without, N seeded prompts of different lengths read, then timed from the last first token
to the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

GOAL = 1.6  # MTP over plain tok/s at one agent, at the best depth
SEED = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvbank.apps.flags import model_flag

    model_flag(p)
    p.add_argument("--arch", choices=("qwen3_5",), default=None,
                   help="a model of the default model's size with a trained MTP head "
                        "(kvbank/testing/tiny_mtp.py), built once into kvbank's cache dir")
    p.add_argument("--mtp", action="store_true", help="compare decoding with the MTP head")
    p.add_argument("--depths", default="1,2,3", help="MTP depths (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=96, help="tokens decoded per run "
                                                          "(default: %(default)s)")
    p.add_argument("--draft-bits", type=int, choices=(0, 4, 8), default=None,
                   help="the drafts' copy of the LM head, quantized (0: the trunk's own) "
                        "(default: the worker's for the device: the trunk's own on a CPU, "
                        "4 on a GPU)")
    p.add_argument("--few-rows", choices=("on", "off"), default="on",
                   help="in process: Linear layers over 2-4 rows as the worker runs them on a "
                        "CPU (worker/compute/few_rows.py), or as MLX's `x @ W.T` (off: to "
                        "measure what the form gives; a depth-3 verify may then round apart "
                        "from plain decoding) (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64,
                   help="tokens per prompt (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="repeats, order alternating (default: %(default)s)")
    p.add_argument("--agents", default=None, metavar="N,N",
                   help="through the worker instead: N requests at once with the MTP head "
                        "(at the first of --depths) and without, e.g. 1,2,4")
    p.add_argument("--beside", action="store_true",
                   help="with --agents: the answers on their own caches beside each other, "
                        "in this process through the worker's scheduler (not batched)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="print the result as JSON (to FILE if given)")


def _provenance(argv: list[str]) -> dict:
    import mlx.core as mx
    import mlx_lm

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"argv": argv, "commit": commit, "date": datetime.now(timezone.utc).isoformat(),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "device": str(mx.default_device()),
            "loadavg_start": list(os.getloadavg())}


def _med(xs) -> float:
    return round(statistics.median(list(xs)), 4)


class _Runs:
    """Decode runs of one model: plain (mlx-lm) and with the head at a depth."""

    def __init__(self, model, head, prompt: list[int], tokens: int, draft_bits: int | None):
        self.model, self.head, self.prompt, self.tokens = model, head, prompt, tokens
        self.draft_bits = draft_bits

    def _timed(self, steps) -> tuple[list[int], float, float]:
        """The tokens, their tok/s by the clock and by this process's CPU seconds (on a
        shared machine the clock also counts others' work; the CPU time counts ours)."""
        out, first = [], None
        for t, _ in steps:
            out.append(t)
            if first is None:
                first = (time.perf_counter(), time.process_time())
        n = len(out) - 1
        return out, n / (time.perf_counter() - first[0]), n / (time.process_time() - first[1])

    def plain(self) -> tuple[list[int], float]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        tokens, tok_s, cpu_tok_s = self._timed(generate_step(mx.array(self.prompt), self.model,
                                                             max_tokens=self.tokens))
        return tokens, tok_s, None, cpu_tok_s

    def mtp(self, depth: int, profile: dict | None = None):
        from kvbank.worker.compute.mtp.decode import MTPDecoder
        from kvbank.worker.compute.mtp.sampling import Sampling

        dec = MTPDecoder(self.model, self.head, depth, draft_bits=self.draft_bits,
                         profile=profile)
        tokens, tok_s, cpu_tok_s = self._timed(dec.generate(self.prompt, Sampling(),
                                                            max_tokens=self.tokens))
        return tokens, tok_s, dec.stats, cpu_tok_s


def _forward_costs(runs: _Runs, depths: list[int], repeats: int = 7) -> dict:
    """CPU seconds of one plain forward (1 token), a verify forward (k+1 tokens, per-token
    states kept) and a draft step (the head and the LM head, 1 row), each alone, median."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from kvbank.worker.compute import few_rows
    from kvbank.worker.compute.mtp.decode import MTPDecoder
    from kvbank.worker.kv.cache_kinds import CacheKinds
    from kvbank.worker.kv.rollback import Speculation

    dec = MTPDecoder(runs.model, runs.head, 1, draft_bits=runs.draft_bits)
    trunk = dec.trunk

    def median_s(fn) -> float:  # CPU seconds of this process: others' load does not count
        ts = []
        for _ in range(repeats):
            t0 = time.process_time()
            fn()
            ts.append(time.process_time() - t0)
        return statistics.median(ts)

    cache = make_prompt_cache(runs.model)
    mx.eval(runs.model(mx.array([runs.prompt]), cache=cache))
    spec = Speculation(CacheKinds.of(runs.model), cache)

    def forward(n: int):
        def fn():
            inputs = mx.array([runs.prompt[:n]])
            if n == 1:  # plain decoding's forward: nothing kept for a rollback
                mx.eval(trunk.logits(trunk.hidden(inputs, cache)))
            else:
                with spec.recording(n), few_rows.verifying():  # as MTPDecoder's verify
                    mx.eval(trunk.logits(trunk.hidden(inputs, cache)))
                spec.keep(1)
            for c in cache:  # the attention caches back to where they stood
                if hasattr(c, "offset"):
                    c.trim(1)
        return fn

    head_cache = KVCache()
    h = mx.zeros((1, 1, trunk.args.hidden_size))
    mx.eval(runs.head(mx.zeros((1, 8, trunk.args.hidden_size)),
                      trunk.embed(mx.array([runs.prompt[:8]])), head_cache))

    def draft():
        g = runs.head(h, trunk.embed(mx.array([[runs.prompt[0]]])), head_cache)
        mx.eval(mx.argmax(dec.draft_logits(g[:, 0]), axis=-1))
        head_cache.trim(1)

    return {"plain_forward_s": round(median_s(forward(1)), 5),
            "verify_forward_s": {str(k): round(median_s(forward(k + 1)), 5) for k in depths},
            "draft_step_s": round(median_s(draft), 5)}


def _model_dir(model: str | None, arch: str | None) -> Path:
    if arch:
        from kvbank.testing.tiny_mtp import mtp_model

        return mtp_model("default")
    from kvbank.models import prepare_model

    return prepare_model(model)


def run(*, model: str | None, arch: str | None, depths: list[int], tokens: int,
        prompt_tokens: int, repeats: int, argv: list[str],
        draft_bits: int | None | str = "auto", few_rows_on: bool = True) -> dict:
    from kvbank.config import preload_openblas

    model_dir = _model_dir(model, arch)
    preload_openblas()  # before the first `import mlx` in this process
    from mlx_lm import load

    from kvbank.mtp_head import read_head

    mlx_model, _ = load(str(model_dir))
    if draft_bits == "auto":  # what the worker drafts with on this device, recorded
        import mlx.core as mx

        from kvbank.worker.compute.mtp.decode import draft_bits_for

        draft_bits = draft_bits_for(mx.default_device())
    loaded = read_head(mlx_model, model_dir)
    if loaded.head is None:
        raise SystemExit(f"kvbank bench decode --mtp: {loaded.message}")
    from kvbank.worker.compute import few_rows

    few_rows_layers = few_rows.install(mlx_model) + few_rows.install(loaded.head)  # as the worker
    if not few_rows_on:
        few_rows.off()
    meta = _provenance(argv)
    from kvbank.mtp_head import Trunk

    rng = np.random.default_rng(SEED)
    prompt = rng.integers(256, Trunk(mlx_model).args.vocab_size, prompt_tokens).tolist()
    runs = _Runs(mlx_model, loaded.head, prompt, tokens, draft_bits)
    runs.plain(), runs.mtp(depths[0])  # first-use kernels and buffers of both paths

    plain, mtp = [], {d: [] for d in depths}
    same = True
    for i in range(repeats):
        order = [0, *depths] if i % 2 == 0 else [*depths[::-1], 0]
        row = {}
        for d in order:
            if d == 0:
                row[0] = runs.plain()
            else:
                row[d] = runs.mtp(d)
        plain.append(row[0])
        for d in depths:
            mtp[d].append(row[d])
            same &= row[d][0] == row[0][0]

    costs = _forward_costs(runs, depths)
    per_depth = {}
    for d in depths:
        stats = mtp[d][0][2]
        profile: dict = {}
        _, _, pstats, _ = runs.mtp(d, profile)
        rates = stats.rates()[:d]
        expected = 1 + sum(float(np.prod(rates[:j + 1])) for j in range(d))
        round_cost = (d * costs["draft_step_s"] + costs["verify_forward_s"][str(d)]) \
            / costs["plain_forward_s"]
        per_round = {k: round(v / pstats.rounds, 5) for k, v in profile.items()}
        per_depth[str(d)] = {
            "tok_s": _med(r[1] for r in mtp[d]),
            "runs_tok_s": [round(r[1], 3) for r in mtp[d]],
            "speedup": _med(r[1] / p[1] for r, p in zip(mtp[d], plain)),
            "cpu_tok_s": _med(r[3] for r in mtp[d]),
            "cpu_speedup": _med(r[3] / p[3] for r, p in zip(mtp[d], plain)),
            "acceptance": [round(x, 4) for x in rates],
            "tokens_per_forward": round(stats.tokens_per_forward, 4),
            "rounds_by_drafts_kept": stats.kept[:d + 1],
            "ceiling": round(expected / round_cost, 4),
            "round_cost_plain_forwards": round(round_cost, 4),
            "profiled_round_s": per_round,
            "profiled_round_plain_forwards": round(sum(per_round.values())
                                                   / costs["plain_forward_s"], 4),
        }
    best = max(depths, key=lambda d: per_depth[str(d)]["speedup"])
    meta["loadavg_end"] = list(os.getloadavg())
    return {"model": str(model_dir), "head": loaded.message, **meta,
            "args": {"depths": depths, "tokens": tokens, "prompt_tokens": prompt_tokens,
                     "repeats": repeats, "draft_bits": draft_bits,
                     "few_rows": few_rows_on, "few_rows_layers": few_rows_layers},
            "plain_tok_s": _med(p[1] for p in plain),
            "plain_runs_tok_s": [round(p[1], 3) for p in plain],
            "plain_cpu_tok_s": _med(p[3] for p in plain),
            "mtp": per_depth, "forward_costs": costs, "same_tokens": same,
            "best_depth": best, "goal": GOAL,
            "within_goal": per_depth[str(best)]["speedup"] >= GOAL}


def run_agents(*, model_dir: Path, agents: list[int], depth: int, tokens: int,
               prompt_tokens: int, repeats: int, argv: list[str]) -> dict:
    """Decode tok/s with N requests at once through a stack with the MTP head and one
    without (module docstring); each side's answers are compared token for token."""
    import tempfile

    from kvbank.deploy.local import LocalStack

    meta = _provenance(argv)
    sides = {"mtp": ["--mtp", "auto", "--mtp-depth", str(depth)], "plain": ["--mtp", "off"]}
    rows = {}
    same = True
    with tempfile.TemporaryDirectory(prefix="kvbank-bench-decode-") as tmp:
        stacks = {}
        try:
            for side, flags in sides.items():
                stacks[side] = LocalStack.start(model_dir, Path(tmp) / side, extra=flags)
            for n in agents:
                got: dict = {side: [] for side in sides}
                for r in range(repeats):
                    for side in (("mtp", "plain") if r % 2 == 0 else ("plain", "mtp")):
                        got[side].append(_at_once(stacks[side], n, tokens, prompt_tokens,
                                                  seed=1000 * n + r))
                same &= _same(got)
                rows[str(n)] = _row(got)
        finally:
            for stack in stacks.values():
                stack.stop()
    meta["loadavg_end"] = list(os.getloadavg())
    several = [rows[str(n)]["speedup"] for n in agents if n > 1]
    return {"model": str(model_dir), **meta,
            "args": {"agents": agents, "depth": depth, "tokens": tokens,
                     "prompt_tokens": prompt_tokens, "repeats": repeats},
            "agents": rows, "same_tokens": same,
            "goal": "at several agents, never slower than plain (speedup >= 1)",
            "not_slower": min(several) >= 1.0 if several else None}


def _at_once(stack, n: int, tokens: int, prompt_tokens: int, seed: int) -> dict:
    """N greedy requests sent together; their decode rate (module docstring)."""
    import threading

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(256, 20000, prompt_tokens).tolist() for _ in range(n)]
    done: list = [None] * n

    def one(i: int) -> None:
        with stack.client() as c:
            t0 = time.monotonic()
            turn = c.generate(token_ids=prompts[i], max_tokens=tokens, no_cache=True)
            done[i] = (t0 + turn.usage["ttft_s"], time.monotonic(), turn)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    span = max(end for _, end, _ in done) - min(first for first, _, _ in done)
    after_first = sum(max(0, len(turn.token_ids) - 1) for _, _, turn in done)
    return {"tok_s": after_first / span, "ids": [turn.token_ids for _, _, turn in done],
            "drafted": sum(turn.usage.get("drafted_tokens", 0) for _, _, turn in done),
            "accepted": sum(turn.usage.get("accepted_tokens", 0) for _, _, turn in done)}


def _same(got: dict) -> bool:
    """Every answer with the head equals the same request's without it."""
    return all(m["ids"] == p["ids"] for m, p in zip(got["mtp"], got["plain"]))


def _row(got: dict) -> dict:
    """One agent count's runs with the head and without: rates, the median ratio of each
    repeat's pair, and what the head drafted and the model kept."""
    return {"mtp_tok_s": [round(x["tok_s"], 3) for x in got["mtp"]],
            "plain_tok_s": [round(x["tok_s"], 3) for x in got["plain"]],
            "speedup": _med(m["tok_s"] / p["tok_s"] for m, p in zip(got["mtp"], got["plain"])),
            "drafted_tokens": sum(x["drafted"] for x in got["mtp"]),
            "accepted_tokens": sum(x["accepted"] for x in got["mtp"])}


def run_beside(*, model_dir: Path, agents: list[int], depth: int, tokens: int,
               prompt_tokens: int, repeats: int, argv: list[str]) -> dict:
    """`--beside` (module docstring): N answers on their own caches at once, through the
    worker's scheduler, with the MTP head and without, alternated."""
    from kvbank.config import preload_openblas

    preload_openblas()  # before the first `import mlx` in this process
    from mlx_lm import load

    from kvbank.v1 import api_pb2, worker_pb2
    from kvbank.worker import commands as cmd
    from kvbank.worker.compute.decoding import Decoding, make_request_sampler
    from kvbank.worker.compute.mtp.serving import load_mtp
    from kvbank.worker.compute.scheduler import BatchScheduler, Running
    from kvbank.worker.kv.cache_kinds import CacheKinds

    model, tokenizer = load(str(model_dir))
    meta = _provenance(argv)

    def once(n: int, with_head: bool, seed: int) -> dict:
        kinds = CacheKinds.of(model)
        mtp, message = load_mtp(model, model_dir, kinds, mode="auto" if with_head else "off",
                                depth=depth)
        if with_head and mtp is None:
            raise SystemExit(f"kvbank bench decode --beside: {message}")
        s = BatchScheduler(model, max_active=n, eos_token_ids=[], decode=tokenizer.decode,
                           kinds=kinds, mtp=mtp, own_lead_tokens=1,  # never batched together
                           may_join=lambda joining: False)
        rng = np.random.default_rng(seed)
        rs = []
        for i in range(n):
            job = cmd.Generate(worker_pb2.WorkerGenerateRequest(), emit=lambda ev: None)
            prompt = rng.integers(256, 20000, prompt_tokens + 8 * i).astype(np.uint32)
            rs.append(Running(job=job, tokens=prompt, bank_key=("", f"bench-{i}"),
                              session=None, cached=0, source=api_pb2.CACHE_SOURCE_NONE,
                              known=0, started=time.monotonic(), stops=[],
                              detok=tokenizer.detokenizer,
                              decoding=Decoding(make_request_sampler(0.0, 0.0, None))))
            s.add(rs[-1], kinds.new_cache(), tokens)
        while any(not r.completion for r in rs):  # every prompt read, its first token out
            s.step()
        t0, first = time.perf_counter(), sum(len(r.completion) for r in rs)
        while s:
            s.step()
        return {"tok_s": (sum(len(r.completion) for r in rs) - first)
                / (time.perf_counter() - t0), "ids": [r.completion for r in rs],
                "drafted": sum(r.drafted for r in rs), "accepted": sum(r.accepted for r in rs)}

    rows, same = {}, True
    for n in agents:
        got: dict = {"mtp": [], "plain": []}
        for r in range(repeats):
            for side in (("mtp", "plain") if r % 2 == 0 else ("plain", "mtp")):
                got[side].append(once(n, side == "mtp", seed=1000 * n + r))
        same &= _same(got)
        rows[str(n)] = _row(got)
    meta["loadavg_end"] = list(os.getloadavg())
    return {"model": str(model_dir), **meta, "beside": True,
            "args": {"agents": agents, "depth": depth, "tokens": tokens,
                     "prompt_tokens": prompt_tokens, "repeats": repeats},
            "agents": rows, "same_tokens": same,
            "goal": "beside each other, never slower than plain (speedup >= 1)",
            "not_slower": min(r["speedup"] for r in rows.values()) >= 1.0}


def print_agents_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    a = result["args"]
    t = Table(title=f"kvbank bench decode --mtp --agents{' --beside' if result.get('beside') else ''}"
                    f": {a['tokens']} tokens each after a "
                    f"{a['prompt_tokens']}-token prompt, depth {a['depth']}, "
                    f"{Path(result['model']).name}, {a['repeats']} repeats",
              title_justify="left")
    for col in ("agents", "MTP tok/s", "plain tok/s", "x plain", "drafted", "accepted"):
        t.add_column(col, justify="right")
    for n, r in result["agents"].items():
        t.add_row(n, " ".join(f"{x:.2f}" for x in r["mtp_tok_s"]),
                  " ".join(f"{x:.2f}" for x in r["plain_tok_s"]), f"{r['speedup']:.3f}",
                  str(r["drafted_tokens"]), str(r["accepted_tokens"]))
    t.caption = (f"Same tokens: {result['same_tokens']}; {result['goal']}: "
                 f"{result['not_slower']}")
    Console(stderr=True).print(t)


def print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    a = result["args"]
    t = Table(title=f"kvbank bench decode --mtp: {a['tokens']} tokens after a "
                    f"{a['prompt_tokens']}-token prompt, {Path(result['model']).name}, "
                    f"{a['repeats']} repeats", title_justify="left")
    for col in ("depth", "tok/s", "x plain", "ceiling", "acceptance", "tok/verify",
                "round: fwds", "draft ms", "verify ms", "accept ms", "rollback ms"):
        t.add_column(col, justify="right")
    t.add_row("plain", f"{result['plain_tok_s']:.2f}", "1", "", "", "1", "1", "", "", "", "")
    for d, r in result["mtp"].items():
        ph = {k: f"{v * 1e3:.1f}" for k, v in r["profiled_round_s"].items()}
        t.add_row(d, f"{r['tok_s']:.2f}", f"{r['speedup']:.3f}", f"{r['ceiling']:.3f}",
                  " ".join(f"{x:.2f}" for x in r["acceptance"]), f"{r['tokens_per_forward']:.2f}",
                  f"{r['round_cost_plain_forwards']:.2f}/{r['profiled_round_plain_forwards']:.2f}",
                  ph.get("draft", ""), ph.get("verify", ""), ph.get("accept", ""),
                  ph.get("rollback", ""))
    c = result["forward_costs"]
    t.caption = (f"alone: a forward {c['plain_forward_s'] * 1e3:.1f} ms, a verify "
                 f"{', '.join(f'{k}+1: {v * 1e3:.1f}' for k, v in c['verify_forward_s'].items())}"
                 f" ms, a draft step {c['draft_step_s'] * 1e3:.1f} ms. round: fwds = plain "
                 f"forwards a round costs by those (the ceiling's) / as profiled. Same tokens: "
                 f"{result['same_tokens']}; goal >= {result['goal']} at the best depth "
                 f"({result['best_depth']}): {result['within_goal']}")
    Console(stderr=True).print(t)


def run_cli(args: argparse.Namespace) -> int:
    from kvbank.apps.bench.report import write_json

    try:
        depths = sorted({int(x) for x in args.depths.split(",") if x.strip()})
    except ValueError:
        depths = []
    if not args.mtp:
        sys.stderr.write("kvbank bench decode: only --mtp is measured so far\n")
        return 2
    if (not depths or min(depths) < 1 or max(depths) > 3 or args.tokens < 2
            or args.prompt_tokens < 8 or args.repeats < 1):
        sys.stderr.write("kvbank bench decode: --depths takes 1..3 (e.g. 1,2,3), --tokens "
                         ">= 2, --prompt-tokens >= 8, --repeats >= 1\n")
        return 2
    if args.beside and not args.agents:
        sys.stderr.write("kvbank bench decode: --beside goes with --agents (e.g. 2,4)\n")
        return 2
    if args.agents:
        try:
            agents = [int(x) for x in args.agents.split(",") if x.strip()]
        except ValueError:
            agents = []
        if not agents or min(agents) < 1:
            sys.stderr.write("kvbank bench decode: --agents takes counts >= 1 (e.g. 1,2,4)\n")
            return 2
        result = (run_beside if args.beside else run_agents)(
            model_dir=_model_dir(args.model, args.arch), agents=agents, depth=depths[0],
            tokens=args.tokens, prompt_tokens=args.prompt_tokens, repeats=args.repeats,
            argv=sys.argv)
        print_agents_summary(result)
        write_json(result, args.json)
        return 0
    result = run(model=args.model, arch=args.arch, depths=depths, tokens=args.tokens,
                 prompt_tokens=args.prompt_tokens, repeats=args.repeats, argv=sys.argv,
                 draft_bits="auto" if args.draft_bits is None else args.draft_bits or None,
                 few_rows_on=args.few_rows == "on")
    print_summary(result)
    write_json(result, args.json)
    return 0
