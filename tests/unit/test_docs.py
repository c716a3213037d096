"""The documents a user relies on stay true to the code."""

from __future__ import annotations

from pathlib import Path

from umbp.core.config import OPTION_NAMES

REPO = Path(__file__).resolve().parents[2]


def test_configuration_reference_documents_every_option() -> None:
    reference = (REPO / "docs" / "configuration.md").read_text()
    missing = [name for name in OPTION_NAMES if f"`{name}`" not in reference]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_readme_first_screen_gives_the_demo_and_test_commands() -> None:
    first_screen = "\n".join((REPO / "README.md").read_text().splitlines()[:12])
    assert "make demo" in first_screen and "make test" in first_screen
    makefile = (REPO / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile


def test_ci_runs_the_readme_test_command() -> None:
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_model_support_matrix_names_only_tests_that_exist() -> None:
    import re

    matrix = (REPO / "docs" / "models.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", matrix)
    assert named, "docs/models.md names no tests"
    for path, test in named:
        source = (REPO / path).read_text()
        assert f"def {test}(" in source, f"docs/models.md names a missing test {path}::{test}"


def test_documents_cited_in_the_source_exist() -> None:
    """A citation such as ``docs/backends.md`` in a module, test or benchmark
    names a file of this repository (the source once cited a page it lacked)."""
    import re

    cited: dict[str, list[str]] = {}
    for folder in ("umbp", "tests", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            for name in re.findall(r"\bdocs/[\w.-]+\.md\b", path.read_text()):
                cited.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert "docs/backends.md" in cited, "the scan must see the source's citations"
    missing = {name: paths for name, paths in cited.items() if not (REPO / name).is_file()}
    assert not missing, f"cited documents that do not exist: {missing}"
