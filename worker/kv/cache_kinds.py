"""The cache-kind seam: the one place that knows what a model's per-layer caches hold.

`mlx_lm`'s `make_prompt_cache(model)` returns one cache per attention-like layer (some models
share or skip layers, so this is never the layer count). Each is of a kind:

- FULL (`KVCache`): K and V of every token. An entry serves any prefix of its tokens; its
  arrays are cut at any token and stored as blocks (worker/kv/arrays.py, worker/kv/codec.py).
- WINDOW (`RotatingKVCache`, W = `max_size`): a ring of the last W tokens' K and V. What
  continues a conversation at token p is the window before p and nothing else.
- STATE (`ArraysCache`: Gated DeltaNet, Mamba, conv states): a fixed-size state that exists
  only where a forward stopped.

WINDOW and STATE slots are kept as *checkpoints*: their arrays at one position p, taken when a
request's cache stood exactly there (a forward split there, the end of a prompt, the end of a
turn). A conversation's state at token p is its FULL blocks up to p plus the checkpoint at p,
so a model with any such slot is restored only at a checkpoint (`restore_point`). A window
checkpoint holds at most W tokens per layer, so a long answer never costs more than W there.

FULL slots may be kept quantized at rest (`kv_bits`, `--kv-bits 8|4`): in the bank and on
SSD their K and V are `mx.quantize`d per token vector (worker/kv/quant.py); a request restores them
dequantized into mlx-lm's ordinary KVCache and runs in full precision, and its commit
quantizes only the tokens its turn added (`prefix`). WINDOW and STATE slots stay full
precision. docs/decisions.md has why at rest and not while running.

Everything else in the worker asks this seam: the bank, restore, sharing, prefetch, the
scheduler and the writer hand it caches and get back arrays, or the other way round; none of
them looks inside a cache. A model whose caches include a kind this module does not know is
refused at start (`UnsupportedModel`), never served wrong.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from kvbank.blocks import CorruptBlock
from kvbank.worker.kv import arrays, codec, quant

MLX_LM_VERSION = "0.32.2"  # the caches' internals read here (pyproject pins it)
CHECKPOINT_EVERY = 2048  # tokens between a long prompt's checkpoints, at least


class Kind(enum.StrEnum):
    FULL = "full"
    WINDOW = "window"
    STATE = "state"


@dataclass(frozen=True, slots=True)
class Slot:
    """One cache of the model's list: its kind and the numbers that fix its shape."""

    kind: Kind
    size: int = 0  # WINDOW: max_size (W); STATE: how many arrays
    keep: int = 0  # WINDOW: leading tokens the ring never drops

    @property
    def tag(self) -> str:
        """How the slot is named in the model fingerprint and a block's header."""
        if self.kind is Kind.FULL:
            return "full"
        return f"{self.kind}:{self.size}" + (f":{self.keep}" if self.kind is Kind.WINDOW else "")


class UnsupportedModel(RuntimeError):
    """A model with a cache kind kvbank cannot restore exactly: refused at start."""


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """The WINDOW and STATE slots' arrays at one position, in slot order (None: a state array
    the model has not written yet). Never written in place: a restore copies on first write."""

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


def classify(c, model_type: str) -> Slot:
    """The kind of one of `make_prompt_cache`'s caches (exact classes: a subclass may keep
    more, or less, than its base)."""
    if type(c) is KVCache:
        return Slot(Kind.FULL)
    if type(c) is RotatingKVCache:
        return Slot(Kind.WINDOW, size=int(c.max_size), keep=int(c.keep))
    if type(c) is ArraysCache:
        return Slot(Kind.STATE, size=len(c.cache))
    raise UnsupportedModel(
        f"model_type {model_type!r} uses the cache class {type(c).__name__}, which kvbank "
        f"cannot restore exactly yet (it serves {', '.join(sorted(k.value for k in Kind))} "
        f"caches: KVCache, RotatingKVCache, ArraysCache). Serve another model, or open an "
        f"issue naming the model_type.")


class CacheKinds:
    """A model's mix of cache kinds, and every move between its caches and kvbank's arrays."""

    def __init__(self, model, model_type: str, kv_bits: int | None = None):
        if kv_bits not in (None, 8, 4):
            raise ValueError(f"kv_bits {kv_bits!r}: 8, 4 or None (full precision)")
        self.model = model
        self.model_type = model_type
        self.kv_bits = kv_bits
        self.rest_bytes_per_token = 0  # one token's FULL K/V in the bank (`measure`)
        self.slots = tuple(classify(c, model_type) for c in make_prompt_cache(model))
        if not self.slots:
            raise UnsupportedModel(f"model_type {model_type!r} returns no caches")
        self.full = [i for i, s in enumerate(self.slots) if s.kind is Kind.FULL]
        self.other = [i for i, s in enumerate(self.slots) if s.kind is not Kind.FULL]

    @classmethod
    def of(cls, model, kv_bits: int | None = None) -> "CacheKinds":
        """For a model loaded without its config at hand (tests, benchmarks)."""
        return cls(model, str(getattr(getattr(model, "args", None), "model_type", "?")),
                   kv_bits)

    @property
    def layout(self) -> str:
        """The slots in order (`full,window:128:0,...`): part of the model fingerprint."""
        return ",".join(s.tag for s in self.slots)

    @property
    def quantized(self) -> str:
        """How FULL slots are kept at rest, for the fingerprint (empty: full precision)."""
        return f"kv-bits:{self.kv_bits}:per-token" if self.kv_bits else ""

    @property
    def checkpointed(self) -> bool:
        """Whether restores need a checkpoint (any WINDOW or STATE slot)."""
        return bool(self.other)

    def new_cache(self) -> list:
        return make_prompt_cache(self.model)

    # -- sizes ------------------------------------------------------------------------------

    def measure(self) -> tuple[int, int, str]:
        """(bytes per token of FULL slots, bytes of one checkpoint at its largest, dtype),
        from a one-token forward. A window slot's checkpoint is priced at W tokens. The bytes
        per token are a running request's (full precision); `rest_bytes_per_token` is what
        the bank and SSD hold of one token."""
        cache = self.new_cache()
        self.model(mx.array([[0]]), cache=cache)
        mx.eval([c.state for c in cache])
        per_token, checkpoint, dtype, rest = 0, 0, None, 0
        for slot, c in zip(self.slots, cache):
            if slot.kind is Kind.STATE:
                checkpoint += sum(int(a.nbytes) for a in c.cache if a is not None)
                dtype = dtype or next(a.dtype for a in c.cache if a is not None)
                continue
            one = int(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes)
            dtype = c.keys.dtype if slot.kind is Kind.FULL or dtype is None else dtype
            if slot.kind is Kind.FULL:
                per_token += one
                rest += (one if not self.kv_bits else
                         sum(int(x.nbytes) for a in (c.keys, c.values)
                             for x in quant.quantize(a[..., :1, :], self.kv_bits)))
            else:
                checkpoint += one * (slot.size + slot.keep)
        self.rest_bytes_per_token = rest
        return per_token, checkpoint, str(dtype).split(".")[-1]

    # -- a running request's cache -> the bank ------------------------------------------------

    def snapshot(self, cache: list) -> Checkpoint | None:
        """The WINDOW and STATE slots as they stand now (None for a model without them).
        Take it when the cache stands exactly at the position it will be filed under."""
        if not self.other:
            return None
        parts = []
        for i in self.other:
            c, slot = cache[i], self.slots[i]
            if slot.kind is Kind.STATE:
                parts.append(tuple(c.cache))
            else:
                parts.append(_window_tail(c))
        out = Checkpoint(tuple(parts))
        mx.eval([a for a in out.flat() if a is not None])
        return out

    def freeze(self, cache: list, n_tokens: int, prefix=None
               ) -> tuple[arrays.Layers, Checkpoint | None]:
        """A finished turn's cache, standing at `n_tokens`, as the bank keeps it: the FULL
        slots' first n_tokens, and the checkpoint at n_tokens. `prefix`: what the request's
        cache was restored from (`at_rest`), kept as it is."""
        position = self.position(cache)
        if position is not None and position != n_tokens and self.other:
            raise RuntimeError(f"bug: cache stands at {position}, checkpoint wants {n_tokens}")
        return self.full_layers(cache, n_tokens, prefix), self.snapshot(cache)

    def full_layers(self, cache: list, n_tokens: int, prefix=None) -> arrays.Layers:
        """The FULL slots' first n_tokens (a cache that may stand past them), as kept at rest:
        quantized past `prefix` when kv_bits is set (see `at_rest`)."""
        full = [cache[i] for i in self.full]
        if self.kv_bits:
            return arrays.freeze_quantized(full, n_tokens, self.kv_bits, prefix)
        return arrays.freeze(full, n_tokens)

    def at_rest(self, cache: list) -> tuple[arrays.Layers, int] | None:
        """The quantized layers (and how many of their tokens) a cache `restore` made stands
        on: its commit keeps them as they are and quantizes only what the request added.
        None: full precision, or a cache restored from nothing."""
        return getattr(cache, "at_rest", None)

    def cut(self, layers: arrays.Layers, n_tokens: int) -> arrays.Layers:
        """An entry's first n_tokens in tight arrays of their own (either form)."""
        return arrays.tight(layers, n_tokens)

    def position(self, cache: list) -> int | None:
        """Where a cache stands, when a slot can say (a STATE slot cannot)."""
        for slot, c in zip(self.slots, cache):
            if slot.kind is not Kind.STATE:
                return int(c.offset)
        return None

    # -- the bank -> a request's own cache ----------------------------------------------------

    def restore(self, layers: arrays.Layers, checkpoint: Checkpoint | None, n_tokens: int,
                owned: bool = False) -> list:
        """A request's own cache at `n_tokens`: the FULL slots over `layers` (`owned`: write in
        place past n_tokens, see arrays.restore), the others from `checkpoint`, which must stand at
        n_tokens. A checkpoint's arrays are never handed over: the request's writes copy."""
        if self.other and checkpoint is None and n_tokens:
            raise RuntimeError("bug: a restore past 0 tokens without its checkpoint")
        cache = self.new_cache()
        if quant.is_quantized(layers) and n_tokens:
            if not self.kv_bits:
                raise RuntimeError("bug: quantized KV restored by a full-precision worker")
            cache = _Restored(cache)
            cache.at_rest = (layers, n_tokens)
        for i, c in zip(self.full, arrays.restore(layers, n_tokens, owned=owned, bits=self.kv_bits)):
            cache[i] = c
        if checkpoint is None:
            return cache
        for i, saved in zip(self.other, checkpoint.arrays):
            c = cache[i]
            if self.slots[i].kind is Kind.STATE:
                c.cache = [None if a is None else a[...] for a in saved]
            else:
                k, v = saved
                c.keys, c.values = k[...], v[...]
                c.offset, c._idx = n_tokens, int(k.shape[2])
        return cache

    def view(self, cache: list) -> list:
        """A running request's cache as it stands, as a new cache that copies on write."""
        snap = self.snapshot(cache)
        n = self.position(cache)
        layers = [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :])
                  for c in (cache[i] for i in self.full)]
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
        arrays.with_room([cache[i] for i in self.full], n_tokens)

    # -- which prefixes an entry serves ------------------------------------------------------

    def restore_point(self, checkpoints: Iterable[int], n_tokens: int) -> int:
        """The longest prefix <= n_tokens that an entry can restore: any, for FULL slots alone;
        else its newest checkpoint at or before n_tokens (0: none)."""
        if not self.other:
            return n_tokens
        return max((p for p in checkpoints if p <= n_tokens), default=0)

    def splits(self, cached: int, n_tokens: int, marks, every: int) -> tuple[int, ...]:
        """Where a prompt's read stops to keep a checkpoint (none for a model without window
        or recurrent caches): where the router says the conversation comes back to (`marks`),
        and every `every` tokens past what was restored."""
        if not self.other:
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
        """A checkpoint decoded from a block, in `checkpoint_views`' order."""
        out, it = [], iter(flat)
        for i in self.other:
            slot = self.slots[i]
            out.append(tuple(next(it) for _ in range(slot.size if slot.kind is Kind.STATE
                                                       else 2)))
        return Checkpoint(tuple(out))


class _Restored(list):
    """A restored cache list that remembers the quantized layers it stands on (`at_rest`)."""

    at_rest: tuple | None = None


def _window_tail(c: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A window cache's tokens in order: its `keep` first, then the last W - keep (after a
    multi-token forward the ring holds W - 1 + S; before it fills, fewer than W)."""
    keys, values, offset, keep, max_size, _ = c.state
    if keys is None:
        raise RuntimeError("bug: a window checkpoint of an empty cache")
    held = min(offset, max_size)
    out = []
    for a in (c._temporal_order(keys), c._temporal_order(values)):
        if a.shape[2] > held:
            a = (mx.concatenate([a[..., :keep, :], a[..., a.shape[2] - (held - keep):, :]],
                                axis=2) if keep else a[..., a.shape[2] - held:, :])
        out.append(mx.contiguous(a))
    return out[0], out[1]
