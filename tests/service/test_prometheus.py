"""A real Prometheus server (Debian's, through ``scripts/prometheus``, which installs it when it
is missing) scrapes a real sidecar every second; after a known workload its HTTP query API
must return the expected series and values, and every Grafana dashboard expression must
evaluate (``status: success``, with data).

Never skipped: a machine where Prometheus cannot be installed fails this test.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.e2e.test_grafana_dashboard import as_promql, dashboard_expressions
from tests.support.harness import BackgroundServer, free_port
from tests.support.rpc_calls import NS
from tests.support.service_fixtures import ALICE, payload
from tests.support.tiny_blocks import BLOCK_BYTES, TINY_LAYOUT, keys
from tierkv import Tier
from tierkv.wire import tierkv_pb2 as pb
from tierkv.wire import tierkv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "prometheus"
DEADLINE_S = 60.0  # for each wait for a scrape to show a value
START_DEADLINE_S = 300.0  # Prometheus's start, after an apt-get install when it was missing
SCRAPE_CONFIG = """\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: tierkv
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


class Prometheus:
    """A Prometheus process scraping ``127.0.0.1:<target_port>``, its data in ``root``."""

    def __init__(self, root: Path, target_port: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        config_path = root / "prometheus.yml"
        config_path.write_text(SCRAPE_CONFIG.format(port=target_port))
        self.port = free_port()
        self.log_path = root / "prometheus.log"
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [str(SCRIPT), f"--config.file={config_path}",
                 f"--storage.tsdb.path={root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )

    def get(self, path: str, **params: str) -> tuple[int, Any]:
        """``(HTTP status, JSON body)`` of a GET of the HTTP API (errors included)."""
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as failure:
            return failure.code, json.loads(failure.read() or b"null")

    def query(self, promql: str) -> dict[str, Any]:
        """The body of an instant query (``status``, ``data`` or ``error``)."""
        _, body = self.get("/api/v1/query", query=promql)
        assert isinstance(body, dict), body
        return body

    def values(self, promql: str) -> list[float]:
        """The sample values of an instant vector query (empty while there is none)."""
        body = self.query(promql)
        assert body["status"] == "success", (promql, body)
        return [float(sample["value"][1]) for sample in body["data"]["result"]]

    def wait_ready(self) -> None:
        deadline_s = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline_s:
            assert self.process.poll() is None, f"prometheus exited:\n{self.log_path.read_text()}"
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready",
                                          timeout=2).status == 200:
                    return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        pytest.fail(f"prometheus did not get ready:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        """SIGTERM (Prometheus stops cleanly), SIGKILL if it takes too long: no leftovers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def wait_for(what: str, check: Callable[[], bool], prometheus: Prometheus) -> None:
    """Until ``check()`` holds (Prometheus scrapes every second), or fail after DEADLINE_S."""
    deadline_s = time.monotonic() + DEADLINE_S
    while not check():
        if time.monotonic() > deadline_s:
            pytest.fail(f"{what}: not seen in {DEADLINE_S:g} s")
        time.sleep(0.25)
    assert prometheus.process.poll() is None


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[BackgroundServer]:
    """A real server with 8 tiny blocks of HOST (so that a workload demotes) and metrics on."""
    server = BackgroundServer(tmp_path / "store", host_blocks=8, metrics_port=free_port())
    yield server
    server.close()


@pytest.fixture
def prometheus(tmp_path: Path, sidecar: BackgroundServer) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path / "prometheus", sidecar.served.server.metrics_port)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def run_workload(target: str) -> None:
    """12 blocks put by stream (4 demoted: HOST holds 8), 4 of them read back by stream and
    8 leased by Acquire (tokens saved: 12 blocks of 4 tokens), a miss, a refused Lookup."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.TierKVStub(channel)
        hashes = keys(12, salt="prom")
        for start in range(0, 12, 4):
            data = payload(4, seed=start)
            chunks = [pb.PutChunk(header=pb.PutHeader(namespace=NS, hashes=hashes[start:start + 4]),
                                  data=data)]
            assert stub.Put(iter(chunks), metadata=ALICE).count == 4
        got = list(stub.Get(pb.BlocksRequest(namespace=NS, hashes=hashes[8:]), metadata=ALICE))
        assert got[0].num_blocks == 4
        lease = stub.Acquire(pb.AcquireRequest(namespace=NS, hashes=hashes[:8],
                                               slab_id=describe_slab(stub)), metadata=ALICE)
        assert lease.num_blocks == 8
        stub.Release(pb.LeaseRequest(lease_id=lease.lease_id), metadata=ALICE)
        missed = list(stub.Get(pb.BlocksRequest(namespace=NS, hashes=keys(2, salt="no")),
                               metadata=ALICE))
        assert missed[0].num_blocks == 0
        with pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(pb.LookupRequest(namespace=NS, hashes=[b"short"]), metadata=ALICE)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A write lease aborted, to count a lease call with no data.
        written = stub.Allocate(pb.AllocateRequest(namespace=NS, hashes=keys(1, salt="w"),
                                                   slab_id=describe_slab(stub)), metadata=ALICE)
        assert written.num_blocks == 1
        stub.Abort(pb.LeaseRequest(lease_id=written.lease_id), metadata=ALICE)


def describe_slab(stub: pb_grpc.TierKVStub) -> bytes:
    return bytes(stub.Describe(pb.DescribeRequest(), metadata=ALICE).slab_id)


def test_a_real_prometheus_scrapes_the_expected_series_and_the_dashboard_evaluates(
    sidecar: BackgroundServer, prometheus: Prometheus,
) -> None:
    wait_for("the sidecar's first scrape",
             lambda: prometheus.values('up{job="tierkv"}') == [1.0], prometheus)
    run_workload(sidecar.tcp_target)
    stats = sidecar.store.stats()
    host_hits = stats.tiers[Tier.HOST].hits
    tokens = 12 * TINY_LAYOUT.block_size
    expected = {
        'tierkv_tier_hits_total{tier="host"}': [float(host_hits)],
        'tierkv_tier_capacity_bytes{tier="host"}': [8.0 * BLOCK_BYTES],
        'tierkv_prefill_tokens_saved_total{tenant="alice",model="test-model"}': [float(tokens)],
        'tierkv_rpc_requests_total{method="Put",code="OK"}': [3.0],
        'tierkv_rpc_requests_total{method="Get",code="OK"}': [2.0],
        'tierkv_rpc_requests_total{method="Lookup",code="INVALID_ARGUMENT"}': [1.0],
        'tierkv_rpc_duration_seconds_count{method="Put"}': [3.0],
        'tierkv_bytes_moved_total{from="host",to="disk"}': [
            float(stats.bytes_moved[Tier.HOST, Tier.DISK])],
        "tierkv_leases_active": [0.0],
    }
    assert host_hits == 8 and stats.tiers[Tier.DISK].hits == 4  # Get 8..11, Acquire 0..7
    assert stats.bytes_moved[Tier.HOST, Tier.DISK] >= 4 * BLOCK_BYTES
    for promql, values in expected.items():
        wait_for(promql, lambda q=promql, v=values: prometheus.values(q) == v, prometheus)
    # The histogram's quantiles: between its lowest bound and its highest (10 s).
    median_s = prometheus.values(
        'histogram_quantile(0.5, sum by (le) (tierkv_rpc_duration_seconds_bucket{method="Put"}))')
    assert len(median_s) == 1 and 0 < median_s[0] <= 10.0
    # Every dashboard expression parses and, once two scrapes follow the workload, has data.
    for title, expr in dashboard_expressions():
        promql = as_promql(expr)
        body = prometheus.query(promql)
        assert body["status"] == "success", (title, promql, body)
        wait_for(f"{title}: {promql}", lambda q=promql: bool(prometheus.values(q)), prometheus)
