"""`kvbank chat` and `kvbank ask`: a person's view of one session, in append mode."""

from __future__ import annotations

import json
import signal
import sys

import grpc

from kvbank.client import Client


def _describe(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


class _CtrlC:
    """Ctrl-C while an answer streams cancels its call, and the answer stops there. No
    KeyboardInterrupt is raised inside the gRPC call (one that is can leave the channel's
    close waiting on it for good: grpc/grpc#19973)."""

    def __init__(self):
        self.call, self.pressed = None, False

    def __enter__(self) -> "_CtrlC":
        self._before = signal.signal(signal.SIGINT, self._press)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._before)

    def on_call(self, call) -> None:
        self.call = call
        if self.pressed:  # pressed before the call had started
            call.cancel()

    def _press(self, *_) -> None:
        self.pressed = True
        if self.call is not None:
            self.call.cancel()


def ask(address: str, session: str, text: str, *, max_tokens: int, temperature: float,
        as_json: bool, api_key: str | None = None) -> int:
    with Client(address, api_key) as c, _CtrlC() as ctrl_c:
        try:
            turn = c.generate(session_id=session, messages=[{"role": "user", "content": text}],
                              append=True, max_tokens=max_tokens, temperature=temperature,
                              on_text=None if as_json else lambda t: print(t, end="", flush=True),
                              on_call=ctrl_c.on_call)
        except grpc.RpcError as e:
            if ctrl_c.pressed:
                print("\nkvbank ask: stopped (Ctrl-C)", file=sys.stderr)
                return 130
            print(f"kvbank ask: {_describe(e)}", file=sys.stderr)
            return 1
    if as_json:
        print(json.dumps({"session_id": session, "text": turn.text,
                          "finish_reason": turn.finish_reason, **turn.usage}))
    else:
        print()
    return 0


def chat(address: str, session: str, *, max_tokens: int, temperature: float,
         api_key: str | None = None) -> int:
    print(f"kvbank chat: session {session!r} at {address}. "
          "Ctrl-C stops an answer, Ctrl-D leaves.")
    with Client(address, api_key) as c:
        while True:
            try:
                line = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            if not line:
                continue
            print("kvbank> ", end="", flush=True)
            with _CtrlC() as ctrl_c:
                try:
                    turn = c.generate(session_id=session, append=True, max_tokens=max_tokens,
                                      messages=[{"role": "user", "content": line}],
                                      temperature=temperature, on_call=ctrl_c.on_call,
                                      on_text=lambda t: print(t, end="", flush=True))
                except grpc.RpcError as e:
                    print("\n[stopped]" if ctrl_c.pressed else f"\n[{_describe(e)}]")
                    continue
            u = turn.usage
            print(f"\n[{u['prompt_tokens']} prompt tokens, {u['cached_tokens']} cached from "
                  f"{u['cache_source']}, {u['completion_tokens']} new, TTFT {u['ttft_s']:.2f}s]")
