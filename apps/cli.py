"""The `kvbank` command.

    kvbank up          start router, worker, coldstore and the OpenAI shim (make run)
    kvbank cluster up  several such stacks behind vllm-router --policy kv_aware (make cluster)
    kvbank chat        talk to a running kvbank in the terminal
    kvbank ask         one turn of a session; --json prints the usage
    kvbank bench ...   benchmarks (JSON out)
    kvbank loadgen     drive several agents' conversations against a server, measure them
    kvbank router | worker | coldstore | shim | prepare-model   one process each (supervised)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kvbank.apps.flags import (FLAG_GROUPS, address_flag, client_key_flags, coldstore_flags,
                               data_dir_flag, forward, metrics_flag, model_flag, router_flags,
                               shim_flags, worker_flags)
from kvbank.config import DEFAULT_METRICS_PORT, DEFAULT_ROUTER_PORT, Layout
from kvbank import transformers_scan


def _setup_logging(name: str) -> None:
    logging.basicConfig(level=os.environ.get("KVBANK_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s {name:9s} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; `command`: the one the arguments name, whose flags alone are
    built where building them imports modules (loadgen's, every bench's: 0.5 s of CPU in a
    bare process, paid by each of a stack's five processes and every `kvbank status`). None:
    all of them."""
    FLAG_GROUPS.clear()
    ap = argparse.ArgumentParser(prog="kvbank", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start router, worker, coldstore and shim (foreground)")
    data_dir_flag(up)
    model_flag(up)
    up.add_argument("--host", default="127.0.0.1", help="router address (default: loopback)")
    up.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT)
    metrics_flag(up, DEFAULT_METRICS_PORT, "the router's port; the worker's is one more, the "
                                       "coldstore's two more")
    worker_flags(up)
    coldstore_flags(up)
    router_flags(up)
    shim_flags(up)
    up.set_defaults(func=_run_up)

    cl = sub.add_parser("cluster", help="several stacks on this machine behind vllm-router")
    clsub = cl.add_subparsers(dest="cluster", required=True)
    _cluster_up_parser(clsub.add_parser(
        "up", help="start N stacks and vllm-router in front of them (foreground)",
        description="Start N kvbank stacks (each a `kvbank up` with its own data dir, ports "
                    "and KV-event endpoints) and vllm-router in front of their OpenAI APIs; "
                    "print the one URL clients use. Ctrl-C stops the router, then the stacks. "
                    "Other `kvbank up` flags (e.g. --memory-budget) go to every stack."))

    r = sub.add_parser("router", help="run the router alone")
    data_dir_flag(r)
    r.add_argument("--model", type=Path, required=True, help="the model folder (tokenizer)")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT)
    metrics_flag(r, -1, "the router's")
    router_flags(r)
    r.set_defaults(func=_run_router)

    w = sub.add_parser("worker", help="run the worker alone")
    data_dir_flag(w)
    w.add_argument("--model", type=Path, required=True)
    metrics_flag(w, -1, "the worker's")
    worker_flags(w)
    w.set_defaults(func=_run_worker)

    c = sub.add_parser("coldstore", help="run the coldstore alone")
    data_dir_flag(c)
    metrics_flag(c, -1, "the coldstore's")
    coldstore_flags(c)
    c.set_defaults(func=_run_coldstore)

    sh = sub.add_parser("shim", help="run the OpenAI-compatible HTTP API alone")
    sh.add_argument("--router", default=f"127.0.0.1:{DEFAULT_ROUTER_PORT}",
                    help="the router's address (default: %(default)s)")
    sh.add_argument("--model-name", default=None,
                    help="the model id /v1/models reports (default: the router's)")
    shim_flags(sh)
    sh.set_defaults(func=_run_shim)

    pm = sub.add_parser("prepare-model", help="import the model if needed; print its folder")
    model_flag(pm)
    pm.set_defaults(func=_run_prepare_model)

    chat = sub.add_parser("chat", help="interactive chat with a running kvbank")
    address_flag(chat)
    client_key_flags(chat, admin=False)
    chat.add_argument("--session", default="chat", help="session name (default: %(default)s)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.set_defaults(func=_run_chat)

    ask = sub.add_parser("ask", help="one turn of a session (append mode)")
    address_flag(ask)
    client_key_flags(ask, admin=False)
    ask.add_argument("--session", required=True)
    ask.add_argument("--max-tokens", type=int, default=128)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--json", action="store_true", help="print the usage as one JSON object")
    ask.add_argument("text")
    ask.set_defaults(func=_run_ask)

    stp = sub.add_parser("status", help="sessions, tiers, budgets and pressure of a running kvbank")
    address_flag(stp)
    client_key_flags(stp, admin=True)
    stp.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    stp.add_argument("--every", type=float, default=2.0, help="seconds between redraws")
    stp.add_argument("--json", action="store_true")
    stp.add_argument("--evictions", action="store_true",
                     help="the bank's eviction log: each entry that left RAM, its reason, and "
                          "a release's write outcome and seconds")
    stp.set_defaults(func=_run_status)

    adm = sub.add_parser("admin", help="operator tools (over the router's Admin service)")
    address_flag(adm)
    client_key_flags(adm, admin=True)
    adm.set_defaults(func=_run_admin)  # apps/admin.py dispatches on args.admin
    asub = adm.add_subparsers(dest="admin", required=True)
    ap_ = asub.add_parser("pressure", help="inject a memory-pressure level, or `auto`")
    ap_.add_argument("level", choices=("normal", "warning", "critical", "auto"))
    asub.add_parser("trim", help="move every idle conversation already on SSD out of RAM")
    asub.add_parser("flush", help="write every conversation not on SSD yet, now")
    ar = asub.add_parser("release", help="move one conversation out of RAM (written out first)")
    ar.add_argument("session")
    ar.add_argument("--tenant", default="",
                    help="whose conversation, with API keys configured (the operator's key; "
                         "`kvbank status --admin-key` lists them)")
    ar.add_argument("--no-write-out", action="store_true",
                    help="drop its KV from RAM even if it is not on SSD yet")

    sto = sub.add_parser("store", help="the SSD store, offline")
    ssub = sto.add_subparsers(dest="store", required=True)
    sv = ssub.add_parser("verify", help="check every stored block's checksum; exit 1 if one "
                                        "failed")
    data_dir_flag(sv)
    sv.add_argument("--json", action="store_true")
    sv.set_defaults(func=_run_store_verify)

    rs = sub.add_parser("resilience", help="SIGKILL processes under load; check nothing "
                                           "acknowledged is lost (make resilience)")
    rs.add_argument("--model", default=None, help="default: the tiny test model")
    rs.add_argument("--agents", type=int, default=3)
    rs.add_argument("--turns", type=int, default=15, help="turns per agent")
    rs.add_argument("--kills", type=int, default=8)
    rs.add_argument("--seed", type=int, default=0)
    rs.add_argument("--report", type=Path, default=Path("resilience-report.json"))
    rs.set_defaults(func=_run_resilience)

    lg = sub.add_parser("loadgen", help="drive agents' conversations against a server")
    if command in (None, "loadgen"):
        from kvbank.apps.loadgen.cli import add_arguments as loadgen_arguments

        loadgen_arguments(lg)
    lg.set_defaults(func=_run_loadgen)

    bench = sub.add_parser("bench", help="benchmarks (a short table; JSON with --json)")
    if command in (None, "bench"):
        from kvbank.apps.bench import add_parsers as bench_parsers  # the one registry

        bench_parsers(bench.add_subparsers(dest="bench", required=True))
    bench.set_defaults(func=_run_bench)
    return ap


# -- one handler per command, registered with set_defaults(func=...) in build_parser. Each
# imports what it runs when it runs (mlx_lm alone takes seconds), so `kvbank --help` stays fast.


def _run_up(args: argparse.Namespace) -> int:
    _setup_logging("up")
    from kvbank.deploy.supervisor import Supervisor

    from kvbank.worker.compute.scheduler_config import SchedulerConfig

    SchedulerConfig.from_flags(args.scheduler_mode, args.max_active_requests,
                               args.decode_wait_s, args.shared_forward_s)  # refuse at start
    from kvbank.models import prepare_model

    model = prepare_model(args.model)
    return Supervisor(model=model, layout=Layout(args.data_dir), host=args.host,
                      port=args.port, shim_port=args.shim_port,
                      metrics_port=args.metrics_port,
                      args={g: forward(args, g) for g in FLAG_GROUPS}).run()


# `kvbank up` flags that `kvbank cluster up` sets per stack itself (not passed through).
CLUSTER_OWNS = ("kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic",
                "kv_events_block_size")


def _cluster_up_parser(p: argparse.ArgumentParser) -> None:
    from kvbank.deploy.cluster import (DEFAULT_BLOCK_SIZE, DEFAULT_POLICY, DEFAULT_PORT,
                                       DEFAULT_STACKS, POLICIES, default_cluster_dir)

    p.add_argument("--stacks", type=int, default=DEFAULT_STACKS,
                   help="kvbank stacks to start (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="vllm-router's address (default: loopback)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help="vllm-router's port: the URL clients use (default: %(default)s, a "
                        "single stack's)")
    model_flag(p)
    p.add_argument("--data-dir", type=Path, default=default_cluster_dir(),
                   help="stack I keeps its data in DATA_DIR/stack-I, its log next to it "
                        "(default: %(default)s)")
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help="vllm-router's policy; kv_aware reads the stacks' KV events, the others "
                        "are for comparisons (default: %(default)s)")
    p.add_argument("--router-bin", default=None,
                   help="the vllm-router program (default: the one next to this Python, else "
                        "on PATH; pip install vllm-router)")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more vllm-router argument, last (repeatable), e.g. "
                        "--router-arg=--retry-max-retries=2")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="each stack's Prometheus ports: 0 free ones (written to "
                        "DATA_DIR/stack-I/run/*.metrics), -1 off, N: stack I uses N+3(I-1) "
                        "and the next two (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=600,
                   help="longest start of the whole cluster (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each stack's and the router's command; start nothing")
    worker_flags(p)
    coldstore_flags(p)
    router_flags(p)
    p.set_defaults(kv_events_block_size=DEFAULT_BLOCK_SIZE)
    for action in p._actions:
        if action.dest in CLUSTER_OWNS[:3]:
            action.help = argparse.SUPPRESS  # set per stack by the cluster
        elif action.dest == "kv_events_block_size":
            action.help = ("tokens per KV-event block: every stack's --kv-events-block-size "
                           "and the router's --kv-event-block-size (default: %(default)s)")
    p.set_defaults(func=_run_cluster_up)


def cluster_stack_flags(args: argparse.Namespace) -> list[str]:
    """The `kvbank up` flags given to `kvbank cluster up`, for every stack (each flag once)."""
    ns = argparse.Namespace(**{**vars(args), **{d: None for d in CLUSTER_OWNS}})
    return [*forward(ns, "worker"), *forward(ns, "coldstore"), *forward(ns, "router")]


def _run_cluster_up(args: argparse.Namespace) -> int:
    _setup_logging("cluster")
    from kvbank.deploy.cluster import run_cluster

    return run_cluster(stacks=args.stacks, model=args.model, base_dir=args.data_dir,
                       host=args.host, port=args.port, policy=args.policy,
                       block_size=getattr(args, "kv_events_block_size", 16),
                       metrics_port=args.metrics_port, router_bin=args.router_bin,
                       router_extra=args.router_arg, stack_extra=cluster_stack_flags(args),
                       timeout_s=args.timeout_s, dry_run=args.dry_run)


def _run_router(args: argparse.Namespace) -> int:
    _setup_logging("router")
    from kvbank.router.admission import Ceilings
    from kvbank.router.auth import load_keys
    from kvbank.router.server import main as router_main

    for flag in ("max_active_per_tenant", "max_queue_per_tenant"):
        value = getattr(args, flag)
        if value is not None and value < (1 if flag == "max_active_per_tenant" else 0):
            raise SystemExit(f"--{flag.replace('_', '-')} {value}: must be at least "
                             f"{1 if flag == 'max_active_per_tenant' else 0}")
    layout = Layout(args.data_dir).ensure()
    router_main(args.model, layout.worker_address, args.host, args.port,
                keys=load_keys(args.api_key, args.api_keys_file),
                ceilings=Ceilings(args.max_prompt_tokens, args.max_request_tokens),
                max_queue=args.max_queue, max_queue_wait_s=args.max_queue_wait_s,
                max_active_per_tenant=args.max_active_per_tenant,
                max_queue_per_tenant=args.max_queue_per_tenant,
                prerender=args.prerender == "on",
                metrics_port=args.metrics_port, admin_key=args.admin_key,
                run_dir=layout.run_dir)
    return 0


def _run_worker(args: argparse.Namespace) -> int:
    from kvbank.worker.memory.allocator import one_heap

    one_heap()  # before any thread starts
    _setup_logging("worker")
    from kvbank.config import preload_openblas

    preload_openblas()  # before the first `import mlx`
    from kvbank.worker.server import main as worker_main

    from kvbank.worker.compute.scheduler_config import SchedulerConfig

    sched = SchedulerConfig.from_flags(args.scheduler_mode, args.max_active_requests,
                                       args.decode_wait_s, args.shared_forward_s)
    from kvbank.worker.kv.cache_kinds import UnsupportedModel

    try:
        worker_main(args.model, Layout(args.data_dir), block_tokens=args.block_tokens,
                    bank_bytes=args.bank_bytes, staging_max_bytes=args.staging_max_bytes,
                    restore_via=args.restore_via, scheduler=sched,
                    memory_budget=args.memory_budget, active_pin_s=args.active_pin_s,
                    admission_chain_shed=args.admission_chain_shed,
                    prefill_chunk_tokens=args.prefill_chunk_tokens,
                    write_out_deadline_s=args.write_out_deadline_s,
                    max_checkpoints=args.max_checkpoints,
                    checkpoint_every=args.checkpoint_every, kv_bits=args.kv_bits,
                    mtp=args.mtp, mtp_depth=args.mtp_depth, mtp_head=args.mtp_head,
                    kv_events=_kv_events(args), metrics_port=args.metrics_port,
                    grammar_timeout_s=args.grammar_timeout_s,
                    max_grammar_bytes=args.max_grammar_bytes)
    except UnsupportedModel as e:  # never served wrong: refused, with what to do
        raise SystemExit(f"kvbank worker: refused to serve {args.model}: {e}") from None
    return 0


def _kv_events(args: argparse.Namespace):
    """The worker's KV-event settings, checked at start (None: off)."""
    from kvbank.worker.link.kv_events import EventsConfig

    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint:
            raise SystemExit("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    if args.kv_events_block_size < 1:
        raise SystemExit(f"--kv-events-block-size {args.kv_events_block_size}: must be >= 1")
    return EventsConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint,
                        args.kv_events_topic, args.kv_events_block_size)


def _run_coldstore(args: argparse.Namespace) -> int:
    _setup_logging("coldstore")
    from kvbank.coldstore.budgets import Limits
    from kvbank.coldstore.server import main as coldstore_main

    limits = Limits(write_bytes_per_hour=args.write_budget_bytes_per_hour,
                    free_disk_floor_bytes=args.free_disk_floor_bytes,
                    store_max_bytes=args.store_max_bytes,
                    entry_max_bytes=args.entry_max_bytes, store_map_bytes=args.store_map_bytes)
    from kvbank.contracts.store_layout import StoreFormatError

    try:
        coldstore_main(Layout(args.data_dir), quiet_grace_s=args.quiet_grace_s,
                       max_dirty_s=args.max_dirty_s, tail_delay_s=args.tail_delay_s,
                       payload_stall_s=args.payload_stall_s,
                       limits=limits, metrics_port=args.metrics_port,
                       anonymous_ttl_s=args.anonymous_ttl_s)
    except StoreFormatError as e:
        raise SystemExit(f"kvbank coldstore: refused: {e}") from None
    return 0


def _run_shim(args: argparse.Namespace) -> int:
    _setup_logging("shim")
    from kvbank.router.auth import load_keys
    from kvbank.apps.shim.server import main as shim_main

    shim_main(router_address=args.router, host=args.shim_host, port=args.shim_port,
              keys=load_keys(args.api_key, args.api_keys_file), model_name=args.model_name,
              default_max_tokens=args.default_max_tokens,
              keep_attribution=args.keep_attribution_line, record_to=args.record_requests,
              strict_model=args.strict_model_name, refusal_share=args.refusal_share)
    return 0


def _run_prepare_model(args: argparse.Namespace) -> int:
    _setup_logging("prepare-model")
    from kvbank.config import preload_openblas

    preload_openblas()
    from kvbank.models import resolve_model

    print(resolve_model(args.model))
    return 0


def _run_status(args: argparse.Namespace) -> int:
    from kvbank.apps.status import run_status

    return run_status(args.address, watch=args.watch, every_s=args.every, as_json=args.json,
                      show_evictions=args.evictions, api_key=args.api_key,
                      admin_key=args.admin_key)


def _run_store_verify(args: argparse.Namespace) -> int:
    from kvbank.apps.store_verify import run_verify

    return run_verify(args.data_dir, args.json)


def _run_admin(args: argparse.Namespace) -> int:
    from kvbank.apps.admin import run_admin

    return run_admin(args)


def _run_resilience(args: argparse.Namespace) -> int:
    import json

    from kvbank.apps.resilience import run as resilience_run

    _setup_logging("resilience")
    summary = resilience_run(model=args.model, agents=args.agents, turns=args.turns,
                             kills=args.kills, seed=args.seed, report_path=args.report)
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


def _run_loadgen(args: argparse.Namespace) -> int:
    from kvbank.apps.loadgen.cli import run_cli

    return run_cli(args)


def _run_chat(args: argparse.Namespace) -> int:
    from kvbank.apps.chat import chat

    return chat(args.address, args.session, max_tokens=args.max_tokens,
                temperature=args.temperature, api_key=args.api_key)


def _run_ask(args: argparse.Namespace) -> int:
    from kvbank.apps.chat import ask

    return ask(args.address, args.session, args.text, max_tokens=args.max_tokens,
               temperature=args.temperature, as_json=args.json, api_key=args.api_key)


def _run_bench(args: argparse.Namespace) -> int:
    _setup_logging("bench")
    from kvbank.config import preload_openblas

    preload_openblas()  # before the first `import mlx`: benches time MLX in this process too
    from kvbank.apps.bench import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    transformers_scan.install()  # before anything imports transformers
    typed = sys.argv[1:] if argv is None else argv
    args = build_parser(next((a for a in typed if not a.startswith("-")), None)).parse_args(typed)
    args.argv = ["kvbank", *typed]  # as typed: benches record it
    return args.func(args)

if __name__ == "__main__":
    sys.exit(main())
