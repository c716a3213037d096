"""Fixtures shared by the unit tests that build vLLM's real scheduler objects."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.unit.vllm_driver import Driver
    from umbp.gpu.device import HostDevice


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama config (no weights): what vLLM's config and scheduler need."""
    from tests.unit.vllm_driver import write_model_config  # imports vLLM: only when used

    return write_model_config(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def device() -> Iterator[HostDevice]:
    """The host device (copies on host threads), closed after the test."""
    from umbp.gpu.device import HostDevice

    host = HostDevice()
    yield host
    host.close()


@pytest.fixture
def server() -> Iterator[Any]:
    """A real ``umbp serve`` process on a short socket path (Unix sockets allow 108 bytes)."""
    from umbp.runtime.server.launch import start_server, stop_server

    directory = Path(tempfile.mkdtemp(prefix="umbp-w-", dir="/tmp"))
    socket_path = str(directory / "umbp.sock")
    process = start_server(socket_path, 16 << 20, page_bytes=4096,
                           log_path=str(directory / "serve.log"))
    process.socket_path = socket_path  # type: ignore[attr-defined]
    yield process
    stop_server(process, socket_path)
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def make_driver(model_dir: Path) -> Iterator[Callable[..., Driver]]:
    """Builds real-Scheduler drivers for one test and closes every one after it."""
    from tests.unit.vllm_driver import Driver  # imports vLLM: only when used

    drivers: list[Driver] = []

    def make(driver_class: type[Driver] = Driver, **kwargs: Any) -> Driver:
        driver = driver_class(model_dir, **kwargs)
        drivers.append(driver)
        return driver

    yield make
    for driver in drivers:
        driver.close()
