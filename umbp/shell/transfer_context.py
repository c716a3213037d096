"""What a worker's loads and stores run on: the device and its streams, the group
copiers, the store, staging, and the host lane for store I/O.

One value shared by :mod:`umbp.shell.loads` and :mod:`umbp.shell.stores`, built once
the KV tensors are registered. Copies are enqueued on the device's streams after the
step's *forward mark*, an event the model thread records on vLLM's stream in
``start_load_kv``: a load then lands after whatever vLLM enqueued on that stream
before (zeroing of reused blocks, an earlier step still running under asynchronous
scheduling), and a store reads blocks only after the forward pass that wrote them and
the token sampling that followed it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from umbp.gpu.copier import BlockCopier
from umbp.gpu.device import Device, Event, Stream
from umbp.gpu.lanes import Lane
from umbp.gpu.staging import StagingRing
from umbp.runtime.paged_copy import Hashes
from umbp.shell.store_io import StoreAccess

__all__ = ["TransferContext"]

MAX_PIECE_OBJECTS = 4096
"""Most objects one borrow or reservation asks for (a server's request carries at most
65,536 keys): larger loads and stores go in pieces."""

STAGING_WAIT_S = 60.0
"""How long a lane waits for room in the staging area before giving up a load."""


@dataclass(slots=True, eq=False)
class TransferContext:
    device: Device
    access: StoreAccess
    ring: StagingRing | None
    """Staging for groups that do not copy in place (None: every group does)."""
    layer_load_stream: Stream
    """Synchronous loads, layer by layer: the forward pass waits for them."""
    async_load_stream: Stream
    store_stream: Stream
    io_lane: Lane
    """Loads' store I/O (reads into staging, borrowing from a server), on a host thread
    (never the model's)."""
    store_lane: Lane
    """Stores' store I/O (puts from staging, reserving on a server, commits)."""
    in_place: bool
    """Objects copy straight from and to the store's memory
    (:func:`umbp.core.config.copies_in_place`); else through ``ring``."""
    borrow_on_lane: bool
    """Borrowing the store's pages asks it over I/O (the server): on ``io_lane``, never
    the model thread (:func:`umbp.core.config.borrows_on_model_thread`)."""
    copiers: Mapping[int, BlockCopier] = field(default_factory=dict)
    """Per cache group; empty while asleep (no KV memory to copy to or from)."""

    def copies_hash(self, copier: BlockCopier) -> bool:
        """Whether this device's copies of ``copier``'s objects hash what they move."""
        return self.device.copies_hash and copier.copies_hash

    def hashes(self, copier: BlockCopier, count: int, *, stream: bool = True) -> Hashes | None:
        """Hash states for a copy of ``count`` objects, where this device's copies hash
        what they move; None: the store hashes its pages (or buffers) itself. ``stream``
        False: the copy keeps what it writes in cache (`BlockCopier.hashes`)."""
        return copier.hashes(count, stream=stream) if self.copies_hash(copier) else None

    def forward_mark(self) -> Event:
        """An event at the end of what the calling thread's stream (vLLM's, on the
        model thread) has enqueued so far."""
        event = self.device.new_event()
        event.record(self.device.current_stream())
        return event

    def record(self, stream: Stream) -> Event:
        event = self.device.new_event()
        event.record(stream)
        return event
