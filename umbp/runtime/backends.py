"""Choosing a back-end: the connector's `mode` -> the stores its two roles use.

Workers open a `WorkerStore` (and, in embedded mode, a pool the scheduler must reach
through them); the scheduler opens a `SchedulerStore` for lookups. Back-end modules are
imported only when their mode is chosen, so a user of one never needs another's packages.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from umbp.core.config import ConnectorConfig
from umbp.runtime.contract import SchedulerStore, WorkerStore
from umbp.runtime.embedded import EmbeddedPool, PoolAddress, connect_to_pool, open_embedded_pool
from umbp.runtime.lookup_service import RankedLookup
from umbp.runtime.pool import SlabPool
from umbp.runtime.private_files import UnsafePath, open_private_file, prepare_directory

logger = logging.getLogger("umbp")


class BackendUnavailable(RuntimeError):
    """The configured back-end cannot be reached or set up at engine start."""


@dataclass(slots=True)
class WorkerBackend:
    """What a worker opened: the store it moves bytes through and, for the embedded
    pool only, the address the scheduler reaches that pool at."""

    store: WorkerStore
    embedded: EmbeddedPool | None

    def close(self) -> None:
        (self.store if self.embedded is None else self.embedded).close()


def open_worker_backend(
    config: ConnectorConfig, page_bytes: int, serve_other_processes: bool
) -> WorkerBackend:
    """Open this worker's store; raises `BackendUnavailable` with what to do about it."""
    if config.mode == "embedded":
        pool = SlabPool(config.capacity_bytes, page_bytes=page_bytes,
                        high_watermark=config.high_watermark,
                        low_watermark=config.low_watermark)
        embedded = open_embedded_pool(pool, serve_other_processes)
        return WorkerBackend(pool, embedded)
    return WorkerBackend(_open_shared_store(config, lookup_only=False), None)


def open_scheduler_store(
    config: ConnectorConfig, embedded_pools: Mapping[str, PoolAddress]
) -> SchedulerStore:
    """The scheduler's lookup handle. ``embedded_pools`` maps each rank tag to the pool
    its worker reported (embedded mode only); shared back-ends hold every rank's
    objects under rank-qualified keys, so one client answers for all."""
    if config.mode == "embedded":
        return RankedLookup({
            tag: connect_to_pool(address, config.lookup_timeout_s)
            for tag, address in embedded_pools.items()
        })
    return _open_shared_store(config, lookup_only=True)


def _open_shared_store(config: ConnectorConfig, *, lookup_only: bool) -> _SharedStore:
    if config.mode == "server":
        return _open_server_store(config, lookup_only)
    if config.mode == "mooncake":
        return _open_mooncake_store(config, lookup_only)
    if config.mode == "mori":
        return _open_mori_store(config)
    raise ValueError(f"umbp: unknown mode {config.mode!r}")


class _SharedStore(WorkerStore, SchedulerStore, Protocol):
    """The shared back-ends implement both roles."""


def _open_server_store(config: ConnectorConfig, lookup_only: bool) -> _SharedStore:
    from umbp.runtime.server.client import ServerStore
    from umbp.runtime.server.launch import probe_server

    endpoint = config.endpoint
    assert endpoint is not None, "validated: mode 'server' needs endpoint"
    timeout = config.lookup_timeout_s if lookup_only else config.io_timeout_s
    probe = probe_server(endpoint, timeout)
    if probe.hello is None:
        if probe.listening:
            # A server is there but slow or full: the store's calls are bounded and
            # retried, so the engine starts and misses until it answers, as it would
            # after start-up.
            logger.warning("umbp: the umbp server at %s is not answering yet (%s); starting "
                           "anyway: lookups miss and stores are dropped until it answers",
                           endpoint, probe.problem)
        elif config.auto_start:
            _auto_start_server(config, endpoint)
        else:
            raise BackendUnavailable(
                f"umbp: no umbp server answers at {endpoint} ({probe.problem}). Start one "
                f"with `umbp serve --socket {endpoint} --capacity <bytes>` (see "
                "docs/operations.md), or set auto_start: true in kv_connector_extra_config"
            )
    return ServerStore(endpoint, io_timeout_s=timeout,
                       reconnect_interval_s=config.reconnect_interval_s)


def _auto_start_server(config: ConnectorConfig, endpoint: str) -> None:
    """Start a detached server unless another process of this node just did: every
    worker and the scheduler of every engine may race here, so the check and the
    start happen under one lock file beside the socket."""
    from umbp.runtime.server.launch import probe_server, server_log_path, start_server
    from umbp.runtime.server.server import DEFAULT_PAGE_BYTES

    try:
        prepare_directory(Path(endpoint).parent, "server socket directory")
        descriptor = open_private_file(endpoint + ".lock", os.O_CREAT | os.O_RDWR,
                                       "auto_start lock file")
    except UnsafePath as error:
        raise BackendUnavailable(f"umbp: auto_start refused: {error}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        if probe_server(endpoint, config.io_timeout_s).listening:  # another just started one
            return
        log_path = server_log_path(endpoint)
        logger.warning("umbp: no server at %s; starting one (auto_start), log in %s",
                       endpoint, log_path)
        try:
            start_server(
                endpoint, config.capacity_bytes, pool_dir=config.pool_dir,
                ssd_dir=config.ssd_dir,
                ssd_capacity_bytes=config.ssd_capacity_bytes,
                page_bytes=config.page_bytes or DEFAULT_PAGE_BYTES,
                high_watermark=config.high_watermark, low_watermark=config.low_watermark,
                detach=True, log_path=log_path,
            )
        except Exception as error:
            raise BackendUnavailable(f"umbp: auto_start could not start a server at "
                                     f"{endpoint}: {error}") from error
    finally:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        os.close(descriptor)


def _open_mooncake_store(config: ConnectorConfig, lookup_only: bool) -> _SharedStore:
    from umbp.runtime.mooncake.store import MooncakeStore

    master = config.mooncake_master
    assert master is not None, "validated: mode 'mooncake' needs mooncake_master"
    hostname = config.mooncake_local_hostname or socket.gethostname()
    try:
        if lookup_only:
            return MooncakeStore.lookup_only(
                master, local_hostname=hostname, protocol=config.mooncake_protocol,
                device_name=config.mooncake_device,
                metadata_server=config.mooncake_metadata_server,
            )
        return MooncakeStore(
            master, local_hostname=hostname, protocol=config.mooncake_protocol,
            device_name=config.mooncake_device, metadata_server=config.mooncake_metadata_server,
            global_segment_bytes=config.capacity_bytes,
            local_buffer_bytes=config.mooncake_buffer_bytes,
        )
    except Exception as error:
        raise BackendUnavailable(f"umbp: Mooncake Store at {master}: {error}") from error


def _open_mori_store(config: ConnectorConfig) -> _SharedStore:
    from umbp.runtime.mori.store import MoriStore

    try:
        return MoriStore(deployment=config.mori_deployment, address=config.mori_address,
                         capacity_bytes=config.capacity_bytes)
    except Exception as error:
        raise BackendUnavailable(f"umbp: MORI UMBP: {error}") from error
