"""The "auto" controller on scripted measurements: no processes, no clock.

Each test feeds ``Controller.observe`` a sequence of windows (what a pass would have measured)
and checks which way it moves, and that it stops: within the usable cores and the memory
budget, at the smallest depth that keeps the consumer fed, never back and forth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aioload._engine import measure, pass_tuning, tuning
from aioload._engine.measure import batch_bytes, cgroup_cpu_quota
from aioload._engine.pass_tuning import PassTuning, auto_arguments
from aioload._engine.tuning import (
    CONCURRENCY,
    DEPTH,
    MAX_CONCURRENCY,
    WORKERS,
    Controller,
    ControllerSettings,
    Window,
)


def window(
    waiting: float,
    busy: float,
    samples_per_s: float = 1000.0,
    idle: float | None = 4.0,
    batch: int = 0,
    per_batch: int = 32,
) -> Window:
    seconds = 1.0
    samples = int(samples_per_s * seconds)
    return Window(
        seconds=seconds,
        batches=max(1, samples // per_batch),
        samples=samples,
        waiting=waiting,
        busy=busy,
        idle_cores=idle,
        batch_bytes=batch,
    )


def controller(**overrides: Any) -> Controller:
    settings: dict[str, Any] = dict(
        workers=None, depth=2, concurrency=1, max_workers=8, cores=8, max_memory=None
    )
    settings.update(overrides)
    made = Controller(ControllerSettings(**settings))
    made.begin_pass()
    return made


def knobs(changes: list[tuning.Change]) -> list[tuple[str, int, int]]:
    return [(c.knob, c.old, c.new) for c in changes]


# -- workers --------------------------------------------------------------------------------


def test_grows_workers_while_the_consumer_waits_and_cores_are_idle() -> None:
    c = controller()
    assert c.workers.value == 2
    changes = c.observe(window(waiting=0.6, busy=0.95, samples_per_s=1000))
    assert knobs(changes) == [(WORKERS, 2, 4)]
    assert "waits 60%" in changes[0].reason and "cores idle" in changes[0].reason
    # The window in which the new workers start is not judged.
    assert c.observe(window(waiting=0.5, busy=0.9, samples_per_s=1200)) == []
    # Judged: 1000 -> 1900 samples/s is a gain, kept; the consumer still waits: grow again.
    changes = c.observe(window(waiting=0.3, busy=0.95, samples_per_s=1900, idle=3.0))
    assert knobs(changes) == [(WORKERS, 4, 6)]
    assert c.workers.value == 6


def test_no_workers_without_idle_cores() -> None:
    c = controller(depth=None)
    changes = c.observe(window(waiting=0.6, busy=0.95, idle=0.2))
    # Not a worker: no core is idle. Not deeper either: the workers are saturated.
    assert changes == []
    assert c.workers.value == 2
    assert "no core is idle" in c.note


def test_never_more_workers_than_usable_cores() -> None:
    c = controller(max_workers=3, cores=3)
    rate = 1000.0
    for _ in range(20):
        rate *= 1.5  # every trial "gains"
        c.observe(window(waiting=0.8, busy=0.99, samples_per_s=rate, idle=8.0))
        assert c.workers.value <= 3
    assert c.workers.value == 3


def test_a_growth_without_gain_is_undone() -> None:
    c = controller()
    assert knobs(c.observe(window(waiting=0.6, busy=0.95, samples_per_s=1000))) == [(WORKERS, 2, 4)]
    c.observe(window(waiting=0.6, busy=0.95, samples_per_s=1010))  # settling
    changes = c.observe(window(waiting=0.6, busy=0.95, samples_per_s=1020))
    assert knobs(changes) == [(WORKERS, 4, 2)]
    assert changes[0].reason.startswith("undone")
    # 2 is the ceiling now: the same signal does not try again at once.
    assert c.observe(window(waiting=0.6, busy=0.95, samples_per_s=1000)) == []


def test_retires_a_worker_when_the_consumer_is_the_bottleneck() -> None:
    c = controller()
    c.workers.value = 5
    changes = c.observe(window(waiting=0.0, busy=0.3))
    assert knobs(changes) == [(WORKERS, 5, 4)]
    assert "bottleneck" in changes[0].reason
    # Judged: throughput held and the consumer is still fed: kept, and one more goes.
    changes = c.observe(window(waiting=0.01, busy=0.375))
    assert knobs(changes) == [(WORKERS, 4, 3)]
    # Three workers at 50 %: two would be 75 % busy, above the limit: it holds.
    assert c.observe(window(waiting=0.01, busy=0.5)) == []
    assert c.workers.value == 3


def test_a_shrink_that_starves_the_consumer_is_undone() -> None:
    c = controller()
    c.workers.value = 4
    assert knobs(c.observe(window(waiting=0.0, busy=0.5, samples_per_s=1000))) == [(WORKERS, 4, 3)]
    changes = c.observe(window(waiting=0.3, busy=0.9, samples_per_s=800))
    assert knobs(changes) == [(WORKERS, 3, 4)]
    assert c.workers.floor == 4


def test_holds_between_the_thresholds() -> None:
    c = controller(depth=None)
    assert c.observe(window(waiting=0.06, busy=0.5)) == []
    assert "holding" in c.note


def test_it_does_not_oscillate() -> None:
    """Windows that alternate between "starved" and "fed" (a noisy machine): each knob turns
    direction a bounded number of times, then holds."""
    c = controller(depth=None)
    moves = 0
    for i in range(200):
        if i % 2:
            w = window(waiting=0.6, busy=0.95, samples_per_s=1000 + (i % 7) * 100)
        else:
            w = window(waiting=0.0, busy=0.2, samples_per_s=1000)
        moves += len(c.observe(w))
    assert moves <= 2 * (tuning.MAX_REVERSALS + 2)
    assert c.workers.reversals >= tuning.MAX_REVERSALS or moves < 10


# -- prefetch depth -------------------------------------------------------------------------


def test_depth_grows_only_while_the_consumer_waits_and_stops_when_fed() -> None:
    c = controller(workers=2, depth=None)
    assert c.depth.value == 2
    changes = c.observe(window(waiting=0.4, busy=0.6, samples_per_s=1000))
    assert knobs(changes) == [(DEPTH, 2, 3)]
    changes = c.observe(window(waiting=0.2, busy=0.7, samples_per_s=1300))
    assert knobs(changes) == [(DEPTH, 3, 4)]
    # Fed now: the trial is kept, and nothing grows any more.
    for _ in range(10):
        assert c.observe(window(waiting=0.01, busy=0.8, samples_per_s=1500)) == []
    assert c.depth.value == 4


def test_depth_shrinks_while_the_consumer_is_fed_and_the_workers_idle() -> None:
    c = controller(workers=4, depth=None)
    c.depth.value = 3
    changes = c.observe(window(waiting=0.0, busy=0.3, samples_per_s=1000))
    assert knobs(changes) == [(DEPTH, 3, 2)]
    assert "fewer batches in flight" in changes[0].reason
    # Judged: the consumer is still fed at the same rate: kept, and one less again.
    assert knobs(c.observe(window(waiting=0.01, busy=0.3, samples_per_s=990))) == [(DEPTH, 2, 1)]
    # One task a worker is the least: it holds.
    for _ in range(5):
        assert c.observe(window(waiting=0.0, busy=0.3, samples_per_s=1000)) == []
    assert c.depth.value == 1


def test_workers_go_before_depth_and_busy_workers_keep_their_depth() -> None:
    c = controller(depth=None)
    c.workers.value = 4
    assert knobs(c.observe(window(waiting=0.0, busy=0.3))) == [(WORKERS, 4, 3)]
    # Three workers 45% busy: two would be 68%, still at most 70%: another goes.
    assert knobs(c.observe(window(waiting=0.0, busy=0.45))) == [(WORKERS, 3, 2)]
    # Two 60% busy: neither one fewer (120%) nor a shorter queue (more than half busy).
    assert c.observe(window(waiting=0.0, busy=0.6)) == []
    assert (c.workers.value, c.depth.value) == (2, 2)


def test_a_depth_shrink_that_starves_the_consumer_is_undone() -> None:
    c = controller(workers=2, depth=None)
    assert knobs(c.observe(window(waiting=0.0, busy=0.4, samples_per_s=1000))) == [(DEPTH, 2, 1)]
    changes = c.observe(window(waiting=0.3, busy=0.6, samples_per_s=800))
    assert knobs(changes) == [(DEPTH, 1, 2)]
    assert changes[0].reason.startswith("undone")
    assert c.depth.floor == 2
    assert c.observe(window(waiting=0.0, busy=0.4, samples_per_s=1000)) == []


def test_depth_keeps_the_room_an_async_concurrency_fills() -> None:
    # 64 fetches at once fill half of 4 x 32 samples in flight: with 3 they would not fit.
    c = controller(workers=2, depth=None, concurrency=64)
    c.depth.value = 4
    assert c.observe(window(waiting=0.0, busy=0.2, per_batch=32)) == []
    c = controller(workers=2, depth=None, concurrency=32)
    c.depth.value = 4
    assert knobs(c.observe(window(waiting=0.0, busy=0.2, per_batch=32))) == [(DEPTH, 4, 3)]


def test_a_pass_that_starts_its_workers_moves_nothing_on_its_first_window() -> None:
    """The first window of a pass that starts its workers measures their start: neither
    depth nor workers move on it, either way; from the next window on they do."""
    c = controller(workers=2, depth=None)
    c.begin_pass(starting=True)
    assert c.observe(window(waiting=0.4, busy=0.3)) == []
    assert "workers start" in c.note
    assert knobs(c.observe(window(waiting=0.4, busy=0.3))) == [(DEPTH, 2, 3)]
    c = controller(workers=None, depth=None)
    c.workers.value = 5
    c.begin_pass(starting=True)
    assert c.observe(window(waiting=0.0, busy=0.2)) == []
    assert knobs(c.observe(window(waiting=0.0, busy=0.2))) == [(WORKERS, 5, 4)]
    # Kept workers (persistent_workers): the first window counts.
    c = controller(workers=2, depth=None)
    c.begin_pass(starting=False)
    assert knobs(c.observe(window(waiting=0.4, busy=0.3))) == [(DEPTH, 2, 3)]


def test_an_async_datasets_concurrency_grows_on_the_first_window() -> None:
    c = controller(workers=2, depth=None, concurrency=None)
    c.begin_pass(starting=True)
    changes = c.observe(window(waiting=0.8, busy=1.0, per_batch=32))
    assert knobs(changes) == [(CONCURRENCY, 4, 16)]


def test_depth_does_not_grow_for_saturated_workers() -> None:
    c = controller(workers=2, depth=None)
    assert c.observe(window(waiting=0.5, busy=0.97)) == []
    assert c.depth.value == 2


def test_depth_stays_within_its_range() -> None:
    c = controller(workers=2, depth=None)
    rate = 100.0
    for _ in range(30):
        rate *= 1.2
        c.observe(window(waiting=0.5, busy=0.3, samples_per_s=rate))
    assert c.depth.value == tuning.MAX_DEPTH


# -- memory ---------------------------------------------------------------------------------


def test_the_memory_budget_lowers_depth_then_workers() -> None:
    mib = 1 << 20
    c = controller(depth=None, max_memory=5 * mib)
    c.workers.value, c.depth.value = 4, 3
    # 4 x 3 + 2 batches of 1 MiB do not fit in 5 MiB: 3 batches in flight do.
    changes = c.observe(window(waiting=0.5, busy=0.9, batch=mib))
    assert knobs(changes) == [(DEPTH, 3, 1), (WORKERS, 4, 3)]
    assert all("memory budget" in ch.reason for ch in changes)
    assert (c.workers.value * c.depth.value + 2) * mib <= 5 * mib
    # And nothing grows back past it.
    for _ in range(10):
        c.observe(window(waiting=0.5, busy=0.9, batch=mib, samples_per_s=5000))
        assert (c.workers.value * c.depth.value + 2) * mib <= 5 * mib


def test_growth_stays_within_the_memory_budget() -> None:
    mib = 1 << 20
    c = controller(depth=None, max_memory=12 * mib)
    rate = 1000.0
    for _ in range(30):
        rate *= 1.3
        c.observe(window(waiting=0.6, busy=0.7, samples_per_s=rate, idle=8, batch=mib))
        assert (c.workers.value * c.depth.value + 2) * mib <= 12 * mib


# -- concurrency ----------------------------------------------------------------------------


def test_concurrency_grows_fourfold_with_room_while_the_consumer_mostly_waits() -> None:
    c = controller(workers=1, depth=None, concurrency=None)
    assert c.concurrency.value == tuning.START_CONCURRENCY
    rate = 200.0
    values = [(c.concurrency.value, c.depth.value)]
    for _ in range(6):
        changes = c.observe(window(waiting=0.9, busy=1.0, samples_per_s=rate, per_batch=32))
        values.append((c.concurrency.value, c.depth.value))
        rate *= 3.5
    # 4 -> 16 -> 64 -> 256 (the most), each in one trial with the depth that gives it room:
    # concurrency fills at most half of depth x 32 samples, so 64 takes 4 tasks per worker,
    # and 256 would take 16: the depth stops at its most (8), and so does concurrency.
    assert values[:4] == [(4, 2), (16, 2), (64, 4), (256, 8)]
    assert max(v for v, _ in values) <= MAX_CONCURRENCY
    assert changes == []


def test_concurrency_doubles_when_the_consumer_waits_less() -> None:
    c = controller(workers=1, depth=None, concurrency=None)
    changes = c.observe(window(waiting=0.3, busy=1.0, samples_per_s=200, per_batch=32))
    assert knobs(changes) == [(CONCURRENCY, 4, 8)]


def test_an_undone_concurrency_trial_puts_its_depth_back() -> None:
    c = controller(workers=1, depth=None, concurrency=None)
    c.concurrency.value = 16
    changes = c.observe(window(waiting=0.9, busy=1.0, samples_per_s=1000, per_batch=32))
    assert knobs(changes) == [(CONCURRENCY, 16, 64), (DEPTH, 2, 4)]
    assert "follows worker_concurrency=64" in changes[1].reason
    changes = c.observe(window(waiting=0.9, busy=1.0, samples_per_s=1020, per_batch=32))
    assert knobs(changes) == [(CONCURRENCY, 64, 16)]
    assert (c.concurrency.value, c.depth.value) == (16, 2)
    assert c.changes[-1].knob == DEPTH and c.changes[-1].reason.startswith("with worker_")


def test_a_pinned_depth_caps_concurrency_at_the_samples_in_flight() -> None:
    c = controller(workers=1, depth=2, concurrency=None)
    c.observe(window(waiting=0.9, busy=1.0, samples_per_s=200))  # 4 -> 16
    assert c.concurrency.value == 16
    c.observe(window(waiting=0.9, busy=1.0, samples_per_s=800))  # kept; 16 -> 64 (2 x 32)
    assert (c.concurrency.value, c.depth.value) == (64, 2)
    assert c.observe(window(waiting=0.9, busy=1.0, samples_per_s=3000)) == []
    assert c.concurrency.value == 64


def test_concurrency_stops_when_throughput_stops_rising() -> None:
    c = controller(workers=1, depth=2, concurrency=None)
    c.observe(window(waiting=0.9, busy=1.0, samples_per_s=200))  # 4 -> 16
    changes = c.observe(window(waiting=0.9, busy=1.0, samples_per_s=210))  # +5 %: undone
    assert knobs(changes) == [(CONCURRENCY, 16, 4)]
    assert c.concurrency.value == 4
    # The twofold step between is still untried: tried next, and undone too, it settles.
    assert "8 is the ceiling" in changes[0].reason
    assert knobs(c.observe(window(waiting=0.9, busy=1.0, samples_per_s=200))) == [
        (CONCURRENCY, 4, 8)
    ]
    assert knobs(c.observe(window(waiting=0.9, busy=1.0, samples_per_s=205))) == [
        (CONCURRENCY, 8, 4)
    ]
    for _ in range(5):
        assert c.observe(window(waiting=0.9, busy=1.0, samples_per_s=200)) == []
    assert c.concurrency.value == 4


def test_a_fourfold_concurrency_step_that_does_not_pay_tries_the_twofold_one() -> None:
    """4 -> 16 pays, 16 -> 64 does not, so 32 is tried, and kept when it pays."""
    c = controller(workers=2, depth=8, concurrency=None)
    assert knobs(c.observe(window(waiting=0.9, busy=1.0, samples_per_s=100))) == [
        (CONCURRENCY, 4, 16)
    ]
    assert knobs(c.observe(window(waiting=0.8, busy=1.0, samples_per_s=300))) == [
        (CONCURRENCY, 16, 64)
    ]
    assert knobs(c.observe(window(waiting=0.8, busy=1.0, samples_per_s=310))) == [
        (CONCURRENCY, 64, 16)
    ]
    assert knobs(c.observe(window(waiting=0.8, busy=1.0, samples_per_s=300))) == [
        (CONCURRENCY, 16, 32)
    ]
    assert c.observe(window(waiting=0.5, busy=1.0, samples_per_s=360)) == []
    assert c.concurrency.value == 32
    # 32 is the ceiling for now: nothing grows past it.
    assert c.observe(window(waiting=0.5, busy=1.0, samples_per_s=360)) == []


def test_depth_does_not_grow_without_an_idle_core() -> None:
    # The workers are not busy because they wait for a core, not for tasks.
    c = controller(workers=2, depth=None)
    assert c.observe(window(waiting=0.6, busy=0.6, idle=0.1)) == []
    assert c.depth.value == 2
    assert "no core is idle" in c.note


# -- per pass (IterableDataset) -------------------------------------------------------------


def test_an_iterable_dataset_count_changes_only_between_passes() -> None:
    c = Controller(
        ControllerSettings(
            workers=None, depth=2, concurrency=1, max_workers=8, cores=8, per_pass_workers=True
        )
    )
    c.begin_pass()
    start = c.pass_workers()
    assert start == 7  # the cores less one for the consumer
    for _ in range(5):
        assert c.observe(window(waiting=0.0, busy=0.3)) == []
    assert c.pass_workers() == start
    c.pass_window = window(waiting=0.0, busy=0.3)
    c.begin_pass()
    assert c.pass_workers() == start - 1
    # A resumed pass (or kept workers) holds the count it is given.
    c.begin_pass(hold_workers=3)
    assert c.pass_workers() == 3


# -- measurements ---------------------------------------------------------------------------


class _Counter:
    def __init__(self) -> None:
        self.busy_s = 0.0


class _Stats:
    """What PassTuning reads of PassStats."""

    def __init__(self, workers: int) -> None:
        self.workers = [_Counter() for _ in range(workers)]
        self.batches = 0
        self.samples = 0
        self.waiting_s = 0.0
        self.between_s = 0.0
        self.tuning: Any = None


def test_pass_tuning_turns_counters_into_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("aioload._engine.pass_tuning.time.perf_counter", lambda: clock[0])
    c = Controller(
        ControllerSettings(
            workers=2,
            depth=None,
            concurrency=1,
            max_workers=2,
            cores=2,
            min_batches=4,
            min_seconds=1.0,
        )
    )
    c.begin_pass()
    stats = _Stats(2)
    feed = PassTuning(c, stats)
    assert stats.tuning is feed
    assert feed.after_batch(None, 0, 0) is False  # the first batch marks the start
    for _ in range(4):
        clock[0] += 0.5
        stats.batches += 1
        stats.samples += 32
        stats.waiting_s += 0.25
        stats.between_s += 0.25
        stats.workers[0].busy_s += 0.2
        stats.workers[1].busy_s += 0.2
        feed.after_batch([b"x" * 10], 3, 1)
    w = c.last_window
    assert w is not None
    assert w.seconds == pytest.approx(2.0)
    assert w.batches == 4 and w.samples == 128
    assert w.waiting == pytest.approx(0.5)
    assert w.busy == pytest.approx(0.4)
    assert w.in_flight == pytest.approx(3.0) and w.head_of_line == pytest.approx(1.0)
    report = feed.report()
    assert report[DEPTH]["auto"] is True and report[WORKERS]["auto"] is False
    assert report["last_window"]["samples_per_s"] == pytest.approx(64.0)


def test_batch_bytes() -> None:
    import numpy as np
    import torch

    batch = {"x": torch.zeros(4, 3, dtype=torch.float32), "y": [np.zeros(5, dtype=np.int64)]}
    assert batch_bytes(batch) == 4 * 3 * 4 + 5 * 8
    assert batch_bytes("text") == 0


# -- the machine ----------------------------------------------------------------------------


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cgroup").write_text("0::/job\n")
    (tmp_path / "fs" / "job").mkdir(parents=True)
    (tmp_path / "fs" / "job" / "cpu.max").write_text("250000 100000\n")
    (tmp_path / "fs" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path / "fs"), str(tmp_path / "proc")) == pytest.approx(2.5)


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cgroup").write_text("4:cpu,cpuacct:/\n")
    directory = tmp_path / "fs" / "cpu,cpuacct"
    directory.mkdir(parents=True)
    (directory / "cpu.cfs_quota_us").write_text("300000\n")
    (directory / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path / "fs"), str(tmp_path / "proc")) == pytest.approx(3.0)


def test_no_cgroup_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_usable_cores_takes_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "affinity", lambda: set(range(16)))
    monkeypatch.setattr(measure, "cgroup_cpu_quota", lambda: 3.6)
    assert measure.usable_cores() == 4
    monkeypatch.setattr(measure, "cgroup_cpu_quota", lambda: None)
    assert measure.usable_cores() == 16


# -- arguments ------------------------------------------------------------------------------


def test_integers_mean_what_they_always_meant() -> None:
    assert auto_arguments(4, 2, 1, None, iterable=False, is_async=False) is None
    assert auto_arguments(0, None, "auto", None, iterable=False, is_async=False) is None


def test_auto_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pass_tuning, "usable_cores", lambda: 6)
    auto = auto_arguments("auto", "auto", "auto", None, iterable=False, is_async=True)
    assert auto is not None
    # torch sees every slot (map-style), depth 2, and the async start of 4.
    assert (auto.num_workers, auto.prefetch_factor, auto.worker_concurrency) == (6, 2, 4)
    assert auto.controller.workers.value == 2
    auto = auto_arguments("auto", None, 1, None, iterable=True, is_async=False)
    assert auto is not None and auto.num_workers == 5  # one pass's count
    assert auto.controller.depth.auto is False


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("many", None, 1, None), "num_workers option should be a non-negative integer or 'auto'"),
        ((2, "deep", 1, None), "prefetch_factor option should be a positive integer or 'auto'"),
        ((2, None, 1, -5), "max_memory option should be None or a positive number"),
        ((2, None, 1, 1 << 30), "max_memory bounds what"),
        ((0, "auto", 1, None), "prefetch_factor option could only be specified"),
    ],
)
def test_auto_argument_errors(arguments: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        auto_arguments(*arguments, iterable=False, is_async=False)
