"""A tenant pays for its refused requests in time, while another tenant shares the server.

A request the front end refuses (a 4xx: a prompt past the context, a schema over the limit, a
full share of the queue, an unknown key) never reaches the worker, yet reading, parsing and
refusing it takes the shim's and the router's CPU. On a machine whose cores also run the
model's forwards, a tenant sending such requests back to back (`kvbank bench tenants`'
big_prompts: eight 4 MB prompts at once) kept 0.5-0.8 of a core busy there, taken from another
tenant's decode, and answering them faster only let it send more. So while another tenant has
sent a request within SHARED_WINDOW_S, each refused request of a tenant holds that tenant's
next requests back, before their bodies are read, long enough that its refused work takes at
most `share` of the front end's time (at most MAX_HOLD_S at once). A tenant alone, and a
server without keys, are never held back; a request that is answered is never charged.
"""

from __future__ import annotations

import asyncio
import time

from kvbank.config import SHARED_WINDOW_S
from kvbank.contracts.failures import Unauthenticated
from kvbank.router.auth import AUTH_KEY, sent_key, tenant_for

MAX_HOLD_S = 10.0  # a client's timeout is longer: a held request is late, never lost
UNKNOWN = "\0unknown"  # requests without a known key share one account
HELD_HEADER = b"x-kvbank-held-ms"  # on a held request's answer: how long it was held


class RefusalPacing:
    """ASGI middleware in front of the shim's routes. It owns `_free_at` (when each tenant's
    next request may start) and `_seen` (when each last sent one); both live on the shim's one
    event loop. `clock` is a test seam: a test that moves time itself holds nothing by
    chance."""

    def __init__(self, app, keys: dict[str, str], share: float, clock=time.monotonic):
        self.app, self.keys, self.share, self.clock = app, keys, share, clock
        self._free_at: dict[str, float] = {}
        self._seen: dict[str, float] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not self.keys \
                or self.share >= 1:
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        now = self.clock()
        self._seen[tenant] = now
        hold = min(self._free_at.get(tenant, 0.0) - now, MAX_HOLD_S)
        if hold > 0 and self._shared(tenant, now):
            await asyncio.sleep(hold)
        else:
            hold = 0.0
        start = self.clock()

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                if _refused(message["status"]) and self._shared(tenant, self.clock()):
                    self._charge(tenant, self.clock() - start)
                if hold:  # said to the held client alone: why its answer came late
                    message = {**message, "headers": [
                        *message.get("headers", ()), (HELD_HEADER, b"%d" % (hold * 1000))]}
            await send(message)

        await self.app(scope, receive, sending)

    def _charge(self, tenant: str, cost_s: float) -> None:
        """The refusal took `cost_s` of the front end: the tenant's next request waits
        cost_s * (1 / share - 1) more, so refusals take at most `share` of the time. Only
        while shared: what a tenant did alone it does not owe when another comes."""
        now = self.clock()
        free = max(now, self._free_at.get(tenant, 0.0)) + cost_s * (1 / self.share - 1)
        self._free_at[tenant] = min(free, now + MAX_HOLD_S)

    def _shared(self, tenant: str, now: float) -> bool:
        return any(t != tenant and now - at < SHARED_WINDOW_S for t, at in self._seen.items())

    def _tenant(self, scope) -> str:
        """The tenant of the request's key, as the router will read it (OpenAI's
        `authorization: Bearer`, or Anthropic's `x-api-key`)."""
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            return tenant_for(self.keys, [(AUTH_KEY, sent_key(headers.get("x-api-key"),
                                                              headers.get(AUTH_KEY)))])
        except Unauthenticated:
            return UNKNOWN


def _refused(status: int) -> bool:
    """A 4xx but 499, nginx's "client closed request": the client left, nothing refused."""
    return 400 <= status < 500 and status != 499
