"""Tenants and listeners: with API keys, one tenant's sessions and cached KV are invisible to
another; without flags, every listener is on loopback.

Tenants are named by an `--api-keys-file` (`alice KEY_A`, `bob KEY_B`) and reached through
both doors: gRPC with `authorization: Bearer KEY` metadata, and the OpenAI shim with the
`openai` client's api_key.

No timing test here: cache hits are kept apart by construction, not by constant time. The
bank's lookup (`SessionBank.lookup`) and the SSD lookup (`Engine._ssd_prefix`) both start
from the caller's tenant root (`chain_root(fingerprint, tenant)`): block ids are chained from
that root, and the bank's index is entered at that root, so another tenant's blocks are never
reached, hashed against or token-compared, and a lookup's time cannot depend on them. The
tests below pin the visible half of that: another tenant's identical prompt restores nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import uuid

import grpc
import httpx
import openai
import psutil
import pytest

from kvbank.v1 import api_pb2, api_pb2_grpc
from tests.conftest import rpc_error, start_stack
from tests.waiting import wait_until

KEYS = {"alice": "KEY_A-" + "a" * 20, "bob": "KEY_B-" + "b" * 20}
OPERATOR_KEY = "KEY_OP-" + "o" * 20  # the router's --admin-key
BLOCK_TOKENS = 16  # start_stack's --block-tokens
PROMPT = [100 + (7 * i) % 900 for i in range(3 * BLOCK_TOKENS + 5)]  # three full blocks + 5


class Tenant:
    """The router's gRPC API as one API key sees it (kvbank.client.Client sends no metadata),
    or (`operator`) as the operator's key does."""

    def __init__(self, address: str, key: str | None, operator: str | None = None):
        self.channel = grpc.insecure_channel(address)
        self.metadata = ((("authorization", f"Bearer {key}"),) if key is not None else ()) + (
            (("x-kvbank-admin-key", operator),) if operator is not None else ())
        self.generation = api_pb2_grpc.GenerationStub(self.channel)
        self.sessions = api_pb2_grpc.SessionsStub(self.channel)
        self.admin = api_pb2_grpc.AdminStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def generate(self, token_ids: list[int], session_id: str = "", max_tokens: int = 4,
                 append: bool = False) -> api_pb2.Usage:
        req = api_pb2.GenerateRequest(session_id=session_id, append=append,
                                      max_tokens=max_tokens)
        req.tokens.ids.extend(token_ids)
        [*_, last] = self.generation.Generate(req, metadata=self.metadata, timeout=60)
        assert last.HasField("usage")
        return last.usage

    def list(self) -> list[str]:
        r = self.sessions.List(api_pb2.ListSessionsRequest(), metadata=self.metadata, timeout=30)
        return [s.session_id for s in r.sessions]

    def get(self, session_id: str) -> api_pb2.Session:
        return self.sessions.Get(api_pb2.GetSessionRequest(session_id=session_id),
                                 metadata=self.metadata, timeout=30)

    def delete(self, session_id: str) -> bool:
        return self.sessions.Delete(api_pb2.DeleteSessionRequest(session_id=session_id),
                                    metadata=self.metadata, timeout=30).deleted

    def release(self, session_id: str, tenant: str = "") -> api_pb2.ReleaseResponse:
        return self.admin.Release(api_pb2.ReleaseRequest(session_id=session_id, write_out=True,
                                                         tenant=tenant),
                                  metadata=self.metadata, timeout=120)

    def status(self) -> api_pb2.StatusResponse:
        return self.admin.Status(api_pb2.StatusRequest(), metadata=self.metadata, timeout=30)

    def trim(self) -> api_pb2.TrimResponse:
        return self.admin.Trim(api_pb2.TrimRequest(), metadata=self.metadata, timeout=120)

    def wait_durable(self, session_id: str, timeout_s: float = 60) -> api_pb2.Session:
        def durable():
            s = self.get(session_id)
            return s if s.durable_tokens == s.token_count else None

        return wait_until(durable, f"session {session_id} to become durable",
                          timeout_s=timeout_s, every_s=0.1)


@pytest.fixture(scope="module")
def keyed(tiny_model, tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("security")
    keys_file = root / "keys"
    keys_file.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    s = start_stack(tiny_model, root / "data", cache_dir=cache_dir,
                    # a refusal holds its tenant's next request back 99x its cost: well
                    # past the next request's sending (the test of it waits for no clock)
                    extra=["--api-keys-file", str(keys_file), "--admin-key", OPERATOR_KEY,
                           "--refusal-share", "0.01"])
    yield s
    s.stop()


@pytest.fixture
def alice(keyed):
    t = Tenant(keyed.address, KEYS["alice"])
    yield t
    t.close()


@pytest.fixture
def bob(keyed):
    t = Tenant(keyed.address, KEYS["bob"])
    yield t
    t.close()


@pytest.fixture
def operator(keyed):
    t = Tenant(keyed.address, None, operator=OPERATOR_KEY)
    yield t
    t.close()


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _unique_prompt() -> list[int]:
    """PROMPT behind a fresh first token: no earlier test's KV is a prefix of it."""
    return [1000 + uuid.uuid4().int % 40000] + PROMPT


def test_another_tenants_session_cannot_be_listed_read_deleted_or_released(alice, bob):
    sid = _name("alice-notes")
    alice.generate(_unique_prompt(), session_id=sid, append=True)
    before = alice.get(sid)
    assert sid in alice.list()

    assert sid not in bob.list()
    err = rpc_error(lambda: bob.get(sid))
    assert err.code() == grpc.StatusCode.NOT_FOUND and sid in err.details()
    assert bob.delete(sid) is False
    assert bob.release(sid).released_entries == 0

    # bob may use the same name: it is his own, empty conversation, not alice's.
    mine = bob.generate([5, 6, 7], session_id=sid, append=True)
    assert mine.cached_tokens == 0 and bob.get(sid).token_count < before.token_count

    after = alice.get(sid)
    assert list(after.token_ids) == list(before.token_ids)
    assert after.ram_bytes == before.ram_bytes > 0  # bob's release did not touch alice's KV
    assert bob.delete(sid) is True  # bob's own session of that name
    assert list(alice.get(sid).token_ids) == list(before.token_ids)


def test_admin_status_does_not_show_another_tenants_session_names(alice, bob):
    sid = _name("alice-private")
    alice.generate(_unique_prompt(), session_id=sid)
    receipts = bob.admin.Status(api_pb2.StatusRequest(), metadata=bob.metadata,
                                timeout=30).recent_receipts_json
    assert not [r for r in receipts if sid in r]


def test_pressure_is_the_operators_alone_loopback_or_not(keyed, alice, bob, operator):
    """Any key holder on loopback could inject `critical` and drop another tenant's turn not
    yet on SSD. A tenant's key is refused now, as is a wrong operator key; the operator's key
    (the router's --admin-key) is taken, from loopback too."""
    def inject(t: Tenant, level: str) -> api_pb2.PressureResponse:
        return t.admin.SetPressure(api_pb2.PressureRequest(level=level), metadata=t.metadata,
                                   timeout=30)

    for t in (alice, bob):
        err = rpc_error(lambda: inject(t, "critical"))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
        assert "--admin-key" in err.details()
    impostor = Tenant(keyed.address, KEYS["bob"], operator="KEY_OP-guessed")
    try:
        err = rpc_error(lambda: inject(impostor, "critical"))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
    finally:
        impostor.close()
    assert inject(operator, "normal").level == "normal"
    assert inject(operator, "auto").source != "injected"


def test_a_tenants_trim_and_flush_leave_the_other_tenants_conversations(alice, bob,
                                                                         operator):
    """bob's Trim pushed alice's conversation out of RAM; now it moves bob's own only, and its
    answer counts bob's bytes. The operator's Trim moves everyone's."""
    a, b = _name("alice-trim"), _name("bob-trim")
    alice.generate(_unique_prompt(), session_id=a)
    bob.generate(_unique_prompt(), session_id=b)
    alice.wait_durable(a)
    bob.wait_durable(b)
    bob.admin.Flush(api_pb2.FlushRequest(), metadata=bob.metadata, timeout=120)
    trimmed = bob.trim()
    assert alice.get(a).state == "resident-clean" and alice.get(a).ram_bytes > 0
    assert bob.get(b).state == "cold"
    assert trimmed.evicted_entries >= 1
    assert trimmed.bank_bytes_after == sum(bob.get(s).ram_bytes for s in bob.list())
    operator.trim()
    assert alice.get(a).state == "cold"


def test_a_tenants_status_has_its_own_figures_and_the_operators_the_servers(alice, bob,
                                                                            operator):
    """The whole server's memory and load are the operator's: from them one tenant read the
    size of another's turns. A tenant sees the settings, the pressure level and its own
    conversations' figures and receipts."""
    import json

    alice.generate(_unique_prompt(), session_id=_name("alice-status"))
    bob.generate(_unique_prompt(), session_id=_name("bob-status"))
    mine, theirs, server = alice.status(), bob.status(), operator.status()
    assert (mine.scope, theirs.scope, server.scope) == ("tenant", "tenant", "server")
    for st in (mine, theirs):
        assert st.held_bytes == st.rss_bytes == st.staged_bytes == st.running_bytes == 0
        assert not st.coldstore_json and st.memory_budget_bytes == server.memory_budget_bytes
        for r in map(json.loads, st.recent_receipts_json):
            assert r["kind"] in ("admission", "idle_release", "release_write_out"), r
            assert "free_before" not in r and "bytes_after" not in r, r
    assert server.held_bytes > 0 and server.coldstore_json
    assert mine.bank_bytes > 0 and theirs.bank_bytes > 0
    assert mine.bank_bytes + theirs.bank_bytes == server.bank_bytes  # the keys' two tenants
    assert mine.bank_entries + theirs.bank_entries == server.bank_entries


def test_the_operator_lists_and_releases_every_tenants_conversations(alice, bob, operator):
    a, b = _name("alice-op"), _name("bob-op")
    alice.generate(_unique_prompt(), session_id=a)
    bob.generate(_unique_prompt(), session_id=b)
    everyone = operator.sessions.List(api_pb2.ListSessionsRequest(), metadata=operator.metadata,
                                      timeout=30).sessions
    assert {("alice", a), ("bob", b)} <= {(s.tenant, s.session_id) for s in everyone}
    err = rpc_error(lambda: bob.release(a, tenant="alice"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "operator" in err.details()
    assert operator.release(a, tenant="alice").released_entries == 1
    assert alice.get(a).state == "cold" and bob.get(b).state != "cold"


def test_kvbank_status_and_admin_take_the_operators_key_or_an_api_key(keyed, alice, bob):
    """`kvbank status` and `kvbank admin` on a keyed stack: without a key they say which one
    to pass; with the operator's key they see and act on everyone; with an API key, on that
    tenant's own conversations."""
    import json
    import os
    import subprocess
    import sys

    a, b = _name("alice-cli"), _name("bob-cli")
    alice.generate(_unique_prompt(), session_id=a)
    bob.generate(_unique_prompt(), session_id=b)

    def kvbank(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVBANK_")}
        return subprocess.run([sys.executable, "-m", "kvbank.apps.cli", *args], capture_output=True,
                              text=True, timeout=120, env=clean | (env or {}))

    where = ["--address", keyed.address]
    nokey = kvbank("status", *where, "--json")
    assert nokey.returncode == 1 and "UNAUTHENTICATED" in nokey.stderr
    assert "--admin-key" in nokey.stderr and "--api-key" in nokey.stderr
    full = json.loads(kvbank("status", *where, "--json", "--admin-key", OPERATOR_KEY).stdout)
    seen = {(s["tenant"], s["sessionId"]) for s in full["sessions"]}
    assert {("alice", a), ("bob", b)} <= seen and full["worker"]["scope"] == "server"
    own = json.loads(kvbank("status", *where, "--json",
                            env={"KVBANK_API_KEY": KEYS["bob"]}).stdout)
    assert {s["tenant"] for s in own["sessions"]} == {"bob"}
    assert own["worker"]["scope"] == "tenant"

    denied = kvbank("admin", *where, "--api-key", KEYS["bob"], "pressure", "warning")
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    released = kvbank("admin", *where, "release", a, "--tenant", "alice",
                      env={"KVBANK_ADMIN_KEY": OPERATOR_KEY})
    assert released.returncode == 0, released.stderr
    assert json.loads(released.stdout)["releasedEntries"] == 1
    assert alice.get(a).state == "cold"
    own_release = kvbank("admin", *where, "--api-key", KEYS["bob"], "release", b)
    assert json.loads(own_release.stdout)["releasedEntries"] == 1


def test_keyless_load_figures_are_coarse_with_keys(keyed, alice):
    """/v1/loads, /get_load and /metrics answer without a key (gateways send none); with API
    keys their KV figure comes in sixteenths of the capacity, so one tenant's turn cannot be
    read off it (it moved by exactly a 1,055-token turn). Request counts stay exact."""
    from prometheus_client.parser import text_string_to_metric_families

    url = keyed.shim_url
    alice.generate(_unique_prompt(), session_id=_name("alice-load"))
    rank = httpx.get(url + "/v1/loads", timeout=10).json()["loads"][0]
    sixteenths = rank["token_usage"] * 16
    assert rank["num_used_tokens"] > 0 and sixteenths == round(sixteenths) >= 1, rank
    assert rank["num_running_reqs"] == 0 and rank["max_total_num_tokens"] > 0
    gauges = {s.name: s.value for f in text_string_to_metric_families(
        httpx.get(url + "/metrics", timeout=10).text) for s in f.samples}
    assert gauges["vllm:kv_cache_usage_perc"] == rank["token_usage"]
    assert httpx.get(url + "/get_load", timeout=10).json() == {"load": 0}


def test_one_tenants_flood_leaves_a_slot_and_the_other_tenant_is_served_first(keyed, alice,
                                                                              bob):
    """The worker runs 4 requests; alice holds 3 (her share) streaming long answers and has a
    4th waiting: bob's request takes the 4th slot at once and is answered while all of hers
    still run and wait. In one FIFO line, alice's 4th took the slot and bob waited behind all
    of them (222 s in the issue). Counted by events: the router's queue, the answers."""
    def hold() -> grpc.Future:
        req = api_pb2.GenerateRequest(max_tokens=1900)  # the tiny model's context is 2,048
        req.tokens.ids.extend(_unique_prompt()[:20])
        return alice.generation.Generate(req, metadata=alice.metadata, timeout=120)

    def waiting() -> int:
        return alice.generation.Load(api_pb2.LoadRequest(), timeout=10).waiting

    holders = [hold() for _ in range(3)]
    try:
        for call in holders:
            next(call)  # admitted and streaming
        fourth = hold()
        wait_until(lambda: waiting() == 1, "alice's 4th request to wait in the router")
        answer = bob.generate(_unique_prompt(), max_tokens=2)
        assert answer.completion_tokens == 2
        assert waiting() == 1  # alice's 4th still waits: bob did not wait behind it
        assert all(call.running() for call in holders)
    finally:
        for call in holders:
            call.cancel()
    next(fourth)  # a slot freed: her 4th runs now
    fourth.cancel()


def test_a_request_waiting_for_memory_holds_no_other_tenants_request(tiny_model, tmp_path,
                                                                      cache_dir):
    """The worker's memory holds alice's first request (600 tokens) and bob's (22), not her
    second (1,900) beside her first, though it fits alone: beyond the model and one forward's
    working memory (the engine runs one forward at a time) the budget leaves about 1.5 MB
    (`+N`, less the 4 % MLX's buffer cache may keep), 0.2 MB from either edge (a token's KV is
    512 bytes here, each cache has room for a growth step of 256 tokens, and a 20-token
    prompt's forward adds 0.18 MB), and her second waits at the worker for her first to end. Bob's starts before it: one
    key's request waiting for memory never holds another key's (in one line, bob waited
    behind her second until her first ended). Ordered by the admission receipts."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()))
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False,
                    extra=["--api-keys-file", str(keys_file), "--admin-key", OPERATOR_KEY,
                           "--memory-budget", "+2100000"])
    alice, bob = Tenant(s.address, KEYS["alice"]), Tenant(s.address, KEYS["bob"])
    operator = Tenant(s.address, None, operator=OPERATOR_KEY)
    calls = []

    def hers(max_tokens: int) -> grpc.Future:
        req = api_pb2.GenerateRequest(max_tokens=max_tokens)
        req.tokens.ids.extend(_unique_prompt()[:20])
        call = alice.generation.Generate(req, metadata=alice.metadata, timeout=120)
        calls.append(call)
        return call

    def load() -> tuple[int, int]:
        r = alice.generation.Load(api_pb2.LoadRequest(), timeout=10)
        return r.running, r.waiting

    try:
        next(hers(580))  # her first streams
        hers(1880)
        wait_until(lambda: load() == (1, 1), "her second to wait for memory at the worker")
        assert bob.generate(_unique_prompt()[:20], max_tokens=2).completion_tokens == 2
        admitted = [r["tenant"] for r in map(json.loads, operator.status().recent_receipts_json)
                    if r.get("kind") == "admission" and r["decision"] == "admitted"]
        assert admitted[:2] == ["alice", "bob"], admitted
    finally:
        for call in calls:
            call.cancel()
        for t in (alice, bob, operator):
            t.close()
        s.stop()


def test_a_prompt_too_long_by_its_bytes_is_refused_without_tokenizing(keyed, alice,
                                                                      tiny_model):
    """A 3.9 MB prompt was tokenized on the router's loop (~2 s, every other request waiting)
    before it was refused; more bytes than the context holds tokens of the longest is refused
    on its byte count. Below that, a large prompt is tokenized on its own thread: the same
    tokens the model's tokenizer gives."""
    from transformers import AutoTokenizer

    req = api_pb2.GenerateRequest(prompt="word " * 200_000, max_tokens=2)  # 1 MB
    err = rpc_error(lambda: list(alice.generation.Generate(req, metadata=alice.metadata,
                                                          timeout=60)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith("prompt is too long: ")
    assert "counted from its 1000000 bytes, without tokenizing it" in err.details()

    # 66 KB in ~820 tokens (the vocabulary's longest token is a line break and 80 spaces):
    # large, and inside the tiny model's context of 2,048 tokens
    text = ("\n" + " " * 80) * 820
    assert len(text.encode()) > 64 << 10
    rendered = alice.generation.Render(api_pb2.GenerateRequest(prompt=text, max_tokens=1),
                                       metadata=alice.metadata, timeout=60).token_ids
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    assert list(rendered) == tok.encode(text, add_special_tokens=False)


def test_a_tenants_refused_requests_hold_its_next_back_while_another_tenant_sends(keyed):
    """A 1 MB prompt is refused on its byte count, yet reading and refusing it takes the front
    end's CPU: a tenant sending them back to back took it from another tenant's decode. Each
    refusal holds that tenant's next request back (said in `x-kvbank-held-ms`); the other
    tenant is never held, and the refused tenant's next good request is answered."""
    url = keyed.shim_url + "/v1/completions"  # no template: nothing of a chat's is cached

    def post(key: str, prompt: str) -> httpx.Response:
        return httpx.post(url, headers={"authorization": f"Bearer {key}"}, timeout=60,
                          json={"model": "kvbank", "max_tokens": 2, "prompt": prompt})

    assert post(KEYS["bob"], "hello").status_code == 200  # bob shares the server
    big = "word " * 200_000
    first = post(KEYS["alice"], big)
    assert first.status_code == 400 and "prompt is too long" in first.text
    held = post(KEYS["alice"], big)
    assert held.status_code == 400
    assert int(held.headers["x-kvbank-held-ms"]) > 0
    good = post(KEYS["alice"], "hello")
    assert good.status_code == 200 and "x-kvbank-held-ms" in good.headers  # held, answered
    assert "x-kvbank-held-ms" not in post(KEYS["bob"], "hello").headers


def test_a_tenant_alone_and_a_server_without_keys_are_never_held():
    """Holding back only shares the front end between tenants: one alone, or a server
    without keys, answers its refusals as fast as it can. (Test seams: the app behind the
    pacing answers 400 on /bad, 200 elsewhere, and each refusal moves the pacing's clock 10 ms;
    nothing else moves it, so whether a request is held never depends on this machine's speed.)"""
    from kvbank.apps.shim.pacing import RefusalPacing

    now = [0.0]

    async def app(scope, receive, send):
        bad = scope["path"] == "/bad"
        now[0] += 0.010 if bad else 0.0
        await send({"type": "http.response.start", "headers": [], "status": 400 if bad else 200})
        await send({"type": "http.response.body", "body": b""})

    async def held(paced, key: str, path: str) -> bool:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=paced),
                                     base_url="http://shim") as c:
            r = await c.post(path, headers={"authorization": f"Bearer {key}"})
            return "x-kvbank-held-ms" in r.headers

    async def run() -> None:
        keys = {KEYS["alice"]: "alice", KEYS["bob"]: "bob"}
        paced = RefusalPacing(app, keys, share=0.5, clock=lambda: now[0])
        assert [await held(paced, KEYS["alice"], "/bad") for _ in range(3)] == [False] * 3
        assert not await held(paced, KEYS["bob"], "/good")  # now alice shares: what she
        assert not await held(paced, KEYS["alice"], "/bad")  # did alone is not owed
        assert await held(paced, KEYS["alice"], "/bad")  # 10 ms refused: held 10 ms
        assert not await held(paced, KEYS["bob"], "/good")
        keyless = RefusalPacing(app, {}, share=0.5, clock=lambda: now[0])
        for key in ("a", "b", "a", "b"):
            assert not await held(keyless, key, "/bad")

    asyncio.run(run())


def test_no_prefix_hit_across_tenants_from_ram(alice, bob):
    prompt = _unique_prompt()
    first = alice.generate(prompt)
    assert first.cached_tokens == 0

    theirs = bob.generate(prompt)  # alice's KV for exactly these tokens is in the bank now
    assert theirs.cached_tokens == 0 and theirs.cache_source == api_pb2.CACHE_SOURCE_NONE

    again = alice.generate(prompt)
    assert again.cached_tokens > 0 and again.cache_source == api_pb2.CACHE_SOURCE_RAM


def test_no_prefix_hit_across_tenants_from_ssd(alice, bob):
    """alice's blocks in LMDB, out of RAM: bob's identical prompt still restores nothing."""
    sid = _name("alice-ssd")
    prompt = _unique_prompt()
    alice.generate(prompt, session_id=sid, max_tokens=2)
    durable = alice.wait_durable(sid)
    assert durable.durable_tokens >= 3 * BLOCK_TOKENS
    assert alice.release(sid).released_entries > 0
    assert alice.get(sid).ram_bytes == 0

    theirs = bob.generate(prompt, session_id=_name("bob-ssd"), max_tokens=2)
    assert theirs.cached_tokens == 0 and theirs.cache_source == api_pb2.CACHE_SOURCE_NONE

    again = alice.generate(prompt, session_id=_name("alice-ssd-2"), max_tokens=2)
    assert again.cache_source == api_pb2.CACHE_SOURCE_SSD
    assert again.cached_tokens >= 3 * BLOCK_TOKENS


def test_no_anonymous_hit_across_tenants_from_ram_or_ssd(alice, bob):
    """Without names too: alice's conversation, found by its tokens, on SSD and out of RAM,
    restores nothing for bob's identical prompt, and is alice's again."""
    prompt = _unique_prompt()
    first = alice.generate(prompt, max_tokens=2)
    assert first.session_id.startswith("~") and first.durable
    assert alice.wait_durable(first.session_id).durable_tokens >= 3 * BLOCK_TOKENS

    theirs = bob.generate(prompt, max_tokens=2)
    assert theirs.cached_tokens == 0 and theirs.cache_source == api_pb2.CACHE_SOURCE_NONE
    assert theirs.session_id not in alice.list() and first.session_id not in bob.list()

    assert alice.release(first.session_id).released_entries > 0
    assert bob.release(theirs.session_id).released_entries > 0
    theirs = bob.generate(prompt + [7], max_tokens=2)
    assert theirs.cache_source == api_pb2.CACHE_SOURCE_SSD  # bob's own, now on SSD
    assert alice.release(first.session_id).released_entries == 0
    again = alice.generate(prompt + [7], max_tokens=2)
    assert again.cache_source == api_pb2.CACHE_SOURCE_SSD
    assert again.cached_tokens >= 3 * BLOCK_TOKENS


def test_no_prefix_hit_across_tenants_through_the_shim(keyed):
    def ask(key: str):
        c = openai.OpenAI(base_url=keyed.shim_url + "/v1", api_key=key, max_retries=0)
        return c.chat.completions.create(model="kvbank", messages=messages, max_tokens=2,
                                         temperature=0).usage.prompt_tokens_details.cached_tokens

    prefix = "a long shared prefix " * 20
    messages = [{"role": "user", "content": f"[{uuid.uuid4().hex}] {prefix}"}]
    assert ask(KEYS["alice"]) == 0
    assert ask(KEYS["bob"]) == 0
    assert ask(KEYS["alice"]) > 0


def test_another_tenants_stored_response_is_a_404(keyed):
    """A stored response (the Responses API's `store`) is its tenant's: another key can
    neither read it, continue it nor delete it."""
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=keyed.shim_url + "/v1", api_key=key, max_retries=0)

    r = client(KEYS["alice"]).responses.create(model="kvbank", input=f"[{uuid.uuid4().hex}] Hi",
                                               max_output_tokens=2, temperature=0)
    bob = client(KEYS["bob"])
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model="kvbank", previous_response_id=r.id, input="Go on.")
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(r.id)
    assert client(KEYS["alice"]).responses.retrieve(r.id).id == r.id


@pytest.mark.parametrize("metadata", [
    (),
    (("authorization", "Bearer not-a-key"),),
    (("authorization", f"Basic {KEYS['alice']}"),),
    (("authorization", "Bearer "),),
    (("authorization", KEYS["alice"]),),
], ids=["none", "unknown", "basic", "empty", "no-scheme"])
def test_without_a_known_key_the_router_says_unauthenticated(keyed, metadata):
    stub = Tenant(keyed.address, None)
    stub.metadata = metadata
    req = api_pb2.GenerateRequest(prompt="hi", max_tokens=2)
    calls = [lambda: list(stub.generation.Generate(req, metadata=metadata, timeout=30)),
             lambda: stub.list(), lambda: stub.get("any"), lambda: stub.delete("any"),
             lambda: stub.admin.Status(api_pb2.StatusRequest(), metadata=metadata, timeout=30)]
    try:
        for call in calls:
            err = rpc_error(call)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()
            assert "API key" in err.details()
    finally:
        stub.close()


@pytest.mark.parametrize("header", [None, "Bearer not-a-key", f"Basic {KEYS['bob']}"],
                         ids=["none", "unknown", "basic"])
def test_without_a_known_key_the_shim_says_401(keyed, header):
    headers = {"authorization": header} if header else {}
    url = keyed.shim_url + "/v1"
    body = {"model": "kvbank", "max_tokens": 2}
    for path, extra in [("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/completions", {"prompt": "hi"})]:
        r = httpx.post(url + path, json=body | extra, headers=headers)
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and "API key" in error["message"]
    assert httpx.get(url + "/models", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="not-a-key", max_retries=0).completions.create(
            model="kvbank", prompt="hi", max_tokens=2)


def _loopback(ip: str) -> bool:
    """127.0.0.0/8 or ::1, also as an IPv4-mapped IPv6 address (gRPC's sockets are IPv6)."""
    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


def test_every_listener_binds_loopback_by_default(tiny_model, tmp_path, cache_dir):
    """A stack started without --host/--shim-host: the router, the shim and every metrics
    port listen on 127.0.0.1 and nowhere else (the worker and coldstore use unix sockets)."""
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir)
    try:
        names = ("router", "worker", "coldstore", "shim")
        pids = {n: s.pid(n) for n in names} | {"supervisor": s.proc.pid}
        listening = {}
        for name, pid in pids.items():
            for conn in psutil.Process(pid).net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    listening[(conn.laddr.ip, conn.laddr.port)] = name
        expected = {int(s.address.rsplit(":", 1)[1]): "router",
                    int(s.shim_url.rsplit(":", 1)[1]): "shim"}
        for name in ("router", "worker", "coldstore"):
            expected[int(httpx.URL(s.metrics_url(name)).port)] = name
    finally:
        s.stop()
    assert all(_loopback(ip) for ip, _ in listening), listening
    assert {port: name for (_, port), name in listening.items()} == expected
