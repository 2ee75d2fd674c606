"""The user pages read as a manual: no word about how the project is run, and no dated
measurement outside the benchmark report.

README.md and every page under docs/ are searched for phrases that speak of issues, rounds of
work, sessions, who edited what, or when something was done, and for dates, clock times and
commit hashes, which belong to a benchmark run's report (docs/benchmarks.md, written by
``make bench``, and the other docs/benchmarks-NAME.md reports) and nowhere else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# The benchmark reports (docs/benchmarks.md, and any docs/benchmarks-NAME.md a benchmark
# writes) state when and at which commit their run was made.
# The benchmark pages, and the notes behind them, where dated measurements belong.
DATED_PAGES = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("benchmark*.md")}

PROJECT_WORDS = [
    r"\bissues? #?\d+",
    r"\bissue #\d+",
    r"\b(this|that|the previous|the next|a later|an earlier|the last) round\b",
    r"\bround (before|of its own)\b",
    r"\bthis session\b",
    r"\bsession's\b",
    r"\bthis (release|change|commit|branch|PR)\b",
    r"\bbefore this change\b",
    r"\bpeople edit",
    r"\bwho (edited|wrote|changed)\b",
    r"\bcoordinator\b",
    r"\b(the|a|our) (design )?brief\b",
    r"\bshared/design\.md\b",
    r"\blater that (night|day)\b",
    r"\btonight\b",
    r"\byesterday\b",
    r"\btoday('s)?\b",
    r"\bnot kept\b",
    r"\bnot done yet\b",
    r"\bfor now\b",
]
DATED = [
    r"\b20\d\d-\d\d-\d\d\b",  # a date
    r"\b\d\d:\d\d(-\d\d:\d\d)? UTC\b",  # a clock time
    r"\b(at|against|is|before|after) [0-9a-f]{7,10}\b",  # a commit hash
    r"\(git [0-9a-f]{7,10}\)",
]


def _findings(page: Path, patterns: list[str]) -> list[str]:
    found = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for pattern in patterns:
            match = re.search(pattern, line, re.IGNORECASE)
            if match:
                found.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line!r}")
    return found


# Pages with known findings still to fix, and what they are: each is expected to fail until it
# is fixed (not strictly, so the fix passes). Empty this as they are fixed.
STILL_TO_FIX: dict[str, str] = {}


def _param(page: Path) -> object:
    name = str(page.relative_to(ROOT))
    if name in STILL_TO_FIX:
        return pytest.param(page, marks=pytest.mark.xfail(reason=STILL_TO_FIX[name]), id=name)
    return pytest.param(page, id=name)


@pytest.mark.parametrize("page", [_param(p) for p in PAGES])
def test_no_word_about_how_the_project_is_run(page: Path) -> None:
    found = _findings(page, PROJECT_WORDS)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if str(p.relative_to(ROOT)) not in DATED_PAGES],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_dated_measurement_outside_the_benchmark_report(page: Path) -> None:
    found = _findings(page, DATED)
    # The short table of ratios on README.md and index.md is the report's (written by `make
    # bench` between its markers), and says when and at which commit its run was made.
    begin, end = "<!-- bench-summary:begin", "<!-- bench-summary:end -->"
    text = page.read_text()
    if begin in text:
        head = text.split(begin, 1)[0].count("\n") + 1
        tail = head + text.split(begin, 1)[1].split(end, 1)[0].count("\n")
        found = [f for f in found if not head <= int(f.split(":")[1]) <= tail]
    assert not found, "\n".join(found)


def test_the_short_tables_say_when_and_where_they_were_measured() -> None:
    for name in ("README.md", "docs/index.md"):
        text = (ROOT / name).read_text()
        block = text.split("<!-- bench-summary:begin", 1)[1].split("<!-- bench-summary:end", 1)[0]
        assert re.search(r"on 20\d\d-\d\d-\d\d at commit [0-9a-f]{7,}", block), name
        assert re.search(r"\d+-core machine \(", block), name


def test_the_patterns_catch_what_they_are_for() -> None:
    # Guards the patterns themselves: each phrase the pages once had is caught, and ordinary
    # technical words are not.
    caught = [
        "what falls short of issue 17's targets",
        "but this round six people edit these files at once",
        "Later that night, the floor ran faster",
        "### Added in this release",
        "today's behaviour",
        "Not kept.",
    ]
    for line in caught:
        assert any(re.search(p, line, re.IGNORECASE) for p in PROJECT_WORDS), line
    dated = ["make bench at 48495c1 (06:08 UTC)", "(2026-11-25, 03:50-03:57 UTC)"]
    for line in dated:
        assert any(re.search(p, line, re.IGNORECASE) for p in DATED), line
    fine = [
        "tasks go round robin over the active workers",
        "medians of alternating rounds",
        "uses the Ray session already initialized",
        "the issue of a copy on the same stream",
        "`--rounds 3`",
    ]
    for line in fine:
        assert not any(re.search(p, line, re.IGNORECASE) for p in PROJECT_WORDS + DATED), line
