"""The prefill-to-decode handoff: what a prefill engine tells the proxy in
``kv_transfer_params``, and the ticket it leaves in the sidecar once the request's blocks are
saved, which the decode engine waits for.

Contracts:

* A producer (``kv_role`` ``kv_producer``, or ``kv_both`` asked with ``do_remote_decode``)
  answers a request that carries ``kv_transfer_params`` with ``{"tierkv": {...}}``
  (``Handoff.to_params``): a random ticket, a digest of the engine's namespaces, the prompt
  tokens whose full blocks it saves (``num_tokens``, a multiple of the hash block size) and
  vLLM's hash of the last of those blocks.
* Once every save of the request has been answered, and its blocks published where every
  sidecar sharing a REMOTE tier looks (``Client.publish``), each TP rank writes its ticket
  record (one 64-byte block of ``TICKET_NAMESPACE``, with a CRC-32 of its own): ``DONE``,
  or ``FAILED`` when a block was dropped, refused or could not be published. A ``DONE``
  ticket means every block it names was stored where the consumer looks; a block evicted
  since is a miss, never wrong.
* A consumer checks the params against its own request (its namespaces' digest, its own
  block hash at ``num_tokens``): params that do not match are ignored, never waited for. It
  waits (at most ``pd_wait_timeout_s``) for every rank's ticket, then looks its blocks up as
  for any request: the handoff only decides when to look, never what a hit returns.
* Tickets live in the caller's tenant like its blocks: another tenant's ticket is never seen.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierkv.keys import Namespace
from tierkv.layout import DType, KVLayout

PARAMS_KEY = "tierkv"
VERSION = 1
# One 64-byte block a ticket: fp32 is only the unit the store counts bytes in.
TICKET_NAMESPACE = Namespace("tierkv:pd-ticket/v1", KVLayout(1, 1, 16, 1, DType.FP32,
                                                                   head_dim_v=0))
# magic, version, status, rank, num_tokens, namespaces digest, last block hash; then a CRC-32
_RECORD = struct.Struct("<4sBBHI16s32s")
_CRC = struct.Struct("<I")
_MAGIC = b"TKVT"


class TicketStatus(enum.IntEnum):
    """What a producer's rank says of the blocks a ticket names."""

    DONE = 1  # every block saved and published
    FAILED = 2  # some block was not: the consumer computes what it does not find


def wants_handoff(params: Any) -> bool:
    """Whether a producer is asked for a handoff: the request carries ``kv_transfer_params``
    with ``do_remote_decode`` (the convention of vLLM's P/D proxies, llm-d and Dynamo)."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def namespaces_digest(namespaces: Sequence[Namespace]) -> str:
    """One engine's namespaces (model, layout, TP size, hash scheme, groups) as 32 hex digits:
    a consumer only takes a handoff of an engine whose blocks are its own."""
    text = "\x00".join(f"{ns.model_id}|{ns.layout.fingerprint}|{ns.tp_size}" for ns in namespaces)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a producer saves of one request, as the proxy carries it to the consumer."""

    ticket: str  # 32 hex digits
    namespaces: str  # ``namespaces_digest``
    num_tokens: int
    last_block_hash: bytes  # 32 bytes: vLLM's hash of block ``num_tokens // size - 1``

    @classmethod
    def new(cls, namespaces: str, num_tokens: int, last_block_hash: bytes) -> Handoff:
        return cls(secrets.token_hex(16), namespaces, num_tokens, bytes(last_block_hash))

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` a producer answers with (JSON-ready)."""
        return {PARAMS_KEY: {"v": VERSION, "ticket": self.ticket, "namespaces": self.namespaces,
                             "num_tokens": self.num_tokens,
                             "last_block_hash": self.last_block_hash.hex()}}

    @classmethod
    def from_params(cls, params: Any) -> Handoff | None:
        """The handoff in a request's ``kv_transfer_params``; None when it carries none.
        Raises ``ValueError`` naming what is wrong with one that is malformed."""
        if not isinstance(params, dict) or PARAMS_KEY not in params:
            return None
        raw = params[PARAMS_KEY]
        if not isinstance(raw, dict) or raw.get("v") != VERSION:
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] is not a version-{VERSION} "
                             "handoff")
        ticket, digest = raw.get("ticket"), raw.get("namespaces")
        num_tokens, last = raw.get("num_tokens"), raw.get("last_block_hash")
        if not (_hex(ticket, 32) and _hex(digest, 32) and _hex(last, 64)):
            raise ValueError("handoff: ticket, namespaces and last_block_hash must be hex of "
                             "32, 32 and 64 digits")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"handoff: num_tokens must be a positive integer, got {num_tokens!r}")
        assert isinstance(ticket, str) and isinstance(digest, str) and isinstance(last, str)
        return cls(ticket, digest, num_tokens, bytes.fromhex(last))

    def key(self, tp_rank: int) -> bytes:
        """The ticket record's key for TP rank ``tp_rank`` (each rank saves its own blocks)."""
        return hashlib.sha256(f"tierkv-pd-ticket\x00{self.ticket}\x00{tp_rank}".encode()).digest()

    def record(self, tp_rank: int, status: TicketStatus) -> torch.Tensor:
        """Rank ``tp_rank``'s ticket record, as the one block ``TICKET_NAMESPACE`` stores."""
        body = _RECORD.pack(_MAGIC, VERSION, int(status), tp_rank, self.num_tokens,
                            bytes.fromhex(self.namespaces), self.last_block_hash)
        raw = body + _CRC.pack(zlib.crc32(body))
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(torch.float32)
        return data.view(1, *TICKET_NAMESPACE.layout.block_shape).clone()

    def status_of(self, block: torch.Tensor, tp_rank: int) -> TicketStatus:
        """The status a record says, FAILED for one that does not name this handoff (a
        record of another layout or version, or damaged: never taken as DONE)."""
        raw = block.contiguous().view(torch.uint8).numpy().tobytes()
        if len(raw) != _RECORD.size + _CRC.size or _CRC.unpack_from(raw, _RECORD.size)[0] != (
                zlib.crc32(raw[: _RECORD.size])):
            return TicketStatus.FAILED
        magic, version, status, rank, num_tokens, digest, last = _RECORD.unpack_from(raw)
        if (magic, version, rank, num_tokens, digest.hex(), last) != (
                _MAGIC, VERSION, tp_rank, self.num_tokens, self.namespaces,
                self.last_block_hash) or status not in (TicketStatus.DONE, TicketStatus.FAILED):
            return TicketStatus.FAILED
        return TicketStatus(status)


def _hex(value: Any, digits: int) -> bool:
    if not isinstance(value, str) or len(value) != digits:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True
