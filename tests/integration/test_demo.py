"""The README's main job keeps working: `umbp demo` (small sizes) on a real engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_demo_restores_prefixes_and_reports_identical_outputs(tmp_path: Path) -> None:
    process = subprocess.run(
        [sys.executable, "-m", "umbp.cli", "demo", "--workdir", str(tmp_path),
         "--prompts", "2", "--prefix-tokens", "256"],
        capture_output=True, text=True, timeout=540, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, check=False,
    )
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    out = process.stdout
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]"):
        assert step in out
    assert "all restored outputs identical to recomputed ones: yes" in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert len(rows) == 2 and all(int(row[2]) > 0 for row in rows)  # tokens restored
