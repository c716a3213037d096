"""umbp's SGLang backend: its options follow core.config's rules, and it is a shell of
its own (it imports no part of vLLM's shell, vLLM's shell imports none of it). Runs
in the main venv: none of this needs SGLang."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from umbp.sglang.config import SGLANG_HOST_KEYS, parse_backend_config

REPO = Path(__file__).resolve().parents[2]
LOADER_KEYS = {"backend_name": "umbp_store", "module_path": "umbp.sglang.hicache_storage",
               "class_name": "UMBPHiCacheStore", "interface_v1": 1, "prefetch_threshold": 16}


def test_sglangs_own_keys_pass_and_store_options_are_validated() -> None:
    config = parse_backend_config({**LOADER_KEYS, "mode": "server", "endpoint": "/run/u.sock",
                                   "io_timeout_s": 2})
    assert (config.mode, config.endpoint, config.io_timeout_s) == ("server", "/run/u.sock", 2.0)
    assert set(LOADER_KEYS) <= SGLANG_HOST_KEYS


def test_defaults_to_an_embedded_pool() -> None:
    assert parse_backend_config(LOADER_KEYS).mode == "embedded"


def test_every_bad_entry_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as raised:
        parse_backend_config({**LOADER_KEYS, "capacity_byte": 1, "load_async": False,
                              "mode": "embedded", "endpoint": "/x", "page_bytes": 3})
    message = str(raised.value)
    assert "(4 problems)" in message
    assert "did you mean 'capacity_bytes'" in message
    assert "load_async configures vLLM's connector" in message
    assert "endpoint applies to mode 'server' only" in message
    assert "page_bytes" in message and "power of two" in message


@pytest.mark.parametrize("options, expected", [
    ({"mode": "server"}, "mode 'server' needs endpoint"),
    ({"mode": "mooncake"}, "mode 'mooncake' needs mooncake_master"),
    ({"mode": "mori"}, "--hicache-storage-backend umbp"),
    ({"mode": "disk"}, "valid values"),
    ({"namespace": "sglang.mine"}, "reserved for another serving stack"),
    ({"lookup_workers": 4}, "configures vLLM's connector"),
])
def test_a_bad_option_stops_the_start_with_a_sentence(options: dict[str, object],
                                                       expected: str) -> None:
    with pytest.raises(ValueError, match="hicache storage extra config") as raised:
        parse_backend_config({**LOADER_KEYS, **options})
    assert expected in str(raised.value)


def _imported_modules(package: Path) -> set[str]:
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


def test_the_two_shells_do_not_import_each_other() -> None:
    sglang_imports = _imported_modules(REPO / "umbp" / "sglang")
    shell_imports = _imported_modules(REPO / "umbp" / "shell")
    assert not {name for name in sglang_imports if name.startswith(("umbp.shell", "vllm"))}
    assert not {name for name in shell_imports if name.startswith(("umbp.sglang", "sglang"))}
    assert {"umbp.core.page_identity", "umbp.runtime.backends"} <= sglang_imports
