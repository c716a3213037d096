"""The ``umbp`` command. ``umbp demo`` is the main job; ``umbp bench`` runs the
benchmarks of a repository checkout."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# Scenario -> script under benchmarks/ in the repository (not part of the package).
BENCHMARKS: dict[str, str] = {
    "pool": "pool_bench.py",
    "planning": "planning_bench.py",
    "lookup": "lookup_bench.py",
    "copy": "gpu_copy.py",
    "ttft": "ttft_bench.py",
    "miss-cost": "miss_cost_bench.py",
    "chat": "chat_bench.py",
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
    args = parser.parse_args(argv)
    if args.command == "bench":
        extra = list(args.extra)
        if extra[:1] == ["--"]:
            extra = extra[1:]
        return run_bench(args.scenario, args.json, args.quick, extra)
    from umbp.demo import run_demo

    return run_demo(workdir=args.workdir, prompts=args.prompts, prefix_tokens=args.prefix_tokens)


if __name__ == "__main__":
    sys.exit(main())
