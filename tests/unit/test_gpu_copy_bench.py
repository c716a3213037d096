"""benchmarks/gpu_copy.py runs on CPU and reports a row per block size (not timings)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCK_LABELS = ["16 KiB", "64 KiB", "256 KiB", "1 MiB", "2 MiB"]
ROW_FIELDS = {
    "block_bytes",
    "objects",
    "bytes_per_op",
    "gather_gbps",
    "gather_ref_gbps",
    "gather_ratio",
    "scatter_gbps",
    "scatter_ref_gbps",
    "scatter_ratio",
}


def test_quick_cpu_benchmark_prints_ratios_and_writes_json(tmp_path: Path) -> None:
    report = tmp_path / "gpu_copy.json"
    # One thread: on a small shared host, a 2-thread OpenMP region can stall for long.
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_copy.py"),
            "--device",
            "cpu",
            "--quick",
            "--threads",
            "1",
            "--json",
            str(report),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr

    for label in BLOCK_LABELS:
        rows = [line for line in done.stdout.splitlines() if line.strip().startswith(label)]
        assert len(rows) == 1, f"no single row for {label}:\n{done.stdout}"
        figures = [float(value) for value in re.findall(r"\d+\.\d+", rows[0])]
        gather_ratio, scatter_ratio = figures[3], figures[6]
        assert gather_ratio > 0 and scatter_ratio > 0

    data = json.loads(report.read_text())
    assert data["benchmark"] == "gpu_copy"
    assert data["device"] == "cpu"
    assert data["quick"] is True
    assert data["layers"] == 32
    assert [row["block_bytes"] for row in data["rows"]] == [
        16 << 10,
        64 << 10,
        256 << 10,
        1 << 20,
        2 << 20,
    ]
    for row in data["rows"]:
        assert set(row) == ROW_FIELDS
        assert row["gather_ratio"] > 0 and row["scatter_ratio"] > 0
        assert row["objects"] >= 1
        assert row["bytes_per_op"] == row["objects"] * data["layers"] * row["block_bytes"]
