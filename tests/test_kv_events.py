"""KV events: a worker says which token blocks it holds, in vLLM's wire format, so a router in
front of several machines sends each conversation back to the one holding its KV.

Real processes; the events are read the way vllm-router reads them (a SUB socket, a DEALER
for replays) and decoded with msgspec structs that mirror vLLM's own definitions
(vllm/distributed/kv_events.py): same names, same field order, the batch array-like, each
event a map tagged by its type.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import msgpack
import msgspec
import numpy as np
import pytest
import zmq

from kvbank.coldstore.store import ColdStore
from kvbank.deploy.local import free_ports
from kvbank.blocks import chain_block_ids, chain_root
from kvbank.contracts.store_layout import StoreReader
from tests.conftest import start_stack
from tests.waiting import wait_until
from kvbank.worker.tiers.bank import BankEntry
from kvbank.worker.tiers.conversations import Conversations
from kvbank.worker.link import kv_events
from kvbank.worker.link.kv_events import EventsConfig, KVEvents, Publisher, block_hashes

BLOCK = 16
LONG = 100_000  # tokens: an agent's conversation late in its life
# What the book may keep of a conversation of LONG tokens on SSD: its 6,250 block ids at 8
# bytes (50 KB) and its slot. It kept ~1 MB (each id a Python int, in a list and in a count
# dict, and the tokens).
BOOK_BOUND = 64 * 1024


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """The router's side: a SUB on the events, a DEALER on the replay socket."""

    def __init__(self, endpoint: str, replay: str):
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.batches: list[tuple[int, KVEventBatch]] = []

    def poll(self) -> list[tuple[int, KVEventBatch]]:
        while self.sub.poll(50):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b""
            self.batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        return self.batches

    def events(self, kind=None, medium=None) -> list:
        return [e for _, b in self.poll() for e in b.events
                if (kind is None or isinstance(e, kind))
                and (medium is None or getattr(e, "medium", None) == medium)]

    def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(10_000), "no answer from the replay socket"
                _, topic, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    assert topic == b"" and payload == b""
                    return out
                out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        finally:
            dealer.close()

    def close(self) -> None:
        self.sub.close()


@pytest.fixture
def events_stack(tiny_model, tmp_path, cache_dir):
    pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    s = start_stack(tiny_model, tmp_path / "data", cache_dir=cache_dir, shim=False,
                    extra=["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay])
    sub = Subscriber(pub, replay)
    yield s, sub
    sub.close()
    s.stop()


def _stored_chains(sub: Subscriber, medium: str) -> list[list[int]]:
    return [e.token_ids for e in sub.events(BlockStored, medium)]


def test_blocks_in_ram_and_on_ssd_are_announced_in_vllm_format(events_stack):
    s, sub = events_stack
    wait_until(lambda: sub.events(AllBlocksCleared), "the state announced to a new subscriber")
    with s.client() as c:
        c.generate(session_id="agent", token_ids=list(range(100, 160)), append=True,
                   max_tokens=8)
        history = list(c.get_session("agent").token_ids)
        whole = len(history) // BLOCK * BLOCK
        assert whole >= 4 * BLOCK

        # In RAM: device memory, the conversation's whole blocks from the root, one id each.
        wait_until(lambda: history[:whole] in _stored_chains(sub, "GPU"),
                   "the conversation's blocks announced as GPU")
        ram = next(e for e in sub.events(BlockStored, "GPU") if e.token_ids == history[:whole])
        assert ram.parent_block_hash is None and ram.block_size == BLOCK
        assert len(ram.block_hashes) * BLOCK == len(ram.token_ids)
        assert ram.lora_id is None and ram.lora_name is None
        wait_until(lambda: c.get_session("agent").durable_tokens == len(history), "on SSD")
        # On SSD too, but a block is announced once, on the best medium holding it.
        assert not sub.events(BlockStored, "STORAGE")

        # Out of RAM: removed as device memory, announced as storage.
        assert c.release("agent").released_entries == 1
    wait_until(lambda: history[:whole] in _stored_chains(sub, "STORAGE"),
               "the released blocks announced as STORAGE")
    assert any(set(ram.block_hashes) <= set(e.block_hashes)
               for e in sub.events(BlockRemoved, "GPU"))
    ssd = next(e for e in sub.events(BlockStored, "STORAGE") if e.token_ids == history[:whole])
    assert ssd.block_hashes == ram.block_hashes and ssd.parent_block_hash is None

    # Numbered from 0, one by one.
    seqs = [seq for seq, _ in sub.poll()]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_a_returning_turn_announces_only_its_new_blocks_after_the_ones_held(events_stack):
    s, sub = events_stack
    with s.client() as c:
        c.generate(session_id="a", token_ids=list(range(200, 264)), append=True, max_tokens=4)
        first = list(c.get_session("a").token_ids)
        wait_until(lambda: any(e.token_ids == first[:len(first) // BLOCK * BLOCK]
                               for e in sub.events(BlockStored, "GPU")), "the first turn")
        before = len(sub.poll())
        c.generate(session_id="a", token_ids=list(range(300, 340)), append=True, max_tokens=4)
        second = list(c.get_session("a").token_ids)
    held = len(first) // BLOCK
    run = wait_until(lambda: next((e for _, b in sub.poll()[before:] for e in b.events
                                   if isinstance(e, BlockStored) and e.medium == "GPU"), None),
                     "the second turn's blocks")
    first_ram = next(e for e in sub.events(BlockStored, "GPU")
                     if e.token_ids == first[:held * BLOCK])
    # Anchored after the last block it shares with the first turn, which stays announced.
    assert run.parent_block_hash == first_ram.block_hashes[held - 1]
    assert run.token_ids == second[held * BLOCK:len(second) // BLOCK * BLOCK]
    assert not [e for _, b in sub.poll()[before:] for e in b.events
                if isinstance(e, BlockRemoved) and set(e.block_hashes) & set(first_ram.block_hashes)]


def test_a_missed_batch_is_replayed(events_stack):
    s, sub = events_stack
    wait_until(lambda: sub.events(AllBlocksCleared), "the state announced to a new subscriber")
    with s.client() as c:
        c.generate(session_id="a", token_ids=list(range(300, 340)), append=True, max_tokens=4)
    wait_until(lambda: sub.events(BlockStored, "GPU"), "a block in RAM")
    seen = sub.poll()
    replayed = sub.replay(seen[1][0])
    assert [seq for seq, _ in replayed] == [seq for seq, _ in seen[1:]]
    assert [b.events for _, b in replayed] == [b.events for _, b in seen[1:]]


def test_the_replay_buffer_keeps_the_newest_batches_within_its_bytes(monkeypatch):
    """A batch that announces a released conversation of 100K tokens is 300-500 KB: the replay
    buffer is bounded in bytes too, keeping the newest batches."""
    monkeypatch.setattr(kv_events, "REPLAY_BUFFER_BYTES", 10_000)
    pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    joined = threading.Event()
    publisher = Publisher(EventsConfig(pub, replay), on_subscribe=joined.set).start()
    sub = Subscriber(pub, replay)
    try:
        assert joined.wait(10), "the subscriber joined"
        for i in range(20):  # ~930 bytes each
            publisher.publish([{"type": "BlockRemoved", "block_hashes": [2**62 + i] * 100,
                                "medium": "GPU"}])
        wait_until(lambda: len(sub.poll()) == 20, "every batch sent")
        seqs = [seq for seq, _ in sub.replay(0)]
        assert 5 <= len(seqs) <= 11 and seqs == list(range(20 - len(seqs), 20))
    finally:
        sub.close()
        publisher.close()


def test_a_restarted_worker_announces_what_its_ssd_holds(events_stack):
    s, sub = events_stack
    with s.client() as c:
        c.generate(session_id="kept", token_ids=list(range(500, 580)), append=True,
                   max_tokens=4)
        history = list(c.get_session("kept").token_ids)
        wait_until(lambda: c.get_session("kept").durable_tokens == len(history),
                   "the conversation on SSD", timeout_s=30)
    whole = len(history) // BLOCK * BLOCK
    t0 = len(sub.poll())  # what the first worker said
    old = s.kill9("worker")
    s.wait_restarted("worker", old, timeout_s=120)

    def announced_again() -> bool:
        batches = [b for _, b in sub.poll()[t0:]]
        cleared = [i for i, b in enumerate(batches)
                   if any(isinstance(e, AllBlocksCleared) for e in b.events)]
        return bool(cleared) and any(
            isinstance(e, BlockStored) and e.medium == "STORAGE" and e.token_ids == history[:whole]
            for b in batches[cleared[0]:] for e in b.events)

    wait_until(announced_again, "AllBlocksCleared, then the SSD blocks, from the new worker",
               timeout_s=60)


def test_events_need_their_endpoint(tiny_model, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvbank.apps.cli", "worker", "--model", str(tiny_model),
                          "--data-dir", str(tmp_path / "d"), "--kv-events-replay-endpoint",
                          "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--kv-events-replay-endpoint needs --kv-events-endpoint" in out.stderr


# -- the book, block by block ------------------------------------------------------------------

class Batches:
    """Test seam: stands in for the Publisher (its sockets are tested above), keeping each
    batch's events as vllm-router decodes them."""

    def __init__(self):
        self.events: list = []

    def publish(self, events: list[dict]) -> None:
        self.events += DECODER.decode(msgpack.packb([0.0, events])).events


def _router(state: dict, events: list) -> None:
    """What a router knows after `events`: block id -> (medium, parent, tokens). Each block is
    stored once, after a block it knows (or at the root), and removed from where it was."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            state.clear()
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                assert state.pop(h)[0] == e.medium, "removed from where it was"
        else:
            assert e.parent_block_hash is None or e.parent_block_hash in state
            assert len(e.token_ids) == len(e.block_hashes) * BLOCK
            for i, h in enumerate(e.block_hashes):
                assert h not in state, "a block announced once"
                state[h] = (e.medium, e.block_hashes[i - 1] if i else e.parent_block_hash,
                            e.token_ids[i * BLOCK:(i + 1) * BLOCK])


def _expected(ram: dict, ssd: dict) -> dict:
    """Every block some holder holds, on its best medium (RAM over SSD)."""
    out = {}
    for medium, held in (("STORAGE", ssd), ("GPU", ram)):
        for (tenant, _), tokens in held.values():
            chain = [int(h) for h in block_hashes(tokens, bytes(_root(tenant)), BLOCK)]
            for i, h in enumerate(chain):
                out[h] = (medium, chain[i - 1] if i else None,
                          tokens[i * BLOCK:(i + 1) * BLOCK].tolist())
    return out


def test_each_block_is_announced_on_its_best_medium_while_a_holder_holds_it():
    """Conversations that share prefixes, in RAM entries and on SSD, taken and let go at
    random: after every change the router knows exactly the blocks held, each on its best
    medium, each stored once after its parent, removed when the last holder lets go; and the
    same after announcing it all again."""
    rng = np.random.default_rng(7)
    trunks = [rng.integers(0, 50_000, 40 * BLOCK).astype(np.uint32) for _ in range(3)]
    branches = [np.concatenate([trunks[i % 3][:rng.integers(0, 30) * BLOCK + rng.integers(16)],
                                rng.integers(0, 50_000, 300).astype(np.uint32)])
                for i in range(12)]
    ram: dict = {}  # entry key -> (session, tokens)
    ssd: dict = {}  # session -> (session, tokens): what LMDB holds
    events = KVEvents(Batches(), salt_for=lambda t: bytes(_root(t)), block_size=BLOCK,
                      ssd_tokens=lambda session: ssd[session][1])  # test seam: Conversations
    entries: dict = {}
    state: dict = {}
    for step in range(400):
        op = rng.integers(5)
        session = ("acme" if rng.integers(4) else "other", f"c{rng.integers(6)}")
        tokens = branches[rng.integers(len(branches))]
        tokens = tokens[:rng.integers(len(tokens) + 1)]
        if op == 0 or (op == 1 and not ram):  # a turn's entry (KV-less: the book reads none)
            e = BankEntry(key=step, session=session, tokens=tokens, block_ids=[], layers=[],
                          nbytes=0, last_used=0.0)
            entries[e.key], ram[e.key] = e, (session, tokens)
            events.ram_added(e)
        elif op == 1:  # an entry leaves, or (once in three) comes back as it was
            e = entries[list(ram)[rng.integers(len(ram))]]
            events.ram_removed(e)
            if rng.integers(3):
                del ram[e.key]
            else:
                events.ram_added(e)
        elif op in (2, 3):  # LMDB holds this much of a conversation now
            ssd[session] = (session, tokens)
            events.ssd_holds(session, tokens)
        elif rng.integers(4):  # deleted, or retired
            ssd.pop(session, None)
            events.ssd_holds(session, None)
        else:
            events.announce_all()
        events.flush()
        _router(state, events.publisher.events)
        events.publisher.events.clear()
        assert state == _expected(ram, ssd), f"step {step}"
    events.announce_all()
    events.flush()
    assert isinstance(events.publisher.events[0], AllBlocksCleared)
    _router(state, events.publisher.events)
    assert state == _expected(ram, ssd)


# -- at scale: what the book keeps of each conversation -------------------------------------

def _root(tenant: str):
    return chain_root(b"kv-events-test", tenant)


def _stored(path: Path, n: int) -> dict:
    """A store holding `n` conversations of LONG tokens, their whole blocks of 256 committed
    (durable): their histories. Each block's KV is a stand-in (a test seam: the events never
    read KV)."""
    histories, w = {}, ColdStore(path)
    for i in range(n):
        key = ("acme", f"agent-{i}")
        toks = histories[key] = np.random.default_rng(i).integers(1000, 20_000, LONG).astype(
            np.uint32)
        meta = w.put_session_tokens(*key, toks, 256)
        ids = [b.hex() for b in chain_block_ids(toks, _root("acme"), 256)]
        w.put_salvaged(replace(meta, blocks=ids), toks, lambda bid: b"KV stand-in")
    w.close()
    return histories


def _traced() -> int:
    """Python's heap as tracemalloc counts it, once what was let go is gone (pyzmq frees a
    large message's bytes on its own thread, once libzmq is done with it)."""
    last = -1
    for _ in range(40):
        gc.collect()
        now = tracemalloc.get_traced_memory()[0]
        if now == last:
            return now
        last = now
        time.sleep(0.05)
    return last


def _book_of_a_store(reader: StoreReader, check=None) -> tuple[KVEvents, int]:
    """The worker's KV events over a store's conversations, told what LMDB holds as the worker
    tells them at start (worker/tiers/manager.py), each batch sent; what the book keeps (bytes,
    with its publisher closed: its replay buffer is bounded apart, by batches).
    `check(events, subscriber)`: run on the engine's side before the publisher closes."""
    conversations = Conversations(root_for=_root, block_tokens=256, store=lambda: reader)
    conversations.load()
    pub, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    joined = threading.Event()
    publisher = Publisher(EventsConfig(pub, replay, block_size=BLOCK), on_subscribe=joined.set)
    sub = Subscriber(pub, replay)
    gc.collect()
    tracemalloc.start()
    try:
        before = _traced()
        events = KVEvents(publisher.start(), salt_for=lambda t: bytes(_root(t)),
                          block_size=BLOCK, ssd_tokens=conversations.history)  # as KVManager
        assert joined.wait(10), "the subscriber joined"
        for key, info in conversations.records.items():  # KVManager._ssd_changed
            events.ssd_holds(key, conversations.history(key)[:info.durable_tokens])
            events.flush()  # the engine's loop, once a turn
        got = 0
        while got < len(conversations.records):  # each batch sent, and thrown away
            assert sub.sub.poll(10_000), "a batch"
            sub.sub.recv_multipart()
            got += 1
        if check is not None:
            check(events, sub)
        publisher.close()
        held = _traced() - before
    finally:
        tracemalloc.stop()
        sub.close()
    return events, held


def test_the_book_keeps_50_kb_of_a_100k_token_conversation_and_rereads_its_tokens(tmp_path):
    """Eight conversations of 100K tokens on SSD: the book keeps under BOOK_BOUND of each (it
    was ~1 MB). Their tokens are read again from LMDB when a subscriber joins: announced again
    whole after AllBlocksCleared, with the ids the router was first told."""
    histories = _stored(tmp_path / "store", 8)
    reader = StoreReader(tmp_path / "store", readonly=True)

    def check(events: KVEvents, sub: Subscriber) -> None:
        sub.batches.clear()
        events.announce_all()
        events.flush()
        first = ("acme", "agent-0")
        events.ssd_holds(first, None)  # deleted
        events.flush()
        wait_until(lambda: sub.events(BlockRemoved), "the deleted one's blocks removed")
        cleared, *stored = sub.events()
        assert isinstance(cleared, AllBlocksCleared)
        assert sorted(e.token_ids for e in stored if isinstance(e, BlockStored)) == sorted(
            h[:LONG // 256 * 256].tolist() for h in histories.values())
        for e in stored:
            if isinstance(e, BlockStored):
                assert e.medium == "STORAGE" and e.parent_block_hash is None
                assert e.block_hashes == block_hashes(
                    np.array(e.token_ids, np.uint32), bytes(_root("acme")), BLOCK).tolist()
        removed = sub.events(BlockRemoved)
        assert [(e.medium, sorted(e.block_hashes)) for e in removed] == [  # in any order
            ("STORAGE", sorted(block_hashes(histories[first][:LONG // 256 * 256],
                                            bytes(_root("acme")), BLOCK).tolist()))]
        sub.batches.clear()

    try:
        _, held = _book_of_a_store(reader, check)
    finally:
        reader.close()
    assert held < 7 * BOOK_BOUND, f"{held / 7:.0f} bytes a conversation"


def test_kv_events_are_off_by_default(stack):
    """No endpoint, no publisher: nothing binds, the worker serves as before."""
    with stack.client() as c:
        c.generate(session_id="x", token_ids=list(range(10, 30)), append=True, max_tokens=2)
    # The worker logs its publisher while it starts, before it serves the turn above.
    assert "KV events on" not in stack.log_tail(100_000)


if __name__ == "__main__":  # what the book keeps: python -m tests.test_kv_events [N]
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    with tempfile.TemporaryDirectory() as d:
        _stored(Path(d), n)
        reader = StoreReader(Path(d), readonly=True)
        held = _book_of_a_store(reader)[1]
        reader.close()
    print(f"{n} conversations of {LONG} tokens on SSD, --kv-events-block-size {BLOCK}: "
          f"{held / n:.0f} bytes a conversation ({held / n / LONG:.2f} a token)")
