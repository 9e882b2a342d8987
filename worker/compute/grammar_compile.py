"""Grammars compiled off the engine thread: once per schema, within a size and a time limit.

A 1.1 MB JSON schema compiled on the engine thread stalled every other stream for 3.4 s, and
again at every turn of its loop while the request waited for memory. Here the worker's gRPC
handler has the request's grammar compiled on a thread before the engine sees the request
(worker/compute/decoding.py `Decodings.compile`), and hands it over compiled; the engine only copies
it. A schema over `max_bytes` is refused at once; a compile that takes longer than
`timeout_s` is refused then (llguidance cannot be stopped: its thread runs on, and the
schema's outcome is kept, so the same schema is refused at once next time). Each outcome,
grammar or refusal, is kept by what it was compiled from (LRU). A tenant compiles one grammar
at a time: another's waits for no one else's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import OrderedDict

from kvbank.contracts.failures import GrammarTooLarge, InvalidRequest

logger = logging.getLogger(__name__)

DEFAULT_GRAMMAR_TIMEOUT_S = 5.0
DEFAULT_MAX_GRAMMAR_BYTES = 256 << 10
KEPT = 256  # outcomes kept, newest last
THREADS = 8  # compiles at once, all tenants together (each tenant has one at most)


class GrammarCompiles:
    """The worker's compiles (its gRPC event loop owns this; compiles run on threads)."""

    def __init__(self, decodings, *, timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
                 max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES):
        self.decodings, self.timeout_s, self.max_bytes = decodings, timeout_s, max_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(THREADS,
                                                           thread_name_prefix="grammar")
        self._kept: OrderedDict[str, object] = OrderedDict()  # key -> Grammar | InvalidRequest
        self._running: dict[str, asyncio.Future] = {}
        self._started: dict[str, float] = {}  # key -> when its thread began (loop time)
        self._turns: dict[str, asyncio.Lock] = {}  # tenant (API key) -> one compile at a time
        self.running = 0  # compiles on a thread now: the forwards leave them a core (cores.py)

    async def grammar(self, req):
        """The request's compiled grammar (None: its answer is free). Raises InvalidRequest."""
        key = self.decodings.grammar_key(req)
        if key is None:
            return None
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._outcome(self._kept[key])
        if len(key.encode()) > self.max_bytes:
            raise GrammarTooLarge(self._field(req), len(key.encode()), self.max_bytes,
                                  param=self._param(req))
        running = self._running.get(key)
        if running is None:
            running = self._running[key] = asyncio.ensure_future(self._compile(key, req))
        try:
            return self._outcome(await asyncio.wait_for(asyncio.shield(running),
                                                        self.timeout_s))
        except asyncio.TimeoutError:
            started = self._started.get(key)
            if started is None or asyncio.get_running_loop().time() - started < self.timeout_s:
                raise InvalidRequest(  # its turn did not come: this key's compile before it
                    f"this API key's earlier grammar is still compiling, and "
                    f"{self._field(req)} waited {self.timeout_s:g} s for it: retry later",
                    param=self._param(req)) from None
            refusal = InvalidRequest(
                f"{self._field(req)} takes longer than {self.timeout_s:g} s to compile into a "
                f"grammar (--grammar-timeout-s): simplify it (fewer optional properties, "
                f"alternatives or patterns)", param=self._param(req))
            self._keep(key, refusal)  # the same schema again: refused at once
            raise refusal from None

    async def _compile(self, key: str, req):
        """One compile on a thread, after the tenant's previous one ended (even if its
        request gave up waiting for it)."""
        turn = self._turns.setdefault(req.tenant, asyncio.Lock())
        try:
            async with turn:
                loop = asyncio.get_running_loop()
                self._started[key] = loop.time()
                self.running += 1
                try:
                    got = await loop.run_in_executor(self._pool, self.decodings.compile, req)
                except InvalidRequest as e:
                    got = e
                except Exception as e:  # llguidance's own failure: ours to log, not theirs
                    logger.exception("a grammar failed to compile")
                    got = InvalidRequest(f"{self._field(req)}: the grammar compiler could not "
                                         f"build a grammar from it ({type(e).__name__})",
                                         param=self._param(req))
                finally:
                    self.running -= 1
            if key not in self._kept:  # a timeout's refusal stands
                self._keep(key, got)
            return self._kept.get(key, got)
        finally:
            self._running.pop(key, None)
            self._started.pop(key, None)

    def _keep(self, key: str, outcome) -> None:
        self._kept[key] = outcome
        self._kept.move_to_end(key)
        while len(self._kept) > KEPT:
            self._kept.popitem(last=False)

    @staticmethod
    def _outcome(got):
        if isinstance(got, InvalidRequest):
            raise InvalidRequest(str(got), param=got.param)
        return got

    @staticmethod
    def _forced(req) -> bool:
        return bool(req.tools_json) and (req.tool_choice == "required"
                                         or req.tool_choice.startswith("function:"))

    @classmethod
    def _field(cls, req) -> str:
        return "the tools' parameters" if cls._forced(req) else "response_format"

    @classmethod
    def _param(cls, req) -> str:
        return "tools" if cls._forced(req) else "response_format"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
