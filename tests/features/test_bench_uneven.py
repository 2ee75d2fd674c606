"""``python -m benchmarks.uneven`` and ``python -m benchmarks.cores`` (``make bench``,
``make bench-cores``): their workload, their tables, and their sections of
docs/benchmarks.md, which a run of ``make bench`` keeps."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import pytest

from benchmarks import cores, report, uneven

pytestmark = pytest.mark.no_local_workers("the benchmarks run in processes of their own")


def test_the_sleep_times_have_the_mean_and_spread_asked_for() -> None:
    even = uneven.sleep_times(200, 0.0, 0.010)
    assert even == [0.010] * 200 or max(abs(t - 0.010) for t in even) < 1e-12
    spread = uneven.sleep_times(2000, 1.0, 0.010, seed=3)
    assert abs(statistics.fmean(spread) - 0.010) < 1e-9
    # A lognormal of sigma 1: the median is well below the mean, the slowest far above it.
    assert statistics.median(spread) < 0.008 and max(spread) > 0.05
    assert uneven.sleep_times(50, 1.0, 0.010, seed=3) == uneven.sleep_times(50, 1.0, 0.010, seed=3)


def test_the_warmup_sampler_makes_the_first_pass_short() -> None:
    sampler = uneven.WarmupSampler(10, 3)
    assert list(sampler) == [0, 1, 2] and list(sampler) == list(range(10)) and len(sampler) == 10


def _uneven_result() -> dict[str, object]:
    rows = []
    for sigma in (0.0, 1.0):
        for loader, in_order, seed_per_sample in uneven.LOADERS:
            share = 0.9 if loader == "aioload" else 0.4
            rows.append(
                {
                    "sigma": sigma,
                    "workers": 8,
                    "loader": loader,
                    "in_order": in_order,
                    "seed_per_sample": seed_per_sample,
                    "share": share,
                    "busy_share": 0.95 if loader == "aioload" else None,
                    "waiting_in_order_mean": 3.0 if loader == "aioload" else None,
                }
            )
    return {
        "command": "python -m benchmarks.uneven",
        "per_worker": 300,
        "mean_ms": 10.0,
        "rounds": 3,
        "cores": 2,
        "rows": rows,
    }


def test_the_uneven_section_is_written_in_place_and_kept_by_make_bench(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n\n" + uneven.BEGIN + "\nOLD\n" + uneven.END + "\n\nafter\n")
    uneven.write_docs(page, _uneven_result())
    text = page.read_text()
    assert "OLD" not in text and text.endswith("after\n")
    assert "| 1 | 8 | 84% | 90% | 90% | 90% | 40% (40%) | 95%, 3.0 |" in text
    # make bench rewrites the page around it, and keeps it.
    kept = report.keep_section(text, "# B, regenerated\n", report.UNEVEN_BEGIN, report.UNEVEN_END)
    assert "| 1 | 8 | 84% | 90% |" in kept and kept.rstrip().endswith(uneven.END)


def test_the_quick_grids_are_small() -> None:
    args = uneven.parse_args(["--quick"])
    assert args.rounds == 1 and args.workers == [2, 8] and args.sigmas == [0.0, 1.0]
    assert len(uneven.grid(args)) == 2 * 2 * len(uneven.LOADERS)
    full = uneven.parse_args([])
    assert full.workers == [2, 8, 14] and full.sigmas == [0.0, 0.5, 1.0] and full.rounds == 3
    assert cores.parse_args(["--quick"]).workers == [2, 4]
    assert cores.parse_args([]).workers == [2, 4, 8, 14]


def test_the_cores_table_puts_each_loader_against_its_floor(tmp_path: Path) -> None:
    rows = [
        {"workload": "tiny", "workers": 8, "loader": "floor", "items_per_s": 1000.0},
        {
            "workload": "tiny",
            "workers": 8,
            "loader": "aioload",
            "items_per_s": 900.0,
            "busy_share": 0.8,
            "busy_min": 0.7,
            "waiting_in_order_mean": 2.5,
        },
        {"workload": "tiny", "workers": 8, "loader": "unordered", "items_per_s": 950.0},
        {"workload": "tiny", "workers": 8, "loader": "torch", "items_per_s": 500.0},
        {"workload": "uneven (sigma=1)", "workers": 8, "loader": "aioload", "share": 0.88},
        {"workload": "uneven (sigma=1)", "workers": 8, "loader": "torch", "share": 0.4},
    ]
    result = {"command": "python -m benchmarks.cores", "cores": 16, "seconds": 200.0, "rows": rows}
    text = cores.table(result)
    assert "| tiny | 8 | 1,000 | 90% | 95% | 50% | 70%, 80% | 2.5 |" in text
    assert (
        "| uneven (sigma=1) | 8 | num_workers / mean sample time | 88% | - | 40% | -, - | - |"
        in text
    )
    page = tmp_path / "benchmarks.md"
    page.write_text("# B\n\n" + cores.BEGIN + "\nNot run yet\n" + cores.END + "\n")
    cores.write_docs(page, result)
    assert "Not run yet" not in page.read_text() and "On 16 cores" in page.read_text()
    with pytest.raises(SystemExit):
        cores.parse_args(["--loaders", "aioload,torch"])  # the floor sizes the others
    assert isinstance(cores.parse_args(["--no-write"]), argparse.Namespace)
