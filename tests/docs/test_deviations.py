"""docs/migrating.md's list of deliberate deviations is the conformance suite's: each test in
tests/conformance/ marked ``DEVIATION (name)`` is on the page as ``**name** (`file.py`)``, and
the page lists no deviation the suite does not mark."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _marked() -> set[tuple[str, str]]:
    found = set()
    for path in sorted((ROOT / "tests" / "conformance").glob("test_*.py")):
        for name in re.findall(r"DEVIATION \(([\w-]+)\)", path.read_text()):
            found.add((name, path.name))
    return found


def _listed() -> set[tuple[str, str]]:
    page = (ROOT / "docs" / "migrating.md").read_text()
    section = page.split("## Deliberate deviations", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- \*\*([\w-]+)\*\* \(`(test_\w+\.py)`\)", section, re.M))


def test_the_page_lists_the_suites_deviations() -> None:
    marked = _marked()
    assert len(marked) >= 5, "the conformance suite's markers were not found"
    listed = _listed()
    assert listed == marked, (
        f"marked in tests/conformance but not on docs/migrating.md: {sorted(marked - listed)}; "
        f"on the page but not marked: {sorted(listed - marked)}"
    )
