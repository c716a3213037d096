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


def _recipe(makefile: str, target: str) -> str:
    """A target's prerequisites and recipe: from its line to the next blank line."""
    return makefile.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]


def test_make_test_runs_them_against_vllm_033() -> None:
    makefile = (REPO / "Makefile").read_text()
    test = _recipe(makefile, "test")
    # `make test` runs the 0.33 leg itself or through its own target (beside SGLang's).
    leg = test if "$(VLLM033_ENV)" in test else _recipe(makefile, "test-vllm033")
    assert re.search(r"\$\(MAKE\)[^\n]*\btest-vllm033\b", test) or leg is test
    assert "$(VLLM033_ENV)" in leg and "-m vllm_versions" in leg
    assert "UMBP_EXPECT_VLLM=$(VLLM033)" in makefile and "VLLM033 := 0.33.0" in makefile
