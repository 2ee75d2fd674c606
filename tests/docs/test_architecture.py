"""docs/architecture.md stays true to the code: its module map names every module of the
package and no module that is gone, and its table of the seam names every member of
``WorkerBackend``."""

from __future__ import annotations

import re
from pathlib import Path

from aioload._backends.base import WorkerBackend

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "aioload"


def _section(title: str) -> str:
    text = PAGE.read_text()
    match = re.search(rf"^## {re.escape(title)}\b.*?\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/architecture.md has no section {title!r}"
    return match.group(1)


def test_the_module_map_names_every_module() -> None:
    mapped = set(re.findall(r"^\| `([\w/]+\.py)` \|", _section("Module map"), re.M))
    modules = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        # A sub-package's __init__.py only says what the folder holds (the page says so).
        if not (path.name == "__init__.py" and path.parent != PACKAGE)
    }
    assert sorted(modules - mapped) == [], "modules missing from the module map"
    assert sorted(mapped - modules) == [], "the module map names modules that do not exist"


def test_the_seam_table_names_every_member() -> None:
    table = _section("The seam")
    documented = set(re.findall(r"^\| `(\w+)", table, re.M))
    members = {
        name
        for name in [*vars(WorkerBackend), *WorkerBackend.__annotations__]
        if not name.startswith("_")
    }
    assert sorted(members - documented) == [], "WorkerBackend members missing from the seam"
    assert sorted(documented - members) == [], "the seam table names members that are gone"
