"""Attacks on ``tierkv serve``'s settings (a review's tests): precedence and ``--print-config``
round trips as properties over the whole schema with odd-but-valid values, hostile values from
every source (never a traceback, always one error naming the setting), and start-up failures
after the settings were accepted (a listener that cannot be bound, TLS files that are not PEM,
a store that cannot open): one line and exit 2, never a traceback.
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

from tierkv.cli.serve_cmd import build_config, build_service_config
from tierkv.cli.setting_values import MAX_SIZE_BYTES, toml_value
from tierkv.cli.settings import SETTINGS, Kind, Setting, resolve
from tierkv.errors import ConfigError

# Settings with a computed default, given here so that resolving needs no torch and no disk.
FIXED = {"gpu_bytes": "0", "disk_bytes": "1GiB", "disk_path": "/nonexistent/tierkv"}
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
    argv = [f"--{name.replace('_', '-')}={value}" for name, value in FIXED.items()
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


# --- failures after the settings were accepted: `tierkv serve` itself ---------------------


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
