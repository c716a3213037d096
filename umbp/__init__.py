"""umbp: a tiered KV-cache pool and vLLM connector.

vLLM loads the connector with ``kv_connector_module_path: "umbp"`` and class
``UMBPStoreConnector``. The connector is imported lazily so that ``umbp.core``
stays importable where vLLM and torch are not installed. Resolving it also runs
umbp's config-phase checks (``umbp.shell.config_phase``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["UMBPStoreConnector"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "UMBPStoreConnector":
        from umbp.shell.config_phase import on_connector_class_resolved
        from umbp.shell.connector import UMBPStoreConnector

        # vLLM resolves the class while it builds its config, before any engine
        # process starts: the earliest point umbp sees its options.
        on_connector_class_resolved()
        return UMBPStoreConnector
    raise AttributeError(f"module 'umbp' has no attribute {name!r}")
