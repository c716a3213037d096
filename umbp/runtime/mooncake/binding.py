"""The Mooncake Store binding as umbp sees it: its typed surface, its error codes, and
whether its master can be reached.

Facts (docs/backends.md, checked against `mooncake-transfer-engine-non-cuda==0.3.13.post1`):
failures come back as negative codes (OBJECT_NOT_FOUND -704, RPC_FAIL -900 when the master
is gone, NO_AVAILABLE_HANDLE -200 when no segment has room, ...). After one failed round
trip Mooncake spends ~4 s per call reconnecting, and `setup` against an absent master
retries for ~90 s; so the master's port is probed first, and calls fail at once while the
client's `health_check` or a probe of the port says the master is gone (`MasterHealth`).
"""

from __future__ import annotations

import importlib
import logging
import socket
from typing import Any, Protocol, cast

from umbp.runtime.contract import StoreUnavailable

__all__ = [
    "INVALID_PARAMS",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_NOT_FOUND",
    "REPLICA_IS_NOT_READY",
    "RPC_FAIL",
    "TRANSFER_FAIL",
    "MasterHealth",
    "MooncakeClient",
    "MooncakeSetupError",
    "complete_memory_size",
    "new_client",
    "parse_address",
    "probe_master",
    "quietly",
]

_log = logging.getLogger("umbp.runtime.mooncake")

# Mooncake error codes umbp tells apart (mooncake-store's ErrorCode).
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
REPLICA_IS_NOT_READY = -703
INVALID_PARAMS = -600  # what a get into a too-small buffer answers
TRANSFER_FAIL = -800  # also what a multi-buffer get answers when the object is shorter
RPC_FAIL = -900  # the master did not answer
_HEALTH_MASTER_UNREACHABLE = 2  # health_check(): 0 healthy, 1 closed, 2 master unreachable
_PROBE_TIMEOUT_S = 0.25


class MooncakeSetupError(StoreUnavailable):
    """The client could not join the cluster (master unreachable, setup refused,
    package missing). The message names the master address."""


class MooncakeClient(Protocol):
    """The part of `mooncake.store.MooncakeDistributedStore` used here (no stubs ship)."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...
    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...
    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def remove(self, key: str, force: bool = ...) -> int: ...
    def remove_all(self, force: bool = ...) -> int: ...
    def remove_by_regex(self, regex_pattern: str, force: bool = ...) -> int: ...
    def health_check(self) -> int: ...
    def close(self) -> int: ...


def new_client() -> MooncakeClient:
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as error:
        raise MooncakeSetupError(
            "mode 'mooncake' needs the Mooncake client: pip install "
            "mooncake-transfer-engine (GPU machines) or mooncake-transfer-engine-non-cuda "
            f"(CPU machines), and libibverbs1 from apt ({error})"
        ) from error
    return cast(MooncakeClient, module.MooncakeDistributedStore())


def parse_address(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" (IPv6 hosts in brackets)."""
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit():
        raise ValueError(f"expected 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def probe_master(master_address: str, timeout_s: float) -> None:
    """Fail in `timeout_s` rather than in Mooncake's ~90 s of setup retries."""
    host, port = parse_address(master_address)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise MooncakeSetupError(
            f"cannot reach the Mooncake master at {master_address}: {error} "
            "(is mooncake_master running there, and is that address right?)"
        ) from error


class MasterHealth:
    """Whether calls should go through to the master. Not thread-safe: the store calls
    it under its lock."""

    def __init__(self, client: MooncakeClient, master_address: str) -> None:
        self._client = client
        self._master_address = master_address
        self.suspect = False
        """Set when an answer said the master did not reply (RPC_FAIL, a malformed or
        failed size query); cleared once a probe of its port succeeds."""

    def unreachable(self) -> bool:
        """True when the master is known to be gone, so that calls fail at once: after a
        failed round trip Mooncake spends ~4 s per call reconnecting, until its own
        heartbeat notices (`health_check`). While in doubt, a TCP probe of the master's
        port decides; once it answers, calls go through again."""
        try:
            if self._client.health_check() == _HEALTH_MASTER_UNREACHABLE:
                return True
        except Exception:  # noqa: BLE001 - no binding error may reach the caller
            return True
        if not self.suspect:
            return False
        try:
            probe_master(self._master_address, _PROBE_TIMEOUT_S)
        except MooncakeSetupError:
            return True
        self.suspect = False
        return False


def complete_memory_size(replicas: Any) -> int | None:
    """Size of the first complete in-memory replica, None when there is none. Each
    attribute is a pybind11 call, so the usual single replica is read with as few as
    possible."""
    for replica in replicas:
        if replica.status.name == "COMPLETE" and replica.is_memory_replica():
            return int(replica.get_memory_descriptor().buffer_descriptor.size)
    return None


def quietly(call: Any, *arguments: object) -> None:
    """Call a binding function whose failure must not stop a cleanup; log it."""
    try:
        call(*arguments)
    except Exception:  # noqa: BLE001 - cleanup must go on; the failure is logged
        _log.warning("Mooncake %s raised", getattr(call, "__name__", call), exc_info=True)
