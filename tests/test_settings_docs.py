"""docs/configuration.md and the README's model table are generated (from the settings schema and
the connector's list): it fails here when either changed and the page did not (run
scripts/gen-docs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tierkv.cli.settings import REFERENCE_END, REFERENCE_START, SETTINGS, reference_markdown
from tierkv.integrations.vllm.geometry import (
    FAMILIES_END,
    FAMILIES_START,
    SPEC_KINDS,
    families_markdown,
)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "configuration.md"


def test_the_reference_page_is_what_scripts_gen_docs_writes() -> None:
    page = REFERENCE.read_text(encoding="utf-8")
    start, end = page.find(REFERENCE_START), page.find(REFERENCE_END)
    assert 0 <= start < end, f"docs/configuration.md lacks the {REFERENCE_START!r} section"
    section = page[start : end + len(REFERENCE_END) + 1]
    assert section == reference_markdown(), (
        "docs/configuration.md is stale: run scripts/gen-docs")


def test_the_reference_has_one_row_per_setting_with_its_flag_and_variable() -> None:
    rows = [line for line in reference_markdown().splitlines() if line.startswith("| `")]
    assert len(rows) == len(SETTINGS)
    for row, setting in zip(rows, SETTINGS, strict=True):
        assert row.startswith(f"| `{setting.name}` | `{setting.flag}` | `{setting.env}` | ")
        if setting.computed:
            assert "computed: " in row


def test_gen_docs_check_passes_on_these_pages() -> None:
    script = ROOT / "scripts" / "gen-docs"
    assert os.access(script, os.X_OK)
    done = subprocess.run([str(script), "--check"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable}, check=False)
    assert done.returncode == 0, done.stderr


def test_the_readme_model_table_is_the_connectors_own_list() -> None:
    readme = README.read_text(encoding="utf-8")
    start, end = readme.find(FAMILIES_START), readme.find(FAMILIES_END)
    assert 0 <= start < end, f"README.md lacks the {FAMILIES_START!r} section"
    assert readme[start : end + len(FAMILIES_END) + 1] == families_markdown(), (
        "README.md's model table is stale: run scripts/gen-docs")
    rows = [line for line in families_markdown().splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(SPEC_KINDS)
