"""The ``umbp`` command. ``umbp demo`` is the main job; ``umbp bench`` runs the
benchmarks of a repository checkout; ``umbp serve`` runs a node-local store server,
``umbp stats`` shows its figures, ``umbp ls`` its namespaces, ``umbp clear`` drops a
namespace's objects and ``umbp limits`` sets a namespace's quota and retention budget;
``umbp pd-proxy`` fronts a prefill and a decode engine (disaggregated prefill through the
store)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

# Scenario -> script under benchmarks/ in the repository (not part of the package).
BENCHMARKS: dict[str, str] = {
    "pool": "pool_bench.py",
    "planning": "planning_bench.py",
    "lookup": "lookup_bench.py",
    "copy": "gpu_copy.py",
    "ttft": "ttft_bench.py",
    "miss-cost": "miss_cost_bench.py",
    "chat": "chat_bench.py",
    "server": "server_bench.py",
    "ssd": "ssd_bench.py",
    "shared-server": "shared_server_bench.py",
    "mooncake": "mooncake_bench.py",
    "serve": "serve_bench.py",
    "clients": "clients_bench.py",
    "startup": "startup_bench.py",
    "stall": "stall_bench.py",
    "live-requests": "live_requests_bench.py",
    "listing": "listing_bench.py",
    "copy-hash": "copy_hash_bench.py",
    "kv-copy-hash": "kv_copy_hash_bench.py",
    "ssd-restore": "ssd_restore_bench.py",
    "prefetch": "prefetch_bench.py",
}


class BenchmarksNotFound(RuntimeError):
    pass


def benchmark_script(scenario: str, roots: Sequence[Path] | None = None) -> Path:
    """The script of ``scenario``: in the checkout this package was imported from, or
    in the current directory when that is a checkout."""
    script = BENCHMARKS[scenario]
    candidates = list(roots) if roots is not None else [
        Path(__file__).resolve().parents[1], Path.cwd()
    ]
    for root in candidates:
        path = root / "benchmarks" / script
        if path.is_file():
            return path
    raise BenchmarksNotFound(
        f"umbp bench: benchmarks/{script} not found (looked in "
        f"{', '.join(str(root) for root in candidates)}). The benchmarks live in the umbp "
        "repository, outside the installed package: run this from a checkout "
        "(pip install -e . there, or cd into it)."
    )


def bench_command(scenario: str, json_file: str | None, quick: bool,
                  extra: Sequence[str]) -> list[str]:
    command = [sys.executable, str(benchmark_script(scenario))]
    if json_file is not None:
        command += ["--json", json_file]
    if quick:
        command.append("--quick")
    return command + list(extra)


def run_bench(scenario: str, json_file: str | None, quick: bool, extra: Sequence[str]) -> int:
    try:
        command = bench_command(scenario, json_file, quick, extra)
    except BenchmarksNotFound as error:
        print(error, file=sys.stderr)
        return 2
    script = Path(command[1])
    return subprocess.run(command, cwd=script.parents[1], check=False).returncode


_BYTE_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTPE]?)(?:I?B)?\s*$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50,
          "E": 1 << 60}
MAX_BYTE_COUNT = 1 << 50
"""The largest size any option takes (1 PiB); what really fits is checked at start-up
against the free space of /dev/shm and of the SSD directory."""


def _byte_count(text: str, minimum: int = 0, maximum: int = MAX_BYTE_COUNT) -> int:
    """A byte count, with an optional binary suffix: 1073741824, 1G, 512M, 64K, 1.5GiB;
    whole bytes in [minimum, maximum]."""
    match = _BYTE_COUNT.match(text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not a byte count: {text!r} (write e.g. 65536, 64K, 512M or 8G)"
        )
    number, unit = match.groups()
    value = Fraction(number) * _UNITS[unit]
    if value.denominator != 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    count = int(value)
    if not minimum <= count <= maximum:
        raise argparse.ArgumentTypeError(
            f"{text!r} is outside [{minimum}, {maximum}] bytes (at most 1 PiB)"
        )
    return count


def _byte_option(minimum: int, maximum: int = MAX_BYTE_COUNT) -> Callable[[str], int]:
    def parse(text: str) -> int:
        return _byte_count(text, minimum, maximum)

    return parse


def _seconds(text: str) -> float:
    """A finite duration in (0, 3600] seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 3600:  # also false for NaN
        raise argparse.ArgumentTypeError(f"{text!r} is outside (0, 3600] seconds")
    return value


def _fraction(text: str) -> float:
    """A watermark: a finite number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is outside (0, 1]")
    return value


def _retention_seconds(text: str) -> float:
    """The longest retention: a finite duration in (0, 1e7] seconds."""
    from umbp.runtime.server.schema import MAX_SECONDS

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} is outside (0, {MAX_SECONDS:g}] seconds")
    return value


def _namespace_bytes(text: str) -> tuple[str, int]:
    """``NAMESPACE=BYTES`` (e.g. ``3f2a9c01d4e5b6a7=8G``)."""
    from umbp.runtime.server.schema import BadRequest, parse_namespace

    name, equals, size = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAMESPACE=BYTES")
    try:
        return parse_namespace(name), _byte_count(size)
    except BadRequest as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _optional_bytes(keyword: str) -> Callable[[str], int | None]:
    """A byte count, or ``keyword`` (None: no quota, the default budget)."""

    def parse(text: str) -> int | None:
        return None if text == keyword else _byte_count(text)

    return parse


def _namespace_option(text: str) -> str:
    from umbp.runtime.server.schema import BadRequest, parse_namespace

    try:
        return parse_namespace(text)
    except BadRequest as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_UNCHANGED: Any = object()
"""`umbp limits`: an option not given (a default argparse never converts)."""


def _count(maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.strip().isdigit() or not 1 <= int(text) <= maximum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number in [1, {maximum}]")
        return int(text)

    return parse


def _add_server_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from umbp.runtime.server.operations import DEFAULT_MAX_RETAIN_S
    from umbp.runtime.server.prefetch import MAX_PREFETCH_READERS, PREFETCH_READERS
    from umbp.runtime.server.server import (
        DEFAULT_FRAME_TIMEOUT_S,
        DEFAULT_MAX_CONNECTIONS,
        DEFAULT_PAGE_BYTES,
        MAX_CONNECTIONS_LIMIT,
    )

    serve = commands.add_parser(
        "serve", help="run a node-local store server in the foreground (SIGTERM stops it)"
    )
    serve.add_argument("--socket", required=True, help="Unix socket path (created 0600)")
    serve.add_argument("--capacity", required=True, type=_byte_option(1),
                       help="bytes of the shared-memory DRAM tier (e.g. 8G)")
    serve.add_argument("--page-bytes", type=_byte_option(64, 1 << 30), default=DEFAULT_PAGE_BYTES)
    serve.add_argument("--high-watermark", type=_fraction, default=0.95)
    serve.add_argument("--low-watermark", type=_fraction, default=0.85)
    serve.add_argument("--pool-dir", default=None,
                       help="tmpfs directory of the DRAM tier's shared file (default: "
                            "/dev/shm); one mounted with huge=within_size gives it huge "
                            "pages")
    serve.add_argument("--ssd-dir", default=None, help="directory of the SSD tier")
    serve.add_argument("--ssd-capacity", type=_byte_option(0), default=0,
                       help="bytes of the SSD tier (needs --ssd-dir)")
    serve.add_argument("--prefetch-bytes", type=_byte_option(0), default=None,
                       help="most bytes of SSD objects a lookup may have on their way into "
                            "DRAM ahead of their load (default: half of --capacity; "
                            "0: none)")
    serve.add_argument("--prefetch-readers", type=_count(MAX_PREFETCH_READERS),
                       default=PREFETCH_READERS,
                       help=f"threads reading SSD objects into DRAM at once for the prefetch "
                            f"(default: {PREFETCH_READERS})")
    serve.add_argument("--write-ahead-bytes", type=_byte_option(0), default=None,
                       help="how much of DRAM's least recently used end is kept copied on "
                            "the SSD tier before eviction, so making room writes nothing "
                            "(default: the watermarks' gap plus --prefetch-bytes; 0: none)")
    serve.add_argument("--persist-on-exit", action="store_true",
                       help="on SIGTERM/SIGINT copy DRAM objects to the SSD tier first")
    serve.add_argument("--max-connections", type=_count(MAX_CONNECTIONS_LIMIT),
                       default=DEFAULT_MAX_CONNECTIONS,
                       help="client connections served at once; more are refused")
    serve.add_argument("--frame-timeout", type=_seconds, default=DEFAULT_FRAME_TIMEOUT_S,
                       help="seconds a client has to finish a frame it has begun")
    serve.add_argument("--quota", type=_namespace_bytes, action="append", default=[],
                       metavar="NAMESPACE=BYTES",
                       help="the most DRAM a namespace may hold (repeatable)")
    serve.add_argument("--retain-budget", type=_namespace_bytes, action="append", default=[],
                       metavar="NAMESPACE=BYTES",
                       help="what a namespace may retain (repeatable)")
    serve.add_argument("--default-retain-budget", type=_byte_option(0), default=None,
                       help="what a namespace may retain without a budget of its own "
                            "(default: a tenth of --capacity)")
    serve.add_argument("--max-retain", type=_retention_seconds, default=DEFAULT_MAX_RETAIN_S,
                       help="the longest retention a request may ask for, in seconds")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus text at http://HOST:PORT/metrics (0: a free port)")
    serve.add_argument("--metrics-host", default="127.0.0.1",
                       help="the address of the metrics endpoint (default 127.0.0.1)")
    stats = commands.add_parser("stats", help="print a running server's figures")
    stats.add_argument("--socket", required=True)
    stats.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    stats.add_argument("--timeout", type=_seconds, default=5.0)
    listing = commands.add_parser(
        "ls", help="a running server's namespaces: model, objects per tier, hits, last use")
    where = listing.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket")
    where.add_argument("--mooncake-http", metavar="HOST:PORT",
                       help="a Mooncake master's HTTP endpoint (its -metrics_port) instead")
    listing.add_argument("--json", action="store_true", help="print the raw rows as JSON")
    listing.add_argument("--timeout", type=_seconds, default=5.0)
    clear = commands.add_parser(
        "clear", help="drop one namespace's objects (or every object) from a running server")
    where = clear.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket")
    where.add_argument("--mooncake-master", metavar="HOST:PORT",
                       help="a Mooncake master's RPC address instead")
    clear.add_argument("--mooncake-http", metavar="HOST:PORT",
                       help="with --mooncake-master: its HTTP endpoint, to count what stayed")
    which = clear.add_mutually_exclusive_group(required=True)
    which.add_argument("--namespace", type=_namespace_option)
    which.add_argument("--all", action="store_true", help="every namespace")
    clear.add_argument("--json", action="store_true", help="print the raw answer as JSON")
    clear.add_argument("--timeout", type=_seconds, default=5.0)
    limits = commands.add_parser(
        "limits", help="set a namespace's DRAM quota and retention budget on a running server")
    limits.add_argument("--socket", required=True)
    limits.add_argument("--namespace", type=_namespace_option, required=True)
    limits.add_argument("--quota", type=_optional_bytes("none"), default=_UNCHANGED,
                        help="the most DRAM the namespace may hold, or 'none'")
    limits.add_argument("--retain-budget", type=_optional_bytes("default"), default=_UNCHANGED,
                        help="what the namespace may retain, or 'default'")
    limits.add_argument("--json", action="store_true", help="print the raw answer as JSON")
    limits.add_argument("--timeout", type=_seconds, default=5.0)


def run_serve(args: argparse.Namespace) -> int:
    import logging

    from umbp.runtime.server.server import ServerConfig, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.ssd_capacity and args.ssd_dir is None:
        print("umbp serve: --ssd-capacity needs --ssd-dir", file=sys.stderr)
        return 2
    config = ServerConfig(
        socket_path=args.socket,
        capacity_bytes=args.capacity,
        page_bytes=args.page_bytes,
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        pool_dir=args.pool_dir,
        ssd_dir=args.ssd_dir,
        ssd_capacity_bytes=args.ssd_capacity,
        persist_on_exit=args.persist_on_exit,
        prefetch_bytes=args.prefetch_bytes,
        prefetch_readers=args.prefetch_readers,
        write_ahead_bytes=args.write_ahead_bytes,
        max_connections=args.max_connections,
        frame_timeout_s=args.frame_timeout,
        quotas=tuple(args.quota),
        retain_budgets=tuple(args.retain_budget),
        default_retain_budget_bytes=args.default_retain_budget,
        max_retain_s=args.max_retain,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
    )
    try:
        return serve(config)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"umbp serve: {error}", file=sys.stderr)
        return 1


def run_stats(socket_path: str, as_json: bool, timeout_s: float) -> int:
    from umbp.runtime.contract import StoreUnavailable
    from umbp.runtime.server.client import ServerStore
    from umbp.runtime.server.stats import format_stats

    store = ServerStore(socket_path, io_timeout_s=timeout_s)
    try:
        figures = store.server_stats()
    except StoreUnavailable as error:
        print(f"umbp stats: {error}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(json.dumps(figures, indent=2) if as_json else format_stats(figures))
    return 0


def run_operator_command(args: argparse.Namespace) -> int:
    """`umbp ls`, `umbp clear` or `umbp limits` against a running server: 0 done, 1 the
    server unreachable or refusing (its reason printed; it changed nothing), 2 bad usage."""
    from umbp.runtime.contract import StoreRefused, StoreUnavailable
    from umbp.runtime.server.client import ServerStore
    from umbp.runtime.server.listing import format_drop, format_limits, format_namespaces

    store = ServerStore(args.socket, io_timeout_s=args.timeout)
    try:
        if args.command == "ls":
            rows = store.namespaces()
            text = json.dumps(rows, indent=2) if args.json else format_namespaces(rows)
        elif args.command == "clear":
            dropped = store.drop(None if args.all else args.namespace)
            text = json.dumps(dropped, indent=2) if args.json else format_drop(dropped)
        else:
            changes = {name: value for name, value in (
                ("quota_bytes", args.quota), ("retain_budget_bytes", args.retain_budget))
                if value is not _UNCHANGED}
            if not changes:
                print("umbp limits: give --quota and/or --retain-budget", file=sys.stderr)
                return 2
            answer = store.set_limits(args.namespace, **changes)
            text = json.dumps(answer, indent=2) if args.json else format_limits(answer)
    except (StoreUnavailable, StoreRefused) as error:
        print(f"umbp {args.command}: {error}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(text)
    return 0


def run_mooncake_command(args: argparse.Namespace) -> int:
    """`umbp ls` / `umbp clear` on Mooncake Store, as far as its API allows
    (umbp.runtime.mooncake.operations)."""
    import socket

    from umbp.runtime.contract import StoreUnavailable
    from umbp.runtime.mooncake.operations import mooncake_namespaces
    from umbp.runtime.server.shares import OTHER_LABEL

    try:
        if args.command == "ls":
            counts = mooncake_namespaces(args.mooncake_http, args.timeout)
            print(json.dumps(counts, indent=2) if args.json else "\n".join(
                [f"{'namespace':<40}{'objects':>10}"] + [
                    f"{name or OTHER_LABEL:<40}{count:>10}"
                    for name, count in sorted(counts.items(), key=lambda item: -item[1])]))
            return 0
        from umbp.runtime.mooncake.store import MooncakeStore

        namespace = None if args.all else args.namespace
        with MooncakeStore.lookup_only(args.mooncake_master,
                                       local_hostname=socket.gethostname()) as store:
            dropped = store.drop(namespace)
        left = None
        if args.mooncake_http is not None:
            counts = mooncake_namespaces(args.mooncake_http, args.timeout)
            left = sum(counts.values()) if namespace is None else counts.get(namespace, 0)
        answer = {"namespace": namespace, "objects": dropped, "in_use": left}
        print(json.dumps(answer, indent=2) if args.json else
              f"dropped {dropped} objects" + ("" if not left else
              f"; {left} under a lease (read in the last seconds) stayed: run it again"))
        return 0
    except (OSError, StoreUnavailable, RuntimeError, ValueError) as error:
        print(f"umbp {args.command}: Mooncake: {error}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="umbp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="serve long shared prefixes, restore them from umbp, print a table"
    )
    demo.add_argument("--workdir", default=None, help="where the demo model is written")
    demo.add_argument("--prompts", type=int, default=4)
    demo.add_argument("--prefix-tokens", type=int, default=1536)
    bench = commands.add_parser(
        "bench", help="run one of the repository's benchmarks (see docs/performance.md)"
    )
    bench.add_argument("scenario", choices=tuple(BENCHMARKS))
    bench.add_argument("--json", metavar="FILE", default=None, help="also write the results here")
    bench.add_argument("--quick", action="store_true", help="the benchmark's short variant")
    bench.add_argument("extra", nargs=argparse.REMAINDER,
                       help="further options for the script, after --")
    _add_server_commands(commands)
    from umbp.pd_proxy import add_arguments as add_proxy_arguments

    add_proxy_arguments(commands.add_parser(
        "pd-proxy", help="disaggregated prefill through the store: one endpoint in front "
        "of a kv_producer and a kv_consumer vllm serve"
    ))
    args = parser.parse_args(argv)
    if args.command == "pd-proxy":
        from umbp.pd_proxy import run as run_proxy

        return run_proxy(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "stats":
        return run_stats(args.socket, args.json, args.timeout)
    if args.command in ("ls", "clear") and args.socket is None:
        return run_mooncake_command(args)
    if args.command in ("ls", "clear", "limits"):
        return run_operator_command(args)
    if args.command == "bench":
        extra = list(args.extra)
        if extra[:1] == ["--"]:
            extra = extra[1:]
        return run_bench(args.scenario, args.json, args.quick, extra)
    from umbp.demo import run_demo

    return run_demo(workdir=args.workdir, prompts=args.prompts, prefix_tokens=args.prefix_tokens)


if __name__ == "__main__":
    sys.exit(main())
