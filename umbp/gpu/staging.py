"""The staging ring: host memory for objects on their way between the KV cache and a
store that neither lends nor reserves rows of its own memory.

One area, allocated and faulted in at start and registered with the device (so the copy
engines reach it directly) and with the store's transport (Mooncake and MORI move bytes
only from registered memory). A transfer takes a slot of whole rows, one object per row;
a transfer larger than what is free goes in pieces. Nothing is allocated or registered
per transfer, so the page-locked memory a worker holds is fixed once it started, whatever
a step's size.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from umbp.runtime.host_memory import allocate_prefaulted_slab

__all__ = ["StagingRing", "StagingSlot"]

_ALIGN = 64  # slots start on cache lines (copies at memcpy speed)


@dataclass(frozen=True, slots=True, eq=False)
class StagingSlot:
    """``rows`` rows of ``row_bytes``: ``memory`` is uint8 ``[rows, row_bytes]``."""

    offset: int
    nbytes: int
    memory: npt.NDArray[np.uint8]

    @property
    def rows(self) -> int:
        return int(self.memory.shape[0])


class StagingRing:
    """Slots of one area, taken and given back in any order (first fit; neighbours
    merge when given back). Thread-safe."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < _ALIGN:
            raise ValueError(f"the staging area needs at least {_ALIGN} bytes, got {nbytes}")
        self._mapping = allocate_prefaulted_slab(nbytes)
        self._area: npt.NDArray[np.uint8] = np.frombuffer(self._mapping, np.uint8)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), by offset
        self._changed = threading.Condition()
        self.nbytes = nbytes

    @property
    def address(self) -> int:
        return int(self._area.ctypes.data)

    def take(self, row_bytes: int, rows_wanted: int) -> StagingSlot | None:
        """A slot of up to ``rows_wanted`` rows (as many as the first free extent with
        room for one holds); None when not even one row fits now."""
        if row_bytes > self.nbytes:
            raise ValueError(f"an object of {row_bytes} bytes does not fit the staging "
                             f"area of {self.nbytes} bytes")
        with self._changed:
            return self._take_locked(row_bytes, rows_wanted)

    def take_waiting(self, row_bytes: int, rows_wanted: int, timeout_s: float) -> StagingSlot | None:
        """:meth:`take`, waiting up to ``timeout_s`` for room (a lane, never the model
        thread)."""
        if row_bytes > self.nbytes:
            raise ValueError(f"an object of {row_bytes} bytes does not fit the staging "
                             f"area of {self.nbytes} bytes")
        with self._changed:
            slot: StagingSlot | None = None

            def taken() -> bool:
                nonlocal slot
                slot = self._take_locked(row_bytes, rows_wanted)
                return slot is not None

            self._changed.wait_for(taken, timeout_s)
            return slot

    def give_back(self, slot: StagingSlot) -> None:
        with self._changed:
            index = bisect.bisect(self._free, (slot.offset, 0))
            start, end = slot.offset, slot.offset + slot.nbytes
            if index < len(self._free) and self._free[index][0] == end:
                end += self._free.pop(index)[1]
            if index > 0 and sum(self._free[index - 1]) == start:
                start = self._free.pop(index - 1)[0]
                index -= 1
            self._free.insert(index, (start, end - start))
            self._changed.notify_all()

    def _take_locked(self, row_bytes: int, rows_wanted: int) -> StagingSlot | None:
        for index, (offset, length) in enumerate(self._free):
            rows = min(rows_wanted, length // row_bytes)
            if rows < 1:
                continue
            nbytes = min(length, -(-rows * row_bytes // _ALIGN) * _ALIGN)
            if nbytes == length:
                del self._free[index]
            else:
                self._free[index] = (offset + nbytes, length - nbytes)
            memory = self._area[offset : offset + rows * row_bytes].reshape(rows, row_bytes)
            return StagingSlot(offset, nbytes, memory)
        return None

    def close(self) -> None:
        try:
            self._mapping.close()
        except BufferError:
            pass  # a slot still referenced: the mapping goes with it
