"""The cache-kind seam: the one place the rest of the worker asks about a model's caches.

`mlx_lm`'s `make_prompt_cache(model)` returns one cache per attention-like layer (some models
share or skip layers, so this is never the layer count), each of a kind (worker/kv/kinds.py:
FULL, WINDOW, STATE, or a LIST of them). `CacheKinds` composes them: its leaves are the
caches that keep arrays, in order (a list's parts in place of the list), and

- the FULL leaves' K and V of every token are an entry's `layers`: cut at any token, kept in
  the bank and stored as blocks (worker/kv/arrays.py, worker/kv/codec.py);
- the WINDOW and STATE leaves are kept as *checkpoints*: their arrays at one position p,
  taken when a request's cache stood exactly there (a forward split there, the end of a
  prompt, the end of a turn). A conversation's state at token p is its FULL blocks up to p
  plus the checkpoint at p, so a model with any such leaf is restored only at a checkpoint.
  A window checkpoint holds at most W tokens per layer, so a long answer never costs more
  than W there.

The longest prefix an entry restores is a fixed point over the leaves (`restore_point`): each
kind accepts the candidate length or lowers it, until none lowers it (as vLLM's hybrid
coordinator finds its longest hit).

FULL leaves may be kept quantized at rest (`kv_bits`, `--kv-bits 8|4`): in the bank and on
SSD their K and V are `mx.quantize`d per token vector (worker/kv/quant.py); a request restores
them dequantized into mlx-lm's ordinary KVCache and runs in full precision, and its commit
quantizes only the tokens its turn added (`prefix`). WINDOW and STATE leaves stay full
precision. docs/decisions.md has why at rest and not while running.

Everything else in the worker asks this seam: the bank, restore, sharing, prefetch, the
scheduler and the writer hand it caches and get back arrays, or the other way round; none of
them looks inside a cache. A model whose caches include a class worker/kv/kinds.py does not
know is refused at start (`UnsupportedModel`), never served wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvbank.blocks import CorruptBlock
from kvbank.worker.kv import arrays, codec, quant
from kvbank.worker.kv.kinds import (MLX_LM_VERSION, CacheKind, FullKind, HeadKind,  # noqa: F401
                                    HiddenKind, Kind, ListKind, RollbackUnsupported, UnsupportedModel,
                                    kind_of)

CHECKPOINT_EVERY = 2048  # tokens between a long prompt's checkpoints, at least


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """The WINDOW and STATE leaves' arrays at one position, in leaf order (None: a state
    array the model has not written yet). Never written in place: a restore copies on first
    write."""

    arrays: tuple[tuple[mx.array | None, ...], ...]
    shared: bool = False  # it ends the prefix other conversations share (system and tools)
    # The router named its position (the system prompt's end, a prompt's end before the
    # generation prompt): a conversation comes back there, so it goes to SSD even inside a
    # block, as an anchor (worker/link/writer.py).
    anchored: bool = False

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for slot in self.arrays for a in slot if a is not None)

    def flat(self) -> list[mx.array | None]:
        return [a for slot in self.arrays for a in slot]


class CacheKinds:
    """A model's mix of cache kinds, and every move between its caches and kvbank's arrays."""

    def __init__(self, model, model_type: str, kv_bits: int | None = None):
        if kv_bits not in (None, 8, 4):
            raise ValueError(f"kv_bits {kv_bits!r}: 8, 4 or None (full precision)")
        self.model = model
        self.model_type = model_type
        self.kv_bits = kv_bits
        self.rest_bytes_per_token = 0  # one token's FULL K/V in the bank (`measure`)
        self.slots: tuple[CacheKind, ...] = tuple(
            kind_of(c, model_type, kv_bits) for c in make_prompt_cache(model))
        if not self.slots:
            raise UnsupportedModel(f"model_type {model_type!r} returns no caches")
        self.head: HeadKind | None = None  # the MTP head's layer, when it runs (`add_head`)
        self._index()
        self.full_kind = FullKind(kv_bits)  # what the FULL leaves share: their bits at rest

    def _index(self) -> None:
        self.leaves = tuple(leaf for s in self.slots for leaf in s.leaves())
        # One of each (leaves of one tag restore alike): what `restore_point` asks.
        self._distinct = tuple({leaf.tag: leaf for leaf in self.leaves}.values())

    def add_head(self, kv_heads: int, head_dim: int, dtype, hidden: int) -> None:
        """The MTP head's history becomes the last two slots of every cache: its attention
        layer (HeadKind, a row a token) and the model's hidden state it pairs with the next
        token (HiddenKind, at checkpoints). Before `measure` and the fingerprint, which then
        count them."""
        self.head = HeadKind(self.kv_bits, kv_heads, head_dim, dtype)
        self._hidden = HiddenKind(hidden, dtype)
        self.slots = self.slots + (self.head, self._hidden)
        self._index()

    def head_cache(self, cache: list):
        """The head's KV cache in a request's cache list (None without a head)."""
        return cache[-2] if self.head is not None else None

    def keep_hidden(self, cache: list, hidden: mx.array) -> None:
        """The model's hidden state [1, 1, H] where the cache now stands (its next
        checkpoint keeps it)."""
        self._hidden.keep(cache[-1], hidden)

    def kept_hidden(self, cache: list) -> mx.array | None:
        """The hidden state restored with the cache (None: not known)."""
        return self._hidden.kept(cache[-1])

    def model_caches(self, cache: list) -> list:
        """The caches the model's forward takes (mlx-lm's BatchGenerator among them): all but
        the head's."""
        return list(cache[:-2]) if self.head is not None else cache

    def with_head(self, cache: list, head_cache=None) -> list:
        """A cache list back from mlx-lm's batch with the head's history: `head_cache` (the
        one it had when the batch took it; None: a fresh one), which saw none of the batch's
        tokens (their rows are zeros: HeadKind), and no hidden state."""
        if self.head is None:
            return cache
        head = head_cache if head_cache is not None else self.head.fresh()
        return [*cache, head, self._hidden.fresh()]

    @classmethod
    def of(cls, model, kv_bits: int | None = None) -> "CacheKinds":
        """For a model loaded without its config at hand (tests, benchmarks)."""
        return cls(model, str(getattr(getattr(model, "args", None), "model_type", "?")),
                   kv_bits)

    @property
    def layout(self) -> str:
        """The slots in order (`full,window:128:0,...`), the MTP head's last
        (`...,mtp,mtp-hidden`): a block's layout says which it carries."""
        return ",".join(s.tag for s in self.slots)

    @property
    def model_layout(self) -> str:
        """The model's own slots (`layout` without the head's): part of the model fingerprint,
        so blocks written with and without MTP share their ids (kvbank/blocks.py
        `carries_head`)."""
        return ",".join(s.tag for s in self.slots[:len(self.slots) - 2 * self.has_head])

    @property
    def has_head(self) -> bool:
        return self.head is not None

    @property
    def full_count(self) -> int:
        """How many FULL leaves a cache has: the K/V pairs of an entry's layers."""
        return sum(1 for leaf in self.leaves if leaf.every_token)

    @property
    def quantized(self) -> str:
        """How FULL leaves are kept at rest, for the fingerprint (empty: full precision)."""
        return f"kv-bits:{self.kv_bits}:per-token" if self.kv_bits else ""

    @property
    def checkpointed(self) -> bool:
        """Whether restores need a checkpoint (any WINDOW or STATE leaf)."""
        return any(not leaf.every_token for leaf in self.leaves)

    @property
    def has_full(self) -> bool:
        """Whether entries hold layers (any FULL leaf)."""
        return any(leaf.every_token for leaf in self.leaves)

    def new_cache(self) -> list:
        return self.with_head(make_prompt_cache(self.model))

    def _leaves(self, cache: list) -> list[tuple[CacheKind, object]]:
        """(kind, cache) of every leaf of a model's cache list, in order."""
        return [(leaf, c) for s, slot in zip(self.slots, cache)
                for leaf, c in zip(s.leaves(), s.caches(slot))]

    def full_caches(self, cache: list) -> list:
        """The FULL leaves' caches, in order (an entry's layers are theirs)."""
        return [c for leaf, c in self._leaves(cache) if leaf.every_token]

    def other_caches(self, cache: list) -> list:
        """The WINDOW and STATE leaves' caches, in order (a checkpoint's arrays are theirs)."""
        return [c for leaf, c in self._leaves(cache) if not leaf.every_token]

    # -- sizes ------------------------------------------------------------------------------

    def measure(self) -> tuple[int, int, str]:
        """(bytes per token of FULL leaves, bytes of one checkpoint at its largest, dtype),
        from a one-token forward. A window's checkpoint is priced at W tokens. The bytes per
        token are a running request's (full precision); `rest_bytes_per_token` is what the
        bank and SSD hold of one token."""
        cache = self.new_cache()
        self.model(mx.array([[0]]), cache=self.model_caches(cache))
        mx.eval([c.state for c in cache])
        per_token, checkpoint, dtype, rest = 0, 0, None, 0
        self.model_bytes_per_token = 0  # the model's own (the fingerprint's): not the head's
        for leaf, c in self._leaves(cache):
            size = leaf.measure(c)
            per_token += size.per_token
            self.model_bytes_per_token += size.per_token if leaf is not self.head else 0
            rest += size.rest_per_token
            checkpoint += size.checkpoint
            dtype = size.dtype if leaf.every_token else (dtype or size.dtype)
        self.rest_bytes_per_token = rest
        return per_token, checkpoint, dtype or "float32"

    # -- a running request's cache -> the bank ------------------------------------------------

    def snapshot(self, cache: list) -> Checkpoint | None:
        """The WINDOW and STATE leaves as they stand now (None for a model without them).
        Take it when the cache stands exactly at the position it will be filed under."""
        if not self.checkpointed:
            return None
        out = Checkpoint(tuple(leaf.snapshot(c) for leaf, c in self._leaves(cache)
                               if not leaf.every_token))
        mx.eval([a for a in out.flat() if a is not None])
        return out

    def freeze(self, cache: list, n_tokens: int, prefix=None, tight: bool = True
               ) -> tuple[arrays.Layers, Checkpoint | None]:
        """A finished turn's cache, standing at `n_tokens`, as the bank keeps it: the FULL
        leaves' first n_tokens, and the checkpoint at n_tokens. `prefix`: what the request's
        cache was restored from (`at_rest`), kept as it is. `tight`: whether buffers with much
        room may be copied tight (FullKind.freeze)."""
        position = self.position(cache)
        if position is not None and position != n_tokens and self.checkpointed:
            raise RuntimeError(f"bug: cache stands at {position}, checkpoint wants {n_tokens}")
        return self.full_layers(cache, n_tokens, prefix, tight), self.snapshot(cache)

    def full_layers(self, cache: list, n_tokens: int, prefix=None,
                    tight: bool = True) -> arrays.Layers:
        """The FULL leaves' first n_tokens (a cache that may stand past them), as kept at rest:
        quantized past `prefix` when kv_bits is set (see `at_rest`)."""
        held = prefix[0] if prefix is not None and self.kv_bits else None
        layers = [leaf.freeze(c, n_tokens, (held[i], prefix[1]) if held is not None else None,
                              tight)
                  for i, (leaf, c) in enumerate((leaf, c) for leaf, c in self._leaves(cache)
                                                if leaf.every_token)]
        mx.eval(layers)
        return layers

    def at_rest(self, cache: list) -> tuple[arrays.Layers, int] | None:
        """The quantized layers (and how many of their tokens) a cache `restore` made stands
        on: its commit keeps them as they are and quantizes only what the request added.
        None: full precision, or a cache restored from nothing."""
        return getattr(cache, "at_rest", None)

    def cut(self, layers: arrays.Layers, n_tokens: int) -> arrays.Layers:
        """An entry's first n_tokens in tight arrays of their own (either form)."""
        return arrays.tight(layers, n_tokens)

    def position(self, cache: list) -> int | None:
        """Where a cache stands, when a leaf can say (a STATE leaf cannot)."""
        return next((p for leaf, c in self._leaves(cache)
                     if (p := leaf.position(c)) is not None), None)

    def trim(self, cache: list, n: int) -> bool:
        """Take back a cache's last n tokens in place, where every leaf can (a STATE leaf
        cannot: such a model goes back to a checkpoint instead). Whether it did."""
        leaves = self._leaves(cache)
        if not all(leaf.trimmable(c, n) for leaf, c in leaves):
            return False
        for leaf, c in leaves:
            leaf.trim(c, n)
        return True

    def rewindable(self) -> str | None:
        """Why a speculative verify could not be rolled back exactly (None: it can)."""
        for leaf in self._distinct:
            if type(leaf).rewind is CacheKind.rewind or isinstance(leaf, ListKind):
                return f"a {leaf.tag} cache cannot be rolled back after a rejected draft"
        return None

    def recorded(self, cache: list) -> list:
        """The leaves whose rollback needs the verify's per-token record (their caches)."""
        return [c for leaf, c in self._leaves(cache) if leaf.records]

    def rewind(self, cache: list, fed: int, keep: int, records: dict) -> None:
        """Every leaf as a forward of the first `keep` of the `fed` tokens just fed would have
        left it (`records`: id(leaf cache) -> what the forward kept for it)."""
        for leaf, c in self._leaves(cache):
            leaf.rewind(c, fed, keep, records.get(id(c)))

    # -- the bank -> a request's own cache ----------------------------------------------------

    def restore(self, layers: arrays.Layers, checkpoint: Checkpoint | None, n_tokens: int,
                owned: bool = False) -> list:
        """A request's own cache at `n_tokens`: the FULL leaves over `layers` (`owned`: write
        in place past n_tokens, see FullKind.restore), the others from `checkpoint`, which must
        stand at n_tokens. A checkpoint's arrays are never handed over: the request's writes
        copy."""
        if self.checkpointed and checkpoint is None and n_tokens:
            raise RuntimeError("bug: a restore past 0 tokens without its checkpoint")
        quantized = quant.is_quantized(layers) and n_tokens
        if quantized and not self.kv_bits:
            raise RuntimeError("bug: quantized KV restored by a full-precision worker")
        full, saved = iter(layers), iter(checkpoint.arrays if checkpoint is not None else ())

        def restored(leaf: CacheKind, fresh):
            if leaf.every_token:
                pair = next(full, None)  # none: blocks written without the MTP head's layer
                return (leaf.absent(fresh, n_tokens) if pair is None
                        else leaf.restore(fresh, pair, n_tokens, owned))
            part = next(saved, None)
            return fresh if part is None else leaf.restore(fresh, part, n_tokens)

        cache = [s.rebuild(c, restored) for s, c in zip(self.slots, self.new_cache())]
        if quantized:
            cache = _Restored(cache)
            cache.at_rest = (layers, n_tokens)
        return cache

    def view(self, cache: list) -> list:
        """A running request's cache as it stands, as a new cache that copies on write."""
        snap = self.snapshot(cache)
        n = self.position(cache)
        layers = [leaf.view(c) for leaf, c in self._leaves(cache) if leaf.every_token]
        return self.restore(layers, snap, n if n is not None else 0)

    def block_bits(self) -> int | None:
        """The bits a block's K/V are encoded at (None: full precision)."""
        return self.kv_bits

    def check_block(self, header) -> None:
        """A stored block this worker would misread (its K/V at other bits than the worker
        keeps) is not the block its id names (the bits are in the fingerprint the ids chain
        over): CorruptBlock, never decoded."""
        bits = header.quant[0] if header.quant is not None else None
        if header.kv_shapes and bits != self.kv_bits:
            raise CorruptBlock(f"block quantized at {bits or 'full precision'}, this worker "
                               f"keeps --kv-bits {self.kv_bits or 'off'}")

    def with_room(self, cache: list, n_tokens: int) -> None:
        for c in self.full_caches(cache):
            self.full_kind.with_room(c, n_tokens)

    def has_room(self, layers: arrays.Layers, n_tokens: int) -> bool:
        """Whether an entry's buffers take a request of n_tokens in place (`with_room` copies
        none of them)."""
        return all(self.full_kind.has_room(k, n_tokens) for k, _ in layers)

    # -- which prefixes an entry serves ------------------------------------------------------

    def restore_point(self, checkpoints: Iterable[int], n_tokens: int) -> int:
        """The longest prefix <= n_tokens that an entry (or a stored chain) with checkpoints
        at these positions restores: a fixed point over the leaves, each accepting the
        candidate or lowering it (any prefix, for FULL leaves alone; else the newest checkpoint
        at or before it; 0: none)."""
        positions = tuple(checkpoints)
        while True:
            m = n_tokens
            for leaf in self._distinct:
                m = leaf.restorable(m, positions)
            if m == n_tokens:
                return n_tokens
            n_tokens = m

    def splits(self, cached: int, n_tokens: int, marks, every: int) -> tuple[int, ...]:
        """Where a prompt's read stops to keep a checkpoint (none for a model without window
        or recurrent caches): where the router says the conversation comes back to (`marks`),
        and every `every` tokens past what was restored."""
        if not self.checkpointed:
            return ()
        steps = range((cached // every + 1) * every, n_tokens, every) if every else ()
        return tuple(sorted({p for p in (*steps, *marks) if cached < p < n_tokens}))

    # -- on SSD -----------------------------------------------------------------------------

    def checkpoint_views(self, checkpoint: Checkpoint) -> codec.StateViews:
        """Zero-copy NumPy views of a checkpoint's arrays, for a block's payload (engine
        thread; reading them is plain NumPy after)."""
        flat = checkpoint.flat()
        views = iter(arrays.numpy_views([a for a in flat if a is not None]))
        return [None if a is None else (str(a.dtype).split(".")[-1], next(views))
                for a in flat]

    def checkpoint_from_arrays(self, flat: list[mx.array | None]) -> Checkpoint:
        """A checkpoint decoded from a block, in `checkpoint_views`' order. A block written
        without the MTP head has no hidden state (None: not known); one written with it has an
        array more than a worker without it reads."""
        it = iter(flat)
        return Checkpoint(tuple(tuple(next(it, None) for _ in range(leaf.saved_arrays()))
                                for leaf in self.leaves if not leaf.every_token))


class _Restored(list):
    """A restored cache list that remembers the quantized layers it stands on (`at_rest`)."""

    at_rest: tuple | None = None
