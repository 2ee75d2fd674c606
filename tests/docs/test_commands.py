"""The commands the pages tell a reader to run exist: every ``python -m MODULE`` names a module
that Python finds (from the repository root, as the pages run them), and every ``make TARGET``
a target of the Makefile. A renamed module or target fails here, not in a reader's shell."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODULE = re.compile(r"python -m ([A-Za-z_][\w.]*)")
# `make TARGET` in code, where a page tells the reader to type it (not prose such as "make the").
TARGET = re.compile(r"(?:`|^\s*)make ([a-z][\w-]*)", re.M)


def _commands(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return sorted(
        {
            (str(page.relative_to(ROOT)), name)
            for page in PAGES
            for name in pattern.findall(page.read_text())
        }
    )


def _module_exists(name: str) -> bool:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package that does not exist
        return False


def test_the_patterns_find_the_commands() -> None:
    # Guards the patterns: the pages do name modules and targets.
    assert ("README.md", "run") in _commands(TARGET)
    assert any(name == "benchmarks" for _, name in _commands(MODULE))
    assert not _module_exists("aioload.bench.sweep")
    assert TARGET.findall("and `make the docs` and make sense") == ["the"]


@pytest.mark.parametrize(("page", "module"), _commands(MODULE))
def test_every_python_m_module_exists(page: str, module: str) -> None:
    if module in ("pip", "build", "venv", "pytest", "mypy"):
        return
    assert _module_exists(module), (
        f"{page} tells readers to run `python -m {module}`, which does not exist"
    )


def test_every_make_target_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    missing = [(page, t) for page, t in _commands(TARGET) if t not in targets]
    assert not missing, f"make targets the pages name that the Makefile lacks: {missing}"


def test_every_test_file_a_page_cites_exists() -> None:
    cited = sorted(
        {
            (str(page.relative_to(ROOT)), path)
            for page in PAGES
            for path in re.findall(r"\b(tests/[\w/]+\.py)", page.read_text())
        }
    )
    assert cited, "no page cites a test file (the pattern is broken)"
    missing = [(page, path) for page, path in cited if not (ROOT / path).exists()]
    assert not missing, f"pages cite test files that do not exist: {missing}"


def test_every_script_and_source_file_a_page_names_exists() -> None:
    # `python examples/quickstart.py`, `tools/check_site.py`, `_wire/slabs.py` (a module of
    # the package, named from inside it): a renamed file fails here, not in a reader's shell.
    named = sorted(
        {
            (str(page.relative_to(ROOT)), path)
            for page in PAGES
            for path in re.findall(
                r"(?<![\w/.:-])([A-Za-z_][\w.-]*/[\w/.-]+\.py)\b", page.read_text()
            )
            if "NAME" not in path
        }
    )
    assert len(named) >= 10, named  # the pattern finds them
    missing = [
        (page, path)
        for page, path in named
        if not (ROOT / path).exists() and not (ROOT / "aioload" / path).exists()
    ]
    assert not missing, f"pages name files that do not exist: {missing}"
    assert ("README.md", "examples/train_images.py") in named
