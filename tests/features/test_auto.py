"""num_workers / prefetch_factor / worker_concurrency "auto", end to end with worker processes
and worker threads.

The controller's own choices depend on timing, so these tests replace it with a scripted one
that changes the numbers every couple of batches: what they check is that results do not
depend on what it picks (order, exactly-once, seed_per_sample augmentations, resume), never
how fast anything runs.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import aioload
from aioload._engine import pass_tuning, tuning
from tests.helpers import seeded_per_sample

pytestmark = [
    pytest.mark.timeout(120),
    # Three slots on a smaller test machine (usable_cores is patched): torch's advice, not ours.
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

N = 240


class Numbers(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class Augmented(Dataset[torch.Tensor]):
    """A random augmentation per sample: the same under seed_per_sample whoever fetches it.
    It draws from the worker's own generator in a thread worker (docs/threads.md: the global
    one is every thread's), which seed_per_sample seeds as a process worker's global one."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        rng = info.rng if getattr(info, "worker_method", None) == "thread" else None
        generator = None if rng is None else rng.torch_generator
        return torch.tensor([float(index), torch.rand((), generator=generator).item()])


class AsyncNumbers(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    async def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        await asyncio.sleep(0.0005 * (index % 3))
        return torch.tensor(index)


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(torch.tensor(i) for i in range(start, N, step))


class Scripted(tuning.Controller):
    """Moves to the next (workers, depth, concurrency) of ``script`` at every window."""

    def __init__(self, script: list[tuple[int, int, int]], **settings: Any) -> None:
        super().__init__(tuning.ControllerSettings(min_batches=2, min_seconds=0.0, **settings))
        self.script = itertools.cycle(script)

    def observe(self, window: tuning.Window, at_s: float = 0.0) -> list[tuning.Change]:
        self.last_window = window
        workers, depth, concurrency = next(self.script)
        changes = []
        for knob, new in (
            (self.workers, workers),
            (self.depth, depth),
            (self.concurrency, concurrency),
        ):
            if knob.auto and knob.value != new:
                changes.append(self._record(knob, new, "scripted"))
        return changes


def scripted(loader: aioload.DataLoader[Any], script: list[tuple[int, int, int]]) -> Scripted:
    tuner = loader._tuner
    assert tuner is not None
    replacement = Scripted(
        script,
        workers=None if tuner.workers.auto else tuner.workers.value,
        depth=None if tuner.depth.auto else tuner.depth.value,
        concurrency=None if tuner.concurrency.auto else tuner.concurrency.value,
        max_workers=tuner.workers.high,
        cores=tuner.cores,
        per_pass_workers=tuner.per_pass_workers,
    )
    loader._tuner = replacement
    return replacement


@pytest.fixture
def three_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pass_tuning, "usable_cores", lambda: 3)


SCRIPT = [(1, 1, 4), (3, 2, 8), (2, 4, 4), (1, 8, 16), (3, 1, 4)]


def values(batches: list[torch.Tensor]) -> list[int]:
    return [int(x) for x in torch.cat([b.reshape(-1) for b in batches]).tolist()]


@pytest.mark.usefixtures("three_cores")
def test_order_and_exactly_once_while_the_count_changes() -> None:
    loader = aioload.DataLoader(Numbers(), batch_size=4, num_workers="auto", prefetch_factor="auto")
    assert loader.num_workers == 3  # every slot the controller may use
    tuner = scripted(loader, SCRIPT)
    for _ in range(2):  # a second pass starts from where the first left the numbers
        assert values(list(loader)) == list(range(N))
    assert len(tuner.changes) > 5
    report = loader.stats().as_dict()["tuning"]
    assert report["num_workers"]["auto"] is True
    assert {c["reason"] for c in report["changes"]} == {"scripted"}
    # Workers of every slot answered some of the batches.
    assert all(w["tasks"] > 0 for w in loader.stats().as_dict()["workers"])


@pytest.mark.parametrize("front", ["for", "async for"])
def test_slots_the_controller_never_activates_start_no_process(
    monkeypatch: pytest.MonkeyPatch, front: str, worker_method: str
) -> None:
    """Six slots, a controller that holds two workers: two processes, under either front
    (thread workers: no process at all), and two workers that answer."""
    monkeypatch.setattr(pass_tuning, "usable_cores", lambda: 6)
    loader = aioload.DataLoader(Numbers(), batch_size=4, num_workers="auto")
    assert loader.num_workers == 6
    scripted(loader, [(2, 2, 1)])
    me = psutil.Process()
    most = 0

    def count() -> None:
        nonlocal most
        most = max(most, len(me.children()))

    async def drain() -> list[torch.Tensor]:
        batches = []
        async for batch in loader:
            count()
            batches.append(batch)
        return batches

    if front == "for":
        batches = []
        for batch in loader:
            count()
            batches.append(batch)
    else:
        batches = asyncio.run(drain())
    assert values(batches) == list(range(N))
    assert most == (0 if worker_method == "thread" else 2)
    assert sum(w["tasks"] > 0 for w in loader.stats().as_dict()["workers"]) == 2


@pytest.mark.usefixtures("three_cores")
def test_async_for_and_in_order_false() -> None:
    async def run() -> list[int]:
        loader = aioload.DataLoader(
            Numbers(), batch_size=4, num_workers="auto", prefetch_factor="auto", in_order=False
        )
        scripted(loader, SCRIPT)
        return sorted(values([b async for b in loader]))

    assert asyncio.run(run()) == list(range(N))


# (Thread workers: seed_per_sample seeds each worker's rng, which Augmented draws from; the
# warning says so at construction.)
@pytest.mark.filterwarnings("ignore:aioload. with worker_method='thread':UserWarning")
@pytest.mark.usefixtures("three_cores")
def test_seed_per_sample_augmentations_do_not_depend_on_the_count() -> None:
    def batches(num_workers: Any) -> list[torch.Tensor]:
        loader = seeded_per_sample(Augmented(), num_workers)
        if num_workers == "auto":
            scripted(loader, SCRIPT)
        return list(loader)

    expected = torch.cat(batches(2))
    assert torch.equal(torch.cat(batches("auto")), expected)


@pytest.mark.usefixtures("three_cores")
def test_resume_while_the_count_changes() -> None:
    def loader() -> aioload.DataLoader[torch.Tensor]:
        made = aioload.DataLoader(
            Numbers(),
            batch_size=4,
            shuffle=True,
            num_workers="auto",
            generator=torch.Generator().manual_seed(3),
        )
        scripted(made, SCRIPT)
        return made

    full = values(list(loader()))
    first = loader()
    iterator = iter(first)
    head = [next(iterator) for _ in range(23)]
    state = first.state_dict()
    del iterator
    second = loader()
    second.load_state_dict(state)
    rest = list(second)
    assert values(head) + values(rest) == full
    assert sorted(full) == list(range(N))


@pytest.mark.usefixtures("three_cores")
def test_worker_concurrency_auto_changes_in_the_workers() -> None:
    loader = aioload.DataLoader(
        AsyncNumbers(), batch_size=8, num_workers=2, worker_concurrency="auto"
    )
    assert loader.worker_concurrency == tuning.START_CONCURRENCY
    tuner = scripted(loader, SCRIPT)
    assert values(list(loader)) == list(range(N))
    assert any(c.knob == tuning.CONCURRENCY for c in tuner.changes)


@pytest.mark.no_local_workers("num_workers=0: the choice alone")
def test_worker_concurrency_auto_with_a_sync_dataset_is_one() -> None:
    loader = aioload.DataLoader(Numbers(), batch_size=4, worker_concurrency="auto")
    assert loader.worker_concurrency == 1
    assert loader._tuner is None


@pytest.mark.usefixtures("three_cores")
def test_an_iterable_dataset_holds_its_count_for_a_pass() -> None:
    loader = aioload.DataLoader(Stream(), batch_size=4, num_workers="auto")
    # The first pass: the cores less one for the consumer.
    assert loader.num_workers == 2
    tuner = loader._tuner
    assert tuner is not None and tuner.per_pass_workers
    got = sorted(values(list(loader)))
    assert got == list(range(N))
    # The next pass's count comes from the last pass's measurements; whatever it is, every
    # sample comes once, as with that many workers.
    tuner.pass_window = tuning.Window(1.0, 10, 40, waiting=0.0, busy=0.1, idle_cores=2.0)
    got = sorted(values(list(loader)))
    assert loader.num_workers == 1
    assert got == list(range(N))


@pytest.mark.usefixtures("three_cores")
def test_the_progress_bar_shows_the_choice(capsys: pytest.CaptureFixture[str]) -> None:
    loader = aioload.DataLoader(
        Numbers(), batch_size=4, num_workers="auto", prefetch_factor="auto", progress=True
    )
    assert values(list(loader)) == list(range(N))
    assert "auto: " in capsys.readouterr().err


@pytest.mark.no_local_workers("refused at construction")
def test_torch_still_validates_integers() -> None:
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        aioload.DataLoader(Numbers(), num_workers=-1)
    with pytest.raises(ValueError, match=r"should be a (non-negative|positive) integer or 'auto'"):
        aioload.DataLoader(Numbers(), num_workers="many")
    with pytest.raises(ValueError, match="max_memory bounds what"):
        aioload.DataLoader(Numbers(), num_workers=2, max_memory=1 << 30)


def test_stats_show_the_starting_choice_before_the_first_pass() -> None:
    loader = aioload.DataLoader(Numbers(), batch_size=4, num_workers="auto", prefetch_factor="auto")
    choice = loader.stats().as_dict()["tuning"]
    assert choice["num_workers"]["auto"] and choice["num_workers"]["value"] >= 1
    assert choice["prefetch_factor"]["value"] == tuning.START_DEPTH
    assert choice["changes"] == [] and choice["last_window"] is None
    assert "tuning: " in str(loader.stats())
    assert aioload.DataLoader(Numbers(), num_workers=2).stats().as_dict()["tuning"] is None


@pytest.mark.parametrize("budget", [2e9, np.int64(1 << 30), 1 << 30, 5e8 + 0.5])
def test_max_memory_takes_whole_bytes_as_int_numpy_or_float(budget: Any) -> None:
    loader = aioload.DataLoader(Numbers(), batch_size=4, num_workers="auto", max_memory=budget)
    assert values(list(loader)) == list(range(N))
    assert loader.stats().as_dict()["tuning"]["max_memory"] == int(budget)


@pytest.mark.no_local_workers("refused at construction")
@pytest.mark.parametrize("budget", [0, -5, 0.5, float("inf"), float("nan"), True, "1G"])
def test_max_memory_refuses_what_is_not_a_number_of_bytes(budget: Any) -> None:
    with pytest.raises(ValueError, match="max_memory option should be None or a positive"):
        aioload.DataLoader(Numbers(), num_workers="auto", max_memory=budget)


@pytest.mark.no_local_workers("no loader: the benchmark's verdict")
def test_bench_auto_judges_and_models() -> None:
    """make bench-auto's verdict (>= 90 % of the grid's best, not below torch's defaults) and
    the floor model, on made-up figures."""
    from benchmarks import auto as bench

    def runs(rate: float) -> list[dict[str, Any]]:
        return [{"ok": True, "items_per_s": rate, "peak_tree_rss_bytes": 1 << 20, "error": ""}]

    summary = bench._summarise(
        "tiny",
        {
            "auto": runs(95.0),
            "1w x2": runs(60.0),
            "2w x2": runs(100.0),
            "torch defaults": runs(50.0),
        },
    )
    assert summary["best"] == "2w x2" and summary["pass"] is True
    summary = bench._summarise(
        "tiny", {"auto": runs(80.0), "2w x2": runs(100.0), "torch defaults": runs(50.0)}
    )
    assert summary["pass"] is False
    # Floors as fast per sample as the 16-core machine's (3.5 us a tiny sample, 2 / 78k s an
    # image): the parent's cost carries over unscaled.
    inputs = {
        "tiny": {"parent_us": 100.0, "over_us": 0.5, "floor_cpu_us": 3.5, "batch_size": 256},
        "image": {"parent_us": 150.0, "over_us": 5.0, "floor_cpu_us": 2e6 / 78e3, "batch_size": 64},
    }
    rows = {(r["workload"], r["workers"]): r for r in bench.predict(inputs)}
    # One parent thread hands over a 256-sample batch every 100 us: 2.56M items/s at most.
    assert rows[("tiny", 14)]["bound"] == "parent"
    assert rows[("tiny", 14)]["predicted"] == pytest.approx(2.56e6)
    assert rows[("image", 8)]["bound"] == "workers"
    # The workers pay the floor's work and 5 us over it a sample: that share of the floor.
    assert rows[("image", 8)]["share"] == pytest.approx(1 / (1 + 5.0 / (2e6 / 78e3)))
    # A machine twice as slow per sample: the same share over the floor, half the parent's cost.
    slow = {
        k: {
            **v,
            "parent_us": 2 * v["parent_us"],
            "over_us": 2 * v["over_us"],
            "floor_cpu_us": 2 * v["floor_cpu_us"],
        }
        for k, v in inputs.items()
    }
    slow_rows = {(r["workload"], r["workers"]): r for r in bench.predict(slow)}
    assert slow_rows[("tiny", 14)]["predicted"] == pytest.approx(2.56e6)
    assert slow_rows[("image", 8)]["share"] == pytest.approx(rows[("image", 8)]["share"])
    # The parent's cost given as measured on the large machine: tiny is workers-bound.
    given = {(r["workload"], r["workers"]): r for r in bench.predict(inputs, parent_us=50.0)}
    assert given[("tiny", 14)]["bound"] == "workers"
    assert given[("tiny", 14)]["predicted"] == pytest.approx(4.0e6 / (1 + 0.5 / 3.5))


@pytest.mark.no_local_workers("no loader: the benchmark's reading")
def test_bench_auto_pairs_each_auto_run_with_its_rounds_run() -> None:
    """The round-by-round reading: auto's ratio to another setting's run of the same round,
    median (lowest-highest) over the rounds, failed runs left out. A machine that gets twice
    as fast between rounds moves the medians of both, not the ratios."""
    from benchmarks import auto as bench

    def run(rate: float, ok: bool = True) -> dict[str, Any]:
        return {"ok": ok, "items_per_s": rate}

    runs = {
        "auto": [run(90.0), run(180.0), run(200.0), run(1.0, ok=False)],
        "2w x2": [run(100.0), run(200.0), run(160.0), run(100.0)],
    }
    assert bench._paired(runs, "2w x2") == "0.90 (0.90-1.25)"
    assert bench._paired(runs, "torch defaults") == "-"
