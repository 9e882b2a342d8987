"""What a run comes to: the summary, the JSON document, the rich tables and the TTFT plot.

Summary token sums are over the rows that report the count (`rows_with_cached` says how many
rows knew their cached tokens; the recomputed sums only cover those). TTFT percentiles are over
the turns that succeeded, linear interpolation between ranks.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvbank.apps.loadgen.run import Row, RunResult

# Plot colours by cache source: kvbank's own (ram/ssd/none), or derived (see run.Row).
SOURCE_COLOURS = {"ram": "tab:green", "ssd": "tab:blue", "none": "tab:red",
                  "hit": "tab:olive", "partial": "tab:orange", "miss": "tab:red",
                  None: "tab:gray"}


def _sum(rows: list[Row], field: str) -> int | None:
    values = [getattr(r, field) for r in rows if getattr(r, field) is not None]
    return sum(values) if values else None


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def summarize(result: RunResult) -> dict:
    rows = result.rows
    ok = [r for r in rows if r.status == "ok"]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    refusals: dict[str, dict] = {}
    errors: dict[str, dict] = {}
    for r in rows:
        if r.status == "ok":
            continue
        book = refusals if r.status == "refused" else errors
        entry = book.setdefault(r.reason or r.status, {"count": 0, "message": r.message})
        entry["count"] += 1
    prompt = _sum(ok, "prompt_tokens")
    return {
        "wall_s": round(result.wall_s, 3),
        "stopped_by": result.stopped_by,
        "turns": len(rows),
        "turns_ok": len(ok),
        "prompt_tokens": prompt,
        "completion_tokens": _sum(ok, "completion_tokens"),
        "cached_tokens": _sum(ok, "cached_tokens"),
        "new_tokens": _sum(ok, "new_tokens"),
        "recomputed_tokens": _sum(ok, "recomputed_tokens"),
        "server_recomputed_tokens": _sum(ok, "server_recomputed_tokens"),
        "rows_with_cached": sum(r.cached_tokens is not None for r in ok),
        "cache_sources": dict(Counter(r.cache_source or "unknown" for r in ok)),
        "ttft_p50_by_source_s": {
            src: _r(percentile([r.ttft_s for r in ok if (r.cache_source or "unknown") == src
                                and r.ttft_s is not None], 50))
            for src in sorted({r.cache_source or "unknown" for r in ok})},
        "hints": dict(Counter(r.hint for r in rows if r.hint)),
        "ttft_p50_by_hint_s": {
            hint: _r(percentile([r.ttft_s for r in ok if r.hint == hint
                                 and r.ttft_s is not None], 50))
            for hint in sorted({r.hint for r in ok if r.hint})},
        "ttft_p50_s": _r(percentile(ttfts, 50)),
        "ttft_p95_s": _r(percentile(ttfts, 95)),
        "ttft_max_s": _r(max(ttfts) if ttfts else None),
        "refusals": refusals,
        "refused": sum(e["count"] for e in refusals.values()),
        "errors": errors,
        "errored": sum(e["count"] for e in errors.values()),
        "token_counts": result.token_counts,
    }


def document(result: RunResult, summary: dict | None = None) -> dict:
    """The `--json` document: what ran, the summary, one row per turn."""
    return {
        "target": result.target,
        "run_id": result.run_id,
        "params": dataclasses.asdict(result.params),
        "summary": summary or summarize(result),
        "rows": [dataclasses.asdict(r) for r in result.rows],
    }


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}"
    return str(x)


def print_tables(result: RunResult, summary: dict, console: Console | None = None) -> None:
    """Per agent: turns, tokens, TTFT; then the totals and any refusals or errors."""
    console = console or Console()
    if not console.is_terminal:  # a log file or a pipe: do not squeeze to 80 columns
        console = Console(width=132)
    t = Table(title=f"kvbank loadgen {result.params.scenario} -> {result.target}")
    for col in ("agent", "ok", "prompt", "cached", "new", "recomp", "sources", "ttft50",
                "ttftmax"):
        t.add_column(col, justify="left" if col in ("agent", "sources") else "right",
                     no_wrap=col == "agent")
    for agent in dict.fromkeys(r.agent for r in result.rows):
        rows = [r for r in result.rows if r.agent == agent]
        ok = [r for r in rows if r.status == "ok"]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        sources = Counter(r.cache_source or "?" for r in ok)
        t.add_row(agent, f"{len(ok)}/{len(rows)}", _fmt(_sum(ok, "prompt_tokens")),
                  _fmt(_sum(ok, "cached_tokens")), _fmt(_sum(ok, "new_tokens")),
                  _fmt(_sum(ok, "recomputed_tokens")),
                  " ".join(f"{k}:{v}" for k, v in sorted(sources.items())),
                  _fmt(percentile(ttfts, 50)), _fmt(max(ttfts) if ttfts else None))
    s = summary
    t.add_section()
    t.add_row("all", f"{s['turns_ok']}/{s['turns']}", _fmt(s["prompt_tokens"]),
              _fmt(s["cached_tokens"]), _fmt(s["new_tokens"]), _fmt(s["recomputed_tokens"]),
              " ".join(f"{k}:{v}" for k, v in sorted(s["cache_sources"].items())),
              _fmt(s["ttft_p50_s"]), _fmt(s["ttft_max_s"]))
    console.print(t)
    console.print("recomp = prompt - cached - new tokens; ttft in seconds, client-side")
    console.print(f"wall {s['wall_s']:.1f} s (stopped by {s['stopped_by']}), TTFT p95 "
                  f"{_fmt(s['ttft_p95_s'])} s, server-counted recomputed tokens "
                  f"{_fmt(s['server_recomputed_tokens'])}, token counts from "
                  f"{s['token_counts']}")
    for title, book in (("refused", s["refusals"]), ("errors", s["errors"])):
        for reason, e in book.items():
            console.print(f"{title}: {reason} x{e['count']}: {e['message']}")


def plot_ttft(path: Path, series: dict[str, list[Row]], title: str) -> None:
    """TTFT per turn (in the order turns started), one panel per series, coloured by cache
    source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(series))
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.8 * n + 0.6), sharex=True, squeeze=False)
    ymax = max((r.ttft_s for rows in series.values() for r in rows if r.ttft_s is not None),
               default=1.0)
    for ax, (name, rows) in zip(axes[:, 0], series.items()):
        seen = set()
        for i, r in enumerate(rows, 1):
            if r.ttft_s is None:
                ax.scatter([i], [0], marker="x", color="black",
                           label="failed" if "failed" not in seen else None)
                seen.add("failed")
                continue
            src = r.cache_source
            label = (src or "unknown") if (src or "unknown") not in seen else None
            seen.add(src or "unknown")
            ax.bar(i, r.ttft_s, color=SOURCE_COLOURS.get(src, "tab:gray"), label=label)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("TTFT s")
        ax.set_ylim(0, ymax * 1.1)
        ax.legend(fontsize=8, loc="upper left")
    axes[-1, 0].set_xlabel("turn (in start order, all agents)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
