"""``tierkv serve``'s settings: one schema, three sources (TOML file < environment < flags), errors
that name the setting and the source, and ``--print-config``, which ``--config`` reads back.

Over the whole schema, as properties: precedence and ``--print-config`` round trips with
odd-but-valid values; hostile values from every source (never a traceback, always one error
naming the setting); start-up failures after the settings were accepted (a listener that cannot
be bound, TLS files that are not PEM, a store that cannot open): one line and exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.cli.main import main
from tierkv.cli.serve_cmd import build_config, build_service_config, read_reload
from tierkv.cli.setting_values import MAX_SIZE_BYTES, toml_value
from tierkv.cli.settings import (
    SETTINGS,
    Kind,
    Resolved,
    Setting,
    build_parser,
    resolve,
    unknown_variables,
)
from tierkv.config import GiB, MiB, TenantShares, Tier
from tierkv.errors import ConfigError

# Every flag and variable `tierkv serve` had before the schema; deployments use them.
EARLIER_FLAGS = (
    "--listen", "--host-bytes", "--gpu-bytes", "--gpu-device", "--disk-path", "--disk-bytes",
    "--disk-on-corrupt", "--no-disk", "--page-bytes", "--write-policy", "--hash-seed",
    "--hash-algo", "--tokens-file", "--tls-cert", "--tls-key", "--put-idle-timeout-s",
    "--max-namespaces-per-tenant", "--stats-interval-s", "--log-level",
)
NEW_FLAGS = ("--metrics-port", "--metrics-host", "--admin-tenants", "--log-format")
# Resolving these needs no torch import and no look at the free disk space.
FIXED = ["--gpu-bytes", "0", "--disk-bytes", "1GiB", "--disk-path", "/nonexistent/tierkv"]


def toml_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tierkv.toml"
    path.write_text(text)
    return path


def test_flags_and_environment_variables_are_the_settings_names() -> None:
    flags = {setting.flag for setting in SETTINGS}
    assert set(EARLIER_FLAGS) | set(NEW_FLAGS) <= flags
    for setting in SETTINGS:
        assert setting.flag == "--" + setting.name.replace("_", "-")
        assert setting.env == "TIERKV_" + setting.name.upper()
        assert setting.name.isidentifier() and setting.name == setting.name.lower()
    assert len(flags) == len(SETTINGS)
    help_text = build_parser().format_help()
    for setting in SETTINGS:
        assert setting.flag in help_text and setting.env in help_text


def test_every_flag_and_every_variable_reaches_its_setting() -> None:
    samples = {Kind.SIZE: ("3MiB", 3 * MiB), Kind.INT: ("7", 7), Kind.FLOAT: ("2.5", 2.5),
               Kind.STR: ("text", "text"), Kind.LIST: ("a", ("a",))}
    tls = {"TIERKV_TLS_CERT": "c.pem", "TIERKV_TLS_KEY": "k.pem"}  # they go together
    for setting in SETTINGS:
        if setting.kind is Kind.BOOL:
            text, value, argv = "true", True, [setting.flag]
        elif setting.kind is Kind.CHOICE:
            text = value = setting.choices[-1]
            argv = [setting.flag, text]
        else:
            text, value = samples[setting.kind]
            argv = [setting.flag, text]
        assert resolve([*FIXED, *argv], tls)[setting.name] == value, setting.name
        if setting.flag not in FIXED:
            assert resolve(FIXED, {**tls, setting.env: text})[setting.name] == value, setting.name


def test_flags_beat_the_environment_which_beats_the_file_which_beats_the_defaults(
    tmp_path: Path,
) -> None:
    path = toml_file(tmp_path, 'host_bytes = "2GiB"\nput_idle_timeout_s = 5\n'
                     'listen = ["unix:///tmp/file.sock"]\nlog_format = "json"\nno_disk = true\n'
                     'admin_tenants = ["ops"]\nmetrics_port = 9100\n')
    base = [*FIXED, "--config", str(path)]
    default = resolve(FIXED, {})
    assert default["host_bytes"] == GiB and default.sources["host_bytes"] == "default"
    assert default["listen"] == ("unix:///tmp/tierkv.sock", "127.0.0.1:50051")
    assert (default["log_format"], default["no_disk"], default["admin_tenants"]) == ("text", False, ())
    from_file = resolve(base, {})
    assert from_file["host_bytes"] == 2 * GiB and from_file.sources["host_bytes"] == str(path)
    assert from_file["put_idle_timeout_s"] == 5.0 and from_file["listen"] == ("unix:///tmp/file.sock",)
    assert from_file["no_disk"] is True and from_file["admin_tenants"] == ("ops",)
    environ = {"TIERKV_HOST_BYTES": "3GiB", "TIERKV_PUT_IDLE_TIMEOUT_S": "6",
               "TIERKV_LISTEN": "unix:///tmp/env.sock, 127.0.0.1:0", "TIERKV_LOG_FORMAT": "text",
               "TIERKV_NO_DISK": "no", "TIERKV_ADMIN_TENANTS": "alice,bob"}
    from_env = resolve(base, environ)
    assert from_env["host_bytes"] == 3 * GiB and from_env.sources["host_bytes"] == "TIERKV_HOST_BYTES"
    assert from_env["listen"] == ("unix:///tmp/env.sock", "127.0.0.1:0")
    assert from_env["no_disk"] is False and from_env["admin_tenants"] == ("alice", "bob")
    assert from_env["metrics_port"] == 9100  # only the file sets it
    flags = ["--host-bytes", "4GiB", "--put-idle-timeout-s", "7", "--listen", "127.0.0.1:1",
             "--listen", "127.0.0.1:2", "--log-format", "json", "--admin-tenants", "carol"]
    from_flags = resolve([*base, *flags], environ)
    assert from_flags["host_bytes"] == 4 * GiB and from_flags.sources["host_bytes"] == "--host-bytes"
    assert from_flags["put_idle_timeout_s"] == 7.0
    assert from_flags["listen"] == ("127.0.0.1:1", "127.0.0.1:2")
    assert from_flags["log_format"] == "json" and from_flags["admin_tenants"] == ("carol",)
    assert resolve([*base, "--no-disk"], environ)["no_disk"] is True


def test_the_config_file_comes_from_the_flag_or_the_environment(tmp_path: Path) -> None:
    path = toml_file(tmp_path, "max_namespaces_per_tenant = 8\n")
    other = tmp_path / "other.toml"
    other.write_text("max_namespaces_per_tenant = 9\n")
    assert resolve(FIXED, {"TIERKV_CONFIG": str(path)})["max_namespaces_per_tenant"] == 8
    both = resolve([*FIXED, "--config", str(other)], {"TIERKV_CONFIG": str(path)})
    assert both["max_namespaces_per_tenant"] == 9 and both.config_path == other


def test_empty_variables_leave_settings_to_lower_sources_except_text() -> None:
    settings = resolve(["--gpu-bytes", "0"], {"TIERKV_DISK_BYTES": "", "TIERKV_DISK_PATH": "",
                                              "TIERKV_HASH_SEED": "", "TIERKV_HOST_BYTES": ""})
    assert settings["host_bytes"] == GiB and settings.sources["host_bytes"] == "default"
    assert settings.sources["disk_bytes"] == settings.sources["disk_path"] == "computed at start"
    assert settings["disk_path"].endswith(os.path.join("tierkv", "store"))
    assert settings["hash_seed"] == "" and settings.sources["hash_seed"] == "TIERKV_HASH_SEED"
    assert resolve(FIXED, {"PYTHONHASHSEED": "42"})["hash_seed"] == "42"
    assert resolve(FIXED, {})["hash_seed"] == "vllm-none-hash"
    assert resolve([*FIXED, "--log-level", "WARNING"], {})["log_level"] == "warning"


BAD_VALUES = [
    # (TOML text, environment, flags, what the one error line must say)
    ('host_bytes = "8 potatoes"\n', {}, [], 'host_bytes = "8 potatoes" (from {toml}): not a size'),
    ("", {"TIERKV_HOST_BYTES": "8 potatoes"}, [],
     'host_bytes = "8 potatoes" (from TIERKV_HOST_BYTES): not a size'),
    ("", {}, ["--host-bytes", "8 potatoes"], 'host_bytes = "8 potatoes" (from --host-bytes): not a size'),
    ("host_bytes = true\n", {}, [], "host_bytes = true (from {toml}): a size is a string"),
    ('max_namespaces_per_tenant = "8"\n', {}, [],
     'max_namespaces_per_tenant = "8" (from {toml}): an integer is expected, not a string'),
    ("metrics_port = true\n", {}, [], "metrics_port = true (from {toml}): an integer is expected"),
    ("", {"TIERKV_METRICS_PORT": "http"}, [], 'metrics_port = "http" (from TIERKV_METRICS_PORT): not an'),
    ("", {}, ["--stats-interval-s", "nan"], "stats_interval_s = \"nan\" (from --stats-interval-s): "
     "not a finite number"),
    ("", {"TIERKV_NO_DISK": "maybe"}, [], 'no_disk = "maybe" (from TIERKV_NO_DISK): a boolean is'),
    ('no_disk = "yes"\n', {}, [], 'no_disk = "yes" (from {toml}): a boolean is expected, not a string'),
    ("", {}, ["--log-format", "xml"], 'log_format = "xml" (from --log-format): must be one of "text", '
     '"json"'),
    ('write_policy = "later"\n', {}, [], 'write_policy = "later" (from {toml}): must be one of'),
    ('listen = "127.0.0.1:1"\n', {}, [], 'listen = "127.0.0.1:1" (from {toml}): an array of strings'),
    ("admin_tenants = [1]\n", {}, [], "admin_tenants = [1] (from {toml}): an array of strings"),
    ("host_byte = 3\n", {}, [], 'unknown setting "host_byte" in {toml}; did you mean host_bytes?'),
    ("[serve]\nhost_bytes = 3\n", {}, [], 'unknown setting "serve" in {toml}'),
    ("host_bytes = \n", {}, [], 'config = "{toml}" (from --config): not valid TOML'),
    ("", {}, ["--tls-cert", "/etc/cert.pem"], 'tls_cert = "/etc/cert.pem" (from --tls-cert): tls_cert '
     "and tls_key go together"),
]


@pytest.mark.parametrize(("text", "environ", "flags", "expected"), BAD_VALUES)
def test_a_bad_value_is_one_error_naming_the_setting_and_its_source(
    tmp_path: Path, text: str, environ: dict[str, str], flags: list[str], expected: str,
) -> None:
    path = toml_file(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        resolve([*FIXED, "--config", str(path), *flags], environ)
    assert expected.format(toml=path) in str(raised.value)


def test_a_missing_config_file_names_where_its_path_came_from(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match=r'config = ".*missing.toml" \(from --config\): cannot read'):
        resolve(["--config", str(missing)], {})
    with pytest.raises(ConfigError, match=r"\(from TIERKV_CONFIG\): cannot read"):
        resolve([], {"TIERKV_CONFIG": str(missing)})


def test_the_configs_own_checks_name_the_setting_and_its_source(tmp_path: Path) -> None:
    def store_error(argv: list[str], environ: dict[str, str]) -> str:
        with pytest.raises(ConfigError) as raised:
            build_config(resolve([*FIXED, *argv], environ))
        return str(raised.value)

    def service_error(argv: list[str], environ: dict[str, str]) -> str:
        with pytest.raises(ConfigError) as raised:
            build_service_config(resolve([*FIXED, *argv], environ))
        return str(raised.value)

    path = toml_file(tmp_path, 'host_bytes = "1KiB"\n')
    assert store_error(["--config", str(path)], {}).startswith(
        f'host_bytes = "1KiB" (from {path}): host capacity_bytes (1024) is smaller than one page')
    assert service_error([], {"TIERKV_PUT_IDLE_TIMEOUT_S": "0"}).startswith(
        "put_idle_timeout_s = 0.0 (from TIERKV_PUT_IDLE_TIMEOUT_S): put_idle_timeout_s must be")
    assert service_error(["--metrics-port", "70000"], {}).startswith(
        "metrics_port = 70000 (from --metrics-port): --metrics-port must be in [0, 65535]")
    assert service_error(["--max-namespaces-per-tenant", "0"], {}).startswith(
        "max_namespaces_per_tenant = 0 (from --max-namespaces-per-tenant)")
    tokens = tmp_path / "tokens"
    tokens.write_text("short alice\n")
    assert service_error([], {"TIERKV_TOKENS_FILE": str(tokens)}).startswith(
        f'tokens_file = "{tokens}" (from TIERKV_TOKENS_FILE): --tokens-file {tokens}:1:')
    key = tmp_path / "key.pem"
    key.write_text("key")
    assert service_error(["--tls-cert", str(tmp_path / "no.pem"), "--tls-key", str(key)], {}).startswith(
        f'tls_cert = "{tmp_path / "no.pem"}" (from --tls-cert): --tls-cert: no such file')


def test_serve_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    path = toml_file(tmp_path, 'host_bytes = "8 potatoes"\n')
    env = {**os.environ, "TIERKV_CONFIG": str(path)}
    done = subprocess.run([sys.executable, "-m", "tierkv", "serve", *FIXED], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr == (f'tierkv serve: host_bytes = "8 potatoes" (from {path}): not a size; use '
                           "a number with an optional unit such as 512MiB, 8GiB or 1.5GB\n")


def test_main_reports_a_bad_variable_with_its_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TIERKV_WRITE_POLICY", "sometimes")
    assert main(["serve", *FIXED]) == 2
    assert capsys.readouterr().err.startswith(
        'tierkv serve: write_policy = "sometimes" (from TIERKV_WRITE_POLICY): must be one of')


@pytest.mark.parametrize("text", [
    "", "plain", 'quote " and \\ backslash', "tab\tnew\nline\r\f\b", "\x00\x01\x1f\x7f",
    "ünïcødé ✓", "'single' # not a comment", "[not, a, list]",
])
def test_toml_strings_read_back_exactly(text: str) -> None:
    assert tomllib.loads(f"x = {toml_value(text)}")["x"] == text
    assert tomllib.loads(f"x = {toml_value((text, text))}")["x"] == [text, text]


def test_print_config_read_back_through_config_gives_the_same_settings(tmp_path: Path) -> None:
    path = toml_file(tmp_path, 'hash_seed = "s\\"e\\\\e\\td"\nstats_interval_s = 0.25\n')
    environ = {"TIERKV_ADMIN_TENANTS": "ops,ünï", "TIERKV_NO_DISK": "1"}
    argv = ["--config", str(path), "--host-bytes", "1.5GB", "--page-bytes", "64KiB",
            "--listen", "unix:///tmp/a b.sock", "--metrics-port", "9100", "--log-level", "DEBUG"]
    first = resolve(argv, environ)
    document = first.to_toml()
    parsed = tomllib.loads(document)
    assert set(parsed) == {setting.name for setting in SETTINGS}
    again = toml_file(tmp_path, document)
    second = resolve(["--config", str(again)], {})
    assert second.values == first.values
    assert set(second.sources.values()) == {str(again)}  # every setting came from the file
    assert first["host_bytes"] == 1_500_000_000 and parsed["host_bytes"] == 1_500_000_000
    assert parsed["page_bytes"] == "64KiB" and first["hash_seed"] == 's"e\\e\td'


def test_serve_print_config_prints_toml_and_starts_nothing(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    socket_path = tmp_path / "s.sock"
    env = {key: value for key, value in os.environ.items() if not key.startswith("TIERKV_")}
    done = subprocess.run(
        [sys.executable, "-m", "tierkv", "serve", "--print-config", "--disk-path", str(disk),
         "--listen", f"unix://{socket_path}", "--gpu-bytes", "0"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )
    parsed = tomllib.loads(done.stdout)
    assert parsed["disk_path"] == str(disk) and parsed["listen"] == [f"unix://{socket_path}"]
    assert isinstance(parsed["disk_bytes"], int | str) and parsed["hash_seed"]
    assert "# computed at start" in done.stdout and "# --disk-path" in done.stdout
    assert not disk.exists() and not socket_path.exists()
    assert done.stderr == ""


def test_resolved_settings_describe_where_a_value_came_from() -> None:
    settings: Resolved = resolve([*FIXED, "--host-bytes", "2GiB"], {})
    assert settings.describe("host_bytes") == 'host_bytes = "2GiB" (from --host-bytes)'
    assert settings.describe("page_bytes") == 'page_bytes = "4KiB" (default)'
    assert settings.describe("hash_seed").endswith("(computed at start)")


def test_misspelt_variables_are_found() -> None:
    environ = {"TIERKV_HOST_BYTE": "1GiB", "TIERKV_HOST_BYTES": "1GiB", "TIERKV_CONFIG": "x",
               "HOME": "/root"}
    assert unknown_variables(environ) == ["TIERKV_HOST_BYTE"]


@pytest.mark.parametrize("argv", [["serve", "--host-byte", "1GiB", "--print-config"],
                                  ["serve", "--metrics", "9433", "--print-config"]])
def test_a_prefix_of_a_flag_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # argparse would take "--host-byte" for "--host-bytes" by default: a deployment file written
    # with it would break the day another flag shares the prefix.
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        resolve(argv[1:], {})


def test_remote_takes_one_url_of_seeds_or_a_list_of_urls() -> None:
    def endpoints(url: str) -> list[str]:
        remote = build_config(resolve([*FIXED, "--remote", url], {})).remote
        assert remote is not None
        return [endpoint.label for endpoint in remote.endpoints]

    seeds = ["cache-a:7000", "cache-b:7000"]
    assert endpoints("redis://cache-a:7000,cache-b:7000") == seeds
    assert endpoints("redis://cache-a:7000,redis://cache-b:7000") == seeds  # as users write it
    assert endpoints("redis://cache-a:7000, redis://cache-b:7000,cache-c:7001") == [
        *seeds, "cache-c:7001"]
    remote = build_config(resolve([*FIXED, "--remote", "rediss://u:p@a:1,rediss://u:p@b:2"],
                                  {})).remote
    assert remote is not None and remote.tls and (remote.username, remote.password) == ("u", "p")
    for bad, why in (("redis://a:1,rediss://b:2", "share the scheme"),
                     ("redis://u:p@a:1,redis://b:2", "share the scheme and the credentials"),
                     ("redis://a:1,http://b:2", "no database number"),
                     ("redis://a:1,redis://b", "not host:port")):
        with pytest.raises(ConfigError, match=why):
            build_config(resolve([*FIXED, "--remote", bad], {}))


# --- properties over the whole schema, hostile values, start-up failures -----------------------


# Settings with a computed default, given here so that resolving needs no torch and no disk.
FIXED_SETTINGS = {"gpu_bytes": "0", "disk_bytes": "1GiB", "disk_path": "/nonexistent/tierkv"}
PARTNERS = {"tls_cert": "tls_key", "tls_key": "tls_cert"}  # set together or not at all

_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_ITEM = st.text(st.characters(exclude_categories=("Cs",), exclude_characters=","), min_size=1,
                max_size=8).map(str.strip).filter(bool)  # what a comma-separated list can hold


def _values(setting: Setting) -> st.SearchStrategy[Any]:
    """Valid values of ``setting``, as the resolution types them."""
    kind = setting.kind
    if kind is Kind.SIZE:
        return st.integers(1, MAX_SIZE_BYTES)
    if kind is Kind.INT:
        return st.integers(0, 65535)
    if kind is Kind.FLOAT:
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind is Kind.BOOL:
        return st.booleans()
    if kind is Kind.CHOICE:
        return st.sampled_from(setting.choices)
    if kind is Kind.LIST:
        return st.lists(_ITEM, max_size=3).map(tuple)
    if setting.name in PARTNERS or setting.name == "disk_path":  # "" means "none" for these
        return _TEXT.filter(bool)
    return _TEXT


def _as_text(setting: Setting, value: Any) -> str:
    if setting.kind is Kind.LIST:
        return ",".join(value)
    if setting.kind is Kind.BOOL:
        return "yes" if value else "no"
    return repr(value) if setting.kind is Kind.FLOAT else str(value)


def _as_flags(setting: Setting, value: Any) -> list[str]:
    if setting.kind is Kind.LIST:
        return [f"{setting.flag}={item}" for item in value]
    if setting.kind is Kind.BOOL:
        return [setting.flag] if value else []
    return [f"{setting.flag}={_as_text(setting, value)}"]


def _base(excluded: set[str]) -> tuple[list[str], dict[str, str]]:
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in FIXED_SETTINGS.items()
            if name not in excluded]
    return argv, {}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_highest_source_given_wins_for_every_setting(data: st.DataObject) -> None:
    setting = data.draw(st.sampled_from(SETTINGS))
    values = {source: data.draw(_values(setting)) for source in ("file", "env", "flag")}
    given_sources = data.draw(st.sets(st.sampled_from(("file", "env", "flag")), min_size=1))
    if setting.kind is Kind.BOOL and "flag" in given_sources:
        values["flag"] = True  # a flag can only turn a boolean on
    for source in ("env", "flag"):  # no flag, or an empty variable, gives no list at all
        if setting.kind is Kind.LIST and source in given_sources and not values[source]:
            values[source] = ("x",)
    argv, environ = _base({setting.name})
    partner = PARTNERS.get(setting.name)
    if partner:
        argv.append(f"--{partner.replace('_', '-')}=partner.pem")
    with tempfile.TemporaryDirectory() as folder:
        if "file" in given_sources:
            path = Path(folder) / "tierkv.toml"
            path.write_text(f"{setting.name} = {toml_value(values['file'])}\n", encoding="utf-8")
            argv += ["--config", str(path)]
        if "env" in given_sources:
            environ[setting.env] = _as_text(setting, values["env"])
        if "flag" in given_sources:
            argv += _as_flags(setting, values["flag"])
        resolved = resolve(argv, environ)
    winner = next(s for s in ("flag", "env", "file") if s in given_sources)
    expected = values[winner]
    if setting.choices and setting.fold_case:
        expected = expected.lower()
    assert resolved[setting.name] == expected
    source = resolved.sources[setting.name]
    assert source == {"flag": setting.flag, "env": setting.env}.get(winner, source)
    if winner == "file":
        assert source.endswith("tierkv.toml")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_print_config_reads_back_to_the_same_values_whatever_they_hold(
    data: st.DataObject,
) -> None:
    chosen = data.draw(st.lists(st.sampled_from(SETTINGS), unique=True, max_size=len(SETTINGS)))
    names = {setting.name for setting in chosen}
    argv, _ = _base(names)
    for setting in chosen:
        argv += _as_flags(setting, data.draw(_values(setting)))
    if ("tls_cert" in names) != ("tls_key" in names):
        argv += ["--tls-cert=c.pem", "--tls-key=k.pem"]  # the later ones win: both set
    first = resolve(argv, {})
    document = first.to_toml()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "printed.toml"
        path.write_text(document, encoding="utf-8")
        second = resolve(["--config", str(path)], {})
    assert second.values == first.values


def test_print_config_parses_when_the_config_path_holds_a_newline(tmp_path: Path) -> None:
    """The path was written raw in a comment: its second line was read as TOML."""
    path = tmp_path / "odd\nname # [x].toml"
    path.write_text('host_bytes = "2GiB"\n')
    first = resolve([*_base(set())[0], "--config", str(path)], {})
    assert tomllib.loads(first.to_toml())["host_bytes"] == "2GiB"


HUGE = "1" + "0" * 400
HOSTILE = [
    # (TOML text, environment, flags, what the error names)
    (f"put_idle_timeout_s = {HUGE}\n", {}, [], "put_idle_timeout_s = "),  # was OverflowError
    (f"stats_interval_s = -{HUGE}\n", {}, [], "stats_interval_s = "),
    (f"host_bytes = {HUGE}\n", {}, [], "host_bytes = "),  # was OverflowError at start
    ("", {"TIERKV_DISK_BYTES": "9EiB"}, [], "disk_bytes = "),
    ("", {}, [f"--page-bytes={1 << 63}"], "page_bytes = "),
    ("", {}, ["--host-bytes=100000000TiB"], "host_bytes = "),
    (f"metrics_port = {HUGE}\n", {}, [], "metrics_port = "),
    ("host_bytes = 1979-05-27T07:32:00Z\n", {}, [], "host_bytes = "),
    ("hash_seed = 1979-05-27\n", {}, [], "hash_seed = "),
    ("listen = [[\"a\"]]\n", {}, [], "listen = "),
    ("[admin_tenants]\nx = 1\n", {}, [], "admin_tenants = "),
    ("log_level = \"\"\n", {}, [], "log_level = "),
    ("", {"TIERKV_LOG_FORMAT": "json "}, [], "log_format = "),
    ("", {"TIERKV_LISTEN": " , ,"}, [], "listen = "),
    ("", {"TIERKV_METRICS_PORT": "9" * 5000}, [], "metrics_port = "),
    ("", {"TIERKV_PUT_IDLE_TIMEOUT_S": "1e999"}, [], "put_idle_timeout_s = "),
    ("", {"TIERKV_HOST_BYTES": "\udcff"}, [], "host_bytes = "),
    ("", {"TIERKV_HASH_SEED": "\udcff"}, [], "hash_seed = "),
    ("", {}, ["--max-namespaces-per-tenant", HUGE], "max_namespaces_per_tenant = "),
]


@pytest.mark.parametrize(("text", "environ", "flags", "named"), HOSTILE)
def test_hostile_values_are_one_config_error_naming_the_setting(
    tmp_path: Path, text: str, environ: dict[str, str], flags: list[str], named: str,
) -> None:
    path = tmp_path / "tierkv.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        resolved = resolve([*_base(set())[0], "--config", str(path), *flags], environ)
        build_config(resolved)
        build_service_config(resolved)
        if resolved["stats_interval_s"] < 0:  # what serve checks before it starts anything
            raise resolved.error("stats_interval_s", "negative")
    assert str(raised.value).startswith(named)
    assert "\n" not in str(raised.value)


# --- failures after the settings were accepted: `tierkv serve` itself --------------------------


def _serve(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("TIERKV_")}
    env["GRPC_VERBOSITY"] = "NONE"
    return subprocess.run(
        [sys.executable, "-m", "tierkv", "serve", "--gpu-bytes", "0", "--host-bytes", "4MiB",
         "--page-bytes", "4KiB", "--stats-interval-s", "0", "--log-level", "warning",
         "--disk-path", str(tmp_path / "disk"), "--disk-bytes", "64MiB", *flags],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )


def _one_error_line(done: subprocess.CompletedProcess[str], named: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert "never awaited" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(f"tierkv serve: {named}"), done.stderr
    assert done.stdout == ""


def test_a_listener_that_cannot_be_bound_is_one_line_naming_it(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        _one_error_line(_serve(tmp_path, "--listen", "127.0.0.1:0", "--listen", address),
                        f"--listen {address}: cannot listen there")
    _one_error_line(_serve(tmp_path, "--listen", "not an address"), "--listen not an address")


def test_tls_files_that_are_not_pem_are_one_line_naming_them(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("not a certificate")
    key.write_text("not a key")
    _one_error_line(_serve(tmp_path, "--listen", "127.0.0.1:0", "--tls-cert", str(cert),
                           "--tls-key", str(key)), f"--tls-cert {cert}, --tls-key {key}")


def test_a_store_that_cannot_open_stops_the_started_server_cleanly(tmp_path: Path) -> None:
    """The listeners (and the metrics endpoint) start before the store opens; a store that
    failed left grpc's server to the collector, which wrote tracebacks after the error."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = _serve(tmp_path, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                  "--disk-path", str(blocker / "disk"))
    _one_error_line(done, "")
    assert str(blocker / "disk") in done.stderr


# --- a reload (SIGHUP): tokens file and tenants' shares ------------------------------------


def _tokens(path: Path, tenants: dict[str, str]) -> Path:
    path.write_text("".join(f"{token} {tenant}\n" for token, tenant in tenants.items()))
    return path


def test_a_reload_reads_the_tokens_file_and_the_shares_again(tmp_path: Path) -> None:
    tokens = _tokens(tmp_path / "tokens", {"a" * 16: "alice", "b" * 16: "bob"})
    config = toml_file(tmp_path, 'tenant_weights = ["alice=1", "bob=1"]\n')
    argv = [*FIXED, "--tokens-file", str(tokens), "--config", str(config)]
    args = build_parser().parse_args(argv)
    started = resolve(argv, {})
    assert build_config(started).tenants.weights == {"alice": 1.0, "bob": 1.0}
    _tokens(tokens, {"a" * 16: "alice", "b" * 16: "bob", "c" * 16: "carol"})
    config.write_text('tenant_weights = ["alice=3", "bob=1"]\ntenant_caps = ["carol=0.25"]\n'
                      'admin_tenants = ["alice"]\nmax_namespaces_per_tenant = 9\n')
    reload = read_reload(args, started, {})
    assert reload.tokens["c" * 16] == "carol"
    assert reload.shares == TenantShares({"alice": 3.0, "bob": 1.0}, {"carol": 0.25})
    assert reload.admin_tenants == ("alice",)
    assert reload.ignored == ("max_namespaces_per_tenant",)  # takes a restart, and is said so


def test_a_reload_without_weights_gives_every_tenant_of_the_new_file_an_equal_share(
        tmp_path: Path) -> None:
    tokens = _tokens(tmp_path / "tokens", {"a" * 16: "alice"})
    argv = [*FIXED, "--tokens-file", str(tokens)]
    started = resolve(argv, {})
    _tokens(tokens, {"a" * 16: "alice", "c" * 16: "carol"})
    reload = read_reload(build_parser().parse_args(argv), started, {})
    assert reload.shares.weights == {"alice": 1.0, "carol": 1.0} and reload.ignored == ()


@pytest.mark.parametrize(("tokens_text", "config_text", "message"), [
    ("short alice\n", "", r"tokens\.bad:1: expected '<token> <tenant>'"),
    ("", "", r"tokens\.bad: no tokens in it"),
    ("\xff\xfe" + "a" * 16 + " alice\n", "", r"cannot read .*tokens\.bad"),
    ("a" * 16 + " alice\n", 'tenant_weights = ["mallory=1"]\n',
     r"'mallory' is not a tenant of the tokens file .*tokens\.bad"),
    ("a" * 16 + " alice\n", 'tenant_caps = ["alice=2"]\n', r"cap must be a fraction"),
    ("a" * 16 + " alice\n", "tenant_weights = [\n", r"not valid TOML"),
])
def test_a_bad_reload_is_refused_with_one_line_that_names_the_file(
        tmp_path: Path, tokens_text: str, config_text: str, message: str) -> None:
    tokens = _tokens(tmp_path / "tokens.bad", {"a" * 16: "alice", "b" * 16: "bob"})
    config = toml_file(tmp_path, "")
    argv = [*FIXED, "--tokens-file", str(tokens), "--config", str(config)]
    started = resolve(argv, {})
    tokens.write_bytes(tokens_text.encode("latin-1"))
    config.write_text(config_text)
    with pytest.raises(ConfigError, match=message) as refused:
        read_reload(build_parser().parse_args(argv), started, {})
    assert "\n" not in str(refused.value)


def test_a_reload_cannot_turn_tokens_on_or_off(tmp_path: Path) -> None:
    tokens = _tokens(tmp_path / "tokens", {"a" * 16: "alice"})
    config = toml_file(tmp_path, f'tokens_file = "{tokens}"\n')
    argv = [*FIXED, "--config", str(config)]
    started = resolve(argv, {})
    config.write_text("")
    with pytest.raises(ConfigError, match="cannot turn tokens on or off"):
        read_reload(build_parser().parse_args(argv), started, {})


def test_remote_tenant_settings_reach_the_remote_config() -> None:
    remote = build_config(resolve([*FIXED, "--remote", "redis://127.0.0.1:1",
                                   "--remote-tenant-write-bytes", "64MiB",
                                   "--remote-tenant-write-interval-s", "10",
                                   "--remote-tenant-ttl-s", "alice=100",
                                   "--remote-tenant-ttl-s", "bob=0"], {})).remote
    assert remote is not None
    assert (remote.tenant_write_bytes, remote.tenant_write_interval_s) == (64 * MiB, 10.0)
    assert remote.ttl_s_of("alice") == 100 and remote.ttl_s_of("bob") == 0
    assert remote.ttl_s_of("carol") == remote.ttl_s
    with pytest.raises(ConfigError, match=r"remote_tenant_ttl_s.*'alice=1\.5' is not TENANT=NUMBER"):
        build_config(resolve([*FIXED, "--remote", "redis://127.0.0.1:1",
                              "--remote-tenant-ttl-s", "alice=1.5"], {}))


def test_tenant_bytes_are_shares_in_bytes_per_tier(tmp_path: Path) -> None:
    tokens = _tokens(tmp_path / "tokens", {"a" * 16: "alice", "b" * 16: "bob"})
    plan = build_config(resolve([*FIXED, "--tokens-file", str(tokens),
                                 "--tenant-bytes", "alice:host=4MiB",
                                 "--tenant-bytes", "bob:disk=1GiB"], {})).tenants
    assert plan.sizes == {("alice", Tier.HOST): 4 * MiB, ("bob", Tier.DISK): GiB}
    assert plan.weights == {"alice": 1.0, "bob": 1.0}  # the rest, equally
    for bad, message in (("alice=4MiB", "is not TENANT:TIER=SIZE"),
                         ("alice:ssd=4MiB", "is not TENANT:TIER=SIZE"),
                         ("alice:host=lots", "cannot read 'lots' as a size"),
                         ("alice:host=0", "positive number of bytes"),
                         ("mallory:host=1MiB", "'mallory' is not a tenant of the tokens file")):
        with pytest.raises(ConfigError, match=message) as refused:
            build_config(resolve([*FIXED, "--tokens-file", str(tokens), "--tenant-bytes", bad],
                                 {}))
        assert "tenant_bytes" in str(refused.value), bad


def test_without_a_tokens_file_only_the_default_tenant_may_have_a_share() -> None:
    """Every call is the tenant ``default`` then: a weight for anyone else would leave it a
    share of 0 (no pins, no zero-copy reads) without a word."""
    with pytest.raises(ConfigError, match=r"'alice' is not the one tenant without a tokens_file"):
        build_config(resolve([*FIXED, "--tenant-weights", "alice=1"], {}))
    with pytest.raises(ConfigError, match=r"tenant_caps.*'alice' is not the one tenant"):
        build_config(resolve([*FIXED, "--tenant-caps", "alice=0.5"], {}))
    plan = build_config(resolve([*FIXED, "--tenant-weights", "default=1",
                                 "--tenant-bytes", "default:host=1MiB"], {})).tenants
    assert plan.weights == {"default": 1.0} and plan.sizes == {("default", Tier.HOST): MiB}


@pytest.mark.parametrize(("flags", "expected"), [
    (["--events-endpoint", "tcp://0.0.0.0:5557"],
     'events_endpoint = "tcp://0.0.0.0:5557" (from --events-endpoint): '
     "--events-endpoint tcp://0.0.0.0:5557: events carry prompt token ids"),
    (["--events-endpoint", "ipc:///tmp/e", "--events-replay-endpoint", "tcp://10.1.2.3:1"],
     "--events-replay-endpoint tcp://10.1.2.3:1: events carry prompt token ids"),
    (["--events-endpoint", "ipc:///tmp/e", "--events-topic", "kv@{node}@{model}"],
     "must name {namespace}"),
    (["--events-endpoint", "ipc:///tmp/e", "--events-topic", "kv@{pod}:{namespace}"],
     "a template of {node}, {tenant}, {model} and {namespace}"),
    (["--events-endpoint", "udp://x"], "give ipc:///path or tcp://host:port"),
    (["--events-endpoint", "ipc:///tmp/e", "--events-heartbeat-s", "0"], "must be positive"),
])
def test_events_settings_are_checked_at_start(flags: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        build_service_config(resolve([*FIXED, *flags], {}))
    assert expected in str(raised.value)


def test_events_without_token_ids_may_bind_any_address() -> None:
    config = build_service_config(resolve(
        [*FIXED, "--events-endpoint", "tcp://0.0.0.0:5557", "--events-token-ids", "off"], {}))
    assert config.events is not None and config.events.replay_endpoint == "tcp://0.0.0.0:5558"
    assert not config.events.token_ids
    assert build_service_config(resolve(FIXED, {})).events is None
