"""`kvbank resilience` (`make resilience`): kill processes under load, check what was promised.

Agents hold conversations through the router (append mode, greedy) while a killer SIGKILLs
the worker, the coldstore or the router at random moments (seeded). After every kill the
supervisor restarts the process; the run waits until the stack answers again and checks:
- every turn whose final message reached its client is in its session record, token for
  token (`turns_lost`);
- a sample of restored turns gives the same tokens as recomputing them (`wrong_restores`);
- a conversation that was on SSD when the worker died is restored afterwards, not recomputed;
- the LMDB store opens and every block a record names is whole and decodes (at the end).
The report is printed and written as JSON.
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
PROCESSES = ("worker", "coldstore", "router")
# An agent compacts (starts a new conversation) before its history passes this many tokens,
# as a real agent does, so it stays inside the model's context (the tiny model's is 2,048).
COMPACT_AT_TOKENS = 1500
# An agent retries a failed call every RETRY_EVERY_S for RETRY_FOR_S: a pause of its own
# between tries would be counted in `serving_to_answer_s`, which measures the stack coming back.
RETRY_EVERY_S = 0.05
RETRY_FOR_S = 120.0


@dataclass
class Report:
    seed: int
    kills: dict = field(default_factory=lambda: dict.fromkeys(PROCESSES, 0))
    turns_acknowledged: int = 0
    turns_lost: int = 0
    restores_checked: int = 0
    wrong_restores: int = 0
    ssd_restores_expected: int = 0
    ssd_restores_missed: int = 0
    store_blocks_checked: int = 0
    store_bad_blocks: int = 0
    retried_turns: int = 0
    agent_errors: list = field(default_factory=list)
    findings: list = field(default_factory=list)
    recovery_s: list = field(default_factory=list)
    # From a restarted worker or router serving (its health check) to the first turn answered
    # after: how long clients wait on a stack that is back (goal: <= 1 s).
    serving_to_answer_s: list = field(default_factory=list)
    # A worker kill: from the kill to the next answer, less the new worker's own start (spawn
    # to serving, the model's load): what the restart costs beyond loading (goal: <= 2 s).
    worker_kill_beyond_load_s: list = field(default_factory=list)

    def summary(self) -> dict:
        out = asdict(self)
        for name in ("recovery", "serving_to_answer", "worker_kill_beyond_load"):
            got = sorted(getattr(self, f"{name}_s"))
            out[f"{name}_p50_s"] = round(got[len(got) // 2], 2) if got else None
            out[f"{name}_max_s"] = round(got[-1], 2) if got else None
            out[f"{name}_s"] = [round(r, 2) for r in got]
        out["ok"] = (self.turns_lost == 0 and self.wrong_restores == 0 and not self.agent_errors
                     and self.ssd_restores_missed == 0 and self.store_bad_blocks == 0)
        return out


class Run:
    def __init__(self, stack, *, agents: int, turns: int, kills: int, seed: int,
                 check_every: int = 3):
        self.stack, self.agents, self.turns, self.kills = stack, agents, turns, kills
        self.rng = random.Random(seed)
        self.report = Report(seed)
        self.acked: dict[str, list[int]] = {}  # session -> its record when a turn was acked
        self.current: dict[int, str] = {}  # agent -> the conversation it is on
        # session -> when the worker died with some of its KV on SSD: the first turn started
        # after that restores from SSD (RAM starts empty)
        self.expect_ssd: dict[str, float] = {}
        self.lock = threading.Lock()
        self.check_every = check_every
        self.stop = threading.Event()
        self.killer_done = threading.Event()
        self.answered: list[float] = []  # when each turn was acknowledged (monotonic)
        self.answer_came = threading.Condition(self.lock)

    # -- agents -----------------------------------------------------------------------------

    def agent(self, i: int) -> None:
        try:
            self._agent(i)
        except Exception as e:  # an agent that dies is a finding, not a silent thread
            with self.lock:
                self.report.agent_errors.append(f"agent-{i}: {type(e).__name__}: {e}"[:300])

    def _agent(self, i: int) -> None:
        rng = np.random.default_rng(self.report.seed * 1000 + i)
        session, compactions, history = f"agent-{i}", 0, 0
        turn = 0
        with self.stack.client() as c:
            # At least `turns` turns, on until the killer is done (or 100x that), and one more
            # when a worker kill left this conversation to come back from SSD.
            while (turn < self.turns or session in self.expect_ssd
                   or (not self.killer_done.is_set() and turn < 100 * self.turns)):
                turn += 1
                new = rng.integers(1000, 20000, int(rng.integers(20, 60))).tolist()
                if history + len(new) + 6 > COMPACT_AT_TOKENS and session not in self.expect_ssd:
                    compactions += 1  # the agent compacts: a new conversation from here
                    session, history = f"agent-{i}-c{compactions}", 0
                self.current[i] = session
                got = self._turn_with_retries(c, session, new)
                if got is None:
                    return
                t, before, started_at = got
                history = len(before) + len(new) + len(t.token_ids) + 1
                record = self._retry(lambda: list(c.get_session(session).token_ids))
                with self.lock:
                    self.answered.append(time.monotonic())
                    self.answer_came.notify_all()
                    self.report.turns_acknowledged += 1
                    if record is not None:
                        self.acked[session] = record
                    killed_at = self.expect_ssd.get(session)
                    expected_ssd = killed_at is not None and started_at > killed_at
                    if expected_ssd:
                        del self.expect_ssd[session]
                if expected_ssd:
                    self.report.ssd_restores_expected += 1
                    # RAM counts too: the check of the turn before (recomputed, cache off)
                    # may have put the same prefix back in RAM first. Recomputing is the miss.
                    if t.usage["cache_source"] == "none":
                        self.report.ssd_restores_missed += 1
                        self.report.findings.append(
                            f"{session}: after a worker restart its turn came from "
                            f"{t.usage['cache_source']} ({t.usage['cached_tokens']} cached of "
                            f"{t.usage['prompt_tokens']}): it was recomputed")
                if t.usage["cached_tokens"] and turn % self.check_every == 0:
                    cold = self._retry(lambda: c.generate(token_ids=before + new,
                                                          max_tokens=len(t.token_ids) or 1,
                                                          no_cache=True))
                    if cold is not None:
                        self.report.restores_checked += 1
                        if cold.token_ids != t.token_ids:
                            self.report.wrong_restores += 1

    def _turn_with_retries(self, c, session: str, new: list[int]):
        deadline = time.monotonic() + RETRY_FOR_S
        while time.monotonic() < deadline:
            try:
                before = list(c.get_session(session).token_ids)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    before = []
                elif e.code() in RETRYABLE:
                    time.sleep(RETRY_EVERY_S)
                    continue
                else:
                    raise
            try:
                started_at = time.monotonic()
                t = c.generate(session_id=session, token_ids=new, append=True, max_tokens=6,
                               timeout_s=120)
                return t, before, started_at
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                self.report.retried_turns += 1
                time.sleep(RETRY_EVERY_S)
        return None

    def _retry(self, fn):
        deadline = time.monotonic() + RETRY_FOR_S
        while time.monotonic() < deadline:
            try:
                return fn()
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                time.sleep(RETRY_EVERY_S)
        return None

    # -- the killer -------------------------------------------------------------------------

    def killer(self) -> None:
        try:
            self._kill_all()
        finally:
            self.killer_done.set()

    def _kill_all(self) -> None:
        for _ in range(self.kills):
            if self.stop.wait(self.rng.uniform(1.0, 4.0)):
                return
            name = self.rng.choice(PROCESSES)
            if name == "worker":  # let something reach SSD first, so the check has a subject:
                # agents compact often, so write-behind may trail their current conversations;
                # a flush writes them now (kvbank admin flush)
                deadline = time.monotonic() + 15
                while not self._durable_sessions() and time.monotonic() < deadline:
                    self._flush()
            with self.lock:
                durable = self._durable_sessions() if name == "worker" else set()
                old = self.stack.kill9(name)
                t0 = time.monotonic()
                self.expect_ssd.update(dict.fromkeys(durable, t0))
            spawned, serving = self._serving_again(name, old)
            self.stack.wait_restarted(name, old, timeout_s=300)
            self.report.recovery_s.append(time.monotonic() - t0)
            # The worker and the router are on every answer's path; the stack answers from RAM
            # while the coldstore is down, so its restart has no first answer to wait for.
            answer = self._next_answer(after=serving) if name != "coldstore" else None
            if answer is not None:
                self.report.serving_to_answer_s.append(answer - serving)
                if name == "worker":
                    self.report.worker_kill_beyond_load_s.append(
                        (answer - t0) - (serving - spawned))
            self.report.kills[name] += 1
            self.check_records()

    def _serving_again(self, name: str, old: int, timeout_s: float = 300
                       ) -> tuple[float, float]:
        """When the supervisor's new `name` process was spawned, and when it first answered
        its health check (monotonic; polled every 20 ms)."""
        import psutil

        from kvbank.contracts.health import coldstore_up, grpc_healthy

        layout = self.stack.layout
        healthy = {"worker": lambda: grpc_healthy(layout.worker_address, 0.5),
                   "router": lambda: grpc_healthy(self.stack.address, 0.5),
                   "coldstore": lambda: coldstore_up(layout.coldstore_address)}[name]
        deadline = time.monotonic() + timeout_s
        pid = old
        while pid == old and time.monotonic() < deadline:
            try:
                pid = self.stack.pid(name)
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.02)
        try:  # its start, on the monotonic clock
            spawned = time.monotonic() - (time.time() - psutil.Process(pid).create_time())
        except psutil.Error:
            spawned = time.monotonic()
        while not healthy() and time.monotonic() < deadline:
            time.sleep(0.02)
        return spawned, time.monotonic()

    def _next_answer(self, after: float, timeout_s: float = 120) -> float | None:
        """When the first turn acknowledged after `after` was (None: none came in time)."""
        with self.answer_came:
            self.answer_came.wait_for(lambda: any(t >= after for t in self.answered)
                                      or self.stop.is_set(), timeout_s)
            return next((t for t in self.answered if t >= after), None)

    def _flush(self) -> None:
        with self.stack.client() as c:
            try:
                c.flush()
            except grpc.RpcError:
                time.sleep(0.2)

    def _durable_sessions(self) -> set[str]:
        """The conversations agents are on whose KV is (partly) on SSD."""
        current = set(self.current.values())
        with self.stack.client() as c:
            try:
                return {s.session_id for s in c.list_sessions()
                        if s.durable_tokens > 0 and s.session_id in current}
            except grpc.RpcError:
                return set()

    # -- invariants -------------------------------------------------------------------------

    def check_records(self) -> None:
        """Every acknowledged turn is in its session record, token for token."""
        with self.stack.client() as c, self.lock:
            for session, acked in self.acked.items():
                record = self._retry(lambda: list(c.get_session(session).token_ids))
                if record is None or record[:len(acked)] != acked:
                    self.report.turns_lost += 1

    def check_store(self) -> None:
        """The store opens, and every block a record names is whole and decodes."""
        from kvbank.coldstore.store import ColdStore
        from kvbank.blocks import decode_block

        store = ColdStore(self.stack.layout.store_dir, readonly=True)
        try:
            for meta in store.list_sessions():
                ids = meta.block_ids()
                for bid, raw in zip(ids, store.get_blocks(ids)):
                    self.report.store_blocks_checked += 1
                    try:
                        header, _ = decode_block(raw)
                        assert header.n_tokens > 0
                    except Exception:
                        self.report.store_bad_blocks += 1
        finally:
            store.close()

    def run(self) -> Report:
        killer = threading.Thread(target=self.killer, name="killer")
        agents = [threading.Thread(target=self.agent, args=(i,)) for i in range(self.agents)]
        killer.start()
        for a in agents:
            a.start()
        for a in agents:
            a.join()
        self.stop.set()
        killer.join()
        self.check_records()
        self.check_store()
        return self.report


def run(*, model: str | None, agents: int, turns: int, kills: int, seed: int,
        report_path: Path | None) -> dict:
    from kvbank.deploy.local import LocalStack
    from kvbank.models import prepare_model
    from kvbank.models import default_cache_dir
    from kvbank.testing.tiny import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvbank-resilience-") as tmp:
        tmp = Path(tmp)
        model_dir = (make_tiny_model(tmp / "tiny", seed=0, cache_dir=default_cache_dir())
                     if model is None else prepare_model(model))
        stack = LocalStack.start(model_dir, tmp / "data", shim=False, wait=False, extra=[
            "--block-tokens", "16", "--quiet-grace-s", "0.1", "--tail-delay-s", "1",
            "--max-dirty-s", "2"])
        try:
            start_to_answer = _answered_after_start(stack)
            summary = Run(stack, agents=agents, turns=turns, kills=kills, seed=seed).run().summary()
            summary["start_to_answer_s"] = round(start_to_answer, 3)
        finally:
            stack.stop()
    if report_path is not None:
        report_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _answered_after_start(stack) -> float:
    """A client that sends from the moment `kvbank up` starts (again at once on a refusal,
    again after a second on UNAVAILABLE, as it asks): from the stack's "kvbank is up" (its
    ready file) to that client's first answer (goal: <= 1 s)."""
    answered: list[float] = []
    stop = threading.Event()

    def send() -> None:
        with stack.client() as c:
            while not stop.is_set():
                try:
                    c.generate(prompt="Are you up?", max_tokens=2, timeout_s=30)
                    answered.append(time.monotonic())
                    return
                except grpc.RpcError:
                    stop.wait(1.0)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    stack.wait_started(300)
    ready_at = time.monotonic()
    sender.join(120)
    stop.set()
    if not answered:
        raise RuntimeError("no answer within 120 s of the stack's start")
    return max(0.0, answered[0] - ready_at)
