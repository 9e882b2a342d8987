"""Every command README.md shows runs in the suite, so a command that cannot start fails CI.

Each `kvbank ...` line of the README is parsed by the real command line (a renamed or removed
flag fails here), and each is run: here, with tiny settings where its defaults take minutes,
or by the test named in RUN_ELSEWHERE. A command the README gains that neither runs fails the
last test below until one does.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbank.apps.cli import build_parser

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()

# Commands the README shows that another test runs (the subcommand words -> where).
RUN_ELSEWHERE = {
    ("up",): "every stack the suite starts (deploy/local.py runs `kvbank up`)",
    ("bench", "turn"): "tests/test_bench_turn.py",
    ("bench", "scale"): "tests/test_bench_scale.py",
    ("bench", "cluster"): "tests/test_bench_cluster.py",
    ("bench", "agents"): "tests/test_bench_agents.py",
    ("bench", "kvbits"): "tests/test_kv_bits.py",
    ("bench", "restore"): "tests/test_background_restore.py",
    ("bench", "tenants"): "tests/test_bench_tenants.py",
    ("bench", "prerender"): "tests/test_bench_agents.py",  # a matrix test: make test-all
    ("bench", "overhead"): "tests/test_shim.py",
}
RUN_HERE = {("ask",), ("chat",), ("status",), ("bench", "compare")}


def _readme_commands() -> list[list[str]]:
    """Every `kvbank` command in the README: its code blocks' lines and its benchmark table's
    first column, as argv (without the program or the comment)."""
    found = []
    for line in re.findall(r"^\.venv/bin/kvbank (.+)$", README, re.M):
        found.append(line.split("  #")[0])
    found += re.findall(r"^\| `kvbank ([^`]+)`", README, re.M)  # the benchmark table
    out = []
    for text in found:
        argv = shlex.split(text.split(" # ")[0])
        if argv not in out:
            out.append(argv)
    return out


def _words(argv: list[str]) -> tuple[str, ...]:
    return tuple(argv[:2]) if argv[0] in ("bench", "cluster", "admin", "store") else (argv[0],)


def test_the_readme_shows_commands():
    words = {_words(a) for a in _readme_commands()}
    assert {("bench", "turn"), ("chat",), ("ask",), ("status",)} <= words, words


@pytest.mark.parametrize("argv", _readme_commands(), ids=" ".join)
def test_every_kvbank_command_in_the_readme_parses(argv):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's way of refusing
        pytest.fail(f"README shows `kvbank {' '.join(argv)}`, which the command line refuses "
                    f"(exit {e.code})")
    assert callable(args.func)


def test_every_command_in_the_readme_runs_in_the_suite():
    missing = {_words(a) for a in _readme_commands()} - set(RUN_ELSEWHERE) - RUN_HERE
    assert not missing, f"README commands no test runs: {sorted(missing)}"
    for words, where in RUN_ELSEWHERE.items():
        if where.startswith("tests/") and words in {_words(a) for a in _readme_commands()}:
            text = (ROOT / where).read_text()
            assert (f'"{words[-1]}"' in text or f"bench import {words[-1]}" in text
                    or f"apps.bench.{words[-1]} import" in text), (words, where)


def _kvbank(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvbank.apps.cli", *argv], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, **kw)


def _ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return out.stdout


def test_ask_chat_and_status_as_the_readme_shows_them(module_stack, tmp_path):
    at = ["--address", module_stack.address]
    usage = json.loads(_ok(_kvbank("ask", *at, "--session", "mine", "--max-tokens", "4",
                                   "--json", "Hi")))
    assert usage["cache_source"] == "none", usage
    chat = _ok(_kvbank("chat", *at, "--session", "mine", "--max-tokens", "4",
                       input="Hi again\n"))
    assert "cached" in chat, chat  # each turn prints its cached tokens and their source
    table = _ok(_kvbank("status", *at))
    assert "mine" in table, table

    # --watch redraws until Ctrl-C, on a terminal (rich draws a live view only there): it
    # draws its first frame, and Ctrl-C ends it cleanly
    screen, terminal = pty.openpty()
    with open(tmp_path / "watch.err", "w+") as err:
        watch = subprocess.Popen([sys.executable, "-m", "kvbank.apps.cli", "status", *at, "--watch"],
                                 stdout=terminal, stderr=err, cwd=ROOT)
        os.close(terminal)
        try:
            drawn = _read_terminal(screen, watch, until=lambda d: b"mine" in d)
            assert b"mine" in drawn, drawn[-2000:]
            watch.send_signal(signal.SIGINT)
            # Its last frame goes out as it stops: the terminal is read until it has exited
            # (a terminal nobody reads would hold that write, and the exit with it).
            drawn += _read_terminal(screen, watch, until=lambda d: False)
            assert watch.wait(timeout=5) == 0, f"status --watch exited {watch.returncode}"
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
            os.close(screen)
        err.seek(0)
        assert "Traceback" not in err.read()


def test_ctrl_c_in_chat_stops_the_answer_and_the_chat_goes_on(module_stack):
    """Ctrl-C while an answer streams stops that answer, and the chat asks for the next line
    (the model answers greedily: where its first text comes is the same every run)."""
    chat = subprocess.Popen([sys.executable, "-m", "kvbank.apps.cli", "chat", "--address",
                             module_stack.address, "--session", "interrupted",
                             "--max-tokens", "300"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        out = chat.stdout.fileno()
        chat.stdin.write(b"Tell me a long story.\n")
        chat.stdin.flush()
        # the answer has begun: text after its prompt
        _read_terminal(out, chat, until=lambda d: re.search(rb"kvbank> [\s\S]", d))
        chat.send_signal(signal.SIGINT)
        drawn = _read_terminal(out, chat, until=lambda d: b"[stopped]\nyou> " in d)
        assert b"[stopped]\nyou> " in drawn and b"prompt tokens" not in drawn, drawn[-2000:]
        chat.stdin.close()  # Ctrl-D: the chat ends as it always does
        assert chat.wait(timeout=60) == 0
    finally:
        if chat.poll() is None:
            chat.kill()
            chat.wait()
    assert b"Traceback" not in chat.stderr.read()


def _read_terminal(screen: int, proc: subprocess.Popen, until, timeout_s: float = 60) -> bytes:
    """What `proc` writes to its terminal, read until `until(all read)` or it exits."""
    drawn, give_up = b"", time.monotonic() + timeout_s
    while not until(drawn) and proc.poll() is None:
        assert time.monotonic() < give_up, f"timed out reading the terminal: {drawn[-500:]}"
        if select.select([screen], [], [], 0.2)[0]:
            try:
                drawn += os.read(screen, 65536)
            except OSError:  # the other end closed: it has exited
                break
    return drawn


def test_the_readmes_curl_request_answers(module_stack):
    line = re.search(r"^curl -s localhost:8000(.+?)\\\n\s*-d '(.+)'$", README, re.M)
    assert line, "README's curl example moved: update this test"
    path, body = line.group(1).split()[0], json.loads(line.group(2))
    import httpx

    r = httpx.post(module_stack.shim_url + path, json={**body, "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_bench_compare_starts_and_reports(tiny_model, tmp_path):
    """The README's bench no other test runs, on the tiny model and a few tokens (`bench
    overhead` runs in tests/test_shim.py)."""
    out = tmp_path / "compare.json"
    _ok(_kvbank("bench", "compare", "--model", str(tiny_model), "--turns", "2",
                "--turn-tokens", "20", "--system-tokens", "40", "--max-tokens", "4",
                "--rounds", "1", "--sides", "kvbank,mlx_lm", "--no-progress",
                "--json", str(out)))
    doc = json.loads(out.read_text())
    assert doc["wall_speedup"] > 0, doc
    # both servers' whole process trees under one cgroup limit, with the same settings;
    # each side's argv, peak and fate recorded, with the run's provenance
    assert doc["fairness"]["ok"], doc["fairness"]
    sides = doc["sides"]
    assert sides["kvbank"]["limit_bytes"] == sides["mlx_lm"]["limit_bytes"] == [
        doc["memory_limit_bytes"]]
    assert sides["kvbank"]["settings"] == sides["mlx_lm"]["settings"]
    for side in sides.values():
        assert 0 < side["peak_bytes"] <= doc["memory_limit_bytes"] and not side["killed"]
    assert "--memory-budget" in sides["kvbank"]["argv"]
    argv = sides["mlx_lm"]["argv"]
    assert argv[argv.index("--prefill-step-size") + 1] == str(
        sides["mlx_lm"]["settings"]["prefill_chunk_tokens"])
    assert doc["provenance"]["commit"]["sha"] and doc["versions"]["mlx_lm"]
