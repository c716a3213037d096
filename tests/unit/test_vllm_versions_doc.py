"""docs/vllm-versions.md names exactly the tests that run on both vLLM versions,
and `make test` runs them against 0.33."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = "pytestmark = pytest.mark." + "vllm_versions"


def test_the_doc_names_every_vllm_versions_test_file() -> None:
    doc = (REPO / "docs" / "vllm-versions.md").read_text()
    named = set(re.findall(r"^\| `(tests/[\w/]+\.py)`", doc, re.MULTILINE))
    marked = {
        str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
        if MARKER in path.read_text()
    }
    assert named == marked


def test_make_test_runs_them_against_vllm_033() -> None:
    makefile = (REPO / "Makefile").read_text()
    target = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "$(VLLM033_ENV)" in target and "-m vllm_versions" in target
    assert "UMBP_EXPECT_VLLM=$(VLLM033)" in makefile and "VLLM033 := 0.33.0" in makefile
