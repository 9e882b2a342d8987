"""API keys: each key is a tenant; the operator's key (`--admin-key`) sees them all.

A tenant's sessions and cached KV are invisible to every other tenant (the worker keys its
bank and block chains by tenant). With no keys configured there is one open tenant, "".
Keys arrive as gRPC metadata `authorization: Bearer KEY` (the shim forwards its client's key);
the operator's as `x-kvbank-admin-key: KEY`.

Who may act beyond their own conversations (`operator_or_tenant`): with keys configured, only
the caller that sends the operator's key, from any address, loopback included (on a machine
where every agent connects over loopback, loopback proves nothing). Without keys there is one
tenant, and a loopback caller is the operator, as is a remote one sending the operator's key.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from kvbank.contracts.failures import PermissionDenied, Unauthenticated

AUTH_KEY = "authorization"
ADMIN_KEY = "x-kvbank-admin-key"
OPERATOR = None  # the scope of the operator's call: every tenant
LOOPBACK_PEERS = ("ipv4:127.", "ipv6:[::1]", "ipv6:%5B::1%5D", "ipv6:[::ffff:127.",
                  "ipv6:%5B::ffff:127.", "unix:")


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


def sent_key(x_api_key: str | None, authorization: str | None) -> str:
    """The `authorization` value a client's key comes as: Anthropic's clients send
    `x-api-key: KEY` (or, with an auth token, `authorization: Bearer`); OpenAI's the latter."""
    return f"Bearer {x_api_key.strip()}" if x_api_key else (authorization or "")


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


def operator_or_tenant(keys: dict[str, str], admin_key: str | None, metadata,
                       peer: str) -> str | None:
    """Whose conversations the caller may act on: OPERATOR (None: every tenant's), or its
    own tenant's. Raises Unauthenticated (no known key) or PermissionDenied (a wrong operator
    key; without keys, a remote caller without the operator's key)."""
    sent = dict(metadata or ()).get(ADMIN_KEY)
    if sent is not None:
        if admin_key and hmac.compare_digest(sent.strip().encode(), admin_key.encode()):
            return OPERATOR
        raise PermissionDenied("the x-kvbank-admin-key sent is not this server's operator key "
                               "(the router's --admin-key)" if admin_key else
                               "x-kvbank-admin-key was sent, but this server has no operator "
                               "key: start the router with --admin-key")
    if keys:
        return tenant_for(keys, metadata)
    if peer.startswith(LOOPBACK_PEERS):
        return OPERATOR
    raise PermissionDenied("the Admin service answers loopback clients, or clients that send "
                           "the router's --admin-key as x-kvbank-admin-key metadata")
