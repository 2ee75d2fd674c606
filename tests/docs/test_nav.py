"""Every page is reachable: each docs/*.md is in mkdocs.yml's nav, and the home page links to
every other page of the nav. README.md links to the guides a newcomer needs first."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    return re.findall(r":\s*([\w-]+\.md)\s*$", nav, re.M)


def test_every_page_is_in_the_nav() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    nav = _nav_pages()
    assert len(nav) >= 10, "the nav was not found"
    assert pages == set(nav), f"not in the nav: {pages - set(nav)}; missing: {set(nav) - pages}"


def test_the_home_page_links_every_page() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", index))
    missing = [page for page in _nav_pages() if page != "index.md" and page not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


def test_the_readme_links_the_first_guides() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in ("quickstart.md", "tuning.md", "limitations.md", "errors.md", "migrating.md"):
        assert f"(docs/{page}" in readme, page
