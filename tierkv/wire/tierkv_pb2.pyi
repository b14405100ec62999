from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]

class WritePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WRITE_POLICY_UNSPECIFIED: _ClassVar[WritePolicy]
    WRITE_POLICY_WRITE_BACK: _ClassVar[WritePolicy]
    WRITE_POLICY_WRITE_THROUGH: _ClassVar[WritePolicy]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_LOW: _ClassVar[Priority]
    PRIORITY_NORMAL: _ClassVar[Priority]
    PRIORITY_HIGH: _ClassVar[Priority]
    PRIORITY_SESSION: _ClassVar[Priority]
TIER_UNSPECIFIED: Tier
TIER_GPU: Tier
TIER_HOST: Tier
TIER_DISK: Tier
WRITE_POLICY_UNSPECIFIED: WritePolicy
WRITE_POLICY_WRITE_BACK: WritePolicy
WRITE_POLICY_WRITE_THROUGH: WritePolicy
PRIORITY_UNSPECIFIED: Priority
PRIORITY_LOW: Priority
PRIORITY_NORMAL: Priority
PRIORITY_HIGH: Priority
PRIORITY_SESSION: Priority

class Namespace(_message.Message):
    __slots__ = ("model_id", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "tp_rank", "tp_size", "head_dim_v")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_V_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    tp_rank: int
    tp_size: int
    head_dim_v: int
    def __init__(self, model_id: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., head_dim_v: _Optional[int] = ...) -> None: ...

class BlocksRequest(_message.Message):
    __slots__ = ("namespace", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "timeout_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    timeout_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CountResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "prefetch", "pin_ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prefetch: bool
    pin_ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., prefetch: _Optional[bool] = ..., pin_ttl_s: _Optional[float] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_cached", "num_gpu", "num_host", "num_disk", "num_pinned", "num_remote")
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_FIELD_NUMBER: _ClassVar[int]
    num_cached: int
    num_gpu: int
    num_host: int
    num_disk: int
    num_pinned: int
    num_remote: int
    def __init__(self, num_cached: _Optional[int] = ..., num_gpu: _Optional[int] = ..., num_host: _Optional[int] = ..., num_disk: _Optional[int] = ..., num_pinned: _Optional[int] = ..., num_remote: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PutDetail(_message.Message):
    __slots__ = ("token_ids", "parent_hash", "lora_name", "extra_keys", "parent_hashes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: bytes
    lora_name: str
    extra_keys: bytes
    parent_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[bytes] = ..., lora_name: _Optional[str] = ..., extra_keys: _Optional[bytes] = ..., parent_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace", "hashes", "write_policy", "priority", "detail")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    write_policy: WritePolicy
    priority: Priority
    detail: PutDetail
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., write_policy: _Optional[_Union[WritePolicy, str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., detail: _Optional[_Union[PutDetail, _Mapping]] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("num_blocks", "data", "more")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    data: bytes
    more: bool
    def __init__(self, num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ..., more: _Optional[bool] = ...) -> None: ...

class Extent(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class BlockExtents(_message.Message):
    __slots__ = ("extents",)
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    def __init__(self, extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "lease_ttl_s", "slab_id", "packed_extents", "releases")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SLAB_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_EXTENTS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ttl_s: float
    slab_id: bytes
    packed_extents: bool
    releases: _containers.RepeatedCompositeFieldContainer[LeaseRequest]
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., lease_ttl_s: _Optional[float] = ..., slab_id: _Optional[bytes] = ..., packed_extents: _Optional[bool] = ..., releases: _Optional[_Iterable[_Union[LeaseRequest, _Mapping]]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("namespace", "hashes", "write_policy", "priority", "lease_ttl_s", "slab_id", "packed_extents", "releases", "detail")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SLAB_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_EXTENTS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    write_policy: WritePolicy
    priority: Priority
    lease_ttl_s: float
    slab_id: bytes
    packed_extents: bool
    releases: _containers.RepeatedCompositeFieldContainer[LeaseRequest]
    detail: PutDetail
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., write_policy: _Optional[_Union[WritePolicy, str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., lease_ttl_s: _Optional[float] = ..., slab_id: _Optional[bytes] = ..., packed_extents: _Optional[bool] = ..., releases: _Optional[_Iterable[_Union[LeaseRequest, _Mapping]]] = ..., detail: _Optional[_Union[PutDetail, _Mapping]] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("lease_id", "num_blocks", "blocks", "write_indices", "expires_in_s", "num_cached", "slab_id", "checksums", "extent_offsets", "extent_lengths", "extent_counts")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITE_INDICES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_FIELD_NUMBER: _ClassVar[int]
    SLAB_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    EXTENT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    EXTENT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    EXTENT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: bytes
    num_blocks: int
    blocks: _containers.RepeatedCompositeFieldContainer[BlockExtents]
    write_indices: _containers.RepeatedScalarFieldContainer[int]
    expires_in_s: float
    num_cached: int
    slab_id: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    extent_offsets: _containers.RepeatedScalarFieldContainer[int]
    extent_lengths: _containers.RepeatedScalarFieldContainer[int]
    extent_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[bytes] = ..., num_blocks: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[BlockExtents, _Mapping]]] = ..., write_indices: _Optional[_Iterable[int]] = ..., expires_in_s: _Optional[float] = ..., num_cached: _Optional[int] = ..., slab_id: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ..., extent_offsets: _Optional[_Iterable[int]] = ..., extent_lengths: _Optional[_Iterable[int]] = ..., extent_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id", "checksums", "corrupt_indices", "num_copied")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_INDICES_FIELD_NUMBER: _ClassVar[int]
    NUM_COPIED_FIELD_NUMBER: _ClassVar[int]
    lease_id: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    corrupt_indices: _containers.RepeatedScalarFieldContainer[int]
    num_copied: int
    def __init__(self, lease_id: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ..., corrupt_indices: _Optional[_Iterable[int]] = ..., num_copied: _Optional[int] = ...) -> None: ...

class LeaseDoneResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("max_namespaces",)
    MAX_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    max_namespaces: int
    def __init__(self, max_namespaces: _Optional[int] = ...) -> None: ...

class BytesMoved(_message.Message):
    __slots__ = ("source", "destination", "num_bytes")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    source: str
    destination: str
    num_bytes: int
    def __init__(self, source: _Optional[str] = ..., destination: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("tenant", "namespace", "num_blocks", "stored_bytes", "num_sessions")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    namespace: Namespace
    num_blocks: int
    stored_bytes: int
    num_sessions: int
    def __init__(self, tenant: _Optional[str] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., num_blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., num_sessions: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "num_blocks", "hits", "misses", "evictions", "promotions_in", "demotions_in", "stored_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    hits: int
    misses: int
    evictions: int
    promotions_in: int
    demotions_in: int
    stored_bytes: int
    def __init__(self, tier: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions_in: _Optional[int] = ..., demotions_in: _Optional[int] = ..., stored_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "num_namespaces", "num_pinned", "promotions", "demotions", "failed_demotions", "checksum_failures", "puts", "gets", "num_leases", "leases_expired", "num_sessions", "bytes_moved", "namespaces", "remote", "tenants", "tenant")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    FAILED_DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    GETS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    num_namespaces: int
    num_pinned: int
    promotions: int
    demotions: int
    failed_demotions: int
    checksum_failures: int
    puts: int
    gets: int
    num_leases: int
    leases_expired: int
    num_sessions: int
    bytes_moved: _containers.RepeatedCompositeFieldContainer[BytesMoved]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    remote: RemoteStats
    tenants: _containers.RepeatedCompositeFieldContainer[TenantTierStats]
    tenant: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., num_namespaces: _Optional[int] = ..., num_pinned: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., failed_demotions: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., puts: _Optional[int] = ..., gets: _Optional[int] = ..., num_leases: _Optional[int] = ..., leases_expired: _Optional[int] = ..., num_sessions: _Optional[int] = ..., bytes_moved: _Optional[_Iterable[_Union[BytesMoved, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., remote: _Optional[_Union[RemoteStats, _Mapping]] = ..., tenants: _Optional[_Iterable[_Union[TenantTierStats, _Mapping]]] = ..., tenant: _Optional[str] = ...) -> None: ...

class TenantTierStats(_message.Message):
    __slots__ = ("tenant", "tier", "share_bytes", "cap_bytes", "used_bytes", "evicted_by_others", "num_blocks", "stored_bytes", "hits", "misses", "evictions", "promotions_in", "demotions_in")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SHARE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BY_OTHERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tier: str
    share_bytes: int
    cap_bytes: int
    used_bytes: int
    evicted_by_others: int
    num_blocks: int
    stored_bytes: int
    hits: int
    misses: int
    evictions: int
    promotions_in: int
    demotions_in: int
    def __init__(self, tenant: _Optional[str] = ..., tier: _Optional[str] = ..., share_bytes: _Optional[int] = ..., cap_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., evicted_by_others: _Optional[int] = ..., num_blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions_in: _Optional[int] = ..., demotions_in: _Optional[int] = ...) -> None: ...

class RemoteStats(_message.Message):
    __slots__ = ("connected", "hits", "misses", "corrupt", "lookups", "errors", "skipped", "bytes_read", "bytes_written", "written", "demoted", "queue_drops", "queued_bytes", "write_failures", "budget_drops")
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DROPS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_DROPS_FIELD_NUMBER: _ClassVar[int]
    connected: bool
    hits: int
    misses: int
    corrupt: int
    lookups: int
    errors: int
    skipped: int
    bytes_read: int
    bytes_written: int
    written: int
    demoted: int
    queue_drops: int
    queued_bytes: int
    write_failures: int
    budget_drops: int
    def __init__(self, connected: _Optional[bool] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., corrupt: _Optional[int] = ..., lookups: _Optional[int] = ..., errors: _Optional[int] = ..., skipped: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., written: _Optional[int] = ..., demoted: _Optional[int] = ..., queue_drops: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., write_failures: _Optional[int] = ..., budget_drops: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("tenant", "model_id", "namespace", "all")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model_id: str
    namespace: Namespace
    all: bool
    def __init__(self, tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., all: _Optional[bool] = ...) -> None: ...

class ClearProgress(_message.Message):
    __slots__ = ("num_blocks_done", "num_blocks_total", "done", "num_namespaces", "num_blocks", "cleared_bytes", "num_sessions", "num_busy")
    NUM_BLOCKS_DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CLEARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_BUSY_FIELD_NUMBER: _ClassVar[int]
    num_blocks_done: int
    num_blocks_total: int
    done: bool
    num_namespaces: int
    num_blocks: int
    cleared_bytes: int
    num_sessions: int
    num_busy: int
    def __init__(self, num_blocks_done: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., done: _Optional[bool] = ..., num_namespaces: _Optional[int] = ..., num_blocks: _Optional[int] = ..., cleared_bytes: _Optional[int] = ..., num_sessions: _Optional[int] = ..., num_busy: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("version", "shm_name", "shm_size_bytes", "page_bytes", "host_id", "max_hashes_per_call", "max_chunk_bytes", "hash_seed", "presence_shm_name", "presence_key", "slab_id", "client_lock_prefix", "has_remote_tier", "carries_releases")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_HASHES_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_KEY_FIELD_NUMBER: _ClassVar[int]
    SLAB_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_LOCK_PREFIX_FIELD_NUMBER: _ClassVar[int]
    HAS_REMOTE_TIER_FIELD_NUMBER: _ClassVar[int]
    CARRIES_RELEASES_FIELD_NUMBER: _ClassVar[int]
    version: str
    shm_name: str
    shm_size_bytes: int
    page_bytes: int
    host_id: str
    max_hashes_per_call: int
    max_chunk_bytes: int
    hash_seed: str
    presence_shm_name: str
    presence_key: bytes
    slab_id: bytes
    client_lock_prefix: str
    has_remote_tier: bool
    carries_releases: bool
    def __init__(self, version: _Optional[str] = ..., shm_name: _Optional[str] = ..., shm_size_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., host_id: _Optional[str] = ..., max_hashes_per_call: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., hash_seed: _Optional[str] = ..., presence_shm_name: _Optional[str] = ..., presence_key: _Optional[bytes] = ..., slab_id: _Optional[bytes] = ..., client_lock_prefix: _Optional[str] = ..., has_remote_tier: _Optional[bool] = ..., carries_releases: _Optional[bool] = ...) -> None: ...

class SaveSessionRequest(_message.Message):
    __slots__ = ("namespace", "session_id", "token_ids", "ttl_s")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class SaveSessionResponse(_message.Message):
    __slots__ = ("num_tokens",)
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    def __init__(self, num_tokens: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ResumeSessionResponse(_message.Message):
    __slots__ = ("namespace", "token_ids", "num_cached_tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: Namespace
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    def __init__(self, namespace: _Optional[_Union[Namespace, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "model_id", "num_tokens", "last_use_unix_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_USE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_id: str
    num_tokens: int
    last_use_unix_s: float
    def __init__(self, session_id: _Optional[str] = ..., model_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., last_use_unix_s: _Optional[float] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...
