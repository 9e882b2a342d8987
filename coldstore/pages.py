"""LMDB's data file read page by page with pread, never mapped: what a damaged file holds.

LMDB reads through a memory map, and a read of a mapped page past the end of the file is
SIGBUS, which kills the process before any Python code can catch it: a coldstore started on
a data file cut short died at its first read, and its supervisor restarted it into the same
death. So a file is checked here first, and a damaged one is read here too.

The newest meta page (the first two pages) names the roots of the trees its commit left: the
free-page list, the main tree, and through the main tree each named database. A page those
trees reach past the end of the file is missing; a page the meta counts (`last_pgno`) past
the end that no tree reaches is not (LMDB leaves pages it freed in the same transaction
unwritten at the end of the file), so the file's size alone cannot tell.

Format: LMDB 0.9's (data version 1) on a 64-bit little-endian machine, the only one py-lmdb
writes. A tree read whole is checked against the page counts its own record keeps
(md_branch_pages, md_leaf_pages, md_overflow_pages, md_entries): a file laid out otherwise is
reported as unreadable (`LayoutError`), never guessed at.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

MAGIC, DATA_VERSION = 0xBEEFC0DE, 1
HEADER = 16  # a page's header: pgno u64, pad u16, flags u16, lower u16, upper u16 (or pages u32)
BRANCH, LEAF, OVERFLOW, META, LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
BIGDATA, SUBDATA, DUPDATA = 0x01, 0x02, 0x04  # a leaf node's flags
NO_ROOT = 0xFFFFFFFFFFFFFFFF
_DB = struct.Struct("<IHHQQQQQ")  # pad (psize), flags, depth, branch, leaf, overflow, entries, root
_META = struct.Struct("<II8xQ48s48sQQ")  # magic, version, (address), mapsize, free, main, last, txn


class LayoutError(ValueError):
    """The file is not laid out as LMDB 0.9 lays out a data file: nothing read from it."""


class NoMetaPage(LayoutError):
    """Neither of the first two pages is a meta page: LMDB itself cannot open the file (it
    writes both when it creates one, so no data file it made is ever shorter)."""


@dataclass(frozen=True)
class Tree:
    """One database's record (MDB_db): where its root is and how many pages it says it has."""

    flags: int
    depth: int
    branch: int
    leaf: int
    overflow: int
    entries: int
    root: int

    @classmethod
    def unpack(cls, raw: bytes) -> "Tree":
        _, flags, depth, branch, leaf, overflow, entries, root = _DB.unpack(raw)
        return cls(flags, depth, branch, leaf, overflow, entries, root)


@dataclass
class Walk:
    """What a tree's walk reached: its pages by kind, its entries, the pages it needed that
    are past the file's end or not pages of this kind (`missing`)."""

    branch: int = 0
    leaf: int = 0
    overflow: int = 0
    entries: int = 0
    missing: list[int] = field(default_factory=list)

    def matches(self, tree: Tree) -> bool:
        return (self.branch, self.leaf, self.overflow, self.entries) == (
            tree.branch, tree.leaf, tree.overflow, tree.entries)


class DataFile:
    """A data file, read with pread. `psize`, `last_pgno`, `txnid` and the trees: the newest
    meta's, or the one before it after `use_meta(1)`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        first = self._meta(0, 0)
        # LMDB writes each commit's meta over the older of the two: the other is the commit
        # before, whose pages LMDB does not reuse before the next one (a salvage reads both).
        self.metas = sorted(filter(None, [first, first and self._meta(1, first[0])]),
                            key=lambda m: m[1], reverse=True)
        if not self.metas:
            os.close(self.fd)
            raise NoMetaPage(f"{self.path}: no LMDB meta page in its {self.size} bytes")
        self.use_meta(0)

    def use_meta(self, i: int) -> None:
        """Read the trees of the newest commit (0) or of the one before it (1)."""
        self.psize, self.txnid, self.last_pgno, self.free, self.main = self.metas[i]

    def close(self) -> None:
        os.close(self.fd)

    @property
    def pages(self) -> int:
        """Whole pages in the file."""
        return self.size // self.psize

    @property
    def needed_bytes(self) -> int:
        """How long the newest commit's page count says the file is."""
        return (self.last_pgno + 1) * self.psize

    def _meta(self, pgno: int, psize: int):
        """Meta page 0 (`psize` unknown yet: 0) or 1: (psize, txnid, last_pgno, free, main)."""
        raw = os.pread(self.fd, HEADER + _META.size, pgno * psize)
        if len(raw) < HEADER + _META.size:
            return None
        magic, version, _, free, main, last, txnid = _META.unpack_from(raw, HEADER)
        if magic != MAGIC or version != DATA_VERSION:
            return None
        psize = psize or _DB.unpack(free)[0]  # the free tree's md_pad holds the page size
        if not 512 <= psize <= 1 << 16 or psize & (psize - 1):
            return None
        return psize, txnid, last, Tree.unpack(free), Tree.unpack(main)

    def page(self, pgno: int) -> bytes | None:
        """A whole page, or None when the file ends before it does."""
        if pgno >= self.pages:
            return None
        raw = os.pread(self.fd, self.psize, pgno * self.psize)
        return raw if len(raw) == self.psize else None

    def read(self, pgno: int, nbytes: int) -> bytes | None:
        """An overflow value of `nbytes` at page `pgno`; None if the file ends before it does
        or the page there is not the first of an overflow run."""
        if pgno + (HEADER + nbytes - 1) // self.psize >= self.pages:
            return None
        raw = os.pread(self.fd, HEADER + nbytes, pgno * self.psize)
        if (len(raw) != HEADER + nbytes or struct.unpack_from("<Q", raw)[0] != pgno
                or not struct.unpack_from("<H", raw, 10)[0] & OVERFLOW):
            return None
        return raw[HEADER:]

    def _overflow_starts(self, pgno: int) -> bool:
        """The page names itself and starts an overflow run (its header only: a value's
        bytes are the checksums' to judge)."""
        raw = os.pread(self.fd, HEADER, pgno * self.psize)
        return (len(raw) == HEADER and struct.unpack_from("<Q", raw)[0] == pgno
                and bool(struct.unpack_from("<H", raw, 10)[0] & OVERFLOW))

    # -- trees ------------------------------------------------------------------------------

    def _node_page(self, pgno: int) -> tuple[bytes, int, tuple[int, ...]] | None:
        """A branch or leaf page: its bytes, flags and node offsets; None when it is missing
        or not such a page (a page that does not name itself is not the one looked for)."""
        raw = self.page(pgno)
        if raw is None or struct.unpack_from("<Q", raw)[0] != pgno:
            return None
        flags, lower = struct.unpack_from("<HH", raw, 10)
        if not flags & (BRANCH | LEAF) or flags & LEAF2 or not HEADER <= lower <= self.psize:
            return None
        ptrs = struct.unpack_from(f"<{(lower - HEADER) // 2}H", raw, HEADER)
        return None if any(not lower <= at <= self.psize - 8 for at in ptrs) else (raw, flags, ptrs)

    def items(self, tree: Tree, walk: Walk | None = None, *, values: bool = True):
        """(key, value) of every entry the tree's pages in the file hold, in key order. The
        value is None where its overflow pages run past the end (or `values` is False:
        nothing but the pages' places is read); a subtree whose page is missing is skipped.
        `walk` counts what was reached and what was missing."""
        walk = walk if walk is not None else Walk()
        if tree.root == NO_ROOT:
            return
        stack, seen = [(tree.root, 1)], set()
        while stack:
            pgno, depth = stack.pop()
            page = None if pgno in seen or depth > tree.depth else self._node_page(pgno)
            seen.add(pgno)
            if page is None:
                walk.missing.append(pgno)
                continue
            raw, flags, ptrs = page
            if flags & BRANCH:
                walk.branch += 1
                stack += [(_pgno(raw, at), depth + 1) for at in reversed(ptrs)]
                continue
            walk.leaf += 1
            for at in ptrs:
                key, nflags, data = _node(raw, at)
                walk.entries += 1
                if not nflags & BIGDATA:
                    yield key, data
                    continue
                first, size = int.from_bytes(data, "little"), _dsize(raw, at)
                npages = (HEADER + size - 1) // self.psize + 1
                walk.overflow += npages
                if first + npages > self.pages or not self._overflow_starts(first):
                    walk.missing.append(first)
                    yield key, None
                else:
                    yield key, self.read(first, size) if values else None

    def named(self) -> dict[bytes, Tree]:
        """The named databases, by name: the main tree's entries (those it still holds)."""
        return {key: Tree.unpack(data[:_DB.size])
                for key, data in self.items(self.main) if data is not None}

    def get(self, tree: Tree, key: bytes) -> bytes | None:
        """One entry's value, by a search down the tree; None when missing or unreadable."""
        pgno = tree.root
        for _ in range(tree.depth):
            page = None if pgno == NO_ROOT else self._node_page(pgno)
            if page is None:
                return None
            raw, flags, ptrs = page
            if flags & BRANCH:  # the last child whose key is at most ours (the first: any)
                pgno = _pgno(raw, ptrs[0])
                for at in ptrs[1:]:
                    if _node(raw, at)[0] > key:
                        break
                    pgno = _pgno(raw, at)
                continue
            for at in ptrs:
                k, nflags, data = _node(raw, at)
                if k == key:
                    if nflags & BIGDATA:
                        return self.read(int.from_bytes(data, "little"), _dsize(raw, at))
                    return data
            return None
        return None


def _node(raw: bytes, at: int) -> tuple[bytes, int, bytes]:
    """A node's key, flags and data: inline (its size), or an overflow page's number."""
    lo, hi, flags, ksize = struct.unpack_from("<HHHH", raw, at)
    key_end = at + 8 + ksize
    size = 8 if flags & BIGDATA or not raw[10] & LEAF else lo | hi << 16
    return raw[at + 8:key_end], flags, raw[key_end:key_end + size]


def _dsize(raw: bytes, at: int) -> int:
    lo, hi = struct.unpack_from("<HH", raw, at)
    return lo | hi << 16


def _pgno(raw: bytes, at: int) -> int:
    """A branch node's child: its page number spans lo, hi and the flags' word."""
    lo, hi, top = struct.unpack_from("<HHH", raw, at)
    return lo | hi << 16 | top << 32


@dataclass
class Damage:
    """A data file whose newest commit reaches pages the file does not hold: past its end, or
    not the pages it wrote (zeroed, overwritten)."""

    file_bytes: int
    needed_bytes: int
    missing_pages: int  # page runs: a branch or leaf page, or one value's overflow pages
    trees: list[str]  # the databases that lost pages ("free": LMDB's list of free pages)


def check(path: Path) -> Damage | None:
    """None when every page the newest commit's trees reach is in the file and is the page
    LMDB wrote there. The trees are walked even when the file is as long as the meta says: a
    file system may give back a file of the right length whose tail is zeros after a crash,
    and LMDB asserts (aborts the process) on such a page. Branch and leaf pages are read (a
    few per thousand blocks), of an overflow value only its first page's header; the values'
    bytes are their checksums' to judge. LayoutError: not an LMDB 0.9 data file. On a store a
    coldstore is writing, hold a read transaction around it (apps/store_verify.py)."""
    try:
        f = DataFile(path)
    except NoMetaPage:
        return Damage(Path(path).stat().st_size, 0, 0, ["meta"])
    try:
        trees = {b"free": f.free, b"main": f.main, **f.named()}
        walks = {}
        for name, tree in trees.items():
            walks[name] = walk = Walk()
            for _ in f.items(tree, walk, values=False):
                pass
            if not walk.missing and not walk.matches(tree):
                raise LayoutError(f"{path}: the {name.decode()!r} tree does not read as LMDB "
                                  f"0.9 writes one ({walk} for {tree})")
        hit = {n.decode(): len(w.missing) for n, w in walks.items() if w.missing}
        if not hit:
            return None
        return Damage(f.size, f.needed_bytes, sum(hit.values()), sorted(hit))
    finally:
        f.close()
