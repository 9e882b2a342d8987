"""One class per kind of mlx-lm cache: what kvbank keeps of it, and how it comes back.

`make_prompt_cache(model)` returns one cache per attention-like layer, each an instance of one
of mlx-lm's cache classes; each class is served by one kind here (`KINDS`):

- `FullKind` (`KVCache`): K and V of every token. An entry serves any prefix of its tokens;
  its arrays are cut at any token, kept in the bank as an entry's layers and stored as blocks.
- `WindowKind` (`RotatingKVCache`, W = `max_size`): a ring of the last W tokens' K and V.
  What continues a conversation at token p is the window before p and nothing else.
- `StateKind` (`ArraysCache`: Gated DeltaNet, Mamba, conv states): a fixed-size state that
  exists only where a forward stopped.
- `ListKind` (`CacheList`): the caches one layer keeps side by side (Falcon-H1's and
  Baichuan-M1's conv state beside their attention cache). Each part is served by its own kind,
  as a layer of its own would be.

WINDOW and STATE caches are kept as *checkpoints*: their arrays at one position, taken when
the request's cache stood exactly there (worker/kv/cache_kinds.py composes them).

Each kind measures, snapshots, restores, cuts and trims its own caches, and says how many
arrays a block stores of it, reading and writing a cache only through mlx-lm's public `state`
and its constructors: nothing here assigns a cache's private fields. This is the only file
that knows mlx-lm's cache classes: a new one is a class here and its line in `KINDS`, and an
mlx-lm upgrade that changes one changes its class.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from kvbank.blocks import HEAD_TAG, HIDDEN_TAG
from kvbank.worker.kv import arrays, quant
from kvbank.worker.kv.arrays import Layers

MLX_LM_VERSION = "0.32.2"  # the caches' `state` layouts read here (pyproject pins it)


class Kind(enum.StrEnum):
    FULL = "full"
    WINDOW = "window"
    STATE = "state"
    LIST = "list"


class UnsupportedModel(RuntimeError):
    """A model with a cache kind kvbank cannot restore exactly: refused at start."""


class RollbackUnsupported(RuntimeError):
    """A cache kvbank cannot roll back exactly after a rejected draft: the model is served
    without MTP."""


@dataclass(frozen=True, slots=True)
class Size:
    """What one cache holds after a one-token forward: bytes a token adds while running and
    at rest (FULL), bytes of a checkpoint at its largest (WINDOW, STATE), and its dtype."""

    per_token: int = 0
    rest_per_token: int = 0
    checkpoint: int = 0
    dtype: str | None = None


class CacheKind:
    """Base: one mlx-lm cache class, as kvbank keeps it."""

    kind: ClassVar[Kind]
    cache_class: ClassVar[type]
    every_token: ClassVar[bool] = False  # its K/V go in an entry's layers; else a checkpoint

    @property
    def tag(self) -> str:
        """How it is named in the model fingerprint and a block's layout."""
        return str(self.kind)

    def leaves(self) -> tuple["CacheKind", ...]:
        """The kinds that keep arrays, in order (a list's: its parts')."""
        return (self,)

    def caches(self, cache) -> list:
        """This slot's caches, in `leaves` order."""
        return [cache]

    def rebuild(self, fresh, restored: Callable[["CacheKind", object], object]):
        """A cache of this slot made of `restored(leaf kind, fresh leaf cache)` for each leaf."""
        return restored(self, fresh)

    def measure(self, cache) -> Size:
        raise NotImplementedError

    def position(self, cache) -> int | None:
        """Where the cache stands, when it can say (a state cannot)."""
        return None

    def restorable(self, n_tokens: int, checkpoints: Iterable[int]) -> int:
        """The longest prefix <= n_tokens this kind restores, given where checkpoints stand:
        only at one (a window's, a state's), by default."""
        return max((p for p in checkpoints if p <= n_tokens), default=0)

    def absent(self, fresh, n_tokens: int):
        """The cache restored where the stored blocks hold none of this kind's layer (only
        the MTP head's can be missing: `HeadKind`)."""
        return fresh

    def trimmable(self, cache, n: int) -> bool:
        """Whether `trim` can take back the cache's last n tokens (a state never can: it
        exists only where a forward stopped)."""
        return False

    def trim(self, cache, n: int) -> None:
        """Take back the cache's last n tokens in place (`trimmable` first)."""
        raise RuntimeError(f"bug: a {self.kind} cache cannot be trimmed")

    # -- a rejected draft (MTP): worker/kv/rollback.py records, these take back ---------------

    records: ClassVar[bool] = False  # whether `rewind` needs what the verify's forward kept

    def rewind(self, cache, fed: int, keep: int, record=None) -> None:
        """After a forward of `fed` tokens (a speculative verify), the cache as a forward of
        its first `keep` tokens would have left it, exactly. `record`: what that forward
        kept for this cache (`records` kinds only)."""
        raise RollbackUnsupported(f"a {type(cache).__name__} cache")

    # -- checkpoints (not every_token) --------------------------------------------------------

    def snapshot(self, cache) -> tuple:
        """The cache's arrays as it stands, for a checkpoint (not yet evaluated)."""
        raise NotImplementedError

    def restore(self, fresh, saved: tuple, n_tokens: int):
        """`fresh` (a new cache of this class) standing at n_tokens with `saved`'s arrays, which
        it copies on its first write."""
        raise NotImplementedError

    def saved_arrays(self) -> int:
        """How many arrays a checkpoint (and a block's state) holds of this kind."""
        raise NotImplementedError


class FullKind(CacheKind):
    """`KVCache`, kept in the bank as K and V (1, kv_heads, m >= n, head_dim), or quantized at
    rest (`bits`: worker/kv/quant.py) and restored dequantized."""

    kind = Kind.FULL
    cache_class = KVCache
    every_token = True

    def __init__(self, bits: int | None = None):
        self.bits = bits

    def measure(self, cache) -> Size:
        keys, values, _ = cache.state
        one = int(keys[..., :1, :].nbytes + values[..., :1, :].nbytes)
        rest = one if not self.bits else sum(int(x.nbytes) for a in (keys, values)
                                             for x in quant.quantize(a[..., :1, :], self.bits))
        return Size(per_token=one, rest_per_token=rest, dtype=_dtype(keys))

    def position(self, cache) -> int | None:
        return int(cache.state[2])

    def restorable(self, n_tokens: int, checkpoints: Iterable[int]) -> int:
        return n_tokens  # any prefix: its arrays are cut at any token

    def trimmable(self, cache, n: int) -> bool:
        return cache.is_trimmable() and n <= self.position(cache)

    def trim(self, cache, n: int) -> None:
        cache.trim(n)

    def rewind(self, cache, fed: int, keep: int, record=None) -> None:
        if fed > keep:
            cache.trim(fed - keep)

    def freeze(self, cache, n_tokens: int, prefix=None, tight: bool = True):
        """The cache's first n_tokens as the bank keeps them (not yet evaluated): its own
        buffers when their room is small or a copy is not `tight`'s to make (the budget has
        no room for it), else a tight copy; quantized past `prefix` (the
        quantized K/V of the first m tokens it was restored from, kept as they are: a token is
        quantized once, when its turn commits) when `bits` is set."""
        keys, values, offset = cache.state
        if offset < n_tokens:
            raise RuntimeError(f"bug: cache holds {offset} tokens, entry wants {n_tokens}")
        if self.bits:
            held, m = prefix if prefix is not None else (None, 0)
            m = min(m, n_tokens)
            pair = []
            for j, a in enumerate((keys, values)):
                new = quant.quantize(a[..., m:n_tokens, :], self.bits) if n_tokens > m else None
                old = arrays.cut(held[j], m) if m else None
                if old is None or new is None:
                    pair.append(tuple(mx.contiguous(x) for x in (old if new is None else new)))
                else:
                    pair.append(tuple(mx.concatenate([o, x], axis=2) for o, x in zip(old, new)))
            return tuple(pair)
        k, v = keys, values
        if tight and k.shape[2] - n_tokens > n_tokens // arrays.KEEP_ROOM:
            k, v = k[..., :n_tokens, :], v[..., :n_tokens, :]
        return mx.contiguous(k), mx.contiguous(v)  # no copy when already so

    def restore(self, fresh, saved, n_tokens: int, owned: bool = False):
        """`fresh` over the first n_tokens of one layer's kept K and V (no copy until written).

        `owned`: the request may write past n_tokens (arrays decoded from SSD for it, or a
        bank entry handed over to it): the cache takes them whole, room included, and writes
        its new tokens in place (MLX reuses a buffer that only one array holds). Otherwise it
        gets slices, and its first write copies them. Quantized K/V are dequantized into
        arrays of the request's own."""
        k, v = saved
        if isinstance(k, tuple):
            k, v = (quant.dequantize(arrays.cut(a, n_tokens), self.bits) for a in (k, v))
        elif not owned:
            k, v = k[..., :n_tokens, :], v[..., :n_tokens, :]
        fresh.state = (k, v, n_tokens)
        return fresh

    def view(self, cache):
        """The K and V the cache holds as it stands (slices: a reader's copy-on-write)."""
        keys, values, offset = cache.state
        return keys[..., :offset, :], values[..., :offset, :]

    def with_room(self, cache, n_tokens: int) -> None:
        """A restored cache without room for its request's prompt (n_tokens) and a first
        answer token gets its own buffer of `arrays.capacity(n_tokens)` now: the copy its first
        write would make, at a size that MLX's cache can serve again."""
        keys, values, offset = cache.state
        if keys is not None and not self.has_room(keys, n_tokens):
            pad = [(0, 0), (0, 0), (0, arrays.capacity(n_tokens) - offset), (0, 0)]
            cache.state = (mx.pad(keys[..., :offset, :], pad),
                           mx.pad(values[..., :offset, :], pad), offset)

    @staticmethod
    def has_room(keys, n_tokens: int) -> bool:
        """Whether a layer's buffer holds n_tokens and one more: a request writes there in
        place, no copy."""
        return keys.shape[2] > n_tokens

    def freeze_layers(self, caches: list, n_tokens: int, prefix: tuple[Layers, int] | None = None
                      ) -> Layers:
        """`freeze` of every cache (a model's FULL caches, in order), evaluated."""
        held = prefix[0] if prefix is not None else None
        layers = [self.freeze(c, n_tokens, (held[i], prefix[1]) if held is not None else None)
                  for i, c in enumerate(caches)]
        mx.eval(layers)
        return layers

    def restore_layers(self, layers: Layers, n_tokens: int, owned: bool = False) -> list:
        """New caches over the first n_tokens of every layer (see `restore`)."""
        return [self.restore(KVCache(), pair, n_tokens, owned) for pair in layers]


class HeadKind(FullKind):
    """The MTP head's own attention layer (kvbank/mtp_head.py), kept beside the model's caches
    as one more full-attention layer of the conversation: counted, evicted, written and
    restored as the others are. Row j holds the head's K/V of the pair (the model's hidden
    state after token j-1, token j); where that hidden state was not kept (a conversation's
    first token, the first new token of a returning turn) the pair's hidden is zero
    (worker/compute/mtp/serving.py), and rows the head never saw (a turn decoded in mlx-lm's
    batch) are zeros. Drafts read these rows; answers never do: they only make drafting
    better or worse, never an answer different."""

    def __init__(self, bits: int | None, kv_heads: int, head_dim: int, dtype):
        super().__init__(bits)
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype

    @property
    def tag(self) -> str:
        return HEAD_TAG

    def measure(self, cache) -> Size:
        one = mx.zeros((1, self.kv_heads, 1, self.head_dim), self.dtype)
        rest = (2 * sum(int(x.nbytes) for x in quant.quantize(one, self.bits)) if self.bits
                else 2 * int(one.nbytes))
        return Size(per_token=2 * int(one.nbytes), rest_per_token=rest, dtype=_dtype(one))

    def position(self, cache) -> int | None:
        return None  # the model's caches say where a request stands; the head may lag

    def rewind(self, cache, fed: int, keep: int, record=None) -> None:
        """Nothing: a verify feeds the model, not the head (the decoder trims the head's
        speculative rows itself)."""

    def _rows(self, cache, n_tokens: int) -> KVCache:
        """A cache of the head's first n_tokens rows, zeros past those it holds (the head's
        own cache is never written)."""
        keys, values, offset = cache.state
        if offset >= n_tokens:
            return cache
        pad = mx.zeros((1, self.kv_heads, n_tokens - offset, self.head_dim), self.dtype)
        held = (([keys[..., :offset, :]], [values[..., :offset, :]]) if offset else ([], []))
        out = KVCache()
        out.state = (mx.concatenate(held[0] + [pad], axis=2),
                     mx.concatenate(held[1] + [pad], axis=2), n_tokens)
        return out

    def freeze(self, cache, n_tokens: int, prefix=None, tight: bool = True):
        return super().freeze(self._rows(cache, n_tokens), n_tokens, prefix, tight)

    def trimmable(self, cache, n: int) -> bool:
        return True

    def fresh(self) -> KVCache:
        return KVCache()

    def restore(self, fresh, saved, n_tokens: int, owned: bool = False):
        k = saved[0]
        held = min(n_tokens, int((k[0] if isinstance(k, tuple) else k).shape[2]))
        if held:
            fresh = super().restore(fresh, saved, held, owned)
        return self._rows(fresh, n_tokens)

    def absent(self, fresh, n_tokens: int) -> KVCache:
        """Blocks written without MTP: the head never saw these tokens, so zeros (the
        restorer counts them, `kvbank_mtp_history_missing_tokens_total`)."""
        return self._rows(fresh, n_tokens)

    def view(self, cache):
        keys, values, offset = cache.state
        return (keys[..., :offset, :], values[..., :offset, :]) if offset else (
            mx.zeros((1, self.kv_heads, 0, self.head_dim), self.dtype),) * 2


class HiddenKind(CacheKind):
    """The model's last hidden state where a forward stopped: what the MTP head pairs with
    the next token (kvbank/mtp_head.py). Kept as a checkpoint, where the recurrent states
    are, so a conversation restored there drafts as one that never left; held in an
    `ArraysCache` of one array beside the model's caches (None: not known, a zero hidden)."""

    kind = Kind.STATE
    cache_class = ArraysCache

    def __init__(self, hidden: int, dtype):
        self.hidden, self.dtype = hidden, dtype

    @property
    def tag(self) -> str:
        return HIDDEN_TAG

    def fresh(self) -> ArraysCache:
        return ArraysCache(1)

    def measure(self, cache) -> Size:
        return Size(checkpoint=int(mx.zeros((1, 1, self.hidden), self.dtype).nbytes),
                    dtype=_dtype(mx.zeros((1,), self.dtype)))

    def restorable(self, n_tokens: int, checkpoints: Iterable[int]) -> int:
        return n_tokens  # where it is not kept, drafting starts from a zero hidden

    def rewind(self, cache, fed: int, keep: int, record=None) -> None:
        """Nothing: set by the forwards kept (`keep_hidden`), never by a verify."""

    def keep(self, cache, hidden: mx.array) -> None:
        cache[0] = hidden

    def kept(self, cache) -> mx.array | None:
        return cache[0]

    def snapshot(self, cache) -> tuple:
        return (cache[0],)

    def restore(self, fresh, saved: tuple, n_tokens: int):
        fresh[0] = saved[0]
        return fresh

    def saved_arrays(self) -> int:
        return 1


class WindowKind(CacheKind):
    """`RotatingKVCache`: its checkpoint is the window in token order, at most W (+ keep)
    tokens, whatever the conversation's length."""

    kind = Kind.WINDOW
    cache_class = RotatingKVCache

    def __init__(self, size: int, keep: int):
        self.size, self.keep = size, keep

    @classmethod
    def of(cls, cache) -> "WindowKind":
        _, _, _, keep, max_size, _ = cache.state
        return cls(int(max_size), int(keep))

    @property
    def tag(self) -> str:
        return f"window:{self.size}:{self.keep}"

    def measure(self, cache) -> Size:
        keys, values = cache.state[:2]
        one = int(keys[..., :1, :].nbytes + values[..., :1, :].nbytes)
        return Size(checkpoint=one * (self.size + self.keep), dtype=_dtype(keys))

    def position(self, cache) -> int | None:
        return int(cache.state[2])

    def trimmable(self, cache, n: int) -> bool:
        """Only while the ring has not wrapped: past W it no longer holds what it dropped."""
        return cache.is_trimmable() and n <= self.position(cache)

    def trim(self, cache, n: int) -> None:
        cache.trim(n)

    def rewind(self, cache, fed: int, keep: int, record=None) -> None:
        """A forward of fed > 1 tokens leaves the ring in time order with the fed tokens at
        its end (mlx-lm's concatenating path), wrapped or not: cutting that tail leaves the
        arrays a forward of the kept tokens would."""
        drop = fed - keep
        if drop <= 0:
            return
        keys, values, offset, keep_first, max_size, idx = cache.state
        if fed < 2 or idx != keys.shape[2]:
            raise RollbackUnsupported("a window cache not in time order after a verify")
        cache.state = (keys[..., :idx - drop, :], values[..., :idx - drop, :],
                       offset - drop, keep_first, max_size, idx - drop)

    def snapshot(self, cache) -> tuple:
        """The window's tokens in order: its `keep` first, then the last W - keep (after a
        multi-token forward the ring holds W - 1 + S; before it fills, fewer than W)."""
        keys, values, offset, keep, max_size, idx = cache.state
        if keys is None:
            raise RuntimeError("bug: a window checkpoint of an empty cache")
        held = min(offset, max_size)
        out = []
        for a in (_in_order(keys, offset, keep, idx), _in_order(values, offset, keep, idx)):
            if a.shape[2] > held:
                a = (mx.concatenate([a[..., :keep, :], a[..., a.shape[2] - (held - keep):, :]],
                                    axis=2) if keep else a[..., a.shape[2] - held:, :])
            out.append(mx.contiguous(a))
        return out[0], out[1]

    def restore(self, fresh, saved: tuple, n_tokens: int):
        k, v = saved
        _, _, _, keep, max_size, _ = fresh.state
        fresh.state = (k[...], v[...], n_tokens, keep, max_size, int(k.shape[2]))
        return fresh

    def saved_arrays(self) -> int:
        return 2


def _in_order(a: mx.array, offset: int, keep: int, idx: int) -> mx.array:
    """A ring's tokens oldest first (the `keep` first), from its public state: the ring is
    written at `idx` and wraps past `keep`."""
    if idx == a.shape[2]:
        return a
    if idx < offset:
        return mx.concatenate([a[..., :keep, :], a[..., idx:, :], a[..., keep:idx, :]], axis=2)
    return a[..., :idx, :]


class StateKind(CacheKind):
    """`ArraysCache`: a recurrent (or conv) state of `size` arrays, as it stands."""

    kind = Kind.STATE
    cache_class = ArraysCache

    def __init__(self, size: int):
        self.size = size

    @classmethod
    def of(cls, cache) -> "StateKind":
        return cls(len(cache.state[0]))

    @property
    def tag(self) -> str:
        return f"state:{self.size}"

    def measure(self, cache) -> Size:
        held = [a for a in cache.state[0] if a is not None]
        return Size(checkpoint=sum(int(a.nbytes) for a in held),
                    dtype=_dtype(held[0]) if held else None)

    def snapshot(self, cache) -> tuple:
        return tuple(cache.state[0])

    records = True

    def rewind(self, cache, fed: int, keep: int, record=None) -> None:
        """A Gated DeltaNet's (conv window, recurrent state) after the first `keep` fed
        tokens: the conv window is a slice of the verify's conv input, the state the one the
        recurrence left after token `keep` (`record`: the forward's conv input and per-token
        states, worker/kv/rollback.py). Nothing is recomputed."""
        if fed == keep:
            return
        if record is None or self.size != 2:
            raise RollbackUnsupported(f"a state of {self.size} arrays with no per-token record")
        conv_input, states = record
        n_keep = conv_input.shape[1] - fed
        _, left_padding, lengths = cache.state
        cache.state = ([mx.contiguous(conv_input[:, keep:keep + n_keep, :]), states[keep - 1]],
                       left_padding, lengths)

    def restore(self, fresh, saved: tuple, n_tokens: int):
        _, left_padding, lengths = fresh.state
        fresh.state = ([None if a is None else a[...] for a in saved], left_padding, lengths)
        return fresh

    def saved_arrays(self) -> int:
        return self.size


class ListKind(CacheKind):
    """`CacheList`: its parts side by side, each kept by its own kind."""

    kind = Kind.LIST
    cache_class = CacheList

    def __init__(self, parts: tuple[CacheKind, ...]):
        self.parts = parts

    @property
    def tag(self) -> str:
        return "list(" + "+".join(p.tag for p in self.parts) + ")"

    def leaves(self) -> tuple[CacheKind, ...]:
        return tuple(leaf for p in self.parts for leaf in p.leaves())

    def caches(self, cache) -> list:
        return [c for i, p in enumerate(self.parts) for c in p.caches(cache[i])]

    def rewind(self, cache, fed: int, keep: int, record=None) -> None:
        raise RollbackUnsupported("a layer keeping a list of caches (its mixer has no "
                                  "per-token states here)")

    def rebuild(self, fresh, restored):
        return CacheList(*(p.rebuild(fresh[i], restored) for i, p in enumerate(self.parts)))


def kind_of(cache, model_type: str, bits: int | None = None) -> CacheKind:
    """The kind of one of `make_prompt_cache`'s caches, by its exact class (a subclass may
    keep more, or less, than its base)."""
    make = KINDS.get(type(cache))
    if make is None:
        served = ", ".join(f"{c.__name__} ({k})" for c, k in SERVED)
        raise UnsupportedModel(
            f"model_type {model_type!r} uses the cache class {type(cache).__name__}, which "
            f"kvbank cannot restore exactly yet (it serves {served}). Serve another model, "
            f"or open an issue naming the model_type.")
    return make(cache, model_type, bits)


def _dtype(a: mx.array) -> str:
    return str(a.dtype).split(".")[-1]


# mlx-lm's cache class -> its kind, made from a fresh cache of the model.
KINDS: dict[type, Callable[[object, str, int | None], CacheKind]] = {
    KVCache: lambda c, model_type, bits: FullKind(bits),
    RotatingKVCache: lambda c, model_type, bits: WindowKind.of(c),
    ArraysCache: lambda c, model_type, bits: StateKind.of(c),
    CacheList: lambda c, model_type, bits: ListKind(
        tuple(kind_of(part, model_type, bits) for part in c.caches)),
}
SERVED = [(KVCache, "full"), (RotatingKVCache, "window"), (ArraysCache, "state"),
          (CacheList, "a list of these")]
