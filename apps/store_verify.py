"""`kvbank store verify`: every stored block's and token record's checksum checked offline,
and which conversations name a block that failed.

Reads the store read-only (a running coldstore may keep writing: LMDB serves the reader one
snapshot). A block written before checksums (format 1) is counted apart: it can only be
decoded, not verified. A data file cut short is found first, by reading its pages without
LMDB's map (coldstore/pages.py), and reported, never read through the map (SIGBUS)."""

from __future__ import annotations

import json
import sys

from kvbank.coldstore.pages import LayoutError, check
from kvbank.coldstore.salvage import describe
from kvbank.blocks import CorruptBlock, verify_block
from kvbank.config import Layout
from kvbank.contracts.store_layout import StoreReader


def _damage(store_dir) -> object:
    """`pages.check` of the data file, a read transaction held while it walks: a running
    coldstore reuses a freed page only once no reader's snapshot may need it, so the pages
    walked stay the ones the commit wrote. LMDB maps the file only when it is as long as its
    last commit needs (a read of a mapped page past the end would be SIGBUS)."""
    import lmdb

    from kvbank.coldstore.pages import DataFile, NoMetaPage

    path = store_dir / "data.mdb"
    try:
        f = DataFile(path)
    except NoMetaPage:
        return check(path)
    short = f.size < f.needed_bytes
    f.close()
    if short:
        return check(path)
    env = lmdb.open(str(store_dir), readonly=True, max_dbs=16)
    try:
        with env.begin():
            return check(path)
    finally:
        env.close()


def verify(layout: Layout) -> dict:
    try:
        damage = _damage(layout.store_dir)
    except LayoutError:  # not laid out as this reader knows: LMDB's own reads decide
        damage = None
    if damage is not None:
        return {"store": str(layout.store_dir), "damaged": describe(damage),
                "blocks_corrupt": 0, "corrupt": {}, "sessions_affected": []}
    store = StoreReader(layout.store_dir, readonly=True)
    try:
        ok, unchecked, bad = 0, 0, {}
        for bid, payload in store.iter_blocks():
            try:
                header, _ = verify_block(payload)
            except CorruptBlock as e:
                bad[bid.hex()] = str(e)
                continue
            if header.checksum is None:
                unchecked += 1
            else:
                ok += 1
        metas = store.list_sessions()
        sessions = sorted(_name(m) for m in metas
                          if any(h in bad for h in (*m.blocks, m.tail or "")))
        records_bad = sorted(_name(m) for m in metas
                             if store.get_session(m.tenant, m.session_id) is None)
        return {"store": str(layout.store_dir), "format_version": store.format_version,
                "blocks_ok": ok, "blocks_without_checksum": unchecked,
                "blocks_corrupt": len(bad), "corrupt": bad, "sessions_affected": sessions,
                "records": len(metas), "records_corrupt": records_bad}
    finally:
        store.close()


def _name(m) -> str:
    return f"{m.tenant}/{m.session_id}" if m.tenant else m.session_id


def run_verify(data_dir, as_json: bool) -> int:
    layout = Layout(data_dir)
    if not (layout.store_dir / "data.mdb").exists():
        print(f"kvbank store verify: no store in {layout.store_dir}", file=sys.stderr)
        return 2
    report = verify(layout)
    if as_json:
        print(json.dumps(report, indent=2))
    elif "damaged" in report:
        print(f"{report['store']}: damaged: {report['damaged']}. The coldstore sets the file "
              f"aside and salvages what verifies when it starts (kvbank up)")
    else:
        print(f"{report['store']} (format {report['format_version']}): "
              f"{report['blocks_ok']} blocks ok, {report['blocks_corrupt']} corrupt, "
              f"{report['blocks_without_checksum']} written before checksums; "
              f"{report['records']} conversation records, "
              f"{len(report['records_corrupt'])} with corrupt tokens")
        for bid, why in report["corrupt"].items():
            print(f"  corrupt {bid}: {why}")
        if report["sessions_affected"]:
            print("  conversations that restore through them (recomputed from there): "
                  + ", ".join(report["sessions_affected"]))
        if report["records_corrupt"]:
            print("  records whose tokens failed (each is found as a new conversation; its "
                  "blocks still restore by content): " + ", ".join(report["records_corrupt"]))
    return 1 if report["blocks_corrupt"] or report.get("records_corrupt") or "damaged" in report else 0
