"""A step's synchronous loads, restored layer by layer while the forward pass runs.

The sync-load lane reads every object of the step's plans, decides with core which
rows to scatter, then scatters them one layer at a time: a layer is a slice of each
object. Objects the embedded pool lends in place (:mod:`umbp.shell.group_io`) are
not copied first, so layer 0 is ready after one layer's copy, not the whole read; their
checksums are verified once every layer is scattered, and what fails is reported in
this step like any failed read. The forward pass waits in
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

from umbp.core.loads.outcomes import (
    GroupLoadOutcome,
    RequestLoadOutcome,
    group_load_outcome,
    merged_groups,
    plan_load_outcome,
    split_statuses,
)
from umbp.core.plans import GroupBlocks, LoadPlan
from umbp.gpu.handle import CopyHandle
from umbp.shell.group_io import GroupIO, GroupRead, ScatterSource, settle_reads

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
        reads: list[tuple[GroupBlocks, GroupRead]] = []
        scattered = False
        try:
            reads = [(merged, self._io.read(merged)) for merged in merged_groups(self._plans)]
            sources: list[tuple[GroupLoadOutcome, ScatterSource]] = []
            for merged, read in reads:
                group = group_load_outcome(merged.group_id, merged.block_ids, read.statuses)
                source = self._io.source(group, read)
                if source is not None:
                    sources.append((group, source))
            self._scatter_by_layer(sources)
            scattered = True
        finally:
            for event in self._ready.values():
                event.set()
            try:
                self._outcomes = self._settle(reads, scattered)
            finally:
                self.seconds = time.perf_counter() - started
                self._done.set()

    def _settle(
        self, reads: Sequence[tuple[GroupBlocks, GroupRead]], scattered: bool
    ) -> tuple[RequestLoadOutcome, ...]:
        """Every plan's outcome from the reads' final statuses."""
        final = settle_reads([read for _, read in reads], scattered)
        statuses = {merged.group_id: answer for (merged, _), answer in zip(reads, final)}
        return tuple(
            plan_load_outcome(plan, shares, False)
            for plan, shares in zip(self._plans, split_statuses(self._plans, statuses))
        )

    def _scatter_by_layer(self, sources: Sequence[tuple[GroupLoadOutcome, ScatterSource]]) -> None:
        for (group_id, layer), event in self._ready.items():
            handles = [
                self._io.scatter_layer(group, layer, source)
                for group, source in sources if group.group_id == group_id
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

