"""Reading and writing a DISK tier's block records with LMDB directly (the store closed), as a
failing disk or a foreign writer would: a record is its head (``heads`` DB) and body
(``blocks`` DB) under one key (``tierkv.tiers.records.split_record``)."""

from __future__ import annotations

from pathlib import Path

import lmdb

from tierkv.tiers.records import split_record


class RawDisk:
    """The LMDB environment of a closed store at ``path``; use in a ``with`` block."""

    def __init__(self, path: Path) -> None:
        self.env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
        self.blocks = self.env.open_db(b"blocks")
        self.heads = self.env.open_db(b"heads")
        self.page_bytes = int(self.env.stat()["psize"])

    def get(self, txn: lmdb.Transaction, key: bytes) -> bytes | None:
        """The whole record under ``key`` (head then body), or None."""
        body = txn.get(key, db=self.blocks)
        if body is None:
            return None
        head = txn.get(key, db=self.heads)
        return bytes(head or b"") + bytes(body)

    def put(self, txn: lmdb.Transaction, key: bytes, record: bytes) -> None:
        """Store ``record`` under ``key`` as the disk tier does (split)."""
        head, body = split_record(record, self.page_bytes)
        if not len(head):
            self.put_whole(txn, key, record)
            return
        txn.put(key, bytes(body), db=self.blocks)
        txn.put(key, bytes(head), db=self.heads)

    def put_whole(self, txn: lmdb.Transaction, key: bytes, value: bytes) -> None:
        """Store ``value`` under ``key`` in ``blocks`` alone (a record stored whole, or a
        foreign value), with no head."""
        txn.delete(key, db=self.heads)
        txn.put(key, value, db=self.blocks)

    def __enter__(self) -> RawDisk:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.env.close()
