"""``tierkv serve`` and ``tierkv bench store`` as a user runs them: real processes, real files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierkv.cli.main import build_parser, main
from tierkv.cli.serve_cmd import build_service_config
from tierkv.service.config import ServiceConfig


def test_serve_opens_reports_ready_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    socket_path = tmp_path / "tierkv.sock"
    command = [
        sys.executable, "-m", "tierkv", "serve", "--host-bytes", "16MiB",
        "--disk-path", str(tmp_path / "disk"), "--disk-bytes", "64MiB", "--stats-interval-s", "0",
        "--listen", f"unix://{socket_path}", "--listen", "127.0.0.1:0",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        ready = json.loads(process.stdout.readline())
        assert ready["ready"] is True
        assert ready["tiers"] == {"host": "16.0 MiB", "disk": "64.0 MiB"}
        assert Path(f"/dev/shm/{ready['host_shm_name']}").exists()
        assert ready["port"] > 0
        for target in (f"unix://{socket_path}", f"127.0.0.1:{ready['port']}"):
            with grpc.insecure_channel(target) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="tierkv.v1.TierKV"), timeout=10
                )
                assert check.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert not Path(f"/dev/shm/{ready['host_shm_name']}").exists()
    assert (tmp_path / "disk" / "data.mdb").exists()


def test_serve_rejects_bad_sizes_with_the_flag_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--host-bytes", "lots", "--no-disk"]) == 2
    assert "--host-bytes" in capsys.readouterr().err


def test_serve_flags_and_their_environment_variables_reach_the_service_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def service_config(*flags: str) -> ServiceConfig:
        args = build_parser().parse_args(["serve", "--listen", "127.0.0.1:0", *flags])
        config: ServiceConfig = build_service_config(args)
        return config

    assert service_config().put_idle_timeout_s == 30
    assert service_config("--put-idle-timeout-s", "2.5").put_idle_timeout_s == 2.5
    monkeypatch.setenv("TIERKV_PUT_IDLE_TIMEOUT_S", "7")
    assert service_config().put_idle_timeout_s == 7
    assert service_config("--hash-seed", "42").hash_seed == "42"
    assert main(["serve", "--listen", "127.0.0.1:0", "--no-disk", "--put-idle-timeout-s", "0"]) == 2
    assert service_config().max_namespaces_per_tenant == 1024
    assert service_config("--max-namespaces-per-tenant", "8").max_namespaces_per_tenant == 8
    monkeypatch.setenv("TIERKV_MAX_NAMESPACES_PER_TENANT", "16")
    assert service_config().max_namespaces_per_tenant == 16
    assert main(["serve", "--listen", "127.0.0.1:0", "--no-disk",
                 "--max-namespaces-per-tenant", "0"]) == 2


def test_bench_store_writes_json_and_a_plot(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "store.json", tmp_path / "store.png"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tierkv", "bench", "store", "--quick", "--only", "lookup", "hashing",
         "--json", str(out_json), "--plot", str(out_png), "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    )
    assert "lookup of 8192 hashes" in result.stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert {row["metric"] for row in rows} == {
        "lookup of 8192 hashes", "block_hashes of 131072 tokens"
    }
    assert all(row["ours"] > 0 for row in rows)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_store_utilisation_rows_cover_every_layout_and_the_mix() -> None:
    from tierkv.bench.utilisation_bench import LAYOUTS, bench_utilisation

    rows = bench_utilisation(lambda _: None)
    utilisation = {row.metric: row.ours for row in rows if row.unit == "ratio"}
    assert len(utilisation) == len(LAYOUTS) + 1
    assert all(value >= 0.97 for value in utilisation.values()), utilisation
    copies = [row for row in rows if row.unit == "copies"]
    assert len(copies) == 1 and copies[0].ours >= 1


def test_bench_store_measures_lmdb_overhead_per_record(tmp_path: Path) -> None:
    from tierkv.bench.utilisation_bench import bench_disk_overhead

    rows = {row.metric: row.ours for row in bench_disk_overhead(tmp_path, lambda _: None)}
    assert len(rows) == 3 and all(value > 1.0 for value in rows.values()), rows
    assert rows["DISK bytes per KV byte, 2 MiB blocks"] <= 1.03  # one page in 512 more


def test_bench_plot_without_matplotlib_is_refused_before_the_bench_runs(tmp_path: Path) -> None:
    # An install without the plot extra (what scripts/serve makes) ran the whole bench, wrote
    # its JSON, then ended in a traceback.
    out = tmp_path / "store.json"
    script = ("import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
              "from tierkv.cli.main import main\n"
              f"sys.exit(main(['bench', 'store', '--only', 'index', '--repeats', '1', "
              f"'--json', {str(out)!r}, '--plot']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "tierkv bench: --plot needs matplotlib, which is not installed: "
        "pip install 'tierkv[plot]' (or leave out --plot)"]
    assert not out.exists()
