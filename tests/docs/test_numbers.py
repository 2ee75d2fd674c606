"""One set of numbers: the benchmark figures on README.md, docs/index.md and docs/benchmarks.md
are what the benchmark's report code writes from the one run in docs/benchmarks.json, not
figures typed by hand. (After a change to the report code, `python -m benchmarks --from-json
docs/benchmarks.json` writes them again.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_page_shows_the_committed_runs_figures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import report

    (tmp_path / "docs").mkdir()
    for name in ("README.md", "docs/index.md", "docs/benchmarks.md", "docs/benchmarks.json"):
        shutil.copy(ROOT / name, tmp_path / name)
    meta, rows, runs = report.load_json(tmp_path / "docs" / "benchmarks.json")
    written = report.write_all(tmp_path / "docs", meta, rows, runs, from_json=True)
    assert {p.name for p in written} >= {"benchmarks.md", "README.md", "index.md"}
    for name in ("README.md", "docs/index.md", "docs/benchmarks.md"):
        assert (tmp_path / name).read_text() == (ROOT / name).read_text(), (
            f"{name} does not show the figures of docs/benchmarks.json: run "
            "`python -m benchmarks --from-json docs/benchmarks.json`"
        )


def test_the_short_tables_are_in_place() -> None:
    from benchmarks import report

    for name in report.SUMMARY_PAGES:
        text = (ROOT / name).read_text()
        assert report.SUMMARY_BEGIN in text and report.SUMMARY_END in text, name
        block = text.split(report.SUMMARY_BEGIN, 1)[1].split(report.SUMMARY_END, 1)[0]
        assert "| workload |" in block and "x |" in block, name
