"""umbp.core stays pure: importable without vLLM, torch or numpy, and its source
imports nothing but the standard library, pyrsistent, returns and umbp.core.

Modules are found by listing ``umbp/core``, so a new module is covered the day it
is added.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "umbp" / "core"
BLOCKED = ("vllm", "torch", "numpy")
ALLOWED_THIRD_PARTY = frozenset({"pyrsistent", "returns"})
# Standard-library modules that mean I/O, clocks, threads, randomness or logging.
SIDE_EFFECT_MODULES = frozenset(
    {
        "asyncio",
        "concurrent",
        "datetime",
        "io",
        "logging",
        "multiprocessing",
        "os",
        "pathlib",
        "random",
        "sched",
        "secrets",
        "selectors",
        "shutil",
        "signal",
        "socket",
        "subprocess",
        "tempfile",
        "threading",
        "_thread",
        "time",
        "urllib",
        "warnings",
    }
)
SIDE_EFFECT_BUILTINS = frozenset({"open", "print", "input", "exec", "eval", "__import__"})


def core_module_files() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def core_module_names() -> list[str]:
    names = []
    for path in core_module_files():
        parts = path.relative_to(CORE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(("umbp", "core", *parts)))
    return names


PROBE = """
import importlib, json, sys, traceback
blocked = {blocked!r}

class BlockHeavyDependencies:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ImportError(f"{{name}} is blocked: umbp.core must not import it")
        return None

sys.meta_path.insert(0, BlockHeavyDependencies())
for name in blocked:
    sys.modules[name] = None
sys.path.insert(0, {repo!r})
failures = {{}}
for module in {modules!r}:
    try:
        importlib.import_module(module)
    except BaseException:
        failures[module] = traceback.format_exc()
print(json.dumps(failures))
"""


def test_every_core_module_imports_without_vllm_torch_or_numpy() -> None:
    modules = core_module_names()
    assert "umbp.core" in modules and len(modules) > 1
    probe = PROBE.format(blocked=BLOCKED, repo=str(REPO), modules=modules)
    completed = subprocess.run(
        [sys.executable, "-I", "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    failures = json.loads(completed.stdout.strip().splitlines()[-1])
    assert failures == {}, "\n".join(f"{name}:\n{trace}" for name, trace in failures.items())


def _imported_roots(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import; relative imports resolve inside umbp.core."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                found.append((node.lineno, "umbp.core." + (node.module or "")))
            elif node.level > 1:
                found.append((node.lineno, "." * node.level + (node.module or "")))
            else:
                found.append((node.lineno, node.module or ""))
    return found


def _is_allowed(module: str) -> bool:
    root = module.partition(".")[0]
    if module == "umbp.core" or module.startswith("umbp.core."):
        return True
    if root in ALLOWED_THIRD_PARTY:
        return True
    return root in sys.stdlib_module_names and root not in SIDE_EFFECT_MODULES


def _module_id(path: Path) -> str:
    return str(path.relative_to(CORE))


@pytest.mark.parametrize("path", core_module_files(), ids=_module_id)
def test_core_source_imports_only_stdlib_pyrsistent_returns_and_core(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [
        f"line {line}: {module}"
        for line, module in _imported_roots(tree)
        if not _is_allowed(module)
    ]
    assert not bad, f"{path.name} imports outside the pure core: {bad}"


@pytest.mark.parametrize("path", core_module_files(), ids=_module_id)
def test_core_source_calls_no_io_builtins(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [
        f"line {node.lineno}: {node.func.id}()"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in SIDE_EFFECT_BUILTINS
    ]
    assert not bad, f"{path.name} calls side-effecting builtins: {bad}"


def test_the_import_check_itself_rejects_heavy_and_side_effect_imports() -> None:
    tree = ast.parse(
        "import torch\nfrom vllm.config import X\nimport logging\nfrom .. import shell\n"
    )
    assert [module for _, module in _imported_roots(tree) if not _is_allowed(module)] == [
        "torch",
        "vllm.config",
        "logging",
        "..",
    ]
    assert _is_allowed("collections.abc") and _is_allowed("returns.result")
    assert _is_allowed("umbp.core.identity") and not _is_allowed("umbp.shell.worker")


def test_every_core_module_declares_its_public_names() -> None:
    import importlib

    missing = [
        name for name in core_module_names()
        if getattr(importlib.import_module(name), "__all__", None) is None
    ]
    assert not missing, f"core modules without __all__: {missing}"


def test_the_core_api_is_explicit_and_documented() -> None:
    """``umbp.core`` names its public API one by one (no star import), each name is
    the object of the module that defines it, and docs/design.md's section on the
    core's public API names every one of them."""
    import importlib

    package = importlib.import_module("umbp.core")
    source = (CORE / "__init__.py").read_text()
    assert "import *" not in source
    for name in package.__all__:
        value = getattr(package, name)
        home = getattr(value, "__module__", None)
        if home is not None and home.startswith("umbp.core.") and not isinstance(value, int):
            assert getattr(importlib.import_module(home), name, value) is value, name
    design = (REPO / "docs" / "design.md").read_text()
    section = design.split("## The core's public API", 1)
    assert len(section) == 2, "docs/design.md has no section on the core's public API"
    undocumented = [name for name in package.__all__ if f"`{name}`" not in section[1]]
    assert not undocumented, f"docs/design.md does not document {undocumented}"


def test_every_core_module_imports_first_in_a_fresh_interpreter() -> None:
    """No import cycle depends on which core module a caller imports first."""
    probe = (
        "import importlib, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "failures = []\n"
        f"for name in {core_module_names()!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'umbp.core' or m.startswith('umbp.core.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as error:\n"
        "        failures.append(f'{name}: {error!r}')\n"
        "print(failures)\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert completed.stdout.strip() == "[]", completed.stdout + completed.stderr
