"""tierkv enums <-> wire enums: write policy, priority and tier, each table once.

Every value of every protobuf enum has a row (``tests/wire/test_wire_tables.py`` checks it), so
adding one to the .proto fails that test until its row is written here, and nowhere else.
"""

from __future__ import annotations

from tierkv.config import Priority, Tier, WritePolicy
from tierkv.errors import InvalidArgumentError
from tierkv.wire import tierkv_pb2 as pb

WRITE_POLICY_TO_WIRE: dict[WritePolicy | None, pb.WritePolicy] = {
    None: pb.WRITE_POLICY_UNSPECIFIED,  # the server's default
    WritePolicy.WRITE_BACK: pb.WRITE_POLICY_WRITE_BACK,
    WritePolicy.WRITE_THROUGH: pb.WRITE_POLICY_WRITE_THROUGH,
}
WRITE_POLICY_FROM_WIRE: dict[int, WritePolicy | None] = {
    wire: policy for policy, wire in WRITE_POLICY_TO_WIRE.items()
}

PRIORITY_TO_WIRE: dict[Priority, pb.Priority] = {
    Priority.LOW: pb.PRIORITY_LOW,
    Priority.NORMAL: pb.PRIORITY_NORMAL,
    Priority.HIGH: pb.PRIORITY_HIGH,
    Priority.SESSION: pb.PRIORITY_SESSION,
}
PRIORITY_FROM_WIRE: dict[int, Priority] = {
    pb.PRIORITY_UNSPECIFIED: Priority.NORMAL,  # a client that did not say
    **{wire: priority for priority, wire in PRIORITY_TO_WIRE.items()},
}

TIER_TO_WIRE: dict[Tier, pb.Tier] = {
    Tier.GPU: pb.TIER_GPU,
    Tier.HOST: pb.TIER_HOST,
    Tier.DISK: pb.TIER_DISK,
}
TIER_FROM_WIRE: dict[int, Tier] = {wire: tier for tier, wire in TIER_TO_WIRE.items()}
TIER_FROM_LABEL: dict[str, Tier] = {tier.label: tier for tier in Tier}
"""``TierStats.tier`` carries the tier's label ("gpu", "host", "disk")."""


def write_policy_to(policy: WritePolicy | None) -> pb.WritePolicy:
    """The wire enum of a write policy (None: the server's default)."""
    return WRITE_POLICY_TO_WIRE[policy]


def write_policy_from(value: int) -> WritePolicy | None:
    """None means the server's default; ``InvalidArgumentError`` for a value no row names."""
    if value not in WRITE_POLICY_FROM_WIRE:
        raise InvalidArgumentError(f"unknown write_policy {value}")
    return WRITE_POLICY_FROM_WIRE[value]


def priority_to(priority: Priority) -> pb.Priority:
    """The wire enum of a priority (a plain int is taken as the ``Priority`` of that value)."""
    return PRIORITY_TO_WIRE[Priority(priority)]


def priority_from(value: int) -> Priority:
    """Unspecified means normal; ``InvalidArgumentError`` for a value no row names."""
    if value not in PRIORITY_FROM_WIRE:
        raise InvalidArgumentError(f"unknown priority {value}")
    return PRIORITY_FROM_WIRE[value]


def tier_from_label(label: str) -> Tier:
    """The tier a ``TierStats.tier`` label names."""
    if label not in TIER_FROM_LABEL:
        raise InvalidArgumentError(f"unknown tier {label!r}")
    return TIER_FROM_LABEL[label]
