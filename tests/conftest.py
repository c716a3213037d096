"""Hypothesis settings for the whole suite: on a loaded 2-core machine the clock is
no evidence, so no example deadline and no health check that measures generation
speed. What the properties assert is unchanged."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile(
    "umbp", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("umbp")
