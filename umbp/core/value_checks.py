"""Checks of one JSON-like option value, as configuration parsers use them.

Types are strict because the values come from JSON or a Python dict written by
hand: ``"true"`` is not a boolean, ``True`` is not an integer and ``2.0`` is not an
integer count; integers are accepted where a float is expected. Each check returns
an error message that shows the value (shortened), or None when it is fine.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = [
    "ValueCheck",
    "check_boolean",
    "check_boolean_or_null",
    "check_choice",
    "check_integer",
    "check_number",
    "check_text",
    "describe_value",
    "is_host_port",
    "is_int",
    "is_number",
    "show_value",
]

ValueCheck = Callable[[object], "str | None"]
"""A value check: an error message naming the problem, or None when the value is fine."""


def show_value(value: object) -> str:
    """A short repr; never raises (huge ints exceed the int-to-str digit limit)."""
    try:
        shown = repr(value)
    except ValueError:
        return "(too long to print)"
    return shown if len(shown) <= 60 else shown[:57] + "..."


def describe_value(value: object) -> str:
    return f"{type(value).__name__} {show_value(value)}"


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_boolean(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    return f"expected a boolean (true/false), got {describe_value(value)}"


def check_boolean_or_null(value: object) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    return f"expected a boolean (true/false) or null, got {describe_value(value)}"


def check_integer(low: int, high: int | None) -> ValueCheck:
    bounds = f"between {low} and {high}" if high is not None else f">= {low}"

    def check(value: object) -> str | None:
        if not is_int(value):
            return f"expected an integer {bounds}, got {describe_value(value)}"
        assert isinstance(value, int)
        if value < low or (high is not None and value > high):
            return f"must be {bounds}, got {show_value(value)}"
        return None

    return check


def check_number(rule: str, accepts: Callable[[float], bool]) -> ValueCheck:
    def check(value: object) -> str | None:
        if not is_number(value):
            return f"expected a number {rule}, got {describe_value(value)}"
        assert isinstance(value, (int, float))
        try:
            as_float = float(value)
        except OverflowError:
            as_float = math.inf
        if not math.isfinite(as_float) or not accepts(as_float):
            return f"must be a finite number {rule}, got {show_value(value)}"
        return None

    return check


def check_choice(valid: tuple[str, ...]) -> ValueCheck:
    def check(value: object) -> str | None:
        if not isinstance(value, str):
            return f"expected a string, one of {', '.join(valid)}; got {describe_value(value)}"
        if value in valid:
            return None
        return f"{show_value(value)} is not valid; valid values: {', '.join(valid)}"

    return check


def check_text(rule: str, accepts: Callable[[str], bool], *, nullable: bool) -> ValueCheck:
    def check(value: object) -> str | None:
        if value is None and nullable:
            return None
        if not isinstance(value, str):
            return f"expected {rule}, got {describe_value(value)}"
        if not accepts(value):
            return f"must be {rule}, got {show_value(value)}"
        return None

    return check


def is_host_port(value: str) -> bool:
    host, _, port = value.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
