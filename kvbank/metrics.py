"""Prometheus metrics: every name in one place, served by each process on its own port.

Names follow what vLLM and llama.cpp users know: a `kvbank_` prefix, units in the name
(`_seconds`, `_bytes`, `_tokens`), `_total` for counters. Each process starts its endpoint
with `serve(name, layout, port)` and writes the URL to `run/<name>.metrics`, so tools and
tests find it even when the port was chosen by the OS.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# -- router --------------------------------------------------------------------------------------
REQUESTS = Counter("kvbank_requests_total", "Generate requests by final gRPC status", ["status"])
QUEUE_DEPTH = Gauge("kvbank_queue_depth", "Requests waiting for an admission slot")
QUEUE_WAIT = Histogram("kvbank_queue_wait_seconds", "Time waiting for an admission slot",
                       buckets=LATENCY_BUCKETS)
TTFT = Histogram("kvbank_time_to_first_token_seconds", "Request received -> first token out",
                 buckets=LATENCY_BUCKETS)
INTER_TOKEN = Histogram("kvbank_inter_token_latency_seconds", "Time between streamed tokens",
                        buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
REFUSALS = Counter("kvbank_refusals_total", "Requests refused, by reason", ["reason"])
QUEUED_NOT_REFUSED = Counter(
    "kvbank_queued_not_refused_total",
    "Requests a full queue took anyway because this machine holds their KV")

# -- worker --------------------------------------------------------------------------------------
PREFIX_QUERIES = Counter("kvbank_prefix_queries_total", "Requests that looked for cached KV")
PREFIX_HITS = Counter("kvbank_prefix_hits_total", "Where a request's cached KV came from",
                      ["tier"])
CACHED_TOKENS = Counter("kvbank_cached_tokens_total", "Prompt tokens restored, not computed",
                        ["tier"])
PROMPT_TOKENS = Counter("kvbank_prompt_tokens_total", "Prompt tokens of admitted requests")
PREFIX_WAITS = Counter("kvbank_prefix_waits_total",
                       "Requests that waited for a running request's prompt KV, not computing it")
PREFIX_SHARED_TOKENS = Counter(
    "kvbank_prefix_shared_tokens_total",
    "Prompt tokens put in the bank for other requests: at prefill end for waiting ones, or "
    "from an answering request for a newcomer")
PREFETCHES = Counter("kvbank_prefetches_total", "Prefetch hints, by what they did", ["status"])
PREFETCHED_TOKENS = Counter("kvbank_prefetched_tokens_total",
                            "Tokens of KV brought from SSD into RAM ahead of their return")
PRERENDERS = Counter("kvbank_prerenders_total",
                     "Pre-renders of a next query's history asked of the worker, by what they "
                     "did (prerendering, in_ram, no_room, off, unknown)", ["status"])
PRERENDERED_TOKENS = Counter("kvbank_prerendered_tokens_total",
                             "Tokens computed in idle time for a next query's history")
WORKER_STAGE = Histogram("kvbank_worker_stage_seconds",
                         "A request's time to first token in the worker, by stage: waiting "
                         "(queue and admission), restore (KV from RAM or SSD), first_token "
                         "(prompt forwards and the first token)", ["stage"],
                         buckets=LATENCY_BUCKETS)
RESTORE_STALL = Histogram("kvbank_worker_restore_stall_seconds",
                          "The engine thread's time on one restore from SSD, which no other "
                          "request decodes through: the whole restore inline, or its start "
                          "and its hand-over when read on a thread (worker/tiers/restore_threads.py)",
                          ["where"], buckets=LATENCY_BUCKETS)
GENERATION_TOKENS = Counter("kvbank_generation_tokens_total", "Tokens generated")
MTP_TOKENS = Counter("kvbank_mtp_tokens_total",
                     "Speculative decoding with the model's MTP head: tokens the head drafted "
                     "(`drafted`) and those the model kept (`accepted`)", ["outcome"])
MTP_HISTORY_MISSING = Counter(
    "kvbank_mtp_history_missing_tokens_total",
    "Tokens restored from SSD without the MTP head's history (their blocks were written with "
    "--mtp off): the head drafts over zeros there until the conversation is computed again; "
    "answers are unchanged")
CORRUPT_BLOCKS = Counter("kvbank_corrupt_blocks_total",
                         "Stored blocks that failed their checksum on a restore (recomputed)")
PREFIX_LOST = Counter("kvbank_prefix_lost_tokens_total",
                      "Prompt tokens held as KV but recomputed: no checkpoint stood there",
                      ["reason"])
BATCH_JOINS = Counter("kvbank_batch_joins_total",
                      "Answers on their own caches that joined mlx-lm's batch, or stayed beside "
                      "it for want of memory for the join's copy", ["outcome"])
RECOMPUTED_TOKENS = Counter("kvbank_recomputed_tokens_total",
                            "Prompt tokens of a session's own history computed again")
BANK_BYTES = Gauge("kvbank_bank_bytes", "KV bytes held in the worker's RAM bank")
BANK_PEAK_BYTES = Gauge("kvbank_bank_peak_bytes",
                        "The most KV bytes the worker's RAM bank has held since it started, "
                        "read after each change settles (a commit and its trims)")
BANK_ENTRIES = Gauge("kvbank_bank_entries", "Entries in the RAM bank")
SESSIONS = Gauge("kvbank_sessions", "Sessions by where their KV is", ["state"])
EVICTIONS = Counter("kvbank_evictions_total", "Bank entries that left RAM, by reason",
                    ["reason"])
UNWRITTEN_DROPPED = Counter("kvbank_unwritten_dropped_total",
                            "Bank entries that left RAM before their KV reached SSD")
WRITE_OUTS = Counter("kvbank_write_outs_total", "Release write-outs by outcome", ["outcome"])
ADMISSIONS = Counter("kvbank_admissions_total", "Admission decisions", ["decision"])
MEMORY_HELD = Gauge("kvbank_memory_held_bytes", "Bytes the worker's ledger holds")
MEMORY_BUDGET = Gauge("kvbank_memory_budget_bytes", "The worker's memory budget")
WORKER_RSS = Gauge("kvbank_worker_rss_bytes", "The worker's resident set size")
PRESSURE_LEVEL = Gauge("kvbank_pressure_level", "0 normal, 1 warning, 2 critical")
PRESSURE_TRIMS = Counter("kvbank_pressure_trims_total", "Guard trims by level", ["level"])

# -- coldstore -----------------------------------------------------------------------------------
CS_WRITTEN = Counter("kvbank_coldstore_written_bytes_total", "KV bytes committed to LMDB")
CS_READ = Counter("kvbank_coldstore_read_bytes_total", "KV bytes read through the coldstore")
CS_WRITE_BUDGET_LEFT = Gauge("kvbank_coldstore_write_budget_left_bytes",
                             "Bytes the rolling-hour write budget still allows")
CS_DISK_FREE = Gauge("kvbank_coldstore_disk_free_bytes", "Free bytes on the store's disk")
CS_STORE_BYTES = Gauge("kvbank_coldstore_store_bytes", "KV bytes stored")
CS_JOBS = Gauge("kvbank_coldstore_jobs_queued", "Write jobs waiting")
CS_REFUSALS = Counter("kvbank_coldstore_refusals_total", "Writes refused, by reason",
                      ["reason"])
CS_STORE_DAMAGED = Counter("kvbank_coldstore_store_damaged_total",
                           "Data files found damaged at start: set aside, what verifies salvaged")
CS_RETIRED = Counter("kvbank_coldstore_retired_total",
                     "Conversations whose KV (anonymous: whole record) was retired, by reason",
                     ["reason"])


def serve(name: str, run_dir, port: int | None) -> str | None:
    """Start this process's /metrics on loopback (port 0: any free one); None: disabled."""
    if port is None or port < 0:
        return None
    httpd, _ = start_http_server(port, addr="127.0.0.1")
    url = f"http://127.0.0.1:{httpd.server_port}/metrics"
    (run_dir / f"{name}.metrics").write_text(url)
    logger.info("%s metrics on %s", name, url)
    return url
