"""For the whole suite: Hypothesis settings (on a loaded 2-core machine the clock is
no evidence, so no example deadline and no health check that measures generation
speed; what the properties assert is unchanged), and every test leaves the process
environment as it found it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "umbp", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("umbp")


@pytest.fixture(autouse=True)
def _environment_left_as_found() -> Iterator[None]:
    """Each test leaves ``os.environ`` as it found it. Building a ``VllmConfig`` with
    umbp in this process runs umbp's config phase, which sets
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` here as it does in ``vllm serve``'s process;
    every process a later test started inherited it (a ``vllm serve`` then had no
    reason to log that umbp set it: the log test failed after any unit test that
    builds a driver)."""
    saved = dict(os.environ)
    yield
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
