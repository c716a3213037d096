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


def run_quick_bench(script: str, report: Path, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
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


def test_quick_server_bench_prints_ratios_and_writes_json(tmp_path: Path) -> None:
    """benchmarks/server_bench.py starts a real `umbp serve` and compares its put/get
    throughput with memcpy; the figures are not judged here, only reported."""
    report = tmp_path / "server.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "server_bench.py"), "--quick",
         "--gib", "0.02", "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr
    for case in ("put 64 KiB", "get 64 KiB", "put 1 MiB", "get 1 MiB"):
        objects, server_gbps, memcpy_gbps, ratio = figures_of(done.stdout, case)
        assert objects >= 32 and server_gbps > 0 and memcpy_gbps > 0 and ratio > 0
    assert "lookup of 1000 keys over the socket" in done.stdout
    data = json.loads(report.read_text())
    assert data["benchmark"] == "server" and data["quick"] is True
    assert [(row["operation"], row["object_bytes"]) for row in data["copies"]] == [
        ("put", 64 << 10), ("get", 64 << 10), ("put", 1 << 20), ("get", 1 << 20)
    ]
    assert data["lookup"]["keys"] == 1000 and data["lookup"]["median_us"] > 0


def test_quick_ssd_bench_prints_ratios_and_writes_json(tmp_path: Path) -> None:
    """benchmarks/ssd_bench.py compares SsdTier put/get with plain pwrite/preadv of the
    same bytes; the figures are not judged here, only reported."""
    report = tmp_path / "ssd.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ssd_bench.py"), "--quick",
         "--gib", "0.01", "--dir", str(tmp_path), "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    for case in ("put 64 KiB", "get 64 KiB", "put 1 MiB", "get 1 MiB"):
        slot_kib, objects, tier_gbps, plain_gbps, ratio = figures_of(done.stdout, case)
        assert slot_kib == 64 and objects >= 8 and tier_gbps > 0 and plain_gbps > 0 and ratio > 0
    data = json.loads(report.read_text())
    assert data["benchmark"] == "ssd" and data["quick"] is True
    assert [(row["operation"], row["object_bytes"]) for row in data["io"]] == [
        ("put", 64 << 10), ("get", 64 << 10), ("put", 1 << 20), ("get", 1 << 20)
    ]
    assert [row["objects"] for row in data["reopen"]] == [data["io"][0]["objects"],
                                                          data["io"][2]["objects"]]


def test_quick_mooncake_bench_prints_ratios_and_writes_json(tmp_path: Path) -> None:
    """benchmarks/mooncake_bench.py compares MooncakeStore with Mooncake's raw client
    calls on a real loopback master; the figures are not judged here, only reported."""
    import pytest

    pytest.importorskip("mooncake.store")
    report = tmp_path / "mooncake.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "mooncake_bench.py"), "--quick",
         "--gib", "0.01", "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for segment in ("local", "remote"):
        for case in ("put 1 MiB", "get 1 MiB", "put 100 KiB", "get 100 KiB"):
            objects, umbp, raw, ratio, bounce, xxh3 = figures_of(done.stdout, f"{segment} {case}")
            assert objects >= 32 and min(umbp, raw, ratio, bounce, xxh3) > 0
    data = json.loads(report.read_text())
    assert data["benchmark"] == "mooncake" and data["quick"] is True
    rows = data["copies"]
    assert [(row["segment"], row["operation"], row["object_bytes"]) for row in rows] == [
        (segment, operation, size)
        for segment in ("local", "remote")
        for size in (1 << 20, 100 << 10)
        for operation in ("put", "get")
    ]
    assert [lookup["segment"] for lookup in data["lookups"]] == ["local", "remote"]
    assert all(lookup["ratio"] > 0 for lookup in data["lookups"])


def test_the_live_requests_bench_drives_the_scheduler_hook_at_every_live_count(
    tmp_path: Path,
) -> None:
    """benchmarks/live_requests_bench.py steps umbp's scheduler through vLLM 0.33's
    own step objects (make test extracts them) with few and with many requests
    decoding; its figures are reported, not judged."""
    report = tmp_path / "live.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "live_requests_bench.py"), "--live", "2,12",
         "--changing", "3", "--rounds", "2", "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    data = json.loads(report.read_text())
    assert set(data["median_us"]) == {"2", "12"} and data["changing"] == 3
    # Every step stores the new requests' 16-block prompts, with few or many decoding.
    assert data["stored_blocks_per_step"] == {"2": 3 * 16, "12": 3 * 16}
    assert all(us > 0 for us in data["median_us"].values())
    assert "12 live vs 2:" in done.stdout


def test_quick_clients_bench_verifies_every_byte_and_writes_json(tmp_path: Path) -> None:
    """benchmarks/clients_bench.py: client processes against one real `umbp serve`, every
    byte they get back compared with what they put; the figures are only reported."""
    report = tmp_path / "clients.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "clients_bench.py"), "--quick",
         "--clients", "1,2", "--mib", "4", "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "1 client vs memcpy of the same bytes (same run)" in done.stdout
    rows = json.loads(report.read_text())["rows"]
    assert [row["clients"] for row in rows] == [1, 2]
    for row in rows:
        assert row["errors"] == 0, row
        assert row["put_aggregate_gbps"] > 0 and row["get_aggregate_gbps"] > 0
        assert row["batch_calls"] > 0 and row["p99_batch_ms"] > 0


def test_quick_startup_bench_reports_population_and_reopen(tmp_path: Path) -> None:
    report = tmp_path / "startup.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "startup_bench.py"), "--quick",
         "--gib", "0.05", "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(report.read_text())
    assert len(data["population"]) == 5 and all(row["seconds"] > 0 for row in data["population"])
    assert [(row["objects"], row["slots_per_object"]) for row in data["reopen"]] == [
        (16_384, 1), (1_024, 16)
    ]


def test_the_listing_bench_times_ls_and_a_scrape_against_a_recount(tmp_path: Path) -> None:
    """benchmarks/listing_bench.py fills a server core and times `umbp ls`, a metrics
    scrape and the recount they replace; the figures are reported, not judged."""
    report = tmp_path / "listing.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "listing_bench.py"), "--quick",
         "--objects", "30000", "--namespaces", "3", "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "30,000 objects in 3 namespaces, 6,000 retained" in done.stdout
    data = json.loads(report.read_text())
    assert data["benchmark"] == "listing" and data["retained"] == 6000
    assert set(data["cases"]) == {"umbp ls", "metrics scrape", "reference: recount by scan"}
    for case in data["cases"].values():
        assert case["median_ms"] > 0 and case["lock_holds_per_call"] >= 1


def test_the_copy_hash_bench_reports_each_way_against_memcpy(tmp_path: Path) -> None:
    """benchmarks/copy_hash_bench.py: memcpy, copy then hash, the Python chunks and the
    native loop (both kernels), per object size; the figures are reported, not judged."""
    report = tmp_path / "copy-hash.json"
    done = run_quick_bench("copy_hash_bench.py", report)
    assert done.returncode == 0, done.stderr
    data = json.loads(report.read_text())
    assert [row["object_bytes"] for row in data["rows"]] == [256 << 10, 1 << 20, 4 << 20,
                                                             16 << 20]
    for row in data["rows"]:
        assert set(row["gbps"]) == {"memcpy", "copy, then hash", "python chunks", "native",
                                    "native, scalar"}
        assert row["ratio"]["memcpy"] == 1.0 and min(row["gbps"].values()) > 0


def test_the_kv_copy_hash_bench_times_each_way_against_memcpy(tmp_path: Path) -> None:
    """benchmarks/kv_copy_hash_bench.py: stores and restores between KV blocks and pages,
    the checksum after the copy or during it; the script checks that the ways' checksums
    agree and every byte arrived; the figures are reported, not judged."""
    report = tmp_path / "kv-copy-hash.json"
    done = run_quick_bench("kv_copy_hash_bench.py", report)
    assert done.returncode == 0, done.stderr
    data = json.loads(report.read_text())
    assert set(data["median_ms"]) == {
        "memcpy", "store: copy alone", "store: copy, then hash", "store: hashing copy",
        "restore: copy alone", "restore: copy, then hash", "restore: hashing copy"}
    assert data["ratio_to_memcpy"]["memcpy"] == 1.0 and min(data["median_ms"].values()) > 0
    assert data["nbytes"] == 16 * 512 << 10


def test_quick_prefetch_bench_times_each_reader_count_against_plain_preadv(
    tmp_path: Path,
) -> None:
    """A real server per reader count: the prefix is checked to be on SSD only before
    the lookup, and every prefetched byte is compared after it (asserts in the script)."""
    report = tmp_path / "prefetch.json"
    done = run_quick_bench("prefetch_bench.py", report, timeout=300)
    assert done.returncode == 0, done.stderr
    for readers in ("1", "2"):
        (row,) = [line for line in done.stdout.splitlines() if line.split()[:1] == [readers]]
        median, *_ = figures_of(row, readers)
        assert median > 0
    figures = json.loads(report.read_text())
    assert set(figures["median_ms"]) == {"1", "2"} and figures["plain_preadv_median_ms"] > 0
