"""Plain-text tables for the demo and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The first column (labels) left-aligned, figures right-aligned, a rule under
    the header."""
    widths = [max(len(title), *(len(row[i]) for row in rows)) if rows else len(title)
              for i, title in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if column == 0 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(cells, widths))
        )

    head = line(header)
    return "\n".join([head, "-" * len(head), *(line(row) for row in rows)])
