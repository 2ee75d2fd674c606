"""The built docs site reads well at 1400 px: each page, opened from disk in headless Chromium,
neither scrolls sideways nor has a table or code block that does, and shows its plots at a
width where their text is legible (tools/check_site.py). Skipped where Chromium is not
installed (Debian: `apt-get install chromium`).

``make test`` builds the site once, strictly (its ``docs`` step), and names it here with
``AIOLOAD_BUILT_SITE``: the test then checks that build instead of making its own, the same
``mkdocs build --strict`` of the same checkout (seconds on the 2-core machine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import check_site  # noqa: E402


@pytest.mark.timeout(600)
def test_every_page_fits_in_1400_px(tmp_path: Path) -> None:
    if check_site.find_chromium() is None:
        pytest.skip("no Chromium to open the pages in (apt-get install chromium)")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.skip("mkdocs is not installed (the docs extra)")
    site = _built_site(mkdocs, tmp_path / "site")
    # What `python tools/check_site.py --site SITE --width 1400` checks, two pages at a time:
    # each page is a Chromium of its own (its own profile), most of whose time is its start.
    chromium = check_site.find_chromium()
    assert chromium is not None
    with ThreadPoolExecutor(max_workers=2) as pool:
        reports = list(
            pool.map(
                lambda page: check_site.check_page(chromium, site, page, 1400, 900, None),
                check_site.pages(site),
            )
        )
    assert reports, "no pages were built"
    failed = [line for report in reports if not report.ok for line in report.lines()]
    assert not failed, "\n".join(failed)
    # Search works from disk: its index as a script (the offline plugin), and nothing loaded
    # from the network (the WebWorker shim it would take from unpkg.com is vendored).
    assert (site / "search" / "search_index.js").exists(), "search does not work from disk"
    remote = [
        f"{page.name}: {tag}"
        for page in check_site.pages(site)
        for tag in re.findall(r"<script[^>]+src=\"https?://[^\"]+\"", page.read_text())
    ]
    assert not remote, f"scripts loaded from the network: {remote}"


def _built_site(mkdocs: Path, into: Path) -> Path:
    """The site ``make test`` built (``AIOLOAD_BUILT_SITE``), or a strict build into ``into``."""
    built = os.environ.get("AIOLOAD_BUILT_SITE")
    if built:
        site = (ROOT / built).resolve()
        assert (site / "index.html").is_file(), f"AIOLOAD_BUILT_SITE={built}: no site there"
        return site
    subprocess.run(
        [str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(into)],
        cwd=ROOT,
        check=True,
        timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    return into
