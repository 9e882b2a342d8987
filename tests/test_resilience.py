"""The short subset of `make resilience`: real SIGKILLs of each process under load."""

from __future__ import annotations

import threading
import time

import httpx

from kvbank.apps.resilience import Run
from kvbank.deploy.local import LocalStack
from tests.conftest import start_stack
from tests.waiting import wait_until


def test_kills_under_load_lose_no_acknowledged_turn(tiny_model, tmp_path, cache_dir):
    stack: LocalStack = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir,
                                    shim=False, extra=["--tail-delay-s", "1", "--max-dirty-s", "2"])
    try:
        run = Run(stack, agents=2, turns=8, kills=3, seed=1, check_every=2)
        run.rng.choice = lambda names: {0: "coldstore", 1: "router"}.get(  # one of each
            sum(run.report.kills.values()), "worker")
        report = run.run().summary()
    finally:
        stack.stop()
    assert report["agent_errors"] == [], report
    assert sum(report["kills"].values()) == 3, report
    assert report["turns_acknowledged"] >= 16, report
    assert report["turns_lost"] == 0, report
    assert report["wrong_restores"] == 0 and report["restores_checked"] > 0, report
    assert report["kills"] == {"worker": 1, "coldstore": 1, "router": 1}, report
    assert report["ssd_restores_missed"] == 0 and report["ssd_restores_expected"] > 0, \
        report["findings"]
    assert report["store_bad_blocks"] == 0 and report["store_blocks_checked"] > 0, report


class Sender:
    """A client that sends all along (the OpenAI API, through the shim), as an agent would:
    again at once after an answer, after Retry-After after a 503, soon after a refused
    connection (the shim not listening yet). Every attempt is an event: when it started,
    how it ended."""

    def __init__(self, url: str):
        self.url, self.attempts, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    r = http.post(self.url + "/v1/chat/completions", json={
                        "model": "kvbank", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "Still there?"}]})
                except httpx.TransportError as e:  # the shim is not listening yet
                    self.attempts.append((started, None, type(e).__name__))
                    self.stop.wait(0.2)
                    continue
                self.attempts.append((started, r.status_code, r.text))
                if r.status_code == 503:
                    assert "Retry-After" in r.headers, r.headers
                    self.stop.wait(float(r.headers["Retry-After"]))

    def after(self, t: float) -> list:
        return [a for a in list(self.attempts) if a[0] >= t]


def _first_after(sender: Sender, t: float, what: str) -> list:
    """Waits for the first success among the attempts started after `t`; returns them all."""
    return wait_until(lambda: (got := sender.after(t)) and any(a[1] == 200 for a in got)
                      and got, f"an answer to a request sent after {what}", timeout_s=60)


def test_a_client_sending_all_along_is_answered_as_soon_as_the_stack_serves(
        tiny_model, tmp_path, cache_dir):
    """`make run` with a client already sending got its first answer 15-20 s after "kvbank is
    up" (the shim's channel to the router was backing off), and after a kill -9 of the worker
    7.6 s after the new one served; the first 503s carried gRPC's own text. Now no request
    sent after the stack (or the new worker) serves fails, and every 503 before is ours, with
    Retry-After. Counted by events (each attempt, the ready file, the worker's health), never
    by a clock. The restarted worker says each step and reads its memory calibration."""
    from kvbank.contracts.health import grpc_healthy

    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, wait=False)
    sender = Sender(s.shim_url)
    sender.thread.start()
    try:
        s.wait_started(120)
        ready_at = time.monotonic()
        tried = _first_after(sender, ready_at, '"kvbank is up"')
        assert all(a[1] == 200 for a in tried), tried  # none refused after the stack serves

        logged = len(s.log.read_text(errors="replace"))
        old = s.kill9("worker")
        wait_until(lambda: s.pid("worker") != old, "the supervisor to start a new worker")
        serving_at = wait_until(lambda: grpc_healthy(s.layout.worker_address, 0.5)
                                and time.monotonic(), "the new worker to serve", every_s=0.02)
        down = [a for a in sender.attempts if a[1] is not None and a[1] != 200]
        tried = _first_after(sender, serving_at, "the new worker serves")
        assert all(a[1] == 200 for a in tried), tried
        # The new worker said what it did, and read its memory calibration (measured once,
        # kept per model and chunk size) rather than run its chunks and warm-up again.
        restart = s.log.read_text(errors="replace")[logged:]
        for said in ("worker    INFO kvbank.worker.compute.served_model: loading the model",
                     "memory calibration read from", "loading session records from the store"):
            assert said in restart, said
        assert "calibrating memory" not in restart and "warming up" not in restart
        assert down, "no request met the worker down"
        for _, status, text in down:
            assert status == 503, (status, text)
            assert "connect" not in text and "ipv4" not in text and "unix:" not in text, text
            assert "retry in 1 s" in text, text
    finally:
        sender.stop.set()
        s.stop()


def test_a_process_that_served_comes_back_at_once_and_a_crash_loop_backs_off(tmp_path, caplog):
    """The supervisor's restart rule, on its own loop (a test seam: the children are plain
    Python processes and `_healthy` says which one serves). A process killed -9 after it
    served is spawned again after RESTART_S, every time: its clients wait. One that dies
    before it ever serves backs off, doubling. The old rule escalated both alike, for any
    process that had run under a minute, and slept in the loop that restarts the others."""
    import logging
    import os
    import signal
    import sys
    from types import SimpleNamespace

    from kvbank.deploy.supervisor import MIN_BACKOFF_S, RESTART_S, Child, Supervisor

    sup = Supervisor.__new__(Supervisor)
    sup.stopping, sup.layout = False, SimpleNamespace(run_dir=tmp_path)
    serves = Child("router", [sys.executable, "-c", "import time; time.sleep(120)"],
                   dict(os.environ))
    fails = Child("worker", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ))
    sup.children = [serves, fails]
    sup._healthy = lambda name: name == "router"
    for c in sup.children:
        sup._spawn(c)

    def restarts(name: str) -> list[str]:
        return [r.getMessage().rsplit(" ", 1)[-1] for r in caplog.records
                if r.getMessage().startswith(f"{name} exited")]

    def loop_until(cond, what: str):
        def once():
            sup._check_children()
            return cond()
        return wait_until(once, what, every_s=0.02)

    caplog.set_level(logging.INFO, logger="kvbank.deploy.supervisor")
    try:
        for kill in range(2):
            loop_until(lambda: serves.served and serves.proc.poll() is None, "the router serves")
            serves.proc.send_signal(signal.SIGKILL)
            loop_until(lambda: len(restarts("router")) > kill, "the router's restart")
        loop_until(lambda: len(restarts("worker")) >= 3, "three restarts of the failing worker")
    finally:
        for c in sup.children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
    assert restarts("router") == [f"{RESTART_S:.1f}s"] * 2
    assert restarts("worker")[:3] == [f"{MIN_BACKOFF_S * 2 ** i:.1f}s" for i in range(3)]
