"""Grammars compile off the engine thread (worker/compute/grammar_compile.py): once per schema,
within a size and a time limit, one at a time per tenant, and a refusal is our own sentence.

The compiles themselves are llguidance's, on the real tokenizer (tests/test_grammar.py); here
`Slow` stands in for `Decodings` (a test seam): its compile waits for the test to let it end,
so the order of events is the test's, not a clock's."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from kvbank.contracts.failures import InvalidRequest
from kvbank.v1 import worker_pb2
from kvbank.worker.compute.decoding import in_our_words
from kvbank.worker.compute.grammar_compile import GrammarCompiles

pytestmark = pytest.mark.unit  # make test-fast


class Slow:
    """Decodings' two calls: the key is the schema; a compile ends when its event is set."""

    def __init__(self):
        self.compiled: list[str] = []
        self.release: dict[str, threading.Event] = {}

    def grammar_key(self, req) -> str | None:
        return req.response_format.json_schema or None

    def compile(self, req):
        key = req.response_format.json_schema
        self.compiled.append(key)
        self.release.setdefault(key, threading.Event()).wait(30)
        if "bad" in key:
            raise InvalidRequest("response_format.json_schema.schema: unknown keyword",
                                 param="response_format")
        return f"grammar of {key}"


def _req(schema: str, tenant: str = "A") -> worker_pb2.WorkerGenerateRequest:
    r = worker_pb2.WorkerGenerateRequest(tenant=tenant, max_tokens=2)
    r.response_format.type = "json_schema"
    r.response_format.json_schema = schema
    return r


def test_a_schema_compiles_once_and_a_slow_one_is_refused_then_at_once():
    async def run():
        slow = Slow()
        compiles = GrammarCompiles(slow, timeout_s=0.3, max_bytes=1000)
        for key in ('{"a": 1}', '{"bad": 1}'):
            slow.release[key] = threading.Event()
            slow.release[key].set()
        assert await compiles.grammar(_req('{"a": 1}')) == 'grammar of {"a": 1}'
        assert await compiles.grammar(_req('{"a": 1}', "B")) == 'grammar of {"a": 1}'
        for _ in range(2):  # a refusal is kept too
            with pytest.raises(InvalidRequest, match="unknown keyword"):
                await compiles.grammar(_req('{"bad": 1}'))
        with pytest.raises(InvalidRequest) as slow_one:
            await compiles.grammar(_req('{"slow": 1}'))
        assert "takes longer than 0.3 s" in str(slow_one.value)
        assert slow_one.value.param == "response_format"
        with pytest.raises(InvalidRequest, match="takes longer"):  # at once: not compiled again
            await compiles.grammar(_req('{"slow": 1}', "B"))
        assert slow.compiled == ['{"a": 1}', '{"bad": 1}', '{"slow": 1}']
        with pytest.raises(InvalidRequest) as big:
            await compiles.grammar(_req('{"x": "' + "y" * 2000 + '"}'))
        assert "--max-grammar-bytes" in str(big.value) and slow.compiled[-1] == '{"slow": 1}'
        slow.release['{"slow": 1}'].set()
        compiles.close()

    asyncio.run(run())


def test_one_tenants_slow_compile_keeps_its_next_waiting_and_no_one_elses():
    async def run():
        slow = Slow()
        compiles = GrammarCompiles(slow, timeout_s=5, max_bytes=1000)
        a_slow = asyncio.ensure_future(compiles.grammar(_req('{"a-slow": 1}', "A")))
        while slow.compiled != ['{"a-slow": 1}']:
            await asyncio.sleep(0.01)
        a_next = asyncio.ensure_future(compiles.grammar(_req('{"a-next": 1}', "A")))
        slow.release['{"b": 1}'] = threading.Event()
        slow.release['{"b": 1}'].set()
        assert await compiles.grammar(_req('{"b": 1}', "B")) == 'grammar of {"b": 1}'
        assert slow.compiled == ['{"a-slow": 1}', '{"b": 1}']  # A's next waits for A's turn
        assert not a_next.done()
        slow.release['{"a-next": 1}'] = threading.Event()
        slow.release['{"a-next": 1}'].set()
        slow.release['{"a-slow": 1}'].set()
        assert await a_slow == 'grammar of {"a-slow": 1}'
        assert await a_next == 'grammar of {"a-next": 1}'
        compiles.close()

    asyncio.run(run())


def test_a_grammar_refusal_is_our_sentence_never_a_panic():
    """A 1.1 MB schema's 400 carried llguidance's `panic: assertion failed: ...` and a
    backtrace."""
    panic = ("response_format.json_schema.schema: panic: assertion failed: "
             "grammar.symbols.len() < u16::MAX\nstack backtrace:\n   0: rust_begin_unwind")
    ours = in_our_words(panic)
    assert ours.startswith("response_format.json_schema.schema: the grammar compiler could not")
    assert "panic" not in ours and "backtrace" not in ours and "\n" not in ours
    assert in_our_words("tools[0].function.parameters: " + "x" * 400).endswith("simplify it")
    plain = "response_format.json_schema.schema: Unknown keyword 'frobnicate'"
    assert in_our_words(plain) == plain  # a sentence a client can act on stays


def test_while_a_compile_runs_the_forwards_leave_it_a_core(request):
    """A compile takes a core for seconds, and OpenBLAS's threads wait for each other at every
    matmul: while one runs, the engine's forwards use the cores it leaves (`Cores.share`, before
    each step), and all of them again once it has ended."""
    from kvbank.worker.compute.cores import Cores
    from tests.conftest import blas_threads

    blas_threads(os.cpu_count())  # OpenBLAS's default (conftest gives pytest one thread)
    request.addfinalizer(lambda: blas_threads(1))
    cores = Cores()
    if cores.all < 2:
        pytest.skip("MLX here runs no OpenBLAS of two threads or more: no core to give")
    blas = cores.threads  # what OpenBLAS itself says

    async def run():
        slow = Slow()
        compiles = GrammarCompiles(slow, timeout_s=5, max_bytes=1000)
        cores.compiling = lambda: compiles.running
        cores.share()
        assert blas() == cores.all
        pending = asyncio.ensure_future(compiles.grammar(_req('{"a": 1}')))
        while slow.compiled != ['{"a": 1}']:
            await asyncio.sleep(0.01)
        cores.share()
        assert blas() == cores.all - 1
        slow.release['{"a": 1}'].set()
        assert await pending == 'grammar of {"a": 1}'
        cores.share()
        assert blas() == cores.all
        compiles.close()

    try:
        asyncio.run(run())
    finally:  # this process's own OpenBLAS: as it was, whatever happened
        cores.compiling = lambda: 0
        cores.share()
