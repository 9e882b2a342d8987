"""`kvbank bench`: every benchmark, registered once here.

Each bench is a module with `add_arguments(parser)` and `run_cli(args) -> exit code`; its
result is a short table, or JSON with --json (apps/bench/report.py). The end-to-end benches
(this folder) drive a stack as a user does and ship with kvbank. The component benches
(apps/bench/components/) drive the worker's parts directly, so they change with them: they
run from a checkout of kvbank (`make install`) and are not in the wheel; from an install
without them, `kvbank bench NAME` says so.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMPONENTS = "components"

# name: (module, help), in the order `kvbank bench --help` lists them.
BENCHES: dict[str, tuple[str, str]] = {
    "turn": ("turn", "TTFT of a returning turn: RAM vs SSD vs recompute"),
    "bank": ("components.bank", "SessionBank.lookup latency on a full bank"),
    "coldstore": ("components.coldstore", "SSD tier vs raw LMDB; write amplification; "
                                          "restore vs recompute"),
    "admission": ("components.admission", "admission decision latency; peak RSS / budget "
                                          "under an adversarial load"),
    "overhead": ("overhead", "streamed decode through shim+router vs in-process"),
    "compare": ("compare", "kvbank vs mlx_lm.server on one loadgen scenario"),
    "scale": ("components.scale", "conversations of real models' size through the bank, "
                                  "writer and coldstore, against raw LMDB"),
    "cluster": ("cluster", "anonymous agents through vllm-router over N stacks: "
                           "kv_aware vs round_robin"),
    "grammar": ("components.grammar", "per-token cost of constrained (JSON schema) decoding"),
    "prefill": ("components.prefill", "prefill tokens/s: chunk size, batched against "
                                      "single-stream, the decode stall it causes"),
    "agents": ("agents", "replayed Claude Code, Codex and Agents SDK turns: the share of each "
                         "turn's history read from cache"),
    "kvbits": ("components.kvbits", "--kv-bits 8|4: conversations a bank holds, bytes per "
                                    "token, answer agreement against full precision and "
                                    "mlx-lm's own quantized cache"),
    "restore": ("restore", "a streaming answer's inter-token gaps while another conversation "
                           "restores from SSD"),
    "tenants": ("tenants", "one API key floods; another's short request: its time to first "
                           "token and stream gaps, against idle"),
    "prerender": ("prerender", "a new query's time to first token after a tool loop, with "
                               "the idle pre-render of its history and without"),
    "decode": ("components.decode", "decode tok/s with and without the model's MTP head "
                                    "(--mtp), depth 1..3"),
}


def _module(name: str):
    """The bench's module; None for a component bench this install does not have."""
    path = f"{__name__}.{BENCHES[name][0]}"
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if BENCHES[name][0].startswith(COMPONENTS + ".") and path.startswith(e.name or "-"):
            return None
        raise


def add_parsers(sub) -> None:
    """One subcommand per bench, with its own flags."""
    for name, (_, help) in BENCHES.items():
        p = sub.add_parser(name, help=help)
        module = _module(name)
        if module is None:
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        else:
            module.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Run the bench `args.bench` names; its exit code."""
    module = _module(args.bench)
    if module is None:
        print(f"kvbank bench {args.bench}: a component benchmark (it drives the worker's parts "
              f"directly); it runs from a checkout of kvbank (make install), not from the "
              f"installed package", file=sys.stderr)
        return 2
    from kvbank.apps.bench.provenance import begin

    begin(getattr(args, "argv", None))  # the command, load and date as the run starts
    return module.run_cli(args)
