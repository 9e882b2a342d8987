"""API keys: each key is a tenant.

A tenant's sessions and cached KV are invisible to every other tenant (the worker keys its
bank and block chains by tenant). With no keys configured there is one open tenant, "".
Keys arrive as gRPC metadata `authorization: Bearer KEY` (the shim forwards its client's key).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from kvbank.contracts.failures import Unauthenticated

AUTH_KEY = "authorization"


def load_keys(keys: list[str] | None, keys_file: Path | None) -> dict[str, str]:
    """KEY -> tenant name. A file line is `KEY` or `TENANT KEY`; `#` starts a comment."""
    out: dict[str, str] = {}
    for key in keys or ():
        out[key] = _anonymous_name(key)
    if keys_file is not None:
        for n, line in enumerate(Path(keys_file).read_text().splitlines(), 1):
            parts = line.split("#", 1)[0].split()
            if not parts:
                continue
            if len(parts) > 2:
                raise SystemExit(f"{keys_file}:{n}: expected `KEY` or `TENANT KEY`, got {len(parts)} words")
            tenant, key = (parts if len(parts) == 2 else (_anonymous_name(parts[0]), parts[0]))
            out[key] = tenant
    return out


def _anonymous_name(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def tenant_for(keys: dict[str, str], metadata) -> str:
    """The caller's tenant, from its `authorization` metadata; raises Unauthenticated."""
    if not keys:
        return ""
    value = dict(metadata or ()).get(AUTH_KEY, "")
    scheme, _, key = value.partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise Unauthenticated("this server needs an API key: send `authorization: Bearer KEY`")
    for known, tenant in keys.items():  # constant-time per key: no timing oracle on keys
        if hmac.compare_digest(known.encode(), key.strip().encode()):
            return tenant
    raise Unauthenticated("the API key is not known to this server")
