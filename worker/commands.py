"""What other threads may ask of the engine, and what they may read of it.

The engine thread owns the model, the bank, the writer and the conversation records. Every
other thread (the gRPC handlers, the memory guard, the coldstore link) posts one of these
commands to its queue, and gets the answer through the command's future; between commands
it reads the `Snapshot` the engine publishes whole after every turn of its loop.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from kvbank.contracts.vocabulary import PressureLevel, PressureSource
from kvbank.v1 import worker_pb2

SessionKey = tuple[str, str]  # (tenant, session_id)


@dataclass
class Command:
    """Base: `reply` resolves with the handler's result, or its exception."""

    reply: Future = field(default_factory=Future, init=False, repr=False, compare=False)


@dataclass
class Generate:
    """One generation; its answers go through `emit` (thread-safe): responses, then None, or
    an Exception."""

    request: worker_pb2.WorkerGenerateRequest
    emit: Callable[[Any], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.monotonic)
    grammar: Any = None  # its grammar, compiled off the engine (compute/grammar_compile.py)
    decoding: Any = None  # its Decoding, made once by the engine (it may wait several turns)


@dataclass
class DeleteSession(Command):
    session: SessionKey


@dataclass
class Release(Command):
    """Admin: one conversation's KV leaves RAM (written out first with `write_out`)."""

    session: SessionKey
    write_out: bool


@dataclass
class Trim(Command):
    """Admin: every idle conversation already on SSD leaves RAM: `tenant`'s, or (None, the
    operator's call) every tenant's."""

    tenant: str | None = None


@dataclass
class Flush(Command):
    """Admin: write every conversation not on SSD yet, now: `tenant`'s, or (None) all."""

    tenant: str | None = None


@dataclass
class Status(Command):
    """The status numbers and the receipts `tenant` may see (None: the operator, all)."""

    tenant: str | None


@dataclass
class Tick(Command):
    """The guard's tick: reconcile the ledger with `rss_bytes`, set the bank's dynamic
    ceiling, send again the writes that need it."""

    rss_bytes: int


@dataclass
class PressureTrim(Command):
    """The guard's action at a raised pressure level."""

    level: PressureLevel
    source: PressureSource
    deferred_s: float


@dataclass
class Probe(Command):
    """How many of `tokens` the RAM bank and LMDB hold: (ram_tokens, ssd_tokens)."""

    tenant: str
    tokens: Any  # np.ndarray, uint32


@dataclass
class Prefetch(Command):
    """A hint that a conversation will come back: bring its KV from SSD into RAM now, if
    memory allows without pushing anything out. `tokens` empty: the named conversation's
    committed history. Replies a `PrefetchReport`."""

    tenant: str
    session_id: str
    tokens: Any  # np.ndarray, uint32
    # A pre-render: compute what RAM lacks of `tokens` in idle time (worker/compute/prerender.py)
    prefill: bool = False


@dataclass(frozen=True)
class PrefetchReport:
    # restored | restoring | in_ram | not_held | no_room | unknown; a pre-render's:
    # prerendering | in_ram | no_room | off | unknown
    status: str
    ram_tokens: int = 0   # held in RAM before the hint
    ssd_tokens: int = 0   # whole blocks committed in LMDB
    restored_tokens: int = 0


@dataclass
class History(Command):
    """A conversation's record and committed tokens, read where they are
    (worker/tiers/conversations.py): (None, None) without a record. LMDB is read on the engine's
    thread only: a map resize there remaps what another thread would be reading."""

    session: SessionKey


@dataclass
class Announce(Command):
    """A KV-event subscriber joined: announce every block held, after clearing."""


@dataclass
class Stop(Command):
    pass


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What the worker knows of a conversation's record (replaced, never mutated). Its tokens
    are the store's once it has them (`Conversations.history`): a store holds many
    conversations of 100K tokens, and RAM keeps only what no read can give."""

    n_tokens: int
    durable_tokens: int
    created_at: float
    updated_at: float
    recorded: bool = True  # the record on disk holds this history
    held: Any = None  # the history itself (np.ndarray) while the store may lack it
    ram: Any = None  # weakref to the bank entry's tokens: read there while it is in RAM
    tail: Any = None  # an anonymous one's tokens after its lineage anchor (worker/tiers/lineage.py)


@dataclass(frozen=True)
class Snapshot:
    """The engine's state as other threads may read it, published whole."""

    sessions: dict[SessionKey, SessionInfo] = field(default_factory=dict)
    ram_bytes: dict[SessionKey, int] = field(default_factory=dict)
    checkpoint_bytes: dict[SessionKey, int] = field(default_factory=dict)  # of ram_bytes
    busy: frozenset[SessionKey] = frozenset()
    held_bytes: int = 0  # everything the worker answers for (the guard's ledger level)
    kv_bytes: int = 0  # the bank's entries and running requests' caches
    bank_bytes: int = 0
    bank_entries: int = 0
    running: int = 0
    waiting: int = 0

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def state(self, key: SessionKey) -> str:
        """Where a conversation's KV is: active | resident-dirty | resident-clean | cold |
        gone."""
        info = self.sessions.get(key)
        ram = self.ram_bytes.get(key, 0)
        if key in self.busy:
            return "active"
        if ram and info is not None and info.durable_tokens < info.n_tokens:
            return "resident-dirty"
        if ram:
            return "resident-clean"
        return "cold" if info is not None and info.durable_tokens > 0 else "gone"


SESSION_STATES = ("active", "resident-dirty", "resident-clean", "cold", "gone")
