"""How every `kvbank bench` prints: a short table for people, one JSON line with --json."""

from __future__ import annotations

import json


def print_result(name: str, result: dict, as_json: bool) -> None:
    """With its provenance (apps/bench/provenance.py), as every bench's result."""
    from kvbank.apps.bench.provenance import stamp

    stamp(result)
    if as_json:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvbank bench {name}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key == "provenance":
            continue
        table.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else str(value))
    Console().print(table)
    Console().print(footer(result))


def footer(result: dict) -> str:
    """The line under a bench's table: the commit, the date, the load, and whether the run
    can be a record (its provenance stamped)."""
    p = result["provenance"]
    return (f"commit {(p['commit']['sha'] or '-')[:10]}"
            f"{' (modified)' if p['commit']['dirty'] else ''}, {p['date']}, load "
            f"{p['load_at_start'][0]} -> {p['load_at_end'][0]}"
            f"{'' if p['quiet'] else ' (busy: not a figure for the record)'}")


def write_json(result: dict, dest: str | None) -> None:
    """`--json [FILE]`: "-" prints one line to stdout, a path gets the indented document;
    with its provenance."""
    from kvbank.apps.bench.provenance import stamp

    stamp(result)
    if dest == "-":
        print(json.dumps(result))
    elif dest:
        from pathlib import Path

        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text(json.dumps(result, indent=2) + "\n")


def provenance() -> dict:
    """What a result was measured with: the command as typed, the commit (and whether the
    tree differed from it), the versions of what matters, the machine, the date."""
    import datetime
    import os
    import platform
    import subprocess
    import sys
    from importlib import metadata
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    versions = {}
    for dist in ("mlx", "mlx-lm", "llguidance", "grpcio", "transformers", "tokenizers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"argv": ["kvbank", *sys.argv[1:]], "commit": git("rev-parse", "HEAD"),
            "tree_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "versions": {"python": platform.python_version(), **versions},
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}
