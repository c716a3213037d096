"""Cutting a batch into the calls a store's service accepts.

The store contract takes a batch of any length (`umbp.runtime.contract`); a service that
takes at most so many keys per call (and `umbp serve`, at most so many bytes per request
body) is asked in consecutive spans, each within every limit, and the answers joined in
key order. A batch then answers exactly as those calls would, one after another.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

__all__ = ["Span", "json_key_spans", "json_string_bytes", "spans_within"]

Span = tuple[int, int]
"""[start, end) positions of one call's keys in the batch."""

_QUOTES_AND_SEPARATOR = 3
_WRITTEN_AS_IS = bytes(byte for byte in range(0x20, 0x7F) if byte not in b'"\\')
"""ASCII that compact JSON writes unescaped: every printable byte but quote and backslash."""
_MOST_JSON_BYTES_PER_CHARACTER = 12
"""ASCII-escaped JSON spells a character outside the Basic Multilingual Plane as two
``\\uXXXX`` escapes; no character takes more."""


def spans_within(weights: Sequence[int], max_count: int, max_weight: int) -> list[Span]:
    """Consecutive spans covering every position of `weights` in order, each of at most
    `max_count` positions whose weights sum to at most `max_weight`: greedy, so every span
    but the last is as long as the limits allow. Raises ValueError when one position alone
    weighs more than `max_weight` (no call could carry it) or a limit is not positive.
    Cut on prefix sums by bisection: C speed for a batch of 100,000 keys."""
    if max_count < 1 or max_weight < 1:
        raise ValueError(f"limits must be positive, got {max_count} keys, {max_weight} bytes")
    total = len(weights)
    if total <= max_count and sum(weights) <= max_weight:
        return [(0, total)] if total else []
    if max(weights) > max_weight:
        position = next(i for i, weight in enumerate(weights) if weight > max_weight)
        raise ValueError(
            f"entry {position} needs {weights[position]} bytes, more than one call carries "
            f"({max_weight})"
        )
    prefix = list(accumulate(weights, initial=0))
    spans: list[Span] = []
    start = 0
    while start < total:
        end = min(start + max_count, total)
        end = min(end, bisect_right(prefix, prefix[start] + max_weight, start, end + 1) - 1)
        spans.append((start, end))
        start = end
    return spans


def json_string_bytes(keys: Sequence[str]) -> list[int]:
    """Bytes each key adds to a compact, ASCII-escaped JSON list: the string with its
    quotes, and one separator. Printable ASCII without a quote or backslash (every key
    umbp builds) is measured at C speed; any other batch key by key."""
    try:
        joined = "".join(keys)
    except TypeError:  # not all strings: measured as they will be sent
        joined = "\0"
    if joined.isascii() and _plain_ascii(joined.encode("ascii")):
        return list(map(_QUOTES_AND_SEPARATOR.__add__, map(len, keys)))
    return [len(json.dumps(key)) + 1 for key in keys]


def _plain_ascii(encoded: bytes) -> bool:
    """No control character, quote or backslash: JSON writes every byte as it is.
    (`str.isprintable` looks each character up in Unicode's tables: 40x slower.)"""
    return not encoded.translate(None, _WRITTEN_AS_IS)


def json_key_spans(
    keys: Sequence[str], max_count: int, max_bytes: int, extra_bytes_per_key: int = 0
) -> list[Span]:
    """Spans of `keys` each of at most `max_count` keys whose compact JSON list, plus
    `extra_bytes_per_key` for each key (a parallel list of numbers, say), takes at most
    `max_bytes` + 1 bytes (the list's brackets, less the last key's separator). A batch
    that fits even if every character took the most JSON bytes any can is one span
    without measuring each key."""
    if not keys:
        return []
    count = len(keys)
    per_key = 3 + extra_bytes_per_key
    try:
        surely = _MOST_JSON_BYTES_PER_CHARACTER * sum(map(len, keys)) + per_key * count
    except TypeError:
        surely = max_bytes + 1
    if count <= max_count and surely <= max_bytes:
        return [(0, count)]
    weights = json_string_bytes(keys)
    if extra_bytes_per_key:
        weights = list(map(extra_bytes_per_key.__add__, weights))
    return spans_within(weights, max_count, max_bytes)
