"""What one request asks of umbp: the ``umbp`` entry of vLLM's ``kv_transfer_params``
(a ``vllm serve`` request body's ``kv_transfer_params``, or
``SamplingParams.extra_args["kv_transfer_params"]``)::

    {"kv_transfer_params": {"umbp": {"retain_s": 3600}}}
    {"kv_transfer_params": {"umbp": {"announced_tokens": 4096}}}

* ``retain_s``: keep the request's blocks in the store this long (the store bounds
  the time and the bytes);
* ``announced_tokens``: a prefill engine (``kv_role: "kv_producer"``) computed this
  many of the prompt's tokens and is storing their blocks; it sends this in its
  response, and the disaggregated-prefill proxy hands it to the decode engine
  (``kv_consumer``), whose lookup waits (bounded) until the pool holds them.

Other connectors' entries are theirs. An ``umbp`` entry that breaks these rules is
refused whole, with a sentence naming the problem; the request is served as if it
had asked nothing (a cache must never be the reason a request fails).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from returns.result import Failure, Result, Success

__all__ = [
    "ENTRY",
    "MAX_RETAIN_S",
    "NO_REQUEST_PARAMS",
    "RequestParams",
    "announcement",
    "request_params",
]

ENTRY: Final = "umbp"
"""umbp's entry in ``kv_transfer_params``."""
MAX_RETAIN_S: Final = 1e7
"""The longest retention a request may write (a store allows at most its own longest)."""
_FIELDS: Final = ("retain_s", "announced_tokens")


@dataclass(frozen=True, slots=True)
class RequestParams:
    """The request's asks; None: not asked."""

    retain_s: float | None = None
    announced_tokens: int | None = None


NO_REQUEST_PARAMS: Final = RequestParams()


def request_params(params: object) -> Result[RequestParams, str]:
    """The ``umbp`` entry of a request's ``kv_transfer_params`` (none: nothing asked),
    or a Failure naming what breaks the rules."""
    if not isinstance(params, Mapping) or ENTRY not in params:
        return Success(NO_REQUEST_PARAMS)
    entry = params[ENTRY]
    if not isinstance(entry, Mapping):
        return Failure(f"kv_transfer_params {ENTRY!r} must be an object such as "
                       f'{{"retain_s": 3600}}, got {type(entry).__name__}')
    unknown = sorted(str(name) for name in entry if name not in _FIELDS)
    if unknown or not entry:
        return Failure(f"kv_transfer_params {ENTRY!r} takes {' and/or '.join(_FIELDS)}, "
                       f"got {sorted(map(str, entry))}")
    retain = entry.get("retain_s")
    if "retain_s" in entry and (
        isinstance(retain, bool) or not isinstance(retain, (int, float))
        or not math.isfinite(retain) or not 0 < retain <= MAX_RETAIN_S
    ):
        return Failure(f"kv_transfer_params {ENTRY!r} retain_s must be a number of seconds "
                       f"in (0, {MAX_RETAIN_S:g}], got {retain!r:.40}")
    announced = entry.get("announced_tokens")
    if "announced_tokens" in entry and (
        isinstance(announced, bool) or not isinstance(announced, int) or announced < 0
    ):
        return Failure(f"kv_transfer_params {ENTRY!r} announced_tokens must be a count of "
                       f"tokens (an integer >= 0), got {announced!r:.40}")
    return Success(RequestParams(
        None if retain is None else float(retain), announced,
    ))


def announcement(tokens: int) -> dict[str, dict[str, int]]:
    """What a prefill engine's response carries for the decode engine."""
    return {ENTRY: {"announced_tokens": tokens}}
