"""`umbp serve` / `umbp stats` argument handling and the stats table (the processes
themselves are exercised in tests/integration/test_server_process.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from umbp.cli import BENCHMARKS, _byte_count, main
from umbp.runtime.server import protocol
from umbp.runtime.server.stats import format_stats


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("64K", 65536), ("64KiB", 65536), ("1.5G", 3 << 29), ("8m", 8 << 20)],
)
def test_byte_counts_take_binary_suffixes(text: str, expected: int) -> None:
    assert _byte_count(text) == expected


def test_a_byte_count_that_is_not_one_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _byte_count("lots")


@pytest.mark.parametrize(
    ("text", "reason"),
    [("infG", "not a byte count"), ("nanM", "not a byte count"), ("-5", "not a byte count"),
     ("1e3", "not a byte count"), ("1.5", "not a whole number"), ("0.3K", "not a whole number"),
     ("1EiB", "outside [0, 1125899906842624]"), ("2P", "outside")],
)  # fmt: skip
def test_absurd_byte_counts_are_refused_naming_the_problem(text: str, reason: str) -> None:
    """They used to give tracebacks (`infG`: OverflowError; `1EiB`: a MemoryError later)."""
    with pytest.raises(argparse.ArgumentTypeError, match=reason.replace("[", r"\[")):
        _byte_count(text)


@pytest.mark.parametrize(
    ("option", "value"),
    [("--high-watermark", "nan"), ("--low-watermark", "inf"), ("--frame-timeout", "0"),
     ("--frame-timeout", "nan"), ("--max-connections", "0"), ("--max-connections", "5000"),
     ("--page-bytes", "8"), ("--capacity", "infG")],
)  # fmt: skip
def test_serve_options_out_of_range_exit_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    arguments = ["serve", "--socket", str(tmp_path / "s.sock"), "--capacity", "1M", option, value]
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


def test_serve_refuses_a_capacity_below_one_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    socket_path = str(tmp_path / "s.sock")
    assert main(["serve", "--socket", socket_path, "--capacity", "100"]) == 1
    assert "below one page" in capsys.readouterr().err
    assert not Path(socket_path).exists()


def test_serve_refuses_inverted_watermarks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["serve", "--socket", str(tmp_path / "s.sock"), "--capacity", "1M",
                 "--high-watermark", "0.5", "--low-watermark", "0.6"])
    assert code == 1 and "watermarks" in capsys.readouterr().err


def test_stats_without_a_server_fails_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stats", "--socket", str(tmp_path / "none.sock"), "--timeout", "1"]) == 1
    assert "umbp stats:" in capsys.readouterr().err


def test_the_server_benchmarks_are_registered() -> None:
    assert BENCHMARKS["server"] == "server_bench.py"
    assert BENCHMARKS["ssd"] == "ssd_bench.py"


def test_the_stats_table_shows_both_tiers_and_the_counters() -> None:
    figures = {
        "dram": {"capacity_bytes": 4 << 20, "used_bytes": 1 << 20, "objects": 7},
        "ssd": {"enabled": True, "capacity_bytes": 1 << 30, "used_bytes": 0, "objects": 3},
        "counters": {"hits": 5, "misses": 2, "evictions_to_ssd": 4, "evictions_dropped": 1,
                     "bytes_to_ssd": 3 << 20},
        "sessions": {"connections": 2},
        "server": {"pid": 42, "shm_path": "/dev/shm/umbp-42-abc"},
    }
    table = format_stats(figures)
    assert "4.0 MiB" in table and "1.0 GiB" in table and "25.0%" in table
    rows = {line.split("  ")[0].strip(): line.split()[-1] for line in table.splitlines() if line}
    assert rows["loads that hit"] == "5" and rows["loads that missed"] == "2"
    assert rows["evictions to SSD"] == "4"
    assert rows["evictions dropped"] == "1" and rows["bytes to SSD"] == "MiB"
    assert "off" in format_stats(figures | {"ssd": {"enabled": False}})


def test_frames_round_trip_and_a_deadline_expires() -> None:
    frame = protocol.encode_json(protocol.LOOKUP, {"keys": ["a"]})
    op, length = protocol.HEADER.unpack(frame[: protocol.HEADER.size])
    assert op == protocol.LOOKUP and length == len(frame) - protocol.HEADER.size
    assert protocol.decode_json(frame[protocol.HEADER.size :]) == {"keys": ["a"]}
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_json(b"{not json")
    with pytest.raises(TimeoutError):
        protocol.Deadline(0.0).remaining()


def test_serve_refuses_a_write_ahead_past_the_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    socket_path = str(tmp_path / "s.sock")
    code = main(["serve", "--socket", socket_path, "--capacity", "1M",
                 "--write-ahead-bytes", "2M"])
    assert code == 1 and "write_ahead_bytes must be in [0, capacity_bytes]" in \
        capsys.readouterr().err
    assert not Path(socket_path).exists()


def test_serve_refuses_a_pool_dir_off_tmpfs_before_taking_the_socket(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    socket_path = str(tmp_path / "s.sock")
    assert main(["serve", "--socket", socket_path, "--capacity", "1M",
                 "--pool-dir", "/proc"]) == 1
    assert "pool directory '/proc' must be on a tmpfs, found proc at /proc" in \
        capsys.readouterr().err
    assert not Path(socket_path).exists()
    assert main(["serve", "--socket", socket_path, "--capacity", "1M",
                 "--pool-dir", str(tmp_path / "absent")]) == 1
    assert "is not a directory" in capsys.readouterr().err
