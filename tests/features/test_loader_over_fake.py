"""The loader itself over the fake backend (``_backends.fake.FakeWorkers``): a whole
``DataLoader``, its dataset and collate run by ``WorkerStep`` slots in this process, with no
worker process forked, and answers whose timing is scripted rather than left to the scheduler.

Each test is the deterministic, fork-free twin of a process-backed one (ordering, out-of-order
delivery, a lost worker, a hung one, resume, sharding by ``get_worker_info()``). The first
checks that the fake's batches are a process pool's, seeds and worker info included.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import anyio
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import aioload
from aioload._backends.fake import HANG, FakeWorkers, VirtualClock
from tests.scripts.datasets import Sharded

# torch's own check, against this machine's cores: the fake forks no worker.
pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.no_local_workers("the fake backend's slots, not local workers"),
]


class _Where(Dataset[torch.Tensor]):
    """Each sample says which index it is, which worker made it, and what that worker's
    python and torch RNGs gave it."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        info = get_worker_info()
        return torch.tensor(
            [
                index,
                -1 if info is None else info.id,
                random.randrange(1 << 30),
                int(torch.randint(1 << 30, ())),
            ]
        )


def _loader(workers: Any, dataset: Any = None, **options: Any) -> aioload.DataLoader:
    options.setdefault("batch_size", 2)
    options.setdefault("num_workers", 3)
    return aioload.DataLoader(
        _Where() if dataset is None else dataset,
        generator=torch.Generator().manual_seed(7),
        workers=workers,
        **options,
    )


def _rows(loader: aioload.DataLoader) -> list[list[list[int]]]:
    return [batch.tolist() for batch in loader]


def _indices(batches: list[list[list[int]]]) -> list[list[int]]:
    return [[sample[0] for sample in batch] for batch in batches]


IN_ORDER = [[2 * i, 2 * i + 1] for i in range(12)]


def test_the_fakes_batches_are_a_process_pools() -> None:
    """The one process-backed run here: the same samples, from the same worker, with the
    same per-worker seeds, whichever backend runs the workers; the caller's RNGs untouched."""
    state = random.getstate(), torch.get_rng_state()
    over_fake = _rows(_loader(FakeWorkers(), shuffle=True))
    assert (random.getstate(), torch.equal(torch.get_rng_state(), state[1])) == (state[0], True)
    over_processes = _rows(_loader(None, shuffle=True))
    assert over_fake == over_processes
    assert {sample[1] for batch in over_fake for sample in batch} == {0, 1, 2}
    assert get_worker_info() is None


def test_out_of_order_answers_come_out_in_sampler_order() -> None:
    fake = FakeWorkers(delay=lambda task_id: 0.002 * (12 - task_id))  # later tasks answer first
    batches = _rows(_loader(fake))
    assert _indices(batches) == IN_ORDER
    # Round robin: batch k from worker k % 3, as a pool deals them.
    assert [batch[0][1] for batch in batches] == [k % 3 for k in range(12)]


def test_out_of_order_answers_under_async_for() -> None:
    fake = FakeWorkers(delay=lambda task_id: 0.002 * (12 - task_id))

    async def drain() -> list[list[int]]:
        return [batch[:, 0].tolist() async for batch in _loader(fake)]

    assert anyio.run(drain) == IN_ORDER


def test_in_order_false_yields_what_is_ready_first() -> None:
    # Task 0 answers last: with in_order=False nothing waits for it.
    # (On the fake's own clock: on the machine's, a stall while the first tasks go out
    # makes the tasks after 0 due later than it.)
    fake = FakeWorkers(delay=lambda task_id: 0.05 if task_id == 0 else 0.0, clock=VirtualClock())
    got = _indices(_rows(_loader(fake, in_order=False)))
    assert sorted(got) == IN_ORDER, "every batch exactly once"
    assert got[0] != IN_ORDER[0]
    assert got.index(IN_ORDER[0]) > 0


def test_a_worker_lost_mid_epoch_loses_and_repeats_nothing() -> None:
    # The worker handed task 5 dies with it, and with what it held; its replacement (in the
    # same slot, set up anew) is sent them again.
    fake = FakeWorkers(delay=lambda task_id: 0.005, lose_on={5})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = _rows(_loader(fake, max_worker_restarts=1))
    assert _indices(batches) == IN_ORDER
    (backend,) = fake.made
    assert backend.restarts == [2]
    assert sorted(backend.answered) == list(range(12)), "no task answered twice"
    assert any("replaced it with a new worker 2" in str(w.message) for w in caught)


def test_a_lost_worker_without_restarts_ends_the_pass() -> None:
    fake = FakeWorkers(lose_on={4})
    with pytest.raises(aioload.WorkerDiedError, match=r"fake 1"):
        _rows(_loader(fake))


def test_a_hung_worker_hits_the_timeout() -> None:
    fake = FakeWorkers(delay=lambda task_id: HANG if task_id == 4 else 0.0)
    got: list[list[int]] = []
    loader = _loader(fake, timeout=0.2)
    with pytest.raises(aioload.DataLoaderTimeoutError) as info:
        for batch in loader:
            got.append(batch[:, 0].tolist())
    assert got == IN_ORDER[:4]
    assert str(info.value).startswith(
        "DataLoader timed out after 0.2 seconds (waiting for batch 4 from DataLoader worker 1, "
        "fake 1, holding indices [8, 9])"
    )
    assert fake.made[0].retired


def _without_worker(batches: list[list[list[int]]]) -> list[list[list[int]]]:
    return [[[sample[0], *sample[2:]] for sample in batch] for batch in batches]


def test_state_dict_mid_epoch_resumes_exactly() -> None:
    # seed_per_sample: a sample's randomness is its own, whichever (fresh) worker makes it.
    # Which worker that is depends on timing (NOTE [balanced in order]: the least busy one
    # gets the next task), so the worker's id is left out of the comparison.
    fake = FakeWorkers(delay=lambda task_id: 0.001 * (task_id % 3))
    whole = _without_worker(_rows(_loader(fake, shuffle=True, seed_per_sample=True)))

    first = _loader(fake, shuffle=True, seed_per_sample=True)
    it = iter(first)
    head = [next(it).tolist() for _ in range(5)]
    state = first.state_dict()
    del it
    resumed = _loader(fake, shuffle=True, seed_per_sample=True)
    resumed.load_state_dict(state)
    tail = _rows(resumed)
    assert _without_worker(head + tail) == whole


def test_an_iterable_dataset_shards_by_worker_info() -> None:
    # Two workers, each its own stream; batches taken from them in turn, as torch's loader
    # takes them, the shorter stream's end ending only its own share.
    fake = FakeWorkers(delay=lambda task_id: 0.002 * (6 - task_id) if task_id < 6 else 0.0)
    got = [batch.tolist() for batch in _loader(fake, Sharded(11), num_workers=2, batch_size=2)]
    assert got == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9]]


class _Range(IterableDataset[int]):
    """torch's documented pattern: ``worker_init_fn`` narrows each worker's copy of the
    dataset to its own part of the range."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self) -> Any:
        return iter(range(self.start, self.end))


def _split_range(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None and info.id == worker_id
    dataset = info.dataset
    per_worker = -(-(dataset.end - dataset.start) // info.num_workers)
    dataset.start += worker_id * per_worker
    dataset.end = min(dataset.start + per_worker, dataset.end)


def test_worker_init_fn_runs_once_per_worker_on_its_own_copy() -> None:
    dataset = _Range(0, 8)
    got = [
        batch.tolist()
        for batch in _loader(
            FakeWorkers(), dataset, num_workers=2, batch_size=2, worker_init_fn=_split_range
        )
    ]
    assert got == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert (dataset.start, dataset.end) == (0, 8), "the loader's own dataset is untouched"


def test_persistent_workers_keep_their_slots_across_epochs() -> None:
    fake = FakeWorkers(delay=lambda task_id: 0.001 * (task_id % 2))
    loader = _loader(fake, persistent_workers=True, shuffle=True)
    epochs = [_rows(loader) for _ in range(2)]
    assert len(fake.made) == 1 and fake.made[0].started_passes == 2
    for batches in epochs:
        assert sorted(i for batch in _indices(batches) for i in batch) == list(range(24))
    # Each worker's RNGs go on from where its last epoch left them, as a kept process's do.
    assert epochs[0] != epochs[1]
    loader.shutdown()
    assert fake.made[0].closed
    pool = _loader(None, persistent_workers=True, shuffle=True)
    assert [_rows(pool) for _ in range(2)] == epochs
    pool.shutdown()
