"""``inspect_disk``: what a DISK tier's LMDB store holds, read offline and changing nothing.

Every record is parsed and verified by the store's own code, as a server reading it would:
block records by ``tierkv.tiers.records.verify_record`` and their payload checksum, namespace
descriptors and sessions by ``try_unseal`` and the parsers of recovery and the session table.
A record that fails is counted and listed (its DB, key and why), never a crash and never
guessed at: a block whose namespace descriptor is lost, or does not parse, is bad too (a server
drops such blocks at its next start).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.checksums import checksum_of_parts, digest_value
from tierkv.keys import NAMESPACE_ID_BYTES, RAW_BLOCK_KEY_BYTES, Namespace
from tierkv.store.namespaces import parse_descriptor
from tierkv.store.sessions import UNPARSABLE, parse_session
from tierkv.tiers.lmdb_readonly import ReadOnlyStore
from tierkv.tiers.records import try_unseal, verify_record
from tierkv.types import layout_label

MAX_LISTED_BAD_RECORDS = 1000
"""Bad records listed one by one (every one is counted)."""


@dataclass(frozen=True, slots=True)
class BadRecord:
    """One record that did not verify: its DB (``blocks``, ``namespaces``, ``sessions``), its
    key in hex, and why."""

    db: str
    key_hex: str
    reason: str


@dataclass(slots=True)
class NamespaceReport:
    """One namespace on disk: its verified blocks (their payload bytes) and its sessions."""

    namespace: Namespace
    num_blocks: int = 0
    stored_bytes: int = 0
    num_sessions: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        namespace = self.namespace
        return {"tenant": namespace.tenant, "model_id": namespace.model_id,
                "layout": layout_label(namespace.layout), "tp_rank": namespace.tp_rank,
                "tp_size": namespace.tp_size, "num_blocks": self.num_blocks,
                "stored_bytes": self.stored_bytes, "num_sessions": self.num_sessions}


@dataclass(slots=True)
class DiskReport:
    """What ``inspect_disk`` found. ``server_running``: a server held the store while it was
    read (the figures are of one moment of a live store)."""

    path: Path
    server_running: bool
    namespaces: list[NamespaceReport] = field(default_factory=list)
    num_bad_records: int = 0
    bad_records: list[BadRecord] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        """Verified blocks, every namespace's."""
        return sum(n.num_blocks for n in self.namespaces)

    @property
    def stored_bytes(self) -> int:
        """Payload bytes of the verified blocks."""
        return sum(n.stored_bytes for n in self.namespaces)

    @property
    def num_sessions(self) -> int:
        """Sessions that parse, every tenant's (expired ones included)."""
        return sum(n.num_sessions for n in self.namespaces)

    def bad(self, db: str, key: bytes, reason: str) -> None:
        """Count (and list, up to ``MAX_LISTED_BAD_RECORDS``) a record that failed."""
        self.num_bad_records += 1
        if len(self.bad_records) < MAX_LISTED_BAD_RECORDS:
            self.bad_records.append(BadRecord(db, key.hex(), reason))

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {
            "path": str(self.path), "server_running": self.server_running,
            "num_namespaces": len(self.namespaces), "num_blocks": self.num_blocks,
            "stored_bytes": self.stored_bytes, "num_sessions": self.num_sessions,
            "num_bad_records": self.num_bad_records,
            "namespaces": [n.as_dict() for n in self.namespaces],
            "bad_records": [{"db": b.db, "key": b.key_hex, "reason": b.reason}
                            for b in self.bad_records],
        }


def inspect_disk(path: Path, progress: Callable[[int], None] | None = None) -> DiskReport:
    """Read the DISK tier store at ``path`` without changing anything there (see
    ``tierkv.tiers.lmdb_readonly``) and verify every record; ``progress(num_bytes)`` is called
    after each block record with its size. Raises ``NotAStoreError`` (a ``ConfigError``) for a
    path that is not a readable tierkv disk store. Namespaces come largest first."""
    with ReadOnlyStore(path) as store:
        report = DiskReport(Path(path), store.server_running)
        by_id: dict[bytes, NamespaceReport] = {}
        for key, value in store.records(1):
            body = try_unseal(key, value)
            if body is None:
                report.bad("namespaces", key, "failed its checksum")
                continue
            try:
                by_id[key] = NamespaceReport(parse_descriptor(key, body))
            except (ValueError, KeyError, TypeError) as exc:
                report.bad("namespaces", key, f"does not parse: {exc}")
        for key, head, block_body in store.block_records():
            _check_block(report, by_id, key, head, block_body)
            if progress is not None:
                progress(len(head or b"") + len(block_body or b""))
        for key, value in store.records(2):
            _check_session(report, by_id, key, value)
    report.namespaces = sorted(by_id.values(), key=lambda n: (
        -n.stored_bytes, n.namespace.tenant, n.namespace.model_id))
    return report


def _check_block(report: DiskReport, by_id: dict[bytes, NamespaceReport], key: bytes,
                 head: memoryview | None, body: memoryview | None) -> None:
    if body is None:
        report.bad("blocks", key, "its record's head is there but its body is lost")
        return
    if len(key) != RAW_BLOCK_KEY_BYTES:
        report.bad("blocks", key, f"a key of {len(key)} bytes, not {RAW_BLOCK_KEY_BYTES}")
        return
    owner = by_id.get(key[:NAMESPACE_ID_BYTES])
    if owner is None:
        report.bad("blocks", key, "its namespace's descriptor is lost or unreadable")
        return
    layout = owner.namespace.layout
    verified = verify_record(head, body, key, layout.fingerprint, layout.bytes_per_block)
    if verified is None:
        report.bad("blocks", key, "its header does not match (torn, foreign or another layout)")
        return
    parts, expected = verified
    if checksum_of_parts(parts) != digest_value(expected):
        report.bad("blocks", key, "its payload fails its checksum")
        return
    owner.num_blocks += 1
    owner.stored_bytes += layout.bytes_per_block


def _check_session(report: DiskReport, by_id: dict[bytes, NamespaceReport], key: bytes,
                   value: memoryview) -> None:
    body = try_unseal(key, value)
    if body is None:
        report.bad("sessions", key, "failed its checksum")
        return
    try:
        _, _, record = parse_session(key, body)
    except UNPARSABLE as exc:
        report.bad("sessions", key, f"does not parse: {exc}")
        return
    namespace = record.namespace
    owner = by_id.setdefault(bytes(namespace.id), NamespaceReport(namespace))
    owner.num_sessions += 1
