"""The server's own settings, frozen and validated where they are built (the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tierkv.config import MiB
from tierkv.errors import ConfigError, InvalidArgumentError
from tierkv.hashing import DEFAULT_ALGORITHM, HashAlgorithm, check_algorithm, default_seed
from tierkv.wire.limits import (
    CHUNK_BYTES,
    DEFAULT_LISTEN,
    MAX_HASHES_PER_CALL,
    MAX_MESSAGE_BYTES,
    MESSAGE_HEADER_ROOM_BYTES,
)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """A certificate chain and its private key (PEM files) for the TCP listeners."""

    cert_path: Path
    key_path: Path

    def __post_init__(self) -> None:
        for name in ("cert_path", "key_path"):
            path = Path(getattr(self, name))
            object.__setattr__(self, name, path)
            if not path.is_file():
                flag = "--tls-cert" if name == "cert_path" else "--tls-key"
                raise ConfigError(f"{flag}: no such file {path}")


DEFAULT_EVENTS_TOPIC = "kv@{node}:{tenant}:{namespace}@{model}"
"""llm-d's ``kv@<pod>@<model>``, its pod part naming this node, the tenant and the namespace."""
_TOPIC_FIELDS = {"node": "n", "tenant": "t", "namespace": "0" * 32, "model": "m"}


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """The KV-event publisher (``tierkv.service.events``).

    ``mode``: ``router`` (what routers consume unchanged: each namespace on sockets of its
    own, ``namespace_endpoints``, one sequence each; a namespace's clear said as removals;
    int hashes) or ``tierkv`` (every namespace on ``endpoint``, one sequence a topic, clears
    as ``AllBlocksCleared``). ``ownership``: the ``ownership`` field of every event (None:
    none; Dynamo drops events that carry one). ``endpoint``: the PUB socket, ``ipc:///path``
    or ``tcp://host:port`` (port 0: any free one); ``replay_endpoint``: the ROUTER socket that
    replays and resyncs (default: the endpoint's path with ``-replay``, or its port plus one;
    port 0: any free one). ``topic``: a template of ``{node}``, ``{tenant}``, ``{model}`` and
    ``{namespace}``, which it must name
    (one topic a namespace: tenants and layouts never share one). ``node``: this sidecar's
    name in topics. ``token_ids``: publish the token ids writers give (prompt
    content: both endpoints must then be a Unix socket or loopback). ``hash_form``: ``int``
    (the last 8 bytes, vLLM's default external form) or ``bytes``. A batch goes every
    ``interval_s`` or at ``batch_events`` events, an empty one on every topic quiet for
    ``heartbeat_s`` (so a subscriber sees a gap, or a restart, within it); each topic's last
    ``ring_batches`` batches are replayable, within its share of ``ring_bytes`` (at least
    1 MiB); ``hwm``: ZMQ's high-water mark per subscriber;
    ``max_pending``: store records waiting before they are dropped (their namespaces are then
    restated). ``node_topic``: the topic of the node's own heartbeats (empty batches, one
    sequence a life of the sidecar), where a subscriber sees a restart even when no namespace
    survived it."""

    endpoint: str
    replay_endpoint: str = ""
    mode: str = "router"
    ownership: str | None = None
    topic: str = DEFAULT_EVENTS_TOPIC
    node: str = "localhost"
    token_ids: bool = True
    hash_form: str = "int"
    interval_s: float = 0.05
    heartbeat_s: float = 1.0
    batch_events: int = 1000
    ring_batches: int = 10_000
    ring_bytes: int = 256 * MiB
    hwm: int = 100_000
    max_pending: int = 1_000_000
    node_topic: str = "kv@{node}"

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"--events-endpoint {self.endpoint!r}: give ipc:///path or "
                              "tcp://host:port")
        if not self.replay_endpoint:
            object.__setattr__(self, "replay_endpoint", replay_endpoint_of(self.endpoint))
        elif not self.replay_endpoint.startswith(("ipc://", "tcp://")):
            raise ConfigError(f"--events-replay-endpoint {self.replay_endpoint!r}: give "
                              "ipc:///path or tcp://host:port")
        try:
            self.topic.format(**_TOPIC_FIELDS)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"--events-topic {self.topic!r}: a template of {{node}}, "
                              f"{{tenant}}, {{model}} and {{namespace}} ({exc!r})") from None
        for name, endpoint in (("--events-endpoint", self.endpoint),
                               ("--events-replay-endpoint", self.replay_endpoint)):
            if self.token_ids and not is_local_endpoint(endpoint):
                raise ConfigError(
                    f"{name} {endpoint}: events carry prompt token ids; bind ipc:///path or "
                    "a loopback address (tcp://127.0.0.1:PORT), or set --events-token-ids off")
        if "{namespace}" not in self.topic:
            raise ConfigError(f"--events-topic {self.topic!r} must name {{namespace}}: one "
                              "topic a namespace, so that tenants never share one")
        if self.hash_form not in ("int", "bytes"):
            raise ConfigError(f"--events-hash-form must be int or bytes, got {self.hash_form!r}")
        if self.mode not in ("router", "tierkv"):
            raise ConfigError(f"--events-mode must be router or tierkv, got {self.mode!r}")
        if self.mode == "router" and self.hash_form != "int":
            raise ConfigError("--events-hash-form bytes needs --events-mode tierkv: routers "
                              "(Dynamo) cannot decode a batch with 32-byte hashes")
        counts = (self.batch_events, self.ring_batches, self.ring_bytes, self.hwm,
                  self.max_pending)
        if not self.interval_s > 0 or not self.heartbeat_s > 0 or min(counts) < 1:
            raise ConfigError("--events-interval-s, --events-heartbeat-s, --events-batch-events, "
                              "--events-ring-batches, --events-hwm and --events-max-pending "
                              "must be positive")


def is_local_endpoint(endpoint: str) -> bool:
    """Whether only this host can connect to ``endpoint`` (a Unix socket or loopback)."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def replay_endpoint_of(endpoint: str) -> str:
    """The replay endpoint beside ``endpoint``: ``ipc://P-replay``, or the next TCP port."""
    if endpoint.startswith("ipc://"):
        return endpoint + "-replay"
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"--events-endpoint {endpoint!r}: tcp://host:port")
    return f"{host}:{int(port) + 1 if int(port) else 0}"


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """How the sidecar listens and what it allows.

    ``listen``: ``unix:///path`` or ``host:port`` addresses (port 0 picks a free one).
    ``tokens``: bearer token -> tenant; when empty, calls need no token and share the tenant
    ``default``. ``tls``: used by every TCP listener when set (Unix sockets stay plain).
    ``put_idle_timeout_s``: a Put stream with no message for this long is dropped
    (DEADLINE_EXCEEDED), so a stalled client cannot hold HOST pages it leased; it runs from
    the start of the stream, so a stream that sends nothing at all is dropped too.
    ``hash_seed`` / ``hash_algo``: how session block hashes are computed (``block_hashes``'s
    ``seed`` and ``algorithm``); they must match the vLLM workers'. The default seed is vLLM's
    rule, resolved when the config is built: ``PYTHONHASHSEED`` of this process if set, else
    ``"vllm-none-hash"``; the default algorithm is vLLM's default, ``"sha256"``. Describe
    reports ``hash_seed``; it has no field for ``hash_algo``, which clients must be told.
    ``max_namespaces`` / ``max_namespaces_per_tenant``: namespaces registered in all / by one
    tenant. Only writes (Put, Allocate, SaveSession) and Acquire register one; when a limit is
    reached, the namespaces (of that tenant) that hold no block and no session are removed
    first, so that one tenant can neither fill another's share nor lock itself out for good.
    ``metrics_port``: the Prometheus endpoint's TCP port on ``metrics_host`` (0: no endpoint).
    ``admin_tenants``: tenants whose operator calls (Stats of every namespace, Clear) reach every
    tenant's namespaces; any other caller's reach only its own. Without tokens every call is the
    one tenant ``default``, which is then an admin. ``events``: the KV-event publisher, if
    any.
    """

    listen: tuple[str, ...] = DEFAULT_LISTEN
    tokens: dict[str, str] = field(default_factory=dict)
    tls: TlsConfig | None = None
    hash_seed: str = field(default_factory=default_seed)
    hash_algo: HashAlgorithm = DEFAULT_ALGORITHM
    max_hashes_per_call: int = MAX_HASHES_PER_CALL
    chunk_bytes: int = CHUNK_BYTES
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_put_bytes: int = 1024 * MiB
    max_namespaces: int = 4096
    max_namespaces_per_tenant: int = 1024
    grace_s: float = 10.0
    put_idle_timeout_s: float = 30.0
    lease_reap_interval_s: float = 1.0
    num_workers: int = 8
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    admin_tenants: tuple[str, ...] = ()
    events: EventsConfig | None = None

    def __post_init__(self) -> None:
        if not self.listen:
            raise ConfigError("--listen: give at least one address")
        try:
            check_algorithm(self.hash_algo)
        except InvalidArgumentError as exc:
            raise ConfigError(f"--hash-algo: {exc}") from None
        if not isinstance(self.hash_seed, str):
            raise ConfigError(f"--hash-seed: a str, got {type(self.hash_seed).__name__}")
        if not 0 < self.chunk_bytes <= self.max_message_bytes - MESSAGE_HEADER_ROOM_BYTES:
            raise ConfigError("chunk_bytes must leave room for the message header under 4 MiB")
        if self.max_hashes_per_call < 1 or self.num_workers < 1:
            raise ConfigError("max_hashes_per_call and num_workers must be positive")
        if not self.put_idle_timeout_s > 0:
            raise ConfigError("put_idle_timeout_s must be positive")
        if not 1 <= self.max_namespaces_per_tenant <= self.max_namespaces:
            raise ConfigError(
                f"--max-namespaces-per-tenant must be in [1, {self.max_namespaces}] (the "
                f"server-wide limit), got {self.max_namespaces_per_tenant}"
            )
        for token in self.tokens:
            if not _is_token(token):
                raise ConfigError(
                    "tokens: every bearer token is at least 16 printable ASCII characters"
                )
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        object.__setattr__(self, "listen", tuple(self.listen))
        object.__setattr__(self, "admin_tenants", tuple(self.admin_tenants))


def _is_token(text: str) -> bool:
    # What a gRPC metadata value can carry (printable ASCII), so every valid token can be sent.
    return len(text) >= 16 and text.isascii() and text.isprintable()


def load_tokens(path: Path) -> dict[str, str]:
    """Read a tokens file: one ``<token> <tenant>`` per line; ``#`` starts a comment.

    A token is at least 16 printable ASCII characters. Raises ``ConfigError`` naming the file
    and the line for anything else (a non-ASCII token would never match a request's metadata).
    """
    tokens: dict[str, str] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--tokens-file: cannot read {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        parts = text.split()
        if len(parts) != 2 or not _is_token(parts[0]):
            raise ConfigError(
                f"--tokens-file {path}:{number}: expected '<token> <tenant>' with a token of "
                "at least 16 printable ASCII characters"
            )
        tokens[parts[0]] = parts[1]
    if not tokens:
        raise ConfigError(f"--tokens-file {path}: no tokens in it")
    return tokens
