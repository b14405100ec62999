"""Running a ``tierkv bench`` as a user does: a subprocess of ``python -m tierkv``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_quick_bench(name: str, tmp_path: Path) -> tuple[str, dict[str, Any], Path]:
    """``tierkv bench NAME --quick --plot`` with its model and work files under ``tmp_path``:
    its stdout, its JSON and the PNG's path. Fails, with the output's tail, unless it exits 0."""
    out_json, out_png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    env = {**os.environ, "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tierkv", "bench", name, "--quick", "--model-dir",
         str(tmp_path / "model"), "--work-dir", str(tmp_path), "--json", str(out_json),
         "--plot", str(out_png)],
        check=False, capture_output=True, text=True, timeout=1200, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout, json.loads(out_json.read_text()), out_png
