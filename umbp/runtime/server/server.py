"""`umbp serve`: the node-local store server process.

A threading Unix-socket server over `StoreCore` (the socket and its connections:
`listener`; what each request does: `dispatch`); this module starts it, runs it until a
signal and shuts it down. Its DRAM tier is a shared-memory file
in /dev/shm that clients map; only control messages cross the socket (see `protocol`).
The socket is owner-only (0600, its directory 0700 when the server creates it), so only
processes of the same user can talk to it or map its pool. One server per socket path:
the holder of the flock on `<socket>.owner` (see `ownership`); a socket or shared-memory
file is deleted only when it is provably a dead holder's. The threat model is in
docs/operations.md.

What a restart keeps: objects in the SSD tier (its slot file rebuilds its index at open),
and the labels engines registered for the namespaces still there (`labels`).
What it loses: the DRAM tier, which lives and dies with the process.

SIGTERM and SIGINT shut down cleanly: the socket, the shared-memory file and the record
of its name are removed and the process exits 0. With `persist_on_exit`
(`--persist-on-exit`) the DRAM tier's objects are first copied to the SSD tier, so that
the next server keeps them too. After a SIGKILL the next server started at the same
socket path removes the socket and the shared-memory file its predecessor left behind
(the file's name is recorded beside the socket, in `<socket>.pool`).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from umbp.runtime.population import PopulationStopped, Progress
from umbp.runtime.server.cold import ColdTier, open_cold_tier, stats_dict
from umbp.runtime.server.index import PoolIndex
from umbp.runtime.server.labels import LabelFile
from umbp.runtime.server.listener import StoreServer, bind
from umbp.runtime.server.metrics import MetricsEndpoint, render
from umbp.runtime.server.operations import DEFAULT_MAX_RETAIN_S
from umbp.runtime.server.ownership import SocketOwnership
from umbp.runtime.server.page_tables import fill_in_background
from umbp.runtime.server.pool_mount import PoolMount, pool_mount
from umbp.runtime.server.prefetch import MAX_PREFETCH_READERS, PREFETCH_READERS
from umbp.runtime.server.schema import MAX_SECONDS
from umbp.runtime.server.sessions import RequestRefused
from umbp.runtime.server.shm import (
    SHM_DIRECTORY,
    SharedPool,
    create_shared_pool,
    release_shared_pool,
)
from umbp.runtime.server.state import StoreCore

__all__ = ["ServerConfig", "serve"]

DEFAULT_PAGE_BYTES = 64 << 10
"""The DRAM allocation granule when none is given."""
DEFAULT_MAX_CONNECTIONS = 256
MAX_CONNECTIONS_LIMIT = 4096
DEFAULT_FRAME_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerConfig:
    socket_path: str
    capacity_bytes: int
    page_bytes: int = DEFAULT_PAGE_BYTES
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    pool_dir: str | None = None
    """The tmpfs directory of the DRAM tier's file (None: /dev/shm); one mounted with
    ``huge=within_size`` gives the pool huge pages (`umbp.runtime.server.pool_mount`)."""
    ssd_dir: str | None = None
    ssd_capacity_bytes: int = 0
    persist_on_exit: bool = False
    """On SIGTERM/SIGINT, copy the DRAM tier's objects to the SSD tier before exiting
    (costs one SSD write per object the SSD lacks; off by default)."""
    prefetch_bytes: int | None = None
    """Most bytes of SSD objects a lookup may have on their way into DRAM ahead of their
    load (`umbp.runtime.server.prefetch`); None: half of `capacity_bytes` (more would
    push out what was prefetched before its load came); 0: none."""
    prefetch_readers: int = PREFETCH_READERS
    """Threads reading SSD objects into DRAM at once for the prefetch (an NVMe drive wants
    several reads in flight; each takes a core while it copies)."""
    write_ahead_bytes: int | None = None
    """How much of the DRAM tier's least recently used end is kept copied on the SSD
    tier ahead of its eviction (`umbp.runtime.server.write_ahead`), so that making room
    writes nothing; None: the watermarks' gap plus the prefetch bound (one round of
    room-making and one full prefetch); 0: none (victims are written when they leave)."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Client connections served at once (one thread each); more are refused."""
    frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S
    """Time a client has to finish a frame once its first byte arrived (and to read an
    answer); an idle connection between frames may wait for ever."""
    quotas: tuple[tuple[str, int], ...] = ()
    """(namespace, bytes): the most DRAM each may hold (`umbp.runtime.server.shares`)."""
    retain_budgets: tuple[tuple[str, int], ...] = ()
    """(namespace, bytes): what each may retain, over `default_retain_budget_bytes`."""
    default_retain_budget_bytes: int | None = None
    """What a namespace may retain unless it has a budget of its own; None: a tenth of
    `capacity_bytes` (within half the low watermark, the cap on all retention)."""
    max_retain_s: float = DEFAULT_MAX_RETAIN_S
    """The longest retention a request may ask for."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    """Serve Prometheus text at http://metrics_host:metrics_port/metrics (0: a free
    port, named in the start-up event); None: no endpoint."""

    def validate(self) -> None:
        if self.page_bytes <= 0 or self.page_bytes % 64:
            raise ValueError(f"page_bytes must be a positive multiple of 64, got {self.page_bytes}")
        if self.capacity_bytes < self.page_bytes:
            raise ValueError(
                f"capacity_bytes ({self.capacity_bytes}) is below one page ({self.page_bytes})"
            )
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError(
                "watermarks must satisfy 0 < low < high <= 1, got "
                f"low={self.low_watermark} high={self.high_watermark}"
            )
        if self.ssd_capacity_bytes < 0:
            raise ValueError(f"ssd_capacity_bytes must be >= 0, got {self.ssd_capacity_bytes}")
        if self.ssd_capacity_bytes and self.ssd_dir is None:
            raise ValueError("ssd_capacity_bytes needs ssd_dir")
        if self.prefetch_bytes is not None and not 0 <= self.prefetch_bytes <= self.capacity_bytes:
            raise ValueError(f"prefetch_bytes must be in [0, capacity_bytes], got "
                             f"{self.prefetch_bytes}")
        if not 1 <= self.prefetch_readers <= MAX_PREFETCH_READERS:
            raise ValueError(f"prefetch_readers must be in [1, {MAX_PREFETCH_READERS}], got "
                             f"{self.prefetch_readers}")
        if (self.write_ahead_bytes is not None
                and not 0 <= self.write_ahead_bytes <= self.capacity_bytes):
            raise ValueError(f"write_ahead_bytes must be in [0, capacity_bytes], got "
                             f"{self.write_ahead_bytes}")
        if not 1 <= self.max_connections <= MAX_CONNECTIONS_LIMIT:
            raise ValueError(
                f"max_connections must be in [1, {MAX_CONNECTIONS_LIMIT}], "
                f"got {self.max_connections}"
            )
        if not 0.01 <= self.frame_timeout_s <= 3600:
            raise ValueError(f"frame_timeout_s must be in [0.01, 3600], got {self.frame_timeout_s}")
        if not 0 < self.max_retain_s <= MAX_SECONDS:
            raise ValueError(f"max_retain_s must be in (0, {MAX_SECONDS:g}], got {self.max_retain_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")


def serve(config: ServerConfig) -> int:
    """Run a server in the foreground until SIGTERM or SIGINT; returns the exit status."""
    config.validate()
    mount = _pool_mount(config)
    stop = _stop_on_signals()
    socket_path = os.path.abspath(config.socket_path)
    ownership = SocketOwnership.acquire(socket_path)
    pool: SharedPool | None = None
    cold: ColdTier | None = None
    server: StoreServer | None = None
    core: StoreCore | None = None
    metrics: MetricsEndpoint | None = None
    try:
        ownership.clear_leftovers()
        pool = _create_pool(config, mount, stop)
        ownership.record_pool(pool.path)
        fill_in_background(pool.mapping, pool.nbytes, _report_present)
        if config.ssd_dir is not None and config.ssd_capacity_bytes > 0:
            cold = open_cold_tier(config.ssd_dir, config.ssd_capacity_bytes)
            _report_cold_tier(cold)
        prefetch_bytes = (config.capacity_bytes // 2 if config.prefetch_bytes is None
                          else config.prefetch_bytes)
        core = StoreCore(pool.view, _index_for(config, pool), cold, prefetch_bytes,
                         _write_ahead_bytes(config, prefetch_bytes), config.prefetch_readers)
        if cold is not None and config.ssd_dir is not None:
            core.restore_labels(LabelFile(config.ssd_dir))
        _apply_limits(config, core)
        hello = _hello(config, pool)
        server = bind(socket_path, core, hello, config.max_connections, config.frame_timeout_s)
        metrics = _start_metrics(config, server)
        ownership.bound()
        _run_until(stop, server, socket_path, pool)
        server.server_close()
        server.drop_connections()
        if config.persist_on_exit:
            _persist(core)
    except PopulationStopped:
        pass  # a SIGTERM while the DRAM tier was being allocated: a clean stop
    finally:
        if metrics is not None:
            metrics.close()
        _shut_down(server, core, ownership, pool, cold)
    return 0


def _write_ahead_bytes(config: ServerConfig, prefetch_bytes: int) -> int:
    if config.write_ahead_bytes is not None:
        return config.write_ahead_bytes
    gap = int((config.high_watermark - config.low_watermark) * config.capacity_bytes)
    return min(config.capacity_bytes, gap + prefetch_bytes)


def _apply_limits(config: ServerConfig, core: StoreCore) -> None:
    """The command line's retention settings and per-namespace limits, each checked as
    `umbp limits` checks it (a ValueError naming the one broken)."""
    default_budget = config.default_retain_budget_bytes
    try:
        core.configure_retention(config.max_retain_s, config.capacity_bytes // 10
                                 if default_budget is None else default_budget,
                                 capped=default_budget is None)
        for namespace, quota in config.quotas:
            core.set_limits(namespace, {"quota_bytes": quota}, require=False)
        for namespace, budget in config.retain_budgets:
            core.set_limits(namespace, {"retain_budget_bytes": budget}, require=False)
    except RequestRefused as error:
        raise ValueError(str(error)) from None


def _start_metrics(config: ServerConfig, server: StoreServer) -> MetricsEndpoint | None:
    """The Prometheus endpoint, its address recorded in the HELLO answer (and so in
    `umbp stats`)."""
    if config.metrics_port is None:
        return None
    core = server.core

    def scrape() -> str:
        return render(core.stats(), core.namespaces(), server.request_times.snapshot(),
                      server.refused_connections)

    endpoint = MetricsEndpoint(config.metrics_host, config.metrics_port, scrape)
    host, port = endpoint.address
    server.hello["metrics"] = f"http://{host}:{port}/metrics"
    return endpoint


def _pool_directory(config: ServerConfig) -> Path:
    return SHM_DIRECTORY if config.pool_dir is None else Path(config.pool_dir)


def _pool_mount(config: ServerConfig) -> PoolMount:
    """The pool directory's mount: a `--pool-dir` is checked (refused with the reason);
    /dev/shm, the default, is only described, as well as this host lets us."""
    directory = str(_pool_directory(config))
    try:
        return pool_mount(directory)
    except (ValueError, OSError):
        if config.pool_dir is not None:
            raise
        return PoolMount(directory, "unknown", ())


def _create_pool(config: ServerConfig, mount: PoolMount, stop: threading.Event) -> SharedPool:
    """The DRAM tier, allocated whole before the server answers; while that lasts, one
    `populating` event a second says how far it is (a pool of hundreds of GiB takes
    minutes), and `populated` says how long it took and whether its pages are huge."""

    def report(progress: Progress) -> None:
        _event("populating", done_bytes=progress.done_bytes,
               total_bytes=progress.total_bytes, seconds=round(progress.seconds, 1))

    nbytes = config.capacity_bytes // config.page_bytes * config.page_bytes
    started = time.monotonic()
    pool = create_shared_pool(nbytes, _pool_directory(config), report=report,
                              should_stop=stop.is_set)
    pages: dict[str, object] = {"huge_pages": mount.huge_pages,
                                "pool_mount": mount.mount_point, "huge": mount.huge_policy}
    if not mount.huge_pages:
        pages["note"] = (f"4 KiB pages (the {mount.fstype} at {mount.mount_point} has huge="
                         f"{mount.huge_policy}); --pool-dir on a tmpfs mounted with "
                         "huge=within_size gives it huge pages (docs/operations.md, "
                         "'Where the DRAM tier lies')")
    _event("populated", bytes=nbytes, seconds=round(time.monotonic() - started, 2), **pages)
    return pool


def _report_present(nbytes: int, seconds: float) -> None:
    """Every page of the DRAM tier is zeroed and mapped in the server (`page_tables`)."""
    _event("present", bytes=nbytes, seconds=round(seconds, 2))


def _event(name: str, **fields: Any) -> None:
    print(json.dumps({"event": name, **fields}), file=sys.stderr, flush=True)


def _index_for(config: ServerConfig, pool: SharedPool) -> PoolIndex:
    total_pages = pool.nbytes // config.page_bytes
    return PoolIndex(
        total_pages,
        config.page_bytes,
        high_pages=int(config.high_watermark * total_pages + 1e-9),
        low_pages=int(config.low_watermark * total_pages + 1e-9),
    )


def _hello(config: ServerConfig, pool: SharedPool) -> dict[str, Any]:
    return {
        "server_id": secrets.token_hex(8),
        "pid": os.getpid(),
        "shm_path": pool.path,
        "shm_bytes": pool.nbytes,
        "page_bytes": config.page_bytes,
        "ssd_dir": config.ssd_dir,
    }


def remove_stale_leftovers(socket_path: str) -> None:
    """Best-effort clean-up after a server that is gone (tests' `stop_server`): when no
    live server holds the socket path's lock, remove the dead one's socket and pool file;
    otherwise touch nothing."""
    path = os.path.abspath(socket_path)
    if not os.path.isdir(os.path.dirname(path)):
        return  # nothing can be left there (and a clean-up must not create the directory)
    ownership = SocketOwnership.try_acquire(path)
    if ownership is None:
        return
    try:
        ownership.clear_leftovers(strict=False)
    finally:
        ownership.release()


def _stop_on_signals() -> threading.Event:
    """Installed before anything is allocated, so that a SIGTERM during a long start
    (allocating a large pool) still ends in a clean shutdown."""
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    # A write past RLIMIT_FSIZE must fail with EFBIG (the SSD tier then answers False),
    # not kill the server and every client's pool with it.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return stop


def _run_until(
    stop: threading.Event, server: StoreServer, socket_path: str, pool: SharedPool
) -> None:
    # A short poll interval: shutdown() waits up to one interval for the loop to notice.
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="umbp-serve",
        daemon=True,
    )
    thread.start()
    print(
        json.dumps({"event": "serving", "socket": socket_path, "pool": pool.path,
                    "pool_bytes": pool.nbytes, "pid": os.getpid(),
                    "metrics": server.hello.get("metrics")}),
        file=sys.stderr,
        flush=True,
    )
    while not stop.wait(0.5):
        pass
    server.shutdown()
    thread.join()


def _persist(core: StoreCore) -> None:
    written = core.persist_to_cold()
    print(json.dumps({"event": "persisted", "objects": written}), file=sys.stderr, flush=True)


def _report_cold_tier(cold: ColdTier) -> None:
    """One line at start: what the SSD tier kept from before, and what it lost."""
    figures = stats_dict(cold.stats())
    event = {"event": "ssd_opened", "objects": figures.get("objects"),
             "dropped_at_open": figures.get("dropped_at_open")}
    print(json.dumps(event), file=sys.stderr, flush=True)


def _shut_down(
    server: StoreServer | None,
    core: StoreCore | None,
    ownership: SocketOwnership,
    pool: SharedPool | None,
    cold: ColdTier | None,
) -> None:
    if server is not None:
        server.server_close()
        server.drop_connections()
    if core is not None:
        core.close()  # its prefetch and write-ahead threads use the cold tier and pool
    if pool is not None:
        release_shared_pool(pool)
    if cold is not None:
        cold.close()
    ownership.release()
    print(json.dumps({"event": "stopped", "socket": ownership.socket_path}), file=sys.stderr,
          flush=True)
