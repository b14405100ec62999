"""A structural check of an LMDB data file, in Python, before LMDB itself walks it: every B-tree
(free-page, main, each named DB) is walked with plain reads and checked against what LMDB will
assume, since LMDB ``abort()``s on a damaged page. LMDB 0.9's on-disk format, 64-bit page numbers.
Design: docs/design/disk-records.md#4-every-b-tree-is-walked-before-lmdb-touches-it
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_PAGE = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
_META = struct.Struct("<IIQQ")  # magic, version, address, map size; then two DBs, last pgno, txnid
_U64 = struct.Struct("<Q")
_PAGE_HEADER_BYTES = _PAGE.size
_META_MAGIC = 0xBEEFC0DE
_NO_PAGE = 2**64 - 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_OVERFLOW = struct.Struct("<QHHI")  # pgno, pad, flags, number of pages
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_MAX_DEPTH = 64


class DamagedError(Exception):
    """The data file is not a B-tree LMDB can walk safely; the message says where."""


@dataclass(frozen=True, slots=True)
class _Db:
    flags: int
    depth: int
    num_branch_pages: int
    num_leaf_pages: int
    num_overflow_pages: int
    num_entries: int
    root: int

    @classmethod
    def unpack(cls, data: bytes, offset: int = 0) -> _Db:
        _, *fields = _DB.unpack_from(data, offset)
        return cls(*fields)


def check_data_file(data_file: Path, page_bytes: int, last_txnid: int) -> None:
    """Raise ``DamagedError`` unless every tree of the commit ``last_txnid`` (the meta LMDB
    picked) is well formed."""
    with data_file.open("rb") as f:
        walker = _Walker(f, page_bytes)
        free_db, main_db = walker.read_meta(last_txnid)
        walker.walk(free_db, "free-page")
        named: dict[bytes, _Db] = {}
        walker.walk(main_db, "main", named)
        for name, db in named.items():
            walker.walk(db, repr(name))


class _Walker:
    def __init__(self, f: BinaryIO, page_bytes: int) -> None:
        self._f = f
        self._page_bytes = page_bytes
        self._num_pages = 0
        self._seen: set[int] = set()

    def _page(self, pgno: int) -> bytes:
        self._f.seek(pgno * self._page_bytes)
        page = self._f.read(self._page_bytes)
        if len(page) != self._page_bytes:
            raise DamagedError(f"page {pgno} is past the end of the file")
        return page

    def read_meta(self, last_txnid: int) -> tuple[_Db, _Db]:
        for pgno in (0, 1):
            page = self._page(pgno)
            offset = _PAGE_HEADER_BYTES + _META.size
            last_pgno, txnid = struct.unpack_from("<QQ", page, offset + 2 * _DB.size)
            if txnid != last_txnid:
                continue
            magic, version, _, _ = _META.unpack_from(page, _PAGE_HEADER_BYTES)
            if magic != _META_MAGIC or version != 1:
                raise DamagedError(f"meta page {pgno}: magic {magic:#x}, version {version}")
            self._num_pages = last_pgno + 1
            return _Db.unpack(page, offset), _Db.unpack(page, offset + _DB.size)
        raise DamagedError(f"no meta page holds the last commit {last_txnid}")

    def walk(self, db: _Db, name: str, named: dict[bytes, _Db] | None = None) -> None:
        """Every page of the tree ``db``; ``named`` collects the DB records of the main tree."""
        if db.root == _NO_PAGE:
            if db.depth or db.num_entries or db.num_leaf_pages or db.num_branch_pages:
                raise DamagedError(f"{name} tree: empty, but its record states pages or entries")
            return
        if not 1 <= db.depth <= _MAX_DEPTH:
            raise DamagedError(f"{name} tree: depth {db.depth}")
        counts = [0, 0, 0, 0]  # branch pages, leaf pages, overflow pages, entries
        stack = [(db.root, 1)]
        while stack:
            pgno, level = stack.pop()
            if not 2 <= pgno < self._num_pages or pgno in self._seen:
                raise DamagedError(f"{name} tree: page {pgno} is out of range or reached twice")
            self._seen.add(pgno)
            page = self._page(pgno)
            if level < db.depth:
                counts[0] += 1
                stack.extend((child, level + 1) for child in self._branch(page, pgno, name))
            else:
                counts[1] += 1
                self._leaf(page, pgno, name, counts, named)
        stated = [db.num_branch_pages, db.num_leaf_pages, db.num_overflow_pages, db.num_entries]
        if counts != stated:
            raise DamagedError(f"{name} tree: found (branch, leaf, overflow pages, entries) "
                               f"{counts}, its record states {stated}")

    def _nodes(self, page: bytes, pgno: int, name: str, kind: int) -> list[int]:
        stated_pgno, _, flags, lower, upper = _PAGE.unpack_from(page)
        if flags != kind or stated_pgno != pgno:  # LMDB frees a page by the number it states
            raise DamagedError(f"{name} tree: page {pgno} states page {stated_pgno}, flags "
                               f"{flags:#x} (not {kind:#x})")
        if not _PAGE_HEADER_BYTES < lower <= upper <= self._page_bytes or lower % 2:
            raise DamagedError(f"{name} tree: page {pgno} bounds {lower}..{upper}")
        offsets = struct.unpack_from(f"<{(lower - _PAGE_HEADER_BYTES) // 2}H", page,
                                     _PAGE_HEADER_BYTES)
        for offset in offsets:
            if not upper <= offset <= self._page_bytes - _NODE.size:
                raise DamagedError(f"{name} tree: page {pgno} has a node at {offset}")
        return list(offsets)

    def _check_overflow(self, first: int, num_pages: int, name: str) -> None:
        if first in self._seen:
            raise DamagedError(f"{name} tree: overflow page {first} is reached twice")
        self._seen.add(first)
        self._f.seek(first * self._page_bytes)
        header = self._f.read(_OVERFLOW.size)
        if len(header) != _OVERFLOW.size:
            raise DamagedError(f"{name} tree: overflow page {first} is past the end of the file")
        stated_pgno, _, flags, stated_pages = _OVERFLOW.unpack(header)
        if (stated_pgno, flags, stated_pages) != (first, _P_OVERFLOW, num_pages):
            raise DamagedError(f"{name} tree: overflow page {first} states page {stated_pgno}, "
                               f"flags {flags:#x}, {stated_pages} pages (not {num_pages})")

    def _branch(self, page: bytes, pgno: int, name: str) -> list[int]:
        children = []
        for offset in self._nodes(page, pgno, name, _P_BRANCH):
            lo, hi, high, key_bytes = _NODE.unpack_from(page, offset)
            if offset + _NODE.size + key_bytes > self._page_bytes:
                raise DamagedError(f"{name} tree: page {pgno} has a key past its end")
            children.append(lo | hi << 16 | high << 32)
        return children

    def _leaf(self, page: bytes, pgno: int, name: str, counts: list[int],
              named: dict[bytes, _Db] | None) -> None:
        for offset in self._nodes(page, pgno, name, _P_LEAF):
            lo, hi, flags, key_bytes = _NODE.unpack_from(page, offset)
            data_start = offset + _NODE.size + key_bytes
            data_bytes = lo | hi << 16
            counts[3] += 1
            if flags == _F_BIGDATA:
                if data_start + _U64.size > self._page_bytes:
                    raise DamagedError(f"{name} tree: page {pgno} has a value past its end")
                (first,) = _U64.unpack_from(page, data_start)
                num_pages = (_PAGE_HEADER_BYTES - 1 + data_bytes) // self._page_bytes + 1
                if first < 2 or first + num_pages > self._num_pages:
                    raise DamagedError(f"{name} tree: page {pgno} has a value on pages "
                                       f"{first}..{first + num_pages - 1}")
                self._check_overflow(first, num_pages, name)
                counts[2] += num_pages
                continue
            if flags not in (0, _F_SUBDATA) or data_start + data_bytes > self._page_bytes:
                raise DamagedError(f"{name} tree: page {pgno} has a bad node at {offset}")
            if flags == _F_SUBDATA:
                if named is None or data_bytes != _DB.size:
                    raise DamagedError(f"{name} tree: page {pgno} has a misplaced DB record")
                key = page[offset + _NODE.size : data_start]
                named[bytes(key)] = _Db.unpack(page, data_start)
