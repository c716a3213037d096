"""The MORI UMBP binding (`mori.umbp`) as umbp sees it: importing it, creating a
`UMBPClient` for a deployment, what counts as a refused registration, releasing a
client, and the defects of known versions.

MORI ships only for ROCm (docs/backends.md); here it is exercised against
`umbp.testing.fake_mori`, a fake of the documented API. Known defects: in 1.2.4 every
put after `clear()` fails (`clear_breaks_puts`: the store then replaces the client);
nightly builds have no `close()`, so `release_client` calls it only when it exists and
otherwise leaves the client to its destructor.
"""

from __future__ import annotations

import importlib
import logging
import types
from collections.abc import Iterable
from typing import Any

from umbp.runtime.contract import StoreUnavailable

__all__ = [
    "DEPLOYMENTS",
    "MoriSetupError",
    "clear_breaks_puts",
    "import_mori",
    "new_client",
    "quietly",
    "register_memory",
    "release_client",
    "where",
]

_log = logging.getLogger("umbp.runtime.mori")

DEPLOYMENTS = ("embedded", "standalone", "distributed")
_VERSIONS_WHOSE_CLEAR_BREAKS_PUTS = ("1.2.4",)


class MoriSetupError(StoreUnavailable):
    """MORI is missing or the client could not be created (the message says which)."""


def import_mori() -> types.ModuleType:
    try:
        return importlib.import_module("mori.umbp")
    except ImportError as error:
        raise MoriSetupError(
            "mode 'mori' needs AMD's amd-mori package with ROCm; it ships wheels for "
            "CPython 3.10 and 3.12 linked against ROCm 7 only, so it cannot run on this "
            f"machine ({error}). Use mode 'mooncake' or 'server' here (docs/multi-node.md)."
        ) from error


def clear_breaks_puts(umbp: types.ModuleType) -> bool:
    """Whether this MORI version refuses every put after `clear()` (1.2.4)."""
    return str(getattr(umbp, "__version__", "")) in _VERSIONS_WHOSE_CLEAR_BREAKS_PUTS


def where(deployment: str, address: str) -> str:
    """The deployment and its address, as error messages name them."""
    return deployment + (f" at {address}" if address else "")


def new_client(
    umbp: types.ModuleType, deployment: str, address: str, capacity_bytes: int, auto_start: bool
) -> Any:
    """A `UMBPClient` configured for `deployment`; `MoriSetupError` when MORI refuses."""
    try:
        config = umbp.UMBPConfig()
        config.dram.capacity_bytes = capacity_bytes
        if deployment == "standalone":
            config.standalone_process.address = address
            config.standalone_process.auto_start = auto_start
        elif deployment == "distributed":
            config.distributed.master_address = address
        return umbp.UMBPClient(config)
    except Exception as error:
        raise MoriSetupError(
            f"MORI UMBPClient ({where(deployment, address)}) could not be created: {error}"
        ) from error


def register_memory(client: Any, address: int, nbytes: int) -> None:
    """Register `nbytes` at `address`; OSError when MORI raises or refuses (False, or a
    non-zero status code)."""
    try:
        answer = client.register_memory(address, nbytes)
    except Exception as error:
        raise OSError(f"MORI register_memory raised: {error}") from error
    refused = answer is False or (
        isinstance(answer, int) and not isinstance(answer, bool) and answer != 0
    )
    if refused:
        raise OSError(f"MORI refused to register {nbytes} bytes at {address:#x} ({answer})")


def release_client(client: Any, registered: Iterable[int]) -> None:
    """Deregister every start address in `registered`, then close the client where the
    binding has a `close()` (nightly builds have none). Failures are logged, never raised."""
    for start in registered:
        quietly(client.deregister_memory, start)
    close = getattr(client, "close", None)
    if close is not None:
        quietly(close)


def quietly(call: Any, *arguments: object) -> None:
    try:
        call(*arguments)
    except Exception:  # noqa: BLE001 - cleanup must go on; the failure is logged
        _log.warning("MORI %s raised", getattr(call, "__name__", call), exc_info=True)
