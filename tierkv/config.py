"""Frozen, validated configuration for the store and each of its tiers.

Configs are built once at the edge (CLI, server, tests) and passed down; nothing deeper reads
environment variables or string-keyed dicts. Every validation error names the setting to change.
"""

from __future__ import annotations

import enum
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tierkv.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


class Tier(enum.IntEnum):
    """Storage tiers, fastest first. Eviction demotes a block to the next tier down."""

    GPU = 0
    HOST = 1
    DISK = 2

    @property
    def label(self) -> str:
        """Lower-case name used in stats and on the command line."""
        return self.name.lower()


class WritePolicy(enum.Enum):
    """When a put reaches DISK.

    ``WRITE_BACK``: when the block is evicted from HOST (default, fastest).
    ``WRITE_THROUGH``: before the put is acknowledged (survives a crash; used for chat sessions).
    """

    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


class Eviction(enum.Enum):
    """Which blocks leave a tier for room (docs/design/eviction.md).

    ``LRU``: the least recently used of the lowest priority class, chains tail first (default).
    ``ADAPTIVE``: W-TinyLFU with its frequency filter switched on or off by miniature
    simulations of the tier (``tierkv.eviction.TinyLfuEviction``): new blocks enter a small
    window, and leave it for the main lists only if used more often than main's next victim,
    while the filter is on.
    """

    LRU = "lru"
    ADAPTIVE = "adaptive"


class Priority(enum.IntEnum):
    """Eviction classes: every evictable block of a lower class goes before any of a higher one."""

    LOW = 0
    NORMAL = 1
    HIGH = 2
    SESSION = 3


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


DEFAULT_PAGE_BYTES = 4 * KiB
"""The page of the HOST and GPU slabs unless configured: every block whose size is a multiple of
4 KiB fills its pages exactly, whatever the model (a block takes whole pages; at the earlier
256 KiB default a 16 KiB block used 6% of its page, a 917,504-byte one 88%). Batches still get
adjacent pages, so one copy moves a batch: HOST put/get measured the same as with 256 KiB."""


@dataclass(frozen=True, slots=True)
class HostTierConfig:
    """HOST tier: one shared-memory slab of ``capacity_bytes`` cut into ``page_bytes`` pages.

    ``prefault`` writes every page once at start (fresh shared-memory pages are ~30x slower to
    write the first time). ``shm_name`` fixes the segment name (default: unique per store).
    """

    capacity_bytes: int
    page_bytes: int = DEFAULT_PAGE_BYTES
    prefault: bool = True
    shm_name: str | None = None

    def __post_init__(self) -> None:
        _check_positive("host capacity_bytes (--host-bytes)", self.capacity_bytes)
        _check_positive("host page_bytes (--page-bytes)", self.page_bytes)
        if self.capacity_bytes < self.page_bytes:
            raise ConfigError(
                f"host capacity_bytes ({self.capacity_bytes}) is smaller than one page "
                f"({self.page_bytes}); raise --host-bytes or lower --page-bytes"
            )


@dataclass(frozen=True, slots=True)
class GpuTierConfig:
    """GPU tier: a paged slab in HBM. ``capacity_bytes == 0`` turns it off.

    ``device`` is a CUDA device (``"cuda"``, ``"cuda:1"``) or ``"emulated"``: a CPU tensor pool
    that runs the same code path (copies, events, demotion) on machines without CUDA.
    """

    capacity_bytes: int = 0
    page_bytes: int = DEFAULT_PAGE_BYTES
    device: str = "cuda"

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ConfigError(f"gpu capacity_bytes (--gpu-bytes) must be >= 0, got {self.capacity_bytes}")
        _check_positive("gpu page_bytes (--page-bytes)", self.page_bytes)
        if 0 < self.capacity_bytes < self.page_bytes:
            raise ConfigError(
                f"gpu capacity_bytes ({self.capacity_bytes}) is smaller than one page "
                f"({self.page_bytes}); raise --gpu-bytes or set it to 0 to turn the GPU tier off"
            )
        if self.device != "emulated" and not self.device.startswith("cuda"):
            raise ConfigError(f"gpu device must be 'cuda[:N]' or 'emulated', got {self.device!r}")

    @property
    def enabled(self) -> bool:
        """Whether the tier exists at all."""
        return self.capacity_bytes > 0


class DiskCorruptAction(enum.Enum):
    """What opening a DISK tier does with an LMDB environment it cannot read as a whole (not an
    LMDB file, truncated, a B-tree that cannot be walked).

    ``MOVE_ASIDE`` (default): rename its files into ``<path>/corrupt-<time>-<pid>/`` (kept for
    inspection, logged as an error) and start with a fresh, empty one.
    ``REFUSE``: raise ``ConfigError`` and leave the files untouched (``--disk-on-corrupt``).
    """

    MOVE_ASIDE = "move_aside"
    REFUSE = "refuse"

    @classmethod
    def parse(cls, value: object) -> DiskCorruptAction:
        """``value`` (an action or its name) as an action; ``ConfigError`` naming the flag."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(action.value) for action in cls)
            raise ConfigError(
                f"disk on_corrupt (--disk-on-corrupt) must be one of {choices}, got {value!r}"
            ) from None


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    """DISK tier: LMDB at ``path`` holding at most ``capacity_bytes`` of records.

    LMDB's map is sized ``capacity_bytes * map_overhead_factor + map_slack_bytes`` so that the
    B-tree and free pages fit beside the records; a full map or disk is reported as
    ``DiskFullError``, never a crash (``writemap`` is never used). ``on_corrupt`` says what
    happens to an environment that cannot be read at open (see ``DiskCorruptAction``; a string
    such as ``"refuse"`` is accepted).
    """

    path: Path
    capacity_bytes: int
    map_overhead_factor: float = 2.0
    map_slack_bytes: int = 256 * MiB
    num_reader_threads: int = 2
    on_corrupt: DiskCorruptAction = DiskCorruptAction.MOVE_ASIDE

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path).expanduser())
        _check_positive("disk capacity_bytes (--disk-bytes)", self.capacity_bytes)
        _check_positive("disk num_reader_threads", self.num_reader_threads)
        if self.map_overhead_factor < 1.0:
            raise ConfigError("disk map_overhead_factor must be >= 1.0")
        object.__setattr__(self, "on_corrupt", DiskCorruptAction.parse(self.on_corrupt))

    @property
    def map_size_bytes(self) -> int:
        """The LMDB map size. ``data.mdb`` is extended to it as a sparse file (holes take no
        disk space; see ``tierkv.tiers.lmdb_env``): its apparent size is this, its use is what
        ``du`` reports."""
        size = int(self.capacity_bytes * self.map_overhead_factor) + self.map_slack_bytes
        page = os.sysconf("SC_PAGESIZE")
        return (size + page - 1) // page * page


@dataclass(frozen=True, slots=True)
class TenantShares:
    """How every tier (GPU, HOST, DISK) is shared among tenants.

    ``weights``: a named tenant is guaranteed ``capacity * weight / sum(weights)`` of each tier:
    no other tenant's put evicts its blocks while it holds no more than that. A tenant not
    named is guaranteed nothing: it borrows room no one uses, and gives it back by eviction.
    ``sizes``: ``(tenant, tier) -> bytes`` guaranteed to the tenant in that tier, in place of
    its weight there; the weighted tenants share what the sizes leave (``check_fits`` refuses
    sizes that sum past a tier). ``caps``: the most of each tier a tenant may hold, a fraction
    in (0, 1] (1 when not named); a tenant at its cap evicts its own blocks. No weights and no
    sizes (the default): no tenant is guaranteed anything and each borrows; one tenant's blocks
    go by LRU as without tenants, several tenants each recycle their own.
    Design: docs/design/tenants.md
    """

    weights: dict[str, float] = field(default_factory=dict)
    caps: dict[str, float] = field(default_factory=dict)
    sizes: dict[tuple[str, Tier], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for (tenant, tier), num_bytes in self.sizes.items():
            if not (isinstance(num_bytes, int) and num_bytes > 0):
                raise ConfigError(f"tenant_bytes: {tenant}'s {Tier(tier).label} share must be "
                                  f"a positive number of bytes, got {num_bytes!r}")
        object.__setattr__(self, "sizes", dict(self.sizes))
        for tenant, weight in self.weights.items():
            if not (isinstance(weight, int | float) and 0 < weight < float("inf")):
                raise ConfigError(
                    f"tenant_weights: {tenant}'s weight must be a positive number, got {weight!r}")
        for tenant, cap in self.caps.items():
            if not (isinstance(cap, int | float) and 0 < cap <= 1):
                raise ConfigError(
                    f"tenant_caps: {tenant}'s cap must be a fraction in (0, 1], got {cap!r}")
            if tenant in self.weights and self.share_fraction(tenant) > cap:
                raise ConfigError(
                    f"tenant_caps: {tenant}'s cap ({cap:g}) is below its guaranteed share "
                    f"({self.share_fraction(tenant):.3g} of each tier, from tenant_weights)")
        object.__setattr__(self, "weights", dict(self.weights))
        object.__setattr__(self, "caps", dict(self.caps))

    @classmethod
    def equal(cls, tenants: Iterable[str], caps: dict[str, float] | None = None
              ) -> TenantShares:
        """Equal guarantees for ``tenants`` (those of a tokens file, by default)."""
        return cls({tenant: 1.0 for tenant in tenants}, dict(caps or {}))

    @property
    def guarantees(self) -> bool:
        """Whether any tenant is guaranteed anything (weights or sizes)."""
        return bool(self.weights or self.sizes)

    def share_fraction(self, tenant: str) -> float:
        """The fraction of each tier guaranteed to ``tenant`` by its weight (0: it only
        borrows), before any ``sizes``."""
        weight = self.weights.get(tenant)
        return 0.0 if weight is None else weight / sum(self.weights.values())

    def share_units(self, tenant: str, tier: Tier, num_units: int, unit_bytes: int) -> int:
        """Whole units (pages, or bytes on DISK) of a tier of ``num_units`` guaranteed to
        ``tenant``: its size there, else its weight's part of what the sizes leave."""
        fixed = self.sizes.get((tenant, tier))
        if fixed is not None:
            return fixed // unit_bytes
        weight = self.weights.get(tenant)
        if weight is None:
            return 0
        left = num_units - sum(size // unit_bytes for (_, t), size in self.sizes.items()
                               if t is tier)
        total = sum(w for name, w in self.weights.items() if (name, tier) not in self.sizes)
        return int(left * weight / total)

    def check_fits(self, tier: Tier, capacity_bytes: int) -> None:
        """``ConfigError`` naming the tier when its ``sizes`` sum past ``capacity_bytes``, or
        a tenant's size there is past its cap."""
        named = {tenant: size for (tenant, t), size in self.sizes.items() if t is tier}
        if sum(named.values()) > capacity_bytes:
            listed = ", ".join(f"{tenant} {size} B" for tenant, size in sorted(named.items()))
            raise ConfigError(
                f"tenant_bytes: the {tier.label} shares ({listed}) sum to "
                f"{sum(named.values())} B, more than the {tier.label} tier's {capacity_bytes} B")
        for tenant, size in named.items():
            if size > self.cap_fraction(tenant) * capacity_bytes:
                raise ConfigError(
                    f"tenant_caps: {tenant}'s cap ({self.cap_fraction(tenant):g} of "
                    f"{capacity_bytes} B) is below its {tier.label} share ({size} B, from "
                    "tenant_bytes)")

    def cap_fraction(self, tenant: str) -> float:
        """The most of each tier ``tenant`` may hold, as a fraction of it."""
        return self.caps.get(tenant, 1.0)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The whole store: its tiers and its policies.

    ``write_policy`` is the default for puts that do not name one. ``promote_on_read`` copies a
    block read from a lower tier into the tier above in the background. ``num_workers`` threads
    run the async variants of put/get/prefetch. ``presence_slots`` sizes the shared-memory
    presence table same-host clients answer small lookups from (8 bytes a slot; it holds up to
    half as many blocks; 0 turns it off). ``remote`` adds the shared REMOTE tier below DISK.
    ``verify_commit`` hashes a same-host client's pages again at its commit and refuses the
    commit when they differ from the client's checksums; off, the commit records the client's
    checksums as they are, and a page that differs is a miss on every later read (every read
    and every copy checks them). Write-through records are checked at the commit either way.
    ``tenants``: each tenant's guaranteed share and cap of every tier (``TenantShares``).
    ``eviction``: the policy choosing what leaves every tier (``Eviction``).
    """

    host: HostTierConfig
    gpu: GpuTierConfig = field(default_factory=GpuTierConfig)
    disk: DiskTierConfig | None = None
    remote: RemoteTierConfig | None = None
    write_policy: WritePolicy = WritePolicy.WRITE_BACK
    eviction: Eviction = Eviction.LRU
    promote_on_read: bool = True
    num_workers: int = 4
    presence_slots: int = 1 << 21
    verify_commit: bool = False
    tenants: TenantShares = field(default_factory=TenantShares)

    def __post_init__(self) -> None:
        _check_positive("num_workers", self.num_workers)
        if self.presence_slots < 0 or self.presence_slots & (self.presence_slots - 1):
            raise ConfigError(
                f"presence_slots must be 0 (off) or a power of two, got {self.presence_slots}"
            )
        if not isinstance(self.write_policy, WritePolicy):
            object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
        if not isinstance(self.eviction, Eviction):
            object.__setattr__(self, "eviction", Eviction(self.eviction))


def default_disk_path() -> Path:
    """``<user cache dir>/tierkv/store`` (e.g. ``~/.cache/tierkv/store`` on Linux)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("tierkv")) / "store"


def default_disk_bytes(path: Path, ceiling_bytes: int = 16 * GiB) -> int:
    """Half of the free space at ``path`` (or its nearest existing parent), at most ``ceiling``."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free_bytes = shutil.disk_usage(probe).free
    return max(64 * MiB, min(ceiling_bytes, free_bytes // 2))


@dataclass(frozen=True, slots=True)
class RemoteEndpoint:
    """One ``host:port`` of the REMOTE tier's Redis (a cluster's seed node, or the one server)."""

    host: str
    port: int

    @property
    def label(self) -> str:
        """``host:port`` (``[v6]:port`` for an IPv6 address)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


RemoteUrl = tuple[tuple[RemoteEndpoint, ...], bool, str | None, str | None]


def parse_remote_url(url: str) -> RemoteUrl:
    """``redis[s]://[user[:password]@]host:port[,host:port...]`` as (endpoints, tls, username,
    password); a comma-separated list of such URLs (a seed list as users write it,
    ``redis://a:7000,redis://b:7000``) gives their endpoints together, if they agree on TLS
    and credentials. ``ConfigError`` naming ``--remote`` otherwise. A database number is
    refused (a cluster has only database 0)."""
    import re

    urls = re.split(r",\s*(?=rediss?://)", url.strip())
    if len(urls) == 1:
        return _parse_one_remote_url(url)
    parsed = [_parse_one_remote_url(one) for one in urls]
    if len({(tls, username, password) for _, tls, username, password in parsed}) > 1:
        raise ConfigError(f"remote url (--remote): the URLs of a list must share the scheme "
                          f"and the credentials, got {url!r}; or write one URL, "
                          "redis://[user[:password]@]host:port,host:port")
    endpoints = tuple(endpoint for one in parsed for endpoint in one[0])
    _, tls, username, password = parsed[0]
    return endpoints, tls, username, password


def _parse_one_remote_url(url: str) -> RemoteUrl:
    from urllib.parse import unquote

    def bad(why: str) -> ConfigError:
        return ConfigError(f"remote url (--remote) {why}, got {url!r}; expected "
                           "redis://host:port[,host:port...] (or a list of such URLs) or "
                           "rediss://... for TLS")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis", "rediss"):
        raise bad("must start with redis:// or rediss://")
    userinfo, at, hosts = rest.rpartition("@")
    if not at:
        userinfo, hosts = "", rest
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    hosts = hosts.rstrip("/")
    if "/" in hosts or "?" in hosts:
        raise bad("takes no database number or options")
    endpoints: list[RemoteEndpoint] = []
    for item in hosts.split(","):
        host, colon, port_text = item.strip().rpartition(":")
        host = host.strip("[]")
        if not colon or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise bad(f"names {item!r}, which is not host:port")
        endpoints.append(RemoteEndpoint(host, int(port_text)))
    return tuple(endpoints), scheme == "rediss", username, password


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """REMOTE tier: blocks shared by every node in a Redis Cluster (or one Redis server).

    ``endpoints`` are seed nodes (a cluster is detected and its slot map read from them).
    ``username``/``password`` authenticate (ACL user, or ``requirepass`` with no user); ``tls``
    with ``tls_ca_path`` (and ``tls_cert_path``/``tls_key_path`` for mutual TLS) encrypts.
    ``ttl_s`` (0: none) expires every key written. ``timeout_s`` bounds every call: a node that
    does not answer within it is a miss, and its breaker stays open ``breaker_cooldown_s``
    while a background probe retries it. ``queue_bytes`` bounds the records waiting to be
    written (more are dropped and counted). ``max_fetch_bytes`` bounds one read's fetch.

    The cluster's memory is shared by every tenant of every node: ``tenant_write_bytes`` (0:
    unbounded) bounds what one tenant's records may take of this node's writes in each
    ``tenant_write_interval_s`` (records past it are dropped and counted, as REMOTE writes
    are best effort), and ``tenant_ttl_s`` gives a tenant's keys their own expiry (seconds,
    0: none) in place of ``ttl_s``.
    """

    endpoints: tuple[RemoteEndpoint, ...]
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_path: Path | None = None
    tls_cert_path: Path | None = None
    tls_key_path: Path | None = None
    ttl_s: int = 0
    timeout_s: float = 0.5
    breaker_cooldown_s: float = 2.0
    queue_bytes: int = 256 * MiB
    max_fetch_bytes: int = 256 * MiB
    tenant_write_bytes: int = 0
    tenant_write_interval_s: float = 60.0
    tenant_ttl_s: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tenant_write_bytes < 0:
            raise ConfigError("remote tenant_write_bytes (--remote-tenant-write-bytes) must be "
                              f">= 0, got {self.tenant_write_bytes}")
        if not 0 < self.tenant_write_interval_s < float("inf"):
            raise ConfigError("remote tenant_write_interval_s (--remote-tenant-write-interval-s) "
                              f"must be > 0, got {self.tenant_write_interval_s}")
        for tenant, ttl_s in self.tenant_ttl_s.items():
            if not (isinstance(ttl_s, int) and ttl_s >= 0):
                raise ConfigError(f"remote tenant_ttl_s (--remote-tenant-ttl-s): {tenant}'s TTL "
                                  f"must be whole seconds >= 0, got {ttl_s!r}")
        object.__setattr__(self, "tenant_ttl_s", dict(self.tenant_ttl_s))
        if not self.endpoints:
            raise ConfigError("remote (--remote) needs at least one host:port")
        if self.ttl_s < 0:
            raise ConfigError(f"remote ttl_s (--remote-ttl) must be >= 0, got {self.ttl_s}")
        if not self.timeout_s > 0:
            raise ConfigError(f"remote timeout_s (--remote-timeout) must be > 0, got {self.timeout_s}")
        if not self.breaker_cooldown_s > 0:
            raise ConfigError("remote breaker_cooldown_s must be > 0")
        _check_positive("remote queue_bytes (--remote-queue-bytes)", self.queue_bytes)
        _check_positive("remote max_fetch_bytes", self.max_fetch_bytes)
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ConfigError("remote TLS: --remote-tls-cert and --remote-tls-key go together")
        if not self.tls and (self.tls_ca_path or self.tls_cert_path):
            raise ConfigError("remote TLS files are set but TLS is off: use rediss:// or --remote-tls")

    def ttl_s_of(self, tenant: str) -> int:
        """The expiry of ``tenant``'s keys (0: none)."""
        return self.tenant_ttl_s.get(tenant, self.ttl_s)

    @classmethod
    def from_url(cls, url: str, **options: object) -> RemoteTierConfig:
        """A config from ``--remote``'s URL; ``options`` override what the URL says (a
        password from a file or the environment beats one in the URL)."""
        endpoints, tls, username, password = parse_remote_url(url)
        fields: dict[str, object] = {"username": username, "password": password, "tls": tls}
        fields.update({name: value for name, value in options.items() if value is not None})
        return cls(endpoints, **fields)  # type: ignore[arg-type]
