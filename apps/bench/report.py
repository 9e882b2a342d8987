"""How every `kvbank bench` prints: a short table for people, one JSON line with --json."""

from __future__ import annotations

import json


def print_result(name: str, result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvbank bench {name}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        table.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else str(value))
    Console().print(table)


def write_json(result: dict, dest: str | None) -> None:
    """`--json [FILE]`: "-" prints one line to stdout, a path gets the indented document."""
    if dest == "-":
        print(json.dumps(result))
    elif dest:
        from pathlib import Path

        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text(json.dumps(result, indent=2) + "\n")
