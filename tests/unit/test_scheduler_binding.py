"""Binding workers to the scheduler role, through vLLM's real connector hook.

The rule (one namespace, every rank reported) is core's
``identity.bound_keyspace``, property-tested in
tests/property/test_identity_properties.py; this checks that the scheduler role
applies it: a bad report is a start-up error with core's message, and it leaves
the binding the workers made before in place.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

BLOCK = 32


def test_a_bad_worker_report_is_a_start_up_error_naming_the_problem(make_driver: Any) -> None:
    driver = make_driver()
    good = driver.worker.get_handshake_metadata()
    # A second worker (on a rank outside this TP=1 topology) under another namespace.
    other = replace(good, namespace=good.namespace + "-other", rank=replace(good.rank, pp=1))
    with pytest.raises(RuntimeError) as disagree:
        driver.connector.set_xfer_handshake_metadata({0: good, 1: other})
    assert str(disagree.value) == (
        f"umbp workers disagree on the namespace: {sorted([good.namespace, other.namespace])}"
    )
    stray = replace(good, rank=replace(good.rank, pp=1))
    with pytest.raises(RuntimeError) as outside:
        driver.connector.set_xfer_handshake_metadata({0: good, 1: stray})
    assert str(outside.value).startswith("umbp: workers reported for ranks outside the topology")
    assert str(stray.rank) in str(outside.value)
    with pytest.raises(RuntimeError) as missing:
        driver.connector.set_xfer_handshake_metadata({})
    assert str(missing.value) == f"umbp: no worker reported for ranks {[good.rank]}"

    # The binding made at start-up still serves: a stored prefix is found.
    tokens = [(i * 7) % 500 + 1 for i in range(2 * BLOCK + 3)]
    driver.fill_pool("a", tokens)
    driver.add("b", tokens, max_tokens=2)
    driver.run(["b"])
    assert driver.cached_tokens("b") == 2 * BLOCK
