"""The ``umbp`` command. ``umbp demo`` is the main job."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="umbp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="serve long shared prefixes, restore them from umbp, print a table"
    )
    demo.add_argument("--workdir", default=None, help="where the demo model is written")
    demo.add_argument("--prompts", type=int, default=4)
    demo.add_argument("--prefix-tokens", type=int, default=1536)
    args = parser.parse_args(argv)
    from umbp.demo import run_demo

    return run_demo(workdir=args.workdir, prompts=args.prompts, prefix_tokens=args.prefix_tokens)


if __name__ == "__main__":
    sys.exit(main())
