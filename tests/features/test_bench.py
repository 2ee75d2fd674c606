"""The benchmark harness runs end to end in a tiny mode. No timings are asserted: the bench
holds the performance claims; this only checks that it runs and prints what it promises."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import instructions, machine_profile, report, runner, startup, sweep, wakeups
from benchmarks.__main__ import main as bench_main

pytestmark = pytest.mark.no_local_workers("the benchmarks run in processes of their own")


def test_tiny_bench_prints_floors_and_targets(
    no_leaks: Iterator[None], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = bench_main(
        [
            "--workloads",
            "tiny",
            "--modes",
            "sync",
            "--scale",
            "0.002",
            "--min-seconds",
            "0.2",
            "--repeats",
            "1",
            "--startup-repeats",
            "1",
            "--import-repeats",
            "1",
            "--peers",
            "none",
            "--no-write",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "floor items/s" in out
    assert "parent CPU/batch" in out
    # Every target is printed with its figure and a verdict.
    for needle in (
        "tiny >= 2.5x torch (sync)",
        "tiny parent CPU per batch",
        "first batch from before `import aioload`",
        "a later epoch's first batch",
        "`import aioload` <= 10 ms",
        "tiny: peak RSS <= torch's",
    ):
        line = next((ln for ln in out.splitlines() if needle in ln), "")
        assert line.strip().startswith(("PASS", "FAIL")), (needle, out)


def test_the_startup_bench_prints_the_first_batch_at_each_worker_count(
    no_leaks: Iterator[None], capsys: pytest.CaptureFixture[str]
) -> None:
    # (One worker count: each takes three fresh processes, a second or more apiece. Judged on
    # nothing: a loaded test machine says nothing of the ratio; the verdict has tests below.)
    argv = ["--workers", "2", "--rounds", "1", "--batch-size", "4", "--max-ratio", "0"]
    assert startup.main(argv) == 0
    out = capsys.readouterr().out
    assert [ln[:4] for ln in out.splitlines() if "first batch, 2 workers" in ln] == ["----"] * 2
    rows = [ln for ln in out.splitlines() if ln.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["2"]
    for row in rows[1:]:
        # Two cells, each "<aioload for> ms / <aioload async for> ms / <torch> ms", from runs.
        cells = [cell.strip() for cell in row.split("|")[2:4]]
        for cell in cells:
            times = [float(part.removesuffix(" ms")) for part in cell.split(" / ")]
            assert len(times) == 3 and min(times) > 0, row


def _first_batches(
    figures: dict[tuple[str, str], list[float]],
) -> Callable[..., dict[str, Any]]:
    """benchmarks.startup.first_batch, answering from ``figures`` (seconds by loader and
    front, one a round) instead of a fresh process."""
    taken: dict[tuple[str, str], int] = {}

    def first_batch(loader: str, *args: Any, front: str = "sync", **kwargs: Any) -> dict[str, Any]:
        i = taken[loader, front] = taken.get((loader, front), -1) + 1
        value = figures[loader, front][i]
        return {"first_batch_s": value, "later_epoch_first_batch_s": value}

    return first_batch


@pytest.mark.parametrize(
    ("aioload_s", "expected_rc"), [([0.07, 0.09, 0.07], 0), ([0.07, 0.09, 0.09], 1)]
)
def test_the_startup_bench_fails_when_the_first_batch_is_over_08x_torchs(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    aioload_s: list[float],
    expected_rc: int,
) -> None:
    # torch's first batch 0.1 s each round: aioload's ratios 0.7, 0.9, 0.7 (median 0.7) under
    # for pass; 0.7, 0.9, 0.9 (median 0.9) fail. async for stays at 0.6 throughout.
    figures = {
        ("torch", "sync"): [0.1, 0.1, 0.1],
        ("aioload", "sync"): aioload_s,
        ("aioload", "async"): [0.06, 0.06, 0.06],
    }
    monkeypatch.setattr(startup, "first_batch", _first_batches(figures))
    monkeypatch.setattr(startup, "compile_package", lambda: None)
    assert startup.main(["--workers", "2", "--rounds", "3"]) == expected_rc
    captured = capsys.readouterr()
    lines = [ln for ln in captured.out.splitlines() if "first batch, 2 workers" in ln]
    assert lines[0].startswith("PASS") and "(async for) / torch: 0.60x" in lines[0]
    verdict = "PASS" if expected_rc == 0 else "FAIL"
    assert lines[1].startswith(verdict) and "(for) / torch: " in lines[1], lines
    assert ("FAIL: aioload's first batch is over 0.80x torch's" in captured.err) == bool(
        expected_rc
    )


def test_the_wakeups_bench_counts_each_fronts_wakeups(
    no_leaks: Iterator[None], capsys: pytest.CaptureFixture[str]
) -> None:
    assert wakeups.main(["--rounds", "1", "--batches", "60"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == [
        "for",
        "async for, asyncio",
        "async for, uvloop",
    ]
    for row in rows[1:]:
        per_batch, empty, cpu = (cell.strip() for cell in row.split("|")[2:5])
        # Every batch but those already in when asked for took a wait; some batch did.
        assert 0 < float(per_batch) <= 3 and 0 <= float(empty) <= float(per_batch), row
        assert float(cpu.removesuffix(" us")) > 0, row


def test_instruction_counts_become_the_models_figures() -> None:
    """Two runs' counts: per batch is their difference over the batches between them (start-up
    cancels), each of 2 workers did half the batches, and the 16-core figure is the parent's
    instructions at the floor's rate there (tiny: 3.5 us a sample)."""
    short = {"main": 5_000_000_000, "children": [4_000_000_000, 4_100_000_000]}
    long = {"main": 5_080_000_000, "children": [5_750_000_000, 5_850_000_000]}
    parent = instructions.per_batch(short, long, 100, 600)
    assert parent["main"] == 160_000
    assert parent["worker"] == [7_000_000, 7_000_000]
    floor = instructions.per_batch({"main": 10, "children": []}, {"main": 7_000_010}, 0, 1)
    assert floor == {"main": 7_000_000}
    figures = instructions.model_figures(160_000, [7_070_000], 7_000_000, "tiny")
    assert abs(figures["o_instructions"] - 0.01) < 1e-9
    # 7M instructions make 256 samples in 256 x 3.5 us: 160K take 160/7000 of that.
    assert abs(figures["parent_us_16"] - 160_000 / 7_000_000 * 256 * 3.5) < 1e-6


def test_targets_judge_the_figures() -> None:
    row = report.SummaryRow(
        workload="image",
        mode="sync",
        torch_ips=10.0,
        aioload_ips=90.0,
        ratio=9.0,
        target_ratio=4.0,
        torch_ttfb_s=0.1,
        aioload_ttfb_s=0.1,
        torch_rss_bytes=100.0,
        aioload_rss_bytes=101.0,
        torch_runs=1,
        aioload_runs=1,
        failures=0,
        max_epochs=1,
        floor_ips=100.0,
    )
    startup = {
        "image": {
            "torch_first_s": 0.2,
            "aioload_first_s": 0.1,
            "torch_later_s": 0.1,
            "aioload_later_s": 0.2,
            "torch_import_s": 0.0,
            "aioload_import_s": 0.001,
        }
    }
    found = {t.name: t.ok for t in report.targets([row], startup, None)}
    assert found["image >= 85% of its floor (sync)"] is True
    assert found["image: first batch from before `import aioload`, fresh process <= torch's"]
    assert not found["image: a later epoch's first batch, no persistent workers <= torch's"]
    assert found["image: peak RSS <= torch's"] is False
    assert math.isclose(row.pct_floor(row.aioload_ips), 0.9)


def _run(loader: str, ok: bool = True, items_per_s: float = 100.0) -> dict[str, object]:
    """One run's record, as `python -m benchmarks` keeps it (the fields summarize reads)."""
    return {
        "workload": "cpu",
        "loader": loader,
        "mode": "sync",
        "pair_mode": "sync",
        "ok": ok,
        "items_per_s": items_per_s if ok else math.nan,
        "ttfb_s": 0.1,
        "peak_tree_rss_bytes": 100.0,
        "epochs": 1,
        "parent_cpu_per_batch_s": 0.001,
    }


def test_a_peers_failed_run_is_shown_and_does_not_fail_the_bench() -> None:
    runs = [
        _run("floor", items_per_s=200.0),
        _run("torch"),
        _run("aioload", items_per_s=110.0),
        _run("torchdata", items_per_s=90.0),
        _run("torchdata", ok=False),
        _run("spdl", ok=False),
    ]
    rows = report.summarize(runs, ["cpu"], ["sync"])
    header, body = report.table_rows(rows)
    cells = dict(zip(header, body[0], strict=True))
    assert cells["torchdata items/s (% floor)"] == "90 (45%), 1 run(s) failed"
    assert cells["spdl items/s (% floor)"] == "failed"
    assert cells["notes"] == ""  # the notes count failed runs of ours only
    assert report.exit_status(runs, rows) == 0
    # A failed run of ours fails it: of aioload, torch or the floor.
    for loader in report.OURS:
        with_ours_failed = [*runs, _run(loader, ok=False)]
        rows = report.summarize(with_ours_failed, ["cpu"], ["sync"])
        assert report.exit_status(with_ours_failed, rows) == 1, loader


def test_sweep_section_is_replaced_in_place() -> None:
    block = report.SWEEP_BEGIN + "\nnew\n" + report.SWEEP_END
    text = "# B\n\nintro\n\n" + report.SWEEP_BEGIN + "\nold\n" + report.SWEEP_END + "\n\nafter\n"
    replaced = report.replace_block(text, block)
    assert "new" in replaced and "old" not in replaced and replaced.endswith("after\n")
    assert report.current_block(replaced) == block
    assert report.replace_block("# B\n", block).endswith(block + "\n")
    axes = {p["axis"] for p in sweep.points(quick=False)}
    assert axes == {"sample size", "batch size", "num_workers"}


def test_the_ray_section_is_kept_and_replaced_in_place(tmp_path: Path) -> None:
    from benchmarks import ray as bench_ray

    old = "# B\n\n" + report.RAY_BEGIN + "\n## Ray workers\nOLD-ROWS\n" + report.RAY_END + "\n"
    kept = report.keep_ray_section(old, "# B, regenerated\n")
    assert (
        kept.startswith("# B, regenerated\n")
        and "OLD-ROWS" in kept
        and kept.endswith(report.RAY_END + "\n")
    )
    assert report.keep_ray_section("# B\n", "new\n") == "new\n"
    page = tmp_path / "benchmarks.md"
    page.write_text(kept + "\nafter\n")
    rows = [
        bench_ray.Row(w, k, 32, 32 * 8, rate, 0.002, [rate])
        for w in ("cpu",)
        for k, rate in (("ray", 950.0), ("local", 1000.0), ("torch", 900.0))
    ]
    bench_ray._write_docs(rows, "", page)
    text = page.read_text()
    assert "OLD-ROWS" not in text and text.count("## Ray workers") == 1
    assert "| cpu (batch 32) | ray | 950 | 0.95x | 2.000 ms | 500 batches/s |" in text
    assert "**0.95x** (target >= 0.9x: PASS)" in text and text.endswith("after\n")


def test_torch_segments_of_a_runs_dead_workers_are_removed(tmp_path: Path) -> None:
    """What torch's workers left in /dev/shm when a run stopped them mid-batch goes; what
    belongs to a live process, or to a process that was not the run's, stays."""
    import os
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    gone = int(dead.stdout)
    names = [
        f"torch_{gone}_123_0",
        f"torch_{gone}_123_7",
        f"torch_{os.getpid()}_5_0",  # alive: the run is not over for it
        "torch_99999999_5_0",  # not the run's
        f"aioload_{gone}",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert runner.remove_torch_segments({gone, os.getpid()}, tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_machine_profile_sorts_perf_rows_into_categories() -> None:
    # Rows as `perf report --stdio --no-children -g none --sort comm,dso,sym` prints them.
    text = """\
# Samples: 8K of event 'cpu-clock'
#
    32.61%  python     libc.so.6                  [.] __memmove_avx512_unaligned_erms
    27.48%  python     libtorch_cpu.so            [.] c10::function_ref<void (char**, long const*, long, long)>::callback_fn<at::native::AVX2::direct_copy_kernel(at::TensorIteratorBase&)::{lambda()#3}>
     5.60%  swapper    [kernel.kallsyms]          [k] pv_native_safe_halt
     5.00%  python     libpython3.11.so.1.0       [.] _PyEval_EvalFrameDefault
     0.68%  python     [kernel.kallsyms]          [k] _raw_spin_unlock_irqrestore
     0.57%  python     libtorch_cpu.so            [.] c10::impl::OperatorEntry::lookup
     0.50%  python     libc.so.6                  [.] malloc
     0.20%  kdamond.0  [kernel.kallsyms]          [k] damon_rand
"""
    shares = machine_profile.parse_report(text)
    assert shares[machine_profile.STACK] == pytest.approx(32.61)
    assert shares[machine_profile.CLONE] == pytest.approx(27.48)
    assert shares[machine_profile.IDLE] == pytest.approx(5.60)
    assert shares[machine_profile.PYTHON] == pytest.approx(5.00)
    assert shares[machine_profile.KERNEL] == pytest.approx(0.88)
    assert shares[machine_profile.TORCH] == pytest.approx(0.57)
    assert shares[machine_profile.OTHER] == pytest.approx(0.50)
    # Every row counted once, the header lines none.
    assert sum(shares.values()) == pytest.approx(72.64)


def test_the_floor_models_inputs_are_cpu_times_of_the_workers(no_leaks: Iterator[None]) -> None:
    # The model of the floor share (benchmarks.auto --model) takes a worker's cost per sample
    # over the floor as a difference of CPU times: both runs must report theirs.
    from benchmarks.auto import _one_run

    floor = _one_run("tiny", "floor", 1, 0.2)
    one = _one_run("tiny", "aioload", 1, 0.2)
    for result in (floor, one):
        per_item = result["worker_cpu_per_item_s"]
        # A sample costs more than nothing and less than a millisecond of CPU on any machine.
        assert 0 < per_item < 1e-3, result
    assert math.isnan(floor["parent_cpu_per_batch_s"])
    assert one["parent_cpu_per_batch_s"] > 0
