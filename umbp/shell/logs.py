"""umbp's log records through vLLM's logging configuration.

vLLM configures only its own ``vllm`` logger (handler, format with process name
and pid, level from ``VLLM_LOGGING_LEVEL``); the ``umbp`` logger would otherwise
have no handler, so its INFO lines vanish and its warnings reach stderr through
Python's last-resort handler, bare. This hands every ``umbp`` record to the
``vllm`` logger's handlers *at emit time*, so a later reconfiguration of vLLM's
logging (``VLLM_LOGGING_CONFIG_PATH``, ``--log-config``) is followed too.
"""

from __future__ import annotations

import logging

UMBP = "umbp"
VLLM = "vllm"


class ToVllmHandlers(logging.Handler):
    """Forwards a record to whatever handlers the ``vllm`` logger has now."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger(VLLM)
        if vllm_logger.isEnabledFor(record.levelno):
            vllm_logger.handle(record)


def route_to_vllm_logging() -> bool:
    """Attach once, where vLLM configured its logging and nobody configured umbp's
    (an application that set up ``umbp`` itself keeps its own handlers). The umbp
    logger takes vLLM's level. Returns whether the route is in place."""
    umbp_logger = logging.getLogger(UMBP)
    if any(isinstance(handler, ToVllmHandlers) for handler in umbp_logger.handlers):
        return True
    vllm_logger = logging.getLogger(VLLM)
    if umbp_logger.handlers or not vllm_logger.handlers:
        return False
    umbp_logger.addHandler(ToVllmHandlers())
    umbp_logger.setLevel(vllm_logger.getEffectiveLevel())
    umbp_logger.propagate = False
    return True
