"""A step's synchronous loads, restored layer by layer while the forward pass runs.

The sync-load lane reads every object of the step's plans (the store verifies each
whole object), decides with core which rows loaded intact, then scatters them one
layer at a time: a layer is a slice of each staged object. The forward pass waits in
``wait_for_layer_load`` for its own layer's copies only (on CUDA on the GPU: its
stream waits for the lane's event, the host does not block), so the copies of later
layers overlap the attention of earlier ones. Every event is set even when reading
fails, so no forward pass can wait forever; failed blocks are never scattered and
are reported, and vLLM recomputes them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import torch

from umbp.core.loads.outcomes import (
    GroupLoadOutcome,
    LoadStatus,
    RequestLoadOutcome,
    group_load_outcome,
    merged_groups,
    plan_load_outcome,
    split_statuses,
)
from umbp.core.plans import LoadPlan
from umbp.gpu.handle import CopyHandle
from umbp.shell.group_io import GroupIO

__all__ = ["LayerwiseLoads"]


class LayerwiseLoads:
    """One step's synchronous load plans: :meth:`run` on the lane, the waits on the
    forward thread. ``layers``: per cache group, how many layers its objects hold."""

    def __init__(self, plans: Sequence[LoadPlan], io: GroupIO, layers: Mapping[int, int]) -> None:
        self._plans = tuple(plans)
        self._io = io
        self._layers = dict(layers)
        self._ready = {
            (group_id, layer): threading.Event()
            for group_id, count in self._layers.items() for layer in range(count)
        }
        self._handles: dict[tuple[int, int], list[CopyHandle]] = {}
        self._done = threading.Event()
        self._outcomes: tuple[RequestLoadOutcome, ...] = ()
        self.seconds = 0.0
        """The lane's time on the job (read after :meth:`outcomes`)."""

    def run(self) -> None:
        started = time.perf_counter()
        try:
            staged: list[tuple[GroupLoadOutcome, torch.Tensor]] = []
            statuses: dict[int, tuple[LoadStatus, ...] | None] = {}
            for merged in merged_groups(self._plans):
                answer, rows = self._io.read(merged)
                statuses[merged.group_id] = answer
                group = group_load_outcome(merged.group_id, merged.block_ids, answer)
                loaded = self._io.loaded_rows(group, rows)
                if loaded is not None:
                    staged.append((group, loaded))
            self._outcomes = tuple(
                plan_load_outcome(plan, shares, False)
                for plan, shares in zip(self._plans, split_statuses(self._plans, statuses))
            )
            self._scatter_by_layer(staged)
        finally:
            for event in self._ready.values():
                event.set()
            self.seconds = time.perf_counter() - started
            self._done.set()

    def _scatter_by_layer(self, staged: Sequence[tuple[GroupLoadOutcome, torch.Tensor]]) -> None:
        for (group_id, layer), event in self._ready.items():
            handles = [
                self._io.scatter_layer(group, layer, rows)
                for group, rows in staged if group.group_id == group_id
            ]
            self._handles[(group_id, layer)] = handles
            event.set()
        for handles in self._handles.values():  # staging is reused by the lane's next job
            for handle in handles:
                handle.wait()

    def wait_layer(self, group_id: int, layer: int) -> None:
        """Until the layer's copies are enqueued, then order the forward pass after
        them (CPU: they are done)."""
        event = self._ready.get((group_id, layer))
        if event is None:
            return
        event.wait()
        for handle in self._handles.get((group_id, layer), ()):
            handle.make_stream_wait()

    def outcomes(self) -> tuple[RequestLoadOutcome, ...]:
        """Every plan's outcome, once the lane has finished the job."""
        self._done.wait()
        return self._outcomes

    @property
    def plans(self) -> tuple[LoadPlan, ...]:
        return self._plans

