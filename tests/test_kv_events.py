"""KV events: a worker says which token blocks it holds, in vLLM's wire format, so a router in
front of several machines sends each conversation back to the one holding its KV.

Real processes; the events are read the way vllm-router reads them (a SUB socket, a DEALER
for replays) and decoded with msgspec structs that mirror vLLM's own definitions
(vllm/distributed/kv_events.py): same names, same field order, the batch array-like, each
event a map tagged by its type.
"""

from __future__ import annotations

import msgspec
import pytest
import zmq

from deploy.local import free_ports
from tests.conftest import start_stack
from tests.waiting import wait_until

BLOCK = 16


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

    out = subprocess.run([sys.executable, "-m", "apps.cli", "worker", "--model", str(tiny_model),
                          "--data-dir", str(tmp_path / "d"), "--kv-events-replay-endpoint",
                          "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--kv-events-replay-endpoint needs --kv-events-endpoint" in out.stderr


def test_kv_events_are_off_by_default(stack):
    """No endpoint, no publisher: nothing binds, the worker serves as before."""
    with stack.client() as c:
        c.generate(session_id="x", token_ids=list(range(10, 30)), append=True, max_tokens=2)
    # The worker logs its publisher while it starts, before it serves the turn above.
    assert "KV events on" not in stack.log_tail(100_000)
