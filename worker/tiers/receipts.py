"""What the Status command shows of the policies' receipts, and to whom: the operator sees
every receipt; a tenant sees its own admissions without the bank's figures, and the rows of
releases and evictions of its own conversations. From the rest, one tenant could read the
size of another's prompts and answers."""

from __future__ import annotations

import dataclasses

# An admission receipt's figures of the whole bank: what the request found free, and what was
# taken from other conversations to make room. A tenant sees its decision and need only.
SERVER_WIDE = ("free_before", "free_after", "lru_evicted", "shed_non_terminal",
               "shed_terminal", "released_sessions", "shed_target_bytes", "written_out",
               "write_out_s", "holders")


def visible(admissions, bank_receipts, eviction_log, tenant: str | None,
            n: int = 20) -> tuple[list[dict], list[dict]]:
    """The last receipts of every policy, oldest first, and the eviction log, as `tenant`
    (None: the operator) may see them."""
    if tenant is None:
        out = [dataclasses.asdict(r) for r in list(admissions)[-n:]]
        out += [dataclasses.asdict(r) for r in list(bank_receipts)[-2 * n:]]
        evictions = [dataclasses.asdict(e) for e in eviction_log][-5 * n:]
        return sorted(out, key=lambda d: d["at"])[-3 * n:], evictions
    out = [{k: v for k, v in dataclasses.asdict(r).items() if k not in SERVER_WIDE}
           for r in list(admissions)[-4 * n:] if r.tenant == tenant][-n:]
    for r in list(bank_receipts)[-4 * n:]:
        d = dataclasses.asdict(r)
        if "rows" not in d:
            continue  # the trims' and the guard's receipts count the whole bank
        d["rows"] = [row for row in d["rows"] if row["tenant"] == tenant]
        if not d["rows"]:
            continue
        out.append({k: d[k] for k in ("kind", "reason", "at", "rows")})
    out = sorted(out, key=lambda d: d["at"])[-3 * n:]
    evictions = [dataclasses.asdict(e) for e in eviction_log
                 if e.tenant == tenant][-5 * n:]
    return out, evictions
