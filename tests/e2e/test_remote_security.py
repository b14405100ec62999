"""The REMOTE tier's connection options against a real single (non-cluster) Redis, through real
``tierkv serve`` sidecars: an ACL user with a password file, TLS with a CA (and mutual TLS),
the ``--remote`` URL's checks, and the ``tierkv_remote_*`` metrics of the blocks two sidecars
shared. Each sidecar stands for another node: its own disk, the same Redis."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.service.test_metrics import scrape
from tests.support.harness import Sidecar, free_port, shm_client, stream_client
from tests.support.redis_cluster import RedisServer
from tests.support.tiny_blocks import TINY_LAYOUT, blocks, keys
from tierkv import Client, ConfigError, Namespace, WritePolicy
from tierkv.config import RemoteTierConfig, parse_remote_url

pytestmark = pytest.mark.slow

PASSWORD = "s3cret pass"  # a space: the file is read whole, not split


def _wait_written(client: Client, count: int) -> None:
    """Until the sidecar has sent ``count`` write-through records to REMOTE."""
    deadline = time.monotonic() + 20
    while True:
        remote = client.stats().remote
        assert remote is not None
        if remote.written >= count and remote.queued_bytes == 0:
            return
        assert time.monotonic() < deadline, f"records never left the queue: {remote}"
        time.sleep(0.05)


def _wait_connected(client: Client) -> None:
    """Until the sidecar has read the REMOTE tier's topology (it connects in the background)."""
    deadline = time.monotonic() + 20
    while not (remote := client.stats().remote) or not remote.connected:
        assert time.monotonic() < deadline, f"never connected: {remote}"
        time.sleep(0.05)


def _share(start: Callable[..., Sidecar], flags: list[str], salt: str) -> tuple[Sidecar, Sidecar]:
    """Two sidecars on ``flags``: blocks put through the first are read bit-exact through the
    second (which has none of them locally); returns both."""
    a = start(*flags, disk_path=None)
    b = start(*flags, "--no-disk")
    namespace = Namespace("remote-model", TINY_LAYOUT)
    hashes, data = keys(6, salt=salt), blocks(6, seed=len(salt))
    with stream_client(a) as writer:
        _wait_connected(writer)
        assert writer.put(namespace, hashes, data, write_policy=WritePolicy.WRITE_THROUGH) == 6
        _wait_written(writer, 6)
    with shm_client(b) as reader:
        _wait_connected(reader)
        assert reader.lookup(namespace, hashes) == 6
        got = reader.get(namespace, hashes)
    assert torch.equal(got.view(torch.uint8), data.view(torch.uint8))
    return a, b


def test_an_acl_user_with_a_password_file_shares_blocks_and_a_wrong_password_is_a_miss(
    tmp_path: Path, sidecar_factory: Callable[..., Sidecar]
) -> None:
    with RedisServer(tmp_path / "redis") as server:
        admin = server.client()
        admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "tierkv", "on", f">{PASSWORD}", "~tkv:*", "+get", "+set",
            "+exists", "+evalsha", "+script|load", "+ping", "+info", "+cluster|slots",
            "+unlink", "+scan")
        admin.execute_command("ACL", "SETUSER", "default", "off")  # type: ignore[no-untyped-call]
        secret = tmp_path / "redis.pass"
        secret.write_text(PASSWORD + "\n")
        url = f"redis://tierkv@127.0.0.1:{server.port}"
        _share(sidecar_factory, ["--remote", url, "--remote-password-file", str(secret)], "acl")

        # A wrong password: the sidecar runs, local-only, and says why in its stats.
        secret.write_text("wrong")
        lonely = sidecar_factory("--remote", url, "--remote-password-file", str(secret),
                                 "--no-disk")
        namespace = Namespace("remote-model", TINY_LAYOUT)
        with stream_client(lonely) as client:
            assert client.lookup(namespace, keys(6, salt="acl")) == 0
            assert client.put(namespace, keys(2, salt="local"), blocks(2)) == 2
            assert client.lookup(namespace, keys(2, salt="local")) == 2
            remote = client.stats().remote
            assert remote is not None and not remote.connected and remote.errors > 0


def _certificates(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate of 127.0.0.1 it signs, and a client certificate."""
    folder.mkdir()
    paths = {name: folder / f"{name}.pem" for name in
             ("ca", "ca-key", "server", "server-key", "client", "client-key")}

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", "/CN=tierkv-test-ca", "-keyout",
            str(paths["ca-key"]), "-out", str(paths["ca"]))
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1"),
                            ("client", "extendedKeyUsage=clientAuth")):
        request = folder / f"{name}.csr"
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-subj", f"/CN={name}", "-keyout", str(paths[f"{name}-key"]), "-out",
                str(request))
        extra = folder / f"{name}.ext"
        extra.write_text(extension + "\n")
        openssl("x509", "-req", "-in", str(request), "-CA", str(paths["ca"]), "-CAkey",
                str(paths["ca-key"]), "-CAcreateserial", "-days", "1", "-extfile", str(extra),
                "-out", str(paths[name]))
    return paths


def test_tls_with_a_ca_and_client_certificates_shares_blocks(
    tmp_path: Path, sidecar_factory: Callable[..., Sidecar]
) -> None:
    certs = _certificates(tmp_path / "certs")
    tls_port = free_port()
    with RedisServer(tmp_path / "redis", [
        "--tls-port", str(tls_port), "--tls-cert-file", str(certs["server"]),
        "--tls-key-file", str(certs["server-key"]), "--tls-ca-cert-file", str(certs["ca"]),
        "--tls-auth-clients", "yes",
    ]):
        url = f"rediss://127.0.0.1:{tls_port}"
        flags = ["--remote", url, "--remote-tls-ca", str(certs["ca"]),
                 "--remote-tls-cert", str(certs["client"]),
                 "--remote-tls-key", str(certs["client-key"])]
        _share(sidecar_factory, flags, "tls")
        # Without the client certificate the server refuses the handshake: a miss, no error.
        lonely = sidecar_factory("--remote", url, "--remote-tls-ca", str(certs["ca"]),
                                 "--no-disk")
        with stream_client(lonely) as client:
            assert client.lookup(Namespace("remote-model", TINY_LAYOUT),
                                 keys(6, salt="tls")) == 0
            remote = client.stats().remote
            assert remote is not None and not remote.connected


def test_remote_metrics_count_what_two_sidecars_shared(
    tmp_path: Path, sidecar_factory: Callable[..., Sidecar]
) -> None:
    with RedisServer(tmp_path / "redis") as server:
        port_a, port_b = free_port(), free_port()
        flags = ["--remote", server.url]
        a = sidecar_factory(*flags, "--metrics-port", str(port_a))
        b = sidecar_factory(*flags, "--no-disk", "--metrics-port", str(port_b))
        namespace = Namespace("remote-model", TINY_LAYOUT)
        hashes, data = keys(5, salt="metrics"), blocks(5, seed=9)
        with stream_client(a) as writer:
            _wait_connected(writer)
            writer.put(namespace, hashes, data, write_policy=WritePolicy.WRITE_THROUGH)
            _wait_written(writer, 5)
        with stream_client(b) as reader:
            _wait_connected(reader)
            assert reader.get(namespace, [*hashes, *keys(1, salt="absent")]).shape[0] == 5
        written, shared = scrape(port_a), scrape(port_b)
        assert written.value("tierkv_remote_written_total") == 5
        assert written.value("tierkv_remote_connected") == 1
        record_bytes = written.value("tierkv_remote_written_bytes_total")
        assert record_bytes > 5 * TINY_LAYOUT.bytes_per_block
        assert shared.value("tierkv_remote_hits_total") == 5
        # The client's lookup found the run's end (the absent block) in REMOTE's answer.
        assert shared.value("tierkv_remote_lookups_total") >= 1
        assert shared.value("tierkv_remote_read_bytes_total") == record_bytes
        assert shared.value("tierkv_remote_queue_drops_total") == 0


@pytest.mark.parametrize("url, message", [
    ("http://h:1", "must start with redis://"),
    ("redis://h", "not host:port"),
    ("redis://h:0", "not host:port"),
    ("redis://h:1/0", "no database number"),
    ("redis://h:1,", "not host:port"),
])
def test_bad_remote_urls_are_one_clear_error(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_remote_url(url)


def test_a_remote_url_gives_endpoints_user_password_and_tls() -> None:
    config = RemoteTierConfig.from_url("rediss://me:p%40ss@a:1,[::1]:2", ttl_s=5)
    assert [e.label for e in config.endpoints] == ["a:1", "[::1]:2"]
    assert (config.username, config.password, config.tls, config.ttl_s) == ("me", "p@ss", True, 5)
    assert RemoteTierConfig.from_url("redis://a:1", password="file").password == "file"
