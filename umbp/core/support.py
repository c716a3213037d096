"""Which engine set-ups umbp serves, decided from plain values at engine start.

An unsupported set-up must stop the engine with a message that says what is
unsupported and what to change, rather than run and misbehave. One case is not
an error: when vLLM itself switched prefix caching off for the model (MLA on a
CPU without AMX, a model vLLM does not prefix-cache), the user cannot switch it
back on, so umbp stays inactive with a warning and the engine serves as if umbp
were absent.

vLLM does not record whether the user or vLLM switched prefix caching off; the
shell tells the two apart by the model (``prefix_caching_possible``, see
``umbp.shell.vllm_compat.support_inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from returns.result import Failure, Result, Success

__all__ = [
    "Support",
    "SupportInputs",
    "check_support",
]


@dataclass(frozen=True, slots=True)
class SupportInputs:
    """What the decision needs, read from vLLM's configuration by the shell."""

    pipeline_parallel_size: int
    prefix_caching_enabled: bool
    # False when vLLM switches prefix caching off for this model on this platform
    # whatever the user asks for; the reason, for the log line.
    prefix_caching_possible: bool = True
    prefix_caching_off_reason: str = ""


@dataclass(frozen=True, slots=True)
class Support:
    """umbp runs (``active``) or stays out of the way with a ``warning``."""

    active: bool
    warning: str | None = None


ACTIVE = Support(active=True)


def check_support(inputs: SupportInputs) -> Result[Support, str]:
    """``Success(Support)`` for a set-up umbp serves or steps aside for;
    ``Failure(message)`` naming what is unsupported and what to change."""
    if inputs.pipeline_parallel_size > 1:
        return Failure(
            f"umbp does not support pipeline parallelism (pipeline_parallel_size="
            f"{inputs.pipeline_parallel_size}): set pipeline_parallel_size=1 (tensor "
            f"parallelism is supported) or remove the umbp kv_transfer_config"
        )
    if inputs.prefix_caching_enabled:
        return Success(ACTIVE)
    if not inputs.prefix_caching_possible:
        reason = f" ({inputs.prefix_caching_off_reason})" if inputs.prefix_caching_off_reason else ""
        return Success(Support(
            active=False,
            warning=f"umbp disabled: prefix caching is off for this model{reason}; "
            "umbp neither looks up nor stores, the engine serves without it",
        ))
    return Failure(
        "umbp needs vLLM's prefix caching (it keys stored KV blocks by vLLM's block "
        "hashes), but enable_prefix_caching is False: enable prefix caching "
        "(enable_prefix_caching=True, or --enable-prefix-caching) or remove the umbp "
        "kv_transfer_config"
    )
