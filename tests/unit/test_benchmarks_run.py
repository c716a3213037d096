"""benchmarks/lookup_bench.py runs and reports its rows (no timing assertions).

benchmarks/ttft_bench.py starts a real vLLM engine and takes minutes: it is run
by hand, not here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROW_LABELS = ("direct (same process)", "socket (other process)", "build_query (32,000 tokens)")
NUMBER = r"\d+(?:\.\d+)?"


def run_lookup_bench(report: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "lookup_bench.py"), "--quick",
         "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )


def figures_of(stdout: str, label: str) -> list[float]:
    rows = [line for line in stdout.splitlines() if line.startswith(label)]
    assert len(rows) == 1, f"no single row for {label!r}:\n{stdout}"
    return [float(value) for value in re.findall(NUMBER, rows[0][len(label):])]


def test_quick_lookup_bench_prints_rows_and_writes_json(tmp_path: Path) -> None:
    report = tmp_path / "lookup.json"
    done = run_lookup_bench(report)
    assert done.returncode == 0, done.stderr

    assert "1000 keys (500 resident)" in done.stdout
    for label in ROW_LABELS:
        keys, per_batch, per_key, ratio = figures_of(done.stdout, label)
        assert keys in (999, 1000)
        assert per_batch > 0 and per_key > 0 and ratio > 0

    data = json.loads(report.read_text())
    assert data["benchmark"] == "lookup"
    assert data["quick"] is True
    assert (data["keys"], data["hits"]) == (1000, 500)
    assert [row["name"] for row in data["rows"]] == ["direct", "socket", "build_query"]
    for row in data["rows"]:
        assert row["us_per_batch"] > 0 and row["us_per_key"] > 0
        assert row["ratio_to_direct"] > 0
    assert data["rows"][0]["ratio_to_direct"] == 1.0
