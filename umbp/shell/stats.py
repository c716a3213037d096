"""umbp's counters in vLLM's KV-connector stats: workers and the scheduler report
what changed since their last report; vLLM sums the reports and logs them."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclasses.dataclass
class UMBPConnectorStats(KVConnectorStats):
    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


def flat_counters(counters: Any) -> dict[str, float]:
    """A counters dataclass as flat numbers (nested dicts become name_key).

    Runs every engine step for each role: reads the fields directly rather than
    through ``dataclasses.asdict``, which deep-copies."""
    flat: dict[str, float] = {}
    for name in _field_names(type(counters)):
        value = getattr(counters, name)
        if isinstance(value, dict):
            flat.update({f"{name}_{key}": float(v) for key, v in value.items()})
        else:
            flat[name] = float(value)
    return flat


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


class StatsDelta:
    """What changed in a set of counters since the previous call."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._previous: dict[str, float] = {}

    def take(self, counters: Any) -> UMBPConnectorStats | None:
        current = flat_counters(counters)
        if current == self._previous:
            return None
        delta = {
            f"{self._prefix}{name}": value - self._previous.get(name, 0.0)
            for name, value in current.items()
            if value != self._previous.get(name, 0.0)
        }
        self._previous = current
        return UMBPConnectorStats(data=delta) if delta else None
