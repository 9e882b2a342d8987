"""`kvbank chat` and `kvbank ask`: a person's view of one session, in append mode."""

from __future__ import annotations

import json
import sys

import grpc

from kvbank.client import Client


def _describe(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


def ask(address: str, session: str, text: str, *, max_tokens: int, temperature: float,
        as_json: bool) -> int:
    with Client(address) as c:
        try:
            turn = c.generate(session_id=session, messages=[{"role": "user", "content": text}],
                              append=True, max_tokens=max_tokens, temperature=temperature,
                              on_text=None if as_json else lambda t: print(t, end="", flush=True))
        except grpc.RpcError as e:
            print(f"kvbank ask: {_describe(e)}", file=sys.stderr)
            return 1
    if as_json:
        print(json.dumps({"session_id": session, "text": turn.text,
                          "finish_reason": turn.finish_reason, **turn.usage}))
    else:
        print()
    return 0


def chat(address: str, session: str, *, max_tokens: int, temperature: float) -> int:
    print(f"kvbank chat: session {session!r} at {address}. Ctrl-D to leave.")
    with Client(address) as c:
        while True:
            try:
                line = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not line:
                continue
            print("kvbank> ", end="", flush=True)
            try:
                turn = c.generate(session_id=session, append=True, max_tokens=max_tokens,
                                  messages=[{"role": "user", "content": line}],
                                  temperature=temperature,
                                  on_text=lambda t: print(t, end="", flush=True))
            except grpc.RpcError as e:
                print(f"\n[{_describe(e)}]")
                continue
            u = turn.usage
            print(f"\n[{u['prompt_tokens']} prompt tokens, {u['cached_tokens']} cached from "
                  f"{u['cache_source']}, {u['completion_tokens']} new, TTFT {u['ttft_s']:.2f}s]")
