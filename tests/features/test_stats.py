"""loader.stats(): counts, the data-bound share, per-worker figures, queues, pin time."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import aioload
import aioload.loader
from aioload._engine.counters import RESERVOIR_SIZE, PassStats
from aioload._engine.pinning import Transfer
from tests.helpers import consume
from tests.scripts.datasets import KillsItselfOnce, Numbers

pytestmark = [pytest.mark.timeout(60)]


class Shards(IterableDataset[torch.Tensor]):
    """Each worker yields its own share, so each worker's last batch is short."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        worker, count = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, self.n, count):
            yield torch.tensor(i)


MODES = ["sync", "async"]


def test_empty_before_any_iteration() -> None:
    loader = aioload.DataLoader(Numbers(10), batch_size=2, num_workers=2)
    stats = loader.stats()
    assert stats.batches == 0 and stats.samples == 0
    assert stats.data_bound_pct is None and not stats.running
    assert [w.worker_id for w in stats.workers] == [0, 1]
    assert all(w.fetch_p50_s is None for w in stats.workers)
    json.dumps(stats.as_dict())
    assert "not started" in str(stats)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_counts_are_what_was_yielded(mode: str, num_workers: int, no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(37), batch_size=4, num_workers=num_workers)
    assert consume(loader, mode) == 10
    stats = loader.stats()
    assert (stats.batches, stats.samples) == (10, 37)
    assert not stats.running
    # Every task was answered once, by some worker (or by the calling process).
    assert sum(w.tasks for w in stats.workers) == 10
    assert stats.in_process == (num_workers == 0)
    assert len(stats.workers) == max(1, num_workers)


@pytest.mark.parametrize("mode", MODES)
def test_counts_after_break_exclude_prefetched_batches(mode: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(400), batch_size=4, num_workers=2, prefetch_factor=4)
    assert consume(loader, mode, stop_after=3) == 3
    stats = loader.stats()
    assert (stats.batches, stats.samples) == (3, 12)
    assert not stats.running  # the abandoned pass was closed


def test_running_while_iterating(no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(20), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    next(it)
    stats = loader.stats()
    assert stats.running and stats.batches == 2
    assert "running" in str(stats)
    del it


def test_short_iterable_batches_are_counted_by_size(no_leaks: None) -> None:
    # 2 workers share 21 samples: 11 and 10, in batches of 4 -> each worker's last one is short.
    loader = aioload.DataLoader(Shards(21), batch_size=4, num_workers=2)
    batches = list(loader)
    stats = loader.stats()
    assert stats.batches == len(batches) == 6
    assert stats.samples == sum(len(b) for b in batches) == 21


def test_no_automatic_batching_counts_one_sample_per_item(no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(9), batch_size=None, num_workers=2)
    assert len(list(loader)) == 9
    assert (loader.stats().batches, loader.stats().samples) == (9, 9)


# The two tests below compare time spent waiting with time spent between batches. Each side is
# made of sleeps (a sample's, or the consumer's pause) many times what the machinery costs, so
# that a busy machine's scheduling, which adds to both, cannot tip the share across the bound.


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_slow_dataset_is_data_bound(mode: str, num_workers: int, no_leaks: None) -> None:
    delay = 0.025  # 0.1 s a batch of 4: waiting is at least 0.4 s, between is a loop's overhead
    loader = aioload.DataLoader(Numbers(32, delay=delay), batch_size=4, num_workers=num_workers)
    consume(loader, mode)
    stats = loader.stats()
    assert stats.data_bound_pct is not None and stats.data_bound_pct > 80, str(stats)
    assert stats.waiting_s > stats.between_s
    # Each task sleeps 4 samples' delay in its worker; the fetch times say so.
    for worker in stats.workers:
        assert worker.tasks > 0
        assert worker.fetch_p50_s is not None and worker.fetch_p50_s >= 4 * delay, str(stats)
    # With the consumer doing nothing, the workers are busy most of the time.
    assert max(w.busy_fraction for w in stats.workers) > 0.4, str(stats)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_slow_consumer_is_not_data_bound(mode: str, num_workers: int, no_leaks: None) -> None:
    loader = aioload.DataLoader(
        Numbers(48), batch_size=4, num_workers=num_workers, persistent_workers=num_workers > 0
    )
    try:
        # Workers are started by a first pass: the measured one's first wait is a batch's,
        # not the time a busy machine takes to start two processes.
        if num_workers:
            list(loader)
        consume(loader, mode, pause=0.03)
        stats = loader.stats()
    finally:
        loader.shutdown()
    assert stats.data_bound_pct is not None and stats.data_bound_pct < 35, str(stats)
    assert stats.between_s >= 12 * 0.03
    assert stats.elapsed_s == pytest.approx(stats.waiting_s + stats.between_s)
    assert stats.batches_per_s is not None and stats.batches_per_s < 1 / 0.03
    # Cheap samples, a slow consumer: the workers idle.
    assert all(w.busy_fraction < 0.5 for w in stats.workers), str(stats)


def test_worker_figures_are_consistent(no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(80, delay=0.001), batch_size=2, num_workers=2)
    list(loader)
    for worker in loader.stats().workers:
        assert worker.fetch_p50_s is not None
        assert worker.fetch_p90_s is not None and worker.fetch_p99_s is not None
        assert 0 < worker.fetch_p50_s <= worker.fetch_p90_s <= worker.fetch_p99_s
        assert worker.busy_s >= worker.tasks * 0.002
        assert 0 < worker.busy_fraction <= 1
        assert worker.restarts == 0


def test_queue_depths(no_leaks: None) -> None:
    # A slow consumer lets the workers fill the whole prefetch budget (2 workers x 3 tasks).
    loader = aioload.DataLoader(Numbers(60), batch_size=2, num_workers=2, prefetch_factor=3)
    consume(loader, "sync", pause=0.01)
    stats = loader.stats()
    assert stats.in_flight_mean is not None and stats.waiting_in_order_mean is not None
    # Between "sent" and "yielded" there are at most 6 tasks, the one being yielded included.
    assert 0 <= stats.in_flight_mean + stats.waiting_in_order_mean <= 5
    # Mostly, the prefetched answers are already here, waiting for their turn.
    assert stats.waiting_in_order_mean > 2, str(stats)


@pytest.mark.processes_only(
    "its dataset SIGKILLs the process it runs in: over threads, this one (test_threads.py counts a thread replaced)"
)
def test_restarts_are_counted(tmp_path: Path, no_leaks: None) -> None:
    loader = aioload.DataLoader(
        KillsItselfOnce(40, at=13, marker=tmp_path / "killed"),
        batch_size=2,
        num_workers=2,
        max_worker_restarts=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = [int(x) for batch in loader for x in batch]
    assert got == list(range(40))
    stats = loader.stats()
    # Batch 6 (indices 12, 13) goes to worker 0 under round robin.
    assert [w.restarts for w in stats.workers] == [1, 0]
    assert (stats.batches, stats.samples) == (20, 40)
    assert "restarts" in str(stats)


def test_persistent_workers_count_per_pass(no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(20), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        list(loader)
        first = loader.stats()
        consume(loader, "sync", stop_after=2)
        second = loader.stats()
    finally:
        loader.shutdown()
    assert (first.batches, first.samples) == (5, 20)
    assert (second.batches, second.samples) == (2, 8)
    assert sum(w.tasks for w in first.workers) == 5
    # The second pass's answers only (it may have prefetched beyond what it yielded).
    assert sum(w.tasks for w in second.workers) <= 5


class Sleepy(Transfer):
    """Stands in for pin + copy on a machine without an accelerator."""

    def run(self, batch: Any) -> Any:
        time.sleep(0.002)
        return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_time(monkeypatch: pytest.MonkeyPatch, num_workers: int, no_leaks: None) -> None:
    monkeypatch.setattr(aioload.loader, "make_transfer", lambda pin, device: Sleepy())
    loader = aioload.DataLoader(Numbers(20), batch_size=4, num_workers=num_workers)
    assert len(list(loader)) == 5
    stats = loader.stats()
    assert stats.pin_batches == 5 and stats.pin_s >= 5 * 0.002
    assert (stats.batches, stats.samples) == (5, 20)
    assert "pin/H2D" in str(stats)


def test_no_pin_stage_no_pin_time(no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(8), batch_size=4, num_workers=2)
    list(loader)
    stats = loader.stats()
    assert stats.pin_batches == 0 and stats.pin_s == 0
    assert "pin/H2D" not in str(stats)


def test_as_dict_is_plain_json(no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(12), batch_size=4, num_workers=2)
    list(loader)
    data = loader.stats().as_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["batches"] == 3 and data["samples"] == 12
    assert [w["worker_id"] for w in data["workers"]] == [0, 1]
    assert set(data["workers"][0]) >= {"busy_fraction", "fetch_p50_s", "fetch_p99_s", "restarts"}


def test_table_has_one_row_per_worker(no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(12), batch_size=4, num_workers=2)
    list(loader)
    text = str(loader.stats())
    assert "data-bound" in text and "3 batches, 12 samples" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert [row[0] for row in rows] == ["0", "1"]
    assert [int(row[1]) for row in rows] == [2, 1]  # tasks, round robin


def test_dataset_error_keeps_counting(no_leaks: None) -> None:
    class FailsOnce(Numbers):
        def __getitem__(self, i: int) -> torch.Tensor:
            if i == 5:
                raise ValueError("bad sample")
            return super().__getitem__(i)

    loader = aioload.DataLoader(FailsOnce(12), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="bad sample"):
        next(it)
    next(it)
    with pytest.raises(StopIteration):
        next(it)
    # The failed batch was not yielded, and the next batch still has its own size.
    assert (loader.stats().batches, loader.stats().samples) == (2, 8)


@pytest.mark.no_local_workers("PassStats alone, no loader")
def test_fetch_times_are_bounded_in_memory() -> None:
    stats = PassStats(1, in_process=False, auto_collation=True)
    for i in range(RESERVOIR_SIZE * 5):
        stats.fetched(0, float(i % 100) / 1000)
    snapshot = stats.snapshot()
    assert len(stats.workers[0].fetch_times) == RESERVOIR_SIZE
    assert snapshot.workers[0].tasks == RESERVOIR_SIZE * 5
    p50, p99 = snapshot.workers[0].fetch_p50_s, snapshot.workers[0].fetch_p99_s
    # Uniform over 0..99 ms: the sampled percentiles stay close to the true ones.
    assert p50 is not None and abs(p50 - 0.050) < 0.01
    assert p99 is not None and p99 >= 0.095


class Shapes(IterableDataset[torch.Tensor]):
    """Samples whose own first dimension (3) is not a batch dimension."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return (torch.zeros(3, 2) for _ in range(worker, 10, workers))


class Words(IterableDataset[str]):
    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return (f"word{i}" for i in range(worker, 10, workers))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_samples_counted_from_the_stream(num_workers: int, no_leaks: None) -> None:
    """Not from the batch's layout: a custom collate or non-tensor samples say nothing."""
    listed = aioload.DataLoader(Shapes(), batch_size=4, num_workers=num_workers, collate_fn=list)
    list(listed)
    words = aioload.DataLoader(Words(), batch_size=4, num_workers=num_workers)
    list(words)
    assert listed.stats().samples == 10
    assert words.stats().samples == 10


class Keyed(Dataset[str]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, key: str) -> str:
        return key.upper()


def test_unbatched_keys_are_one_sample_each(no_leaks: None) -> None:
    sampler = ["alpha", "beta", "gamma", "delta"]
    loader = aioload.DataLoader(Keyed(), batch_size=None, sampler=sampler, num_workers=2)
    assert list(loader) == ["ALPHA", "BETA", "GAMMA", "DELTA"]
    assert loader.stats().samples == 4
