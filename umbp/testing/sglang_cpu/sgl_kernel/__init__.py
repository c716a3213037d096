"""TEST-ONLY import stand-in for ``sgl_kernel`` (CUDA-only wheels) on CPU machines.

SGLang's CPU path imports a few ``*_cpu`` helpers from it at module load; none is
called on a CPU without AMX. Any name resolves to a function that raises, so a call
that does happen fails loudly instead of computing something wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"sgl_kernel.{name} is not available: umbp's CPU test "
                           "stand-in only lets SGLang import on CPU")

    unavailable.__name__ = name
    return unavailable
