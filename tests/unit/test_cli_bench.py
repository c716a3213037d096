"""``umbp bench``: dispatch to the repository's benchmark scripts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from umbp.cli import BENCHMARKS, BenchmarksNotFound, bench_command, benchmark_script, main

REPO = Path(__file__).resolve().parents[2]


def test_every_scenario_names_a_script_of_the_repository() -> None:
    for scenario, script in BENCHMARKS.items():
        assert benchmark_script(scenario) == REPO / "benchmarks" / script


def test_json_quick_and_extra_options_reach_the_script() -> None:
    command = bench_command("ttft", "out.json", True, ["--repeats", "3"])
    assert command == [sys.executable, str(REPO / "benchmarks" / "ttft_bench.py"),
                       "--json", "out.json", "--quick", "--repeats", "3"]


def test_without_a_checkout_the_error_says_where_the_benchmarks_live(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(BenchmarksNotFound, match="outside the installed package"):
        benchmark_script("lookup", roots=[tmp_path])


def test_unknown_scenario_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "nonsense"])
    assert "invalid choice" in capsys.readouterr().err


def test_umbp_bench_lookup_quick_prints_the_table(tmp_path: Path) -> None:
    report = tmp_path / "lookup.json"
    done = subprocess.run(
        [sys.executable, "-m", "umbp.cli", "bench", "lookup", "--quick", "--json", str(report)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert "mode" in done.stdout and "us/batch" in done.stdout
    assert "direct (same process)" in done.stdout
    assert report.exists()
