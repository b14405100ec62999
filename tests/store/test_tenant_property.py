"""Property test of tenants' shares: random multi-tenant workloads against one tiny store.

A hypothesis state machine drives a store shared by three tenants (A weighted 2, B weighted 1,
C guaranteed nothing and capped) with puts, gets, pins, unpins, deletes, read leases held across
steps, write leases reserved and aborted, chat sessions saved (their blocks written through)
and resumed, and reloads of the shares, under either eviction policy, and checks after every
step:

- no tier holds more than its capacity;
- every byte a tier holds is charged to exactly one tenant (the tenants' ``used_bytes`` sum to
  the tier's, and so do their blocks, KV bytes and counters; each tenant's own ``stats`` view
  agrees with its books);
- no tenant loses a HOST block to another tenant's step while it holds no more than its
  share: the blocks it lost to others are at most what it held beyond its share before;
- no tenant holds more than its cap, but by reads and pins it made before a reload;
- a hit returns exactly the bytes its tenant put under the key.

HOST is the top tier (no GPU) and nothing is promoted on read, so a tenant's HOST holdings only
change by its own steps or by eviction: the share check is exact.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.support.tiny_blocks import (
    BLOCK_BYTES,
    PAGE_BYTES,
    RECORD_BYTES,
    TINY_LAYOUT,
    block_for,
    key,
    same_bytes,
)
from tierkv import (
    CapacityError,
    DiskTierConfig,
    HostTierConfig,
    Namespace,
    Priority,
    ReadLease,
    SessionNotFoundError,
    StoreConfig,
    TenantShares,
    Tier,
    TieredStore,
    WriteLease,
    WritePolicy,
)
from tierkv.config import Eviction
from tierkv.hashing import block_hashes
from tierkv.store import migrate

TENANTS = ("alice", "bob", "carol")
NUM_KEYS = 8
KEYS = [key(i, "tenant-property") for i in range(NUM_KEYS)]
PLANS = [
    TenantShares({"alice": 2.0, "bob": 1.0}, caps={"carol": 0.5}),
    TenantShares({"alice": 1.0, "bob": 1.0, "carol": 1.0}),
    TenantShares({"bob": 1.0}, caps={"alice": 0.75}),
]
LEASE_TTL_S = 600.0  # held across steps (the longest a lease may be): none expires in an example
tenants = st.sampled_from(TENANTS)
starts = st.integers(0, NUM_KEYS - 1)
lengths = st.integers(1, 4)


def content(tenant: str, i: int) -> torch.Tensor:
    """The bytes tenant ``tenant`` always stores under key ``i``."""
    return block_for(100 * TENANTS.index(tenant) + i)


SESSION_SEED = "tenant-property"


def session_tokens(tenant: str, num_blocks: int) -> list[int]:
    return [1000 * TENANTS.index(tenant) + j for j in range(num_blocks * TINY_LAYOUT.block_size)]


def session_content(tenant: str, j: int) -> torch.Tensor:
    """The bytes tenant ``tenant`` stores for block ``j`` of its chat session."""
    return block_for(5000 + 100 * TENANTS.index(tenant) + j)


def chain(start: int, length: int) -> list[int]:
    return [(start + j) % NUM_KEYS for j in range(min(length, NUM_KEYS))]


class TenantMachine(RuleBasedStateMachine):
    """One tiny store shared by three tenants per example."""

    def __init__(self) -> None:
        super().__init__()
        self.store: TieredStore | None = None
        self.tmp: tempfile.TemporaryDirectory[str] | None = None

    @initialize(host_blocks=st.integers(3, 12), disk_blocks=st.sampled_from([0, 4, 8, 12]),
                plan=st.integers(0, len(PLANS) - 1), eviction=st.sampled_from(list(Eviction)))
    def open(self, host_blocks: int, disk_blocks: int, plan: int, eviction: Eviction) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="tierkv-tenants-", ignore_cleanup_errors=True)
        disk = (DiskTierConfig(Path(self.tmp.name) / "disk", disk_blocks * RECORD_BYTES)
                if disk_blocks else None)
        self.store = TieredStore(StoreConfig(
            host=HostTierConfig(host_blocks * BLOCK_BYTES, PAGE_BYTES), disk=disk,
            promote_on_read=False, num_workers=1, tenants=PLANS[plan], eviction=eviction))
        self.namespaces = {t: Namespace("tenant-model", TINY_LAYOUT, tenant=t) for t in TENANTS}
        for namespace in self.namespaces.values():
            self.store.register(namespace)
        self.read_leases: list[ReadLease] = []
        self.write_leases: list[WriteLease] = []
        self.pinned: dict[str, list[int]] = {t: [] for t in TENANTS}
        self.reloaded = False
        self.before = self.host_books()

    def teardown(self) -> None:
        store, self.store = self.store, None
        if store is not None:
            store.close(flush=False)
        if self.tmp is not None:
            self.tmp.cleanup()

    @property
    def s(self) -> TieredStore:
        assert self.store is not None
        return self.store

    def host_books(self) -> dict[str, tuple[int, int, int]]:
        """Each tenant's HOST ``(used_bytes, share_bytes, evicted_by_others)``."""
        return {t: next((s.used_bytes, s.share_bytes, s.evicted_by_others)
                        for s in self.s.tenant_stats(t) if s.tier is Tier.HOST)
                for t in TENANTS}

    def step_by(self, actor: str | None) -> None:
        """After a step by ``actor`` (None: by no tenant): who lost HOST blocks to it."""
        after = self.host_books()
        pages_per_block = -(-BLOCK_BYTES // PAGE_BYTES)
        for tenant, (used, share, lost) in self.before.items():
            lost_now = after[tenant][2] - lost
            if tenant == actor:
                continue
            beyond = max(0, used - share)
            assert lost_now * pages_per_block * PAGE_BYTES <= beyond, (
                f"{tenant} lost {lost_now} block(s) to {actor} while holding {beyond} B beyond "
                f"its share")
        self.before = after

    # --- rules ------------------------------------------------------------------------------

    @rule(tenant=tenants, start=starts, length=lengths,
          priority=st.sampled_from([Priority.LOW, Priority.NORMAL, Priority.HIGH]),
          write_through=st.booleans())
    def put(self, tenant: str, start: int, length: int, priority: Priority,
            write_through: bool) -> None:
        indices = chain(start, length)
        policy = WritePolicy.WRITE_THROUGH if write_through and self.s.config.disk else None
        with contextlib.suppress(CapacityError):
            self.s.put(self.namespaces[tenant], [KEYS[i] for i in indices],
                       torch.stack([content(tenant, i) for i in indices]), priority=priority,
                       write_policy=policy)
        self.step_by(tenant)

    @rule(tenant=tenants, start=starts, length=lengths)
    def get(self, tenant: str, start: int, length: int) -> None:
        indices = chain(start, length)
        got = self.s.get(self.namespaces[tenant], [KEYS[i] for i in indices])
        for j in range(len(got)):
            assert same_bytes(got[j], content(tenant, indices[j])), (tenant, indices[j])
        self.step_by(tenant)

    @rule(tenant=tenants, start=starts, length=lengths)
    def pin(self, tenant: str, start: int, length: int) -> None:
        indices = chain(start, length)
        self.s.pin(self.namespaces[tenant], [KEYS[i] for i in indices])
        self.pinned[tenant].extend(indices)
        self.step_by(tenant)

    @rule(tenant=tenants)
    def unpin_all(self, tenant: str) -> None:
        if self.pinned[tenant]:
            self.s.unpin(self.namespaces[tenant], [KEYS[i] for i in self.pinned[tenant]])
            self.pinned[tenant] = []
        self.step_by(tenant)

    @rule(tenant=tenants, start=starts, length=lengths)
    def delete(self, tenant: str, start: int, length: int) -> None:
        self.s.delete(self.namespaces[tenant], [KEYS[i] for i in chain(start, length)])
        self.step_by(tenant)

    @rule(tenant=tenants, start=starts, length=lengths)
    def acquire(self, tenant: str, start: int, length: int) -> None:
        if len(self.read_leases) < 4:
            lease = self.s.sidecar.acquire(self.namespaces[tenant], [KEYS[i] for i in chain(start, length)],
                                   ttl_s=LEASE_TTL_S)
            self.read_leases.append(lease)
        self.step_by(tenant)

    @rule()
    def release_oldest(self) -> None:
        if self.read_leases:
            self.s.sidecar.release(self.read_leases.pop(0).lease_id)
        self.step_by(None)

    @rule(tenant=tenants, start=starts, length=lengths)
    def allocate(self, tenant: str, start: int, length: int) -> None:
        if len(self.write_leases) < 2:
            with contextlib.suppress(CapacityError):
                self.write_leases.append(self.s.sidecar.allocate(
                    self.namespaces[tenant], [KEYS[(i + 4) % NUM_KEYS] for i in chain(start, length)],
                    ttl_s=LEASE_TTL_S))
        self.step_by(tenant)

    @rule()
    def abort_oldest(self) -> None:
        if self.write_leases:
            self.s.sidecar.abort(self.write_leases.pop(0).lease_id)
        self.step_by(None)

    @rule(tenant=tenants, num_blocks=st.integers(1, 3))
    def save_session(self, tenant: str, num_blocks: int) -> None:
        """A chat turn: the session's blocks written through (they count against DISK), then
        its record."""
        if self.s.config.disk is not None:
            tokens = session_tokens(tenant, num_blocks)
            hashes = block_hashes(tokens, TINY_LAYOUT.block_size, SESSION_SEED)
            with contextlib.suppress(CapacityError):
                self.s.put(self.namespaces[tenant], [bytes(h) for h in hashes],
                           torch.stack([session_content(tenant, j) for j in range(num_blocks)]),
                           write_policy=WritePolicy.WRITE_THROUGH)
                self.s.save_session(self.namespaces[tenant], "chat", tokens)
        self.step_by(tenant)

    @rule(tenant=tenants)
    def resume_session(self, tenant: str) -> None:
        """What a resumed session says is cached is there, with the bytes its tenant wrote."""
        with contextlib.suppress(SessionNotFoundError):
            resumed = self.s.resume_session("chat", tenant=tenant, seed=SESSION_SEED)
            num_blocks = resumed.num_cached_tokens // TINY_LAYOUT.block_size
            hashes = block_hashes(list(resumed.token_ids), TINY_LAYOUT.block_size, SESSION_SEED)
            got = self.s.get(self.namespaces[tenant], [bytes(h) for h in hashes[:num_blocks]])
            for j in range(len(got)):
                assert same_bytes(got[j], session_content(tenant, j)), (tenant, j)
        self.step_by(tenant)

    @rule(plan=st.integers(0, len(PLANS) - 1))
    def reload(self, plan: int) -> None:
        self.s.set_tenant_shares(PLANS[plan])
        self.reloaded = True
        after = self.host_books()
        assert all(after[t][2] == self.before[t][2] for t in TENANTS), "a reload evicted"
        self.before = after

    # --- invariants -------------------------------------------------------------------------

    @invariant()
    def every_byte_is_charged_to_one_tenant_and_fits(self) -> None:
        if self.store is None:
            return
        tiers = self.s.stats().tiers
        books = self.s.tenant_stats()
        for tier, tier_stats in tiers.items():
            assert 0 <= tier_stats.used_bytes <= tier_stats.capacity_bytes, tier_stats
            charged = [s for s in books if s.tier is tier]
            assert sum(s.used_bytes for s in charged) == tier_stats.used_bytes, (tier, charged)
            for field in ("num_blocks", "stored_bytes", "hits", "misses", "evictions",
                          "promotions_in", "demotions_in"):  # each counted to one tenant too
                assert sum(getattr(s, field) for s in charged) == getattr(tier_stats, field), \
                    (tier, field, charged)
            for s in charged:  # a tenant's own view says what its books say
                own = self.s.stats(s.tenant).tiers[tier]
                assert (own.used_bytes, own.num_blocks, own.hits) == (s.used_bytes, s.num_blocks,
                                                                      s.hits)
            if not self.reloaded:
                for s in charged:
                    assert s.used_bytes <= s.cap_bytes, s


@pytest.fixture(autouse=True)
def short_reserve_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A put waits up to 5 s (``migrate._RESERVE_WAIT_S``) for HOST room that read leases
    hold; here no lease ends within an example (``LEASE_TTL_S``) and nothing runs beside the
    machine, so every such wait ends in the same refusal: 0.2 s (a run took 1-131 s by its
    draws)."""
    monkeypatch.setattr(migrate, "_RESERVE_WAIT_S", 0.2)


TestTenantMachine = TenantMachine.TestCase
TestTenantMachine.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
