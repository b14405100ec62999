"""Every setting of ``tierkv serve``, in one schema: its TOML key, flag, environment variable,
type, default and meaning. Sources, in rising precedence: defaults, TOML file, ``TIERKV_<NAME>``,
flags. The parser, the resolution, ``--print-config`` and docs/configuration.md come from it;
a bad value is one ``ConfigError`` naming setting, value and source.
Design: docs/design/operations.md#settings
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import re
import textwrap
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.cli.setting_values import (
    BadValueError,
    Kind,
    Setting,
    check_text,
    from_text,
    from_toml,
    setting_value,
    toml_string,
    toml_value,
)
from tierkv.config import DEFAULT_PAGE_BYTES, DiskCorruptAction, Eviction, GiB, WritePolicy
from tierkv.errors import ConfigError
from tierkv.hashing import DEFAULT_ALGORITHM, HASH_ALGORITHMS, VLLM_DEFAULT_SEED
from tierkv.logs import LOG_FORMATS, LOG_LEVELS
from tierkv.wire.limits import DEFAULT_LISTEN

__all__ = [
    "BY_FLAG", "BY_NAME", "CONFIG_ENV", "SETTINGS", "Kind", "Resolved", "Setting",
    "add_arguments", "build_parser", "reference_markdown", "replace_reference", "resolve",
    "resolve_args", "unknown_variables",
]

CONFIG_ENV = "TIERKV_CONFIG"
DEFAULT_SOURCE = "default"
COMPUTED_SOURCE = "computed at start"


def _setting(name: str, kind: Kind, default: Any, help: str, **more: Any) -> Setting:
    return Setting(name, kind, default, help, **more)


SETTINGS: tuple[Setting, ...] = (
    _setting("listen", Kind.LIST, DEFAULT_LISTEN,
             "addresses to serve on: unix:///path or host:port (port 0: any free port); TCP on "
             "another host's address wants tls_cert and tokens_file", metavar="ADDRESS"),
    _setting("host_bytes", Kind.SIZE, 1 * GiB,
             "HOST tier budget: one shared-memory slab, pre-faulted at start"),
    _setting("gpu_bytes", Kind.SIZE, None, "GPU tier budget (0: no GPU tier)",
             computed="2GiB when CUDA is present, else 0"),
    _setting("gpu_device", Kind.STR, "cuda",
             "cuda[:N], or emulated (a CPU pool that runs the GPU tier's code)", metavar="DEVICE"),
    _setting("page_bytes", Kind.SIZE, DEFAULT_PAGE_BYTES,
             "page size of the GPU and HOST slabs (a block takes whole pages)"),
    _setting("no_disk", Kind.BOOL, False, "run without a DISK tier"),
    _setting("disk_path", Kind.STR, None, "LMDB directory of the DISK tier (one server a path)",
             computed="<user cache dir>/tierkv/store, e.g. ~/.cache/tierkv/store", metavar="PATH"),
    _setting("disk_bytes", Kind.SIZE, None, "DISK tier budget",
             computed="half the free space at disk_path, at least 64MiB, at most 16GiB"),
    _setting("disk_on_corrupt", Kind.CHOICE, DiskCorruptAction.MOVE_ASIDE.value,
             "an unreadable LMDB store at disk_path: move its files aside into a corrupt-* "
             "folder there and start empty, or refuse to start",
             choices=tuple(action.value for action in DiskCorruptAction)),
    _setting("write_policy", Kind.CHOICE, WritePolicy.WRITE_BACK.value,
             "default write policy of puts: to disk when evicted from HOST (write_back), or "
             "before the put is acknowledged (write_through)",
             choices=tuple(policy.value for policy in WritePolicy)),
    _setting("eviction", Kind.CHOICE, Eviction.LRU.value,
             "what leaves a tier for room: the least recently used, chains tail first (lru), "
             "or W-TinyLFU whose frequency filter miniature simulations of each tier switch "
             "on when it gets more hits (adaptive); fixed at start",
             choices=tuple(eviction.value for eviction in Eviction)),
    _setting("verify_commit", Kind.BOOL, False,
             "hash a same-host client's pages again at its commit and refuse the commit if "
             "they differ from its checksums (off: the checksums are recorded as sent, and a "
             "page that differs is a miss on every read, which checks every block)"),
    _setting("remote", Kind.STR, "",
             "REMOTE tier shared by every node: redis://[user[:password]@]host:port[,host:port"
             "...] of a Redis Cluster's nodes (or of one Redis server), or a comma-separated "
             "list of such URLs; rediss:// for TLS (empty: none)", metavar="URL"),
    _setting("remote_password_file", Kind.STR, "",
             "file holding the REMOTE tier's password (beats one in the URL)", metavar="PATH"),
    _setting("remote_tls_ca", Kind.STR, "",
             "PEM CA bundle that signs the REMOTE tier's TLS certificates", metavar="PATH"),
    _setting("remote_tls_cert", Kind.STR, "",
             "PEM client certificate for the REMOTE tier (mutual TLS, with remote_tls_key)",
             metavar="PATH"),
    _setting("remote_tls_key", Kind.STR, "", "PEM key of remote_tls_cert", metavar="PATH"),
    _setting("remote_ttl_s", Kind.INT, 0,
             "expiry of every key written to the REMOTE tier (0: none; Redis's maxmemory "
             "policy evicts)"),
    _setting("remote_timeout_s", Kind.FLOAT, 0.5,
             "a REMOTE node that does not answer within this is a miss, and is skipped while "
             "a background probe waits for it"),
    _setting("remote_queue_bytes", Kind.SIZE, 256 * 1024 * 1024,
             "records waiting to be written to the REMOTE tier (more are dropped, counted)"),
    _setting("remote_tenant_write_bytes", Kind.SIZE, 0,
             "the most one tenant's records may take of this node's REMOTE writes per "
             "remote_tenant_write_interval_s (0: no bound; more are dropped, counted): the "
             "cluster's memory is shared by every tenant"),
    _setting("remote_tenant_write_interval_s", Kind.FLOAT, 60.0,
             "the window of remote_tenant_write_bytes"),
    _setting("remote_tenant_ttl_s", Kind.LIST, (),
             "TENANT=SECONDS: the expiry of that tenant's REMOTE keys in place of "
             "remote_ttl_s (0: none)", metavar="TENANT=SECONDS"),
    _setting("hash_seed", Kind.STR, None,
             "seed of session block hashes: the vLLM workers' PYTHONHASHSEED (any value given, "
             "even empty, is used as is)",
             computed=f"vLLM's rule: this server's PYTHONHASHSEED if set, else {VLLM_DEFAULT_SEED}",
             metavar="SEED"),
    _setting("hash_algo", Kind.CHOICE, DEFAULT_ALGORITHM,
             "algorithm of session block hashes: the vLLM workers' --prefix-caching-hash-algo",
             choices=tuple(HASH_ALGORITHMS)),
    _setting("tokens_file", Kind.STR, "",
             "file of '<token> <tenant>' lines; every call must then carry a token (empty: "
             "no tokens, every call is the tenant 'default')", metavar="PATH"),
    _setting("tenant_weights", Kind.LIST, (),
             "TENANT=WEIGHT: a tenant's guaranteed share of every tier is the tier times its "
             "weight over the sum of weights; no other tenant's put evicts its blocks while it "
             "holds no more (a tenant not named is guaranteed nothing and only borrows); "
             "none given: weight 1 for every tenant of tokens_file", metavar="TENANT=WEIGHT"),
    _setting("tenant_bytes", Kind.LIST, (),
             "TENANT:TIER=SIZE (tier gpu, host or disk): the tenant's guaranteed share of that "
             "tier in bytes, in place of its weight there; the weighted tenants share what "
             "these leave; shares that sum past a tier are refused", metavar="TENANT:TIER=SIZE"),
    _setting("tenant_caps", Kind.LIST, (),
             "TENANT=FRACTION: the most of every tier a tenant may hold, in (0, 1]; at its cap "
             "it evicts its own blocks", metavar="TENANT=FRACTION"),
    _setting("admin_tenants", Kind.LIST, (),
             "tenants whose operator calls (stats of every namespace, clear) reach every "
             "tenant's namespaces", metavar="TENANT"),
    _setting("tls_cert", Kind.STR, "", "PEM certificate chain of the TCP listeners (with tls_key)",
             metavar="PATH"),
    _setting("tls_key", Kind.STR, "", "PEM private key of the TCP listeners (with tls_cert)",
             metavar="PATH"),
    _setting("put_idle_timeout_s", Kind.FLOAT, 30.0,
             "drop a Put stream that sends nothing for this long (its leased pages come back)"),
    _setting("max_namespaces_per_tenant", Kind.INT, 1024,
             "namespaces (model x layout x TP shard) one tenant may hold; its empty ones are "
             "removed when it is reached"),
    _setting("metrics_port", Kind.INT, 0, "TCP port of the Prometheus endpoint (0: none)",
             metavar="PORT"),
    _setting("metrics_host", Kind.STR, "127.0.0.1", "address the Prometheus endpoint binds",
             metavar="HOST"),
    _setting("events_endpoint", Kind.STR, "",
             "publish KV events for cache-aware routers (vLLM's format: ZMQ PUB) on "
             "ipc:///path or tcp://host:port; they carry prompt token ids unless "
             "events_token_ids is off: keep it on a Unix socket or loopback (empty: none)",
             metavar="ENDPOINT"),
    _setting("events_replay_endpoint", Kind.STR, "",
             "the ROUTER socket that replays recent event batches and restates a topic "
             "(resync) (empty: events_endpoint's path with -replay, or its port plus one)",
             metavar="ENDPOINT"),
    _setting("events_mode", Kind.CHOICE, "router",
             "router: what routers (Dynamo, llm-d) consume unchanged, each namespace on sockets "
             "of its own (events_endpoint's path or host plus the namespace); tierkv: every "
             "namespace on events_endpoint, a topic each", choices=("router", "tierkv")),
    _setting("events_ownership", Kind.STR, "",
             "the ownership field of every event (empty: none; Dynamo drops events that carry "
             "one)", metavar="NAME"),
    _setting("events_topic", Kind.STR, "kv@{node}:{tenant}:{namespace}@{model}",
             "topic of each namespace's events: a template of {node}, {tenant}, {model} and "
             "{namespace} (which it must name: one topic a namespace)", metavar="TEMPLATE"),
    _setting("events_node", Kind.STR, None, "this sidecar's name in topics",
             computed="the host name", metavar="NAME"),
    _setting("events_token_ids", Kind.CHOICE, "on",
             "publish the token ids writers give with their puts (off: hashes only)",
             choices=("on", "off")),
    _setting("events_hash_form", Kind.CHOICE, "int",
             "block hashes in events: int (their last 8 bytes, vLLM's default) or bytes",
             choices=("int", "bytes")),
    _setting("events_interval_s", Kind.FLOAT, 0.05, "publish a batch of events this often"),
    _setting("events_heartbeat_s", Kind.FLOAT, 1.0,
             "an empty batch on every topic quiet this long, so subscribers see a gap or a "
             "restart within it"),
    _setting("events_ring_batches", Kind.INT, 10_000,
             "event batches of each topic kept for replay (all topics together keep at most "
             "256 MiB, each at least 1 MiB)"),
    _setting("stats_interval_s", Kind.FLOAT, 60.0, "log a stats event this often (0: never)"),
    _setting("log_format", Kind.CHOICE, "text",
             "logs on stderr: text lines, or one JSON object a line", choices=LOG_FORMATS),
    _setting("log_level", Kind.CHOICE, "info", "least severe level logged (any case)",
             choices=LOG_LEVELS, fold_case=True),
)
BY_NAME: Mapping[str, Setting] = {setting.name: setting for setting in SETTINGS}
BY_FLAG: Mapping[str, Setting] = {setting.flag: setting for setting in SETTINGS}


# --- resolution ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    """The effective settings of one start: ``values`` (every setting, computed defaults filled
    in, typed as ``Setting.default``) and ``sources`` (where each came from: ``"default"``,
    ``"computed at start"``, the TOML file's path, an environment variable or a flag)."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]
    config_path: Path | None = None

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def describe(self, name: str) -> str:
        """``host_bytes = "8GiB" (from --host-bytes)``."""
        source = self.sources[name]
        origin = source if source in (DEFAULT_SOURCE, COMPUTED_SOURCE) else f"from {source}"
        return f"{name} = {setting_value(BY_NAME[name], self.values[name])} ({origin})"

    def error(self, name: str, problem: str) -> ConfigError:
        """A ``ConfigError`` about setting ``name`` that says its value and source."""
        return ConfigError(f"{self.describe(name)}: {problem}")

    def explain(self, exc: ConfigError) -> ConfigError:
        """``exc`` with the value and source of the first setting its message names (by flag or
        by name) in front; ``exc`` itself when it names none."""
        for word in _WORD.findall(str(exc)):
            setting = BY_FLAG.get(word) or BY_NAME.get(word)
            if setting is not None:
                return ConfigError(f"{self.describe(setting.name)}: {exc}")
        return exc

    @contextlib.contextmanager
    def explaining(self) -> Iterator[None]:
        """Re-raise a ``ConfigError`` from the block through ``explain``."""
        try:
            yield
        except ConfigError as exc:
            raise self.explain(exc) from None

    def to_toml(self) -> str:
        """Every setting as a TOML document (``--print-config``): read back through ``--config``
        it gives the same values. Each line says where its value came from."""
        lines = ["# tierkv serve: the effective configuration (tierkv serve --print-config).",
                 "# Sources, lowest first: defaults, --config file, TIERKV_* environment, flags."]
        for setting in SETTINGS:
            literal = setting_value(setting, self.values[setting.name])
            lines.append(f"{setting.name} = {literal}  # {_comment(self.sources[setting.name])}")
        return "\n".join(lines) + "\n"


def _comment(text: str) -> str:
    # A source is a file's path, which may hold a newline: raw, it would end the comment and
    # the rest of the path would be read as TOML.
    return text if text.isprintable() else toml_string(text)


_WORD = re.compile(r"--[a-z0-9-]+|[a-z0-9_]+")


def _unknown(name: str, path: Path) -> ConfigError:
    close = difflib.get_close_matches(name, list(BY_NAME), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return ConfigError(f"unknown setting {toml_string(name)} in {path}{hint} "
                       "(tierkv serve --print-config lists every setting)")


def _read_toml(path: Path, source: str) -> dict[str, Any]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"config = {toml_string(str(path))} (from {source}): cannot read "
                          f"it: {exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config = {toml_string(str(path))} (from {source}): not valid "
                          f"TOML: {exc}") from None


def _shown(raw: Any) -> str:
    if isinstance(raw, str | bool | int | float):
        return toml_value(raw)
    if isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw):
        return toml_value(raw)
    return repr(raw)


def resolve_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Resolved:
    """The effective settings for parsed ``serve`` arguments (flags not given are None) and
    ``environ``: defaults < TOML file < environment < flags, computed defaults filled in.
    ``ConfigError`` naming the setting, its value and its source for anything invalid."""
    values = {setting.name: setting.default for setting in SETTINGS}
    sources = dict.fromkeys(values, DEFAULT_SOURCE)

    def put(setting: Setting, raw: Any, source: str, convert: Any) -> None:
        try:
            values[setting.name] = convert(setting, raw)
        except BadValueError as problem:
            raise ConfigError(f"{setting.name} = {_shown(raw)} (from {source}): {problem}") from None
        sources[setting.name] = source

    config_path = None
    given_path = getattr(args, "config", None)
    config_source = "--config" if given_path else CONFIG_ENV
    given_path = given_path or environ.get(CONFIG_ENV)
    if given_path:
        config_path = Path(given_path)
        for name, raw in _read_toml(config_path, config_source).items():
            if name not in BY_NAME:
                raise _unknown(name, config_path)
            put(BY_NAME[name], raw, str(config_path), from_toml)
    for setting in SETTINGS:
        text = environ.get(setting.env)
        if text is not None and (text or setting.kind is Kind.STR):
            put(setting, text, setting.env, from_text)
    for setting in SETTINGS:
        given = getattr(args, setting.name, None)
        if setting.kind is Kind.LIST and given is not None:
            put(setting, given, setting.flag, lambda s, items: tuple(check_text(i, s) for i in items))
        elif setting.kind is Kind.BOOL and given:
            put(setting, given, setting.flag, lambda s, value: True)
        elif given is not None and (given or setting.kind is Kind.STR):
            put(setting, given, setting.flag, from_text)
    _compute_defaults(values, sources, environ)
    resolved = Resolved(values, sources, config_path)
    if bool(values["tls_cert"]) != bool(values["tls_key"]):
        name = "tls_cert" if values["tls_cert"] else "tls_key"
        raise resolved.error(name, "tls_cert and tls_key go together (--tls-cert, --tls-key)")
    return resolved


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """``TIERKV_*`` names in ``environ`` that are no setting (nor ``TIERKV_CONFIG``), sorted: a
    misspelt variable is otherwise ignored without a word (``serve`` warns of them)."""
    known = {setting.env for setting in SETTINGS} | {CONFIG_ENV}
    return sorted(name for name in environ if name.startswith("TIERKV_") and name not in known)


def _compute_defaults(values: dict[str, Any], sources: dict[str, str],
                      environ: Mapping[str, str]) -> None:
    from tierkv.config import default_disk_bytes, default_disk_path

    def computed(name: str, value: Any) -> None:
        values[name] = value
        sources[name] = COMPUTED_SOURCE

    if values["gpu_bytes"] is None:
        import torch  # only now: it takes a second to import

        computed("gpu_bytes", 2 * GiB if torch.cuda.is_available() else 0)
    if not values["disk_path"]:
        computed("disk_path", str(default_disk_path()))
    if values["disk_bytes"] is None:
        computed("disk_bytes", default_disk_bytes(Path(values["disk_path"]).expanduser()))
    if values["hash_seed"] is None:
        computed("hash_seed", environ.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED))
    if values["events_node"] is None:
        import socket

        computed("events_node", socket.gethostname())


# --- the parser ----------------------------------------------------------------------------


def _flag_help(setting: Setting) -> str:
    if setting.computed:
        default = setting.computed
    elif setting.kind is Kind.LIST:
        default = ", ".join(setting.default) or "none"
    else:
        default = setting_value(setting, setting.default).strip('"') or "none"
    more = "; repeatable" if setting.kind is Kind.LIST else ""
    text = f"{setting.help} (default: {default}; env {setting.env}{more})"
    return text.replace("%", "%%")


_METAVARS = {Kind.SIZE: "SIZE", Kind.INT: "N", Kind.FLOAT: "SECONDS", Kind.STR: "TEXT",
             Kind.LIST: "VALUE"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config``, ``--print-config`` and one flag per setting to ``parser``. A flag not
    given is None in the parsed namespace (so that the lower sources show through);
    ``resolve_args`` does every conversion and check."""
    parser.add_argument("--config", metavar="PATH", default=None,
                        help=f"TOML file of settings: keys are the flags' names in snake_case "
                        f"(host_bytes = \"8GiB\"); the environment and flags override it (env "
                        f"{CONFIG_ENV})")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective configuration as TOML and exit")
    for setting in SETTINGS:
        if setting.kind is Kind.BOOL:
            parser.add_argument(setting.flag, dest=setting.name, action="store_true",
                                default=None, help=_flag_help(setting))
            continue
        metavar = setting.metavar or _METAVARS.get(setting.kind)
        if setting.choices:
            metavar = "{" + ",".join(setting.choices) + "}"
        parser.add_argument(setting.flag, dest=setting.name, default=None, metavar=metavar,
                            action="append" if setting.kind is Kind.LIST else "store",
                            help=_flag_help(setting))


DESCRIPTION = (
    "Run the tiered KV-cache store and its gRPC service until interrupted. Settings come from "
    "defaults < a TOML file (--config) < TIERKV_<NAME> environment variables < flags; "
    "--print-config shows the result."
)


def build_parser() -> argparse.ArgumentParser:
    """A parser of ``tierkv serve``'s arguments alone (what ``tierkv serve`` registers)."""
    parser = argparse.ArgumentParser(prog="tierkv serve", description=DESCRIPTION,
                                     allow_abbrev=False)
    add_arguments(parser)
    return parser


def resolve(argv: Sequence[str], environ: Mapping[str, str]) -> Resolved:
    """The effective settings of ``tierkv serve <argv>`` started with ``environ``. Flag errors
    exit as argparse does (status 2); a bad value raises ``ConfigError``."""
    return resolve_args(build_parser().parse_args(list(argv)), environ)


# --- the reference page (docs/configuration.md) ----------------------------------------------

REFERENCE_START = "<!-- config-reference:start: scripts/gen-docs writes this from tierkv/cli/settings.py -->"
REFERENCE_END = "<!-- config-reference:end -->"


def _cell(text: str) -> str:
    # A bare <token> would be read as an HTML tag, a bare | as the end of the cell.
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _default_cell(setting: Setting) -> str:
    if setting.computed:
        return f"computed: {setting.computed}"
    if setting.kind is Kind.LIST:
        return ", ".join(f"`{item}`" for item in setting.default) or "none"
    literal = setting_value(setting, setting.default)
    return "none" if literal == '""' else f"`{literal}`"


def _wrap(text: str) -> list[str]:
    # Lines of at most 100 characters that never break inside a `code span`.
    glued = re.sub(r"`[^`]*`", lambda span: span.group().replace(" ", "\0"), text)
    return [line.replace("\0", " ") for line in textwrap.wrap(glued, 100, break_on_hyphens=False)]


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), between its two marker lines
    (included)."""
    intro = (
        "Every setting of `tierkv serve` comes, in rising precedence, from its default, a TOML "
        f"file (`--config PATH` or `{CONFIG_ENV}`), an environment variable and a flag. "
        "`tierkv serve --print-config` prints the effective configuration as TOML (a file "
        "`--config` reads back) and exits; an invalid value stops the start with one line "
        "naming the setting, the value and where it came from. In TOML a size is a string "
        '(`"8GiB"`) or a number of bytes and a list is an array of strings; in the '
        "environment a list is comma-separated and a boolean is 1/0/true/false/yes/no; a list "
        "flag repeats. An empty environment variable leaves a setting to the file and the "
        "default, except a text setting, where it is the value."
    )
    lines = [
        REFERENCE_START,
        "",
        *_wrap(intro),
        "",
        "| Setting | Flag | Environment | Default | Meaning |",
        "|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        meaning = setting.help
        if setting.choices:
            meaning += "; one of " + ", ".join(f"`{choice}`" for choice in setting.choices)
        lines.append(f"| `{setting.name}` | `{setting.flag}` | `{setting.env}` | "
                     f"{_cell(_default_cell(setting))} | {_cell(meaning)} |")
    lines += ["", REFERENCE_END]
    return "\n".join(lines) + "\n"


def replace_reference(page: str) -> str:
    """``page`` with the text between (and including) its reference markers replaced by
    ``reference_markdown()``; ``ValueError`` when it lacks the markers."""
    start, end = page.find(REFERENCE_START), page.find(REFERENCE_END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {REFERENCE_START!r} ... {REFERENCE_END!r} section")
    return page[:start] + reference_markdown() + page[end + len(REFERENCE_END) + 1:]
