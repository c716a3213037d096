"""A real mooncake_master on loopback for the tests that need one (skipped, saying why,
where Mooncake is not installed)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest


def running_master() -> Iterator[Any]:
    """Yield a started ``MooncakeMaster``; stops it afterwards (a fixture's body)."""
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake-transfer-engine is not installed")
    from umbp.testing.mooncake_master import MooncakeMaster, find_master_binary

    try:
        find_master_binary()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    with MooncakeMaster.start() as master:
        yield master
