"""Host memory registered with a device (page-locked, so that its copy engines move the
bytes directly), kept by the mapping it lies in.

A registration must end before its memory is unmapped: CUDA keeps the pages it locked,
and a later mapping at the same address would be copied to and from those old pages.
The worker's staging area lives as long as the worker; a store's lent memory (the
embedded pool's slab, a server's shared pool) is followed through the store
(`WatchesLentMemory`): a restarted server's new pool is registered when it is mapped,
and the old one unregistered once no loan or reservation in it is left.
"""

from __future__ import annotations

import logging
import threading

from umbp.gpu.device import Device

__all__ = ["REGISTER_CHUNK_BYTES", "HostRegistrations"]

logger = logging.getLogger("umbp")

REGISTER_CHUNK_BYTES = 32 << 30
"""Host memory is registered in pieces of at most this (drivers limit one registration's
size)."""


class HostRegistrations:
    """The host ranges registered with `device`, by mapping (`WatchesLentMemory`).
    Thread-safe: a store tells of its mappings from whichever thread (re)connects or
    hears its server hang up, so each call first makes the device the thread's own (CUDA
    registers in the calling thread's current device, and a thread that never chose one
    would act in a context of device 0, creating it if need be)."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self._lock = threading.Lock()
        self._pieces: dict[int, list[int]] = {}  # mapping's address -> pieces registered
        self._closed = False

    def mapped(self, address: int, nbytes: int) -> None:
        """Register `[address, address + nbytes)`, in pieces; a device that refuses (or
        needs nothing) leaves the rest unregistered: its copies still work, slower."""
        self._device.bind_thread()
        with self._lock:
            if self._closed or address in self._pieces:
                return
            pieces = self._pieces[address] = []
            registered = 0
            for start in range(address, address + nbytes, REGISTER_CHUNK_BYTES):
                size = min(REGISTER_CHUNK_BYTES, address + nbytes - start)
                if not self._device.register_host(start, size):
                    break
                pieces.append(start)
                registered += size
            if registered:  # an operator sees a restarted server's pool taken up
                logger.info("umbp: %d MiB of host memory at %#x registered with %s",
                            registered >> 20, address, self._device.name)

    def unmapping(self, address: int) -> None:
        """Unregister the mapping at `address` (nothing when it was not registered)."""
        self._device.bind_thread()
        with self._lock:
            self._unregister_locked(address)

    def close(self) -> None:
        """Unregister everything (once every copy finished); later mappings are ignored."""
        self._device.bind_thread()
        with self._lock:
            self._closed = True
            for address in list(self._pieces):
                self._unregister_locked(address)

    def _unregister_locked(self, address: int) -> None:
        pieces = self._pieces.pop(address, [])
        for start in pieces:
            self._device.unregister_host(start)
        if pieces:
            logger.info("umbp: host memory at %#x unregistered from %s (unmapped next)",
                        address, self._device.name)
