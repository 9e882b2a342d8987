"""What an operator sees: metrics, the event log, `kvbank status` and `kvbank admin`."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import start_stack


def _metrics(stack, name: str) -> dict[tuple, float]:
    text = httpx.get(stack.metrics_url(name), timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def _events(stack) -> list[dict]:
    return [json.loads(line) for line in stack.layout.events_path.read_text().splitlines()]


def _kvbank(stack, *args) -> str:
    out = subprocess.run([sys.executable, "-m", "kvbank.apps.cli", args[0], "--address", stack.address,
                          *args[1:]],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_metrics_events_status_and_admin_follow_a_conversation(tiny_model, tmp_path, cache_dir):
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False,
                    extra=["--quiet-grace-s", "3600", "--max-dirty-s", "3600",
                           "--active-pin-s", "0"])
    try:
        with s.client() as c:
            msgs = [{"role": "user", "content": "Count to three."}]
            c.generate(session_id="obs", messages=msgs, append=True, max_tokens=6)
            c.generate(session_id="obs", messages=[{"role": "user", "content": "Again."}],
                       append=True, max_tokens=6)

        w, r = _metrics(s, "worker"), _metrics(s, "router")
        assert _get(r, "kvbank_requests_total", status="OK") == 2
        assert _get(r, "kvbank_time_to_first_token_seconds_count") == 2
        assert _get(w, "kvbank_prefix_queries_total") == 2
        assert _get(w, "kvbank_prefix_hits_total", tier="none") == 1
        assert _get(w, "kvbank_prefix_hits_total", tier="ram") == 1
        assert _get(w, "kvbank_cached_tokens_total", tier="ram") > 0
        assert _get(w, "kvbank_bank_bytes") > 0
        assert _get(w, "kvbank_bank_peak_bytes") >= _get(w, "kvbank_bank_bytes")

        # Before the flush the turn is only in RAM; `kvbank status` says so.
        st = json.loads(_kvbank(s, "status", "--json"))
        (obs,) = [x for x in st["sessions"] if x["sessionId"] == "obs"]
        assert obs["state"] == "resident-dirty"
        table = _kvbank(s, "status")
        assert "obs" in table and "SSD tier" in table  # the tables name it, and the tiers
        assert json.loads(st["worker"]["coldstoreJson"])["sessions"] == 1

        flush = json.loads(_kvbank(s, "admin", "flush"))
        assert flush["writtenEntries"] == 1
        st = json.loads(_kvbank(s, "status", "--json"))
        (obs,) = [x for x in st["sessions"] if x["sessionId"] == "obs"]
        assert obs["state"] == "resident-clean"
        assert obs["durableTokens"] == obs["tokenCount"]

        # A write-out and an eviction: release the session.
        rel = json.loads(_kvbank(s, "admin", "release", "obs"))
        assert rel["releasedEntries"] == 1
        st = json.loads(_kvbank(s, "status", "--json"))
        (obs,) = [x for x in st["sessions"] if x["sessionId"] == "obs"]
        assert obs["state"] == "cold"
        w, cs = _metrics(s, "worker"), _metrics(s, "coldstore")
        assert _get(w, "kvbank_evictions_total", reason="admin_release") == 1
        assert _get(w, "kvbank_unwritten_dropped_total") == 0
        assert _get(cs, "kvbank_coldstore_written_bytes_total") > 0
        assert _get(w, "kvbank_sessions", state="cold") == 1

        (ev,) = json.loads(_kvbank(s, "status", "--evictions", "--json"))
        assert ev["session_id"] == "obs" and ev["reason"] == "admin_release" and ev["durable"]
        assert "admin_release" in _kvbank(s, "status", "--evictions")

        kinds = [e["kind"] for e in _events(s)]
        assert kinds.count("kv_resident") == 2 and kinds.count("kv_restored") == 1
        assert kinds.count("kv_durable") == 1
        (ev,) = [e for e in _events(s) if e["kind"] == "kv_evicted"]
        assert ev["reason"] == "admin_release" and ev["now"] == "cold"
        assert ev["session_id"] == "obs"
        assert "admission" in kinds and "release_write_out" in kinds

        pressure = json.loads(_kvbank(s, "admin", "pressure", "critical"))
        assert pressure == {"level": "critical", "source": "injected"}
    finally:
        s.stop()
