"""Figures the benchmark notes quote from a committed run are that run's: the table of what
``seed_per_sample`` costs is docs/seeding.json (``python -m benchmarks.seeding --json``), and the
per-sample differences worked out beside it follow from the table."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "docs" / "benchmark-notes.md"


def _seeding_block() -> str:
    text = NOTES.read_text()
    begin, end = "<!-- seeding:begin", "<!-- seeding:end -->"
    assert begin in text and end in text, "the seeding table's markers are gone"
    return text.split(begin, 1)[1].split(end, 1)[0]


def _number(cell: str) -> float:
    return float(cell.replace(",", "").replace("µs", "").rstrip("x").strip())


def test_the_seeding_table_is_the_committed_run() -> None:
    run = json.loads((ROOT / "docs" / "seeding.json").read_text())
    rows = {}
    for line in _seeding_block().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    assert set(rows) == {"scalars", "crops"}, rows
    for name, (off, on, ratio) in rows.items():
        assert _number(off) == run[name]["samples_per_s_off"], name
        assert _number(on) == run[name]["samples_per_s_on"], name
        assert abs(_number(ratio) - run[name]["on_over_off"]) < 0.006, name
    seeding = re.search(r"seeding alone, per sample \| \| ([\d.]+) µs", _seeding_block())
    assert seeding and float(seeding.group(1)) == run["seeding_us_per_sample"]


def test_the_worked_differences_follow_from_the_table() -> None:
    text = NOTES.read_text()
    worked = re.findall(r"2/([\d,]+) - 2/([\d,]+) s = ([\d.]+) µs", text)
    assert len(worked) == 2, worked
    for on, off, difference in worked:
        expected = (2 / _number(on) - 2 / _number(off)) * 1e6
        assert f"{expected:.1f}" == difference, (on, off, difference)


def test_the_soak_note_is_the_committed_soak_run() -> None:
    # reliability.md's "How this is tested" note under Soak quotes docs/soak.json (`make soak`).
    run = json.loads((ROOT / "docs" / "soak.json").read_text())
    page = " ".join((ROOT / "docs" / "reliability.md").read_text().split())
    for row in ("start", "end"):
        counts = run[row]
        cells = f"| {row} | {counts['processes']} | {counts['fds']} | {counts['threads']} | "
        assert cells + f"{counts['dev_shm_entries']} |" in page, row
    activity = run["activity"]
    said = (
        f"{run['loaders']:,} loaders in {run['seconds']} s: {activity['sync']} sync and "
        f"{activity['async']} async passes, {activity['batches']:,} batches, "
        f"{activity['killed']} with a worker killed ({activity['healed']} of them healing), "
        f"{activity['persistent']} persistent"
    )
    assert said in page, said
