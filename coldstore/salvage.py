"""A store whose data file is damaged at start: set aside, salvaged, reported.

The coldstore checks its data file before LMDB maps it (coldstore/pages.py). A damaged file
is never served from and never deleted: it moves to `<store>/damaged-<UTC time>/data.mdb`,
and a fresh store takes what it still holds that can be trusted, read with pread, so no
SIGBUS can reach the coldstore: each record whose record and tokens are readable, cut short
at its first block that is missing or fails its checksum (a block written before checksums
cannot be verified, and goes too), and the stored responses that are readable: through the
trees of the file's last commit, then of the commit before it (`_copy`). What is lost is
computed again when its conversation comes back, and counted there.

One record per transaction. While the salvage runs, a marker (SALVAGING) in the store's
folder names the file set aside: a coldstore killed meanwhile goes on from there at its next
start, past the records it had salvaged already.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvbank.coldstore.pages import Damage, DataFile, LayoutError, Walk, check
from kvbank.coldstore.store import ColdStore, SessionMeta
from kvbank import events, metrics
from kvbank.blocks import BlockId, CorruptBlock, verify_block

logger = logging.getLogger(__name__)

SALVAGING = "SALVAGING"


@dataclass
class Salvage:
    """What was found, where the damaged file went, and what the fresh store took."""

    found: str
    set_aside: str
    records: int = 0  # in the damaged store, by its own count; so are blocks and responses
    records_whole: int = 0
    records_cut: int = 0  # kept, short of the blocks that were lost
    tokens_recomputed: int = 0  # the cut records' tokens no longer on SSD
    blocks: int = 0
    blocks_kept: int = 0
    responses: int = 0
    responses_kept: int = 0
    error: str = ""  # why the salvage stopped early, if it did

    def lost(self) -> dict:
        return {"records_lost": max(0, self.records - self.records_whole - self.records_cut),
                "blocks_dropped": max(0, self.blocks - self.blocks_kept),
                "responses_lost": max(0, self.responses - self.responses_kept)}


def open_store(store_dir: Path, **store_kw) -> tuple[ColdStore, Salvage | None]:
    """The coldstore's store, its data file checked before LMDB maps it; a damaged one set
    aside and salvaged first (the Salvage says how it went; None: nothing was wrong)."""
    data, marker = store_dir / "data.mdb", store_dir / SALVAGING
    if marker.exists():
        state = json.loads(marker.read_text())
        if Path(state["set_aside"]).exists():
            logger.warning("a salvage of %s did not finish: going on", state["set_aside"])
            return _salvage(store_dir, state, store_kw)
        marker.unlink()  # stopped before the file moved: it is checked again
    if data.exists():
        try:
            damage = check(data)
        except LayoutError as e:
            logger.warning("could not check %s before opening it (%s): opened as it is", data, e)
            damage = None
        if damage is not None:
            return _salvage(store_dir, set_aside(store_dir, damage), store_kw)
    return ColdStore(store_dir, **store_kw), None


def describe(damage: Damage) -> str:
    if not damage.needed_bytes:
        return f"the data file holds {damage.file_bytes} bytes and no LMDB meta page"
    where = ", ".join(damage.trees)
    if damage.file_bytes >= damage.needed_bytes:
        return (f"{damage.missing_pages} of the pages the data file's last commit uses are not "
                f"the pages it wrote: zeroed or overwritten (in {where})")
    return (f"the data file holds {damage.file_bytes} bytes but its last commit needs "
            f"{damage.needed_bytes}: {damage.missing_pages} of the pages it uses are past "
            f"its end or not the pages it wrote (in {where})")


def set_aside(store_dir: Path, damage: Damage) -> dict:
    """The damaged file moves to a folder of its own; the marker first, so no stop between
    the two can lose track of it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = store_dir / f"damaged-{stamp}"
    n = 1
    while aside.exists():
        n += 1
        aside = store_dir / f"damaged-{stamp}-{n}"
    aside.mkdir()
    state = {"found": describe(damage), "set_aside": str(aside / "data.mdb")}
    tmp = store_dir / f"{SALVAGING}.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, store_dir / SALVAGING)
    os.rename(store_dir / "data.mdb", aside / "data.mdb")
    fd = os.open(store_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return state


def _salvage(store_dir: Path, state: dict, store_kw: dict) -> tuple[ColdStore, Salvage]:
    store = ColdStore(store_dir, **store_kw)  # new, or what an unfinished salvage put in
    report = Salvage(state["found"], state["set_aside"])
    try:
        src = DataFile(Path(state["set_aside"]))
    except LayoutError as e:
        report.error = f"nothing in it can be read: {e}"
    else:
        try:
            _copy(src, store, report)
        except Exception as e:  # a full disk, a page this reader cannot read: what is in stays
            logger.exception("the salvage stopped")
            report.error = f"{type(e).__name__}: {e}"
        finally:
            src.close()
    report.blocks_kept = store.stats()["blocks"]
    Path(state["set_aside"]).with_name("salvage.json").write_text(
        json.dumps({**asdict(report), **report.lost()}, indent=2))
    (store_dir / SALVAGING).unlink()
    _report(report)
    return store, report


def _copy(src: DataFile, store: ColdStore, report: Salvage) -> None:
    """What the file holds that verifies, into `store`: through the trees of its newest
    commit, then of the one before it (`DataFile.metas`), which adds what the newest one's
    damaged pages hid; a conversation's newest record wins, a block is taken from either."""
    commits = []
    for i in range(len(src.metas)):
        src.use_meta(i)
        if trees := src.named():
            commits.append(trees)
    if not commits:
        report.error = "LMDB's list of the store's databases is lost: the store starts empty"
        return
    bad: set[bytes] = set()

    def block(bid: BlockId) -> bytes | None:
        for trees in commits if bid not in bad else ():
            payload = src.get(trees[b"blocks"], bid) if b"blocks" in trees else None
            try:
                if payload is not None and verify_block(payload)[0].checksum is not None:
                    return payload
            except CorruptBlock:
                pass
        bad.add(bid)  # missing, failed its checksum, or written before checksums
        return None

    newest: dict[bytes, set | None] = {}  # its keys (None: it hid some: pages lost)

    def entries(trees: dict, name: bytes, again: int):
        """A tree's (key, value)s; from the commit before the newest, only keys the newest
        names (its value lost) or, where the newest hid keys, any: a key the newest dropped
        whole was deleted there, and must not come back."""
        tree, walk = trees.get(name), Walk()
        for key, raw in src.items(tree, walk) if tree else ():
            if not again or newest.get(name) is None or key in newest[name]:
                yield key, raw
            if not again:
                newest.setdefault(name, set()).add(key)
        if not again:
            hidden = tree is None or walk.entries < tree.entries
            newest[name] = None if hidden else newest.get(name, set())

    for again, trees in enumerate(commits):
        sessions, tokens, blocks, responses = (trees.get(n) for n in (
            b"sessions", b"tokens", b"blocks", b"responses"))
        for key, raw in entries(trees, b"sessions", again) if tokens else ():
            try:
                meta = SessionMeta.from_json(raw)
            except (TypeError, ValueError):
                continue
            got = store.get_session(meta.tenant, meta.session_id)  # salvaged before a stop
            if got and again:
                continue
            toks = src.get(tokens, key)
            if toks is None or len(toks) != 4 * meta.token_count or not meta.tokens_ok(toks):
                continue  # a record whose tokens are lost: its conversation starts over
            kept = got[0] if got else store.put_salvaged(meta, np.frombuffer(toks, np.uint32),
                                                         block)
            if kept.durable_tokens < meta.durable_tokens:
                report.records_cut += 1
                report.tokens_recomputed += meta.durable_tokens - kept.durable_tokens
            else:
                report.records_whole += 1
        if not again:  # what the store held: its newest commit's own counts
            report.records = sessions.entries if sessions else 0
            report.blocks = blocks.entries if blocks else 0
            report.responses = responses.entries if responses else 0
        for key, raw in entries(trees, b"responses", again):
            tenant, _, rid = key.decode(errors="replace").partition("\0")
            if raw is None or len(raw) < 8:
                continue
            if store.get_response(tenant, rid) is None:
                store.put_response(tenant, rid, struct.unpack("<Q", raw[:8])[0] / 1000,
                                   raw[8:])
            elif again:
                continue
            report.responses_kept += 1


def _report(r: Salvage) -> None:
    lost = r.lost()
    logger.error(
        "the store was damaged: %s. The damaged file is kept at %s (with salvage.json, what "
        "was kept): delete it once you no longer need it, and check the disk (dmesg, SMART). "
        "A fresh store took what still verifies: %d of %d records (%d of them cut short, %d "
        "tokens to compute again), %d blocks (%d dropped), %d responses (%d lost)%s. Lost KV "
        "is computed again when its conversation comes back.",
        r.found, r.set_aside, r.records_whole + r.records_cut, r.records, r.records_cut,
        r.tokens_recomputed, r.blocks_kept, lost["blocks_dropped"], r.responses_kept,
        lost["responses_lost"], f"; the salvage stopped early: {r.error}" if r.error else "")
    events.emit("store_damaged", **asdict(r), **lost)
    metrics.CS_STORE_DAMAGED.inc()
