"""The backend's options: SGLang's extra config minus SGLang's own keys, validated by
umbp.core's rules (every bad entry at once, unknown keys an error)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from returns.result import Failure

from umbp.core.config import ConnectorConfig, format_config_errors
from umbp.core.page_identity import SGLANG_STACK
from umbp.core.stack_config import parse_stack_store_config

__all__ = ["SGLANG_HOST_KEYS", "SGLANG_MODES", "parse_backend_config"]

# Keys of --hicache-storage-backend-extra-config that SGLang itself reads (the dynamic
# loader's three, the interface switches, prefetch knobs); they are SGLang's, not ours.
SGLANG_HOST_KEYS: Final = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "interface_v2",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size",
})
SGLANG_MODES: Final = ("embedded", "server", "mooncake")
_REFUSED_MODES: Final = {
    "mori": "mode 'mori' is not offered for SGLang: SGLang ships AMD MORI's UMBP as its "
    "own storage backend (--hicache-storage-backend umbp); use that, or mode 'server' "
    "or 'mooncake'",
}


def parse_backend_config(extra: Mapping[str, object]) -> ConnectorConfig:
    """The validated options; raises ValueError naming every bad entry (SGLang then
    fails the engine's start with it)."""
    parsed = parse_stack_store_config(
        extra, stack="SGLang", host_keys=SGLANG_HOST_KEYS, modes=SGLANG_MODES,
        refused_modes=_REFUSED_MODES,
    )
    if isinstance(parsed, Failure):
        message = format_config_errors(parsed.failure()).replace(
            "kv_connector_extra_config", f"{SGLANG_STACK} hicache storage extra config"
        )
        raise ValueError(message)  # noqa: TRY004 - a Result
    return parsed.unwrap()
