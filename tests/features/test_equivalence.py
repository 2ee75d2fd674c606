"""aioload yields what torch's DataLoader yields, for the same arguments and seeds."""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import aioload
from tests.scripts.datasets import Sharded, Squares

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.processes_only(
        "its datasets draw from the process-wide generators, which torch seeds per worker "
        "process; over threads, tests/conformance is the torch-as-oracle suite (its datasets "
        "draw from get_worker_info().rng there)"
    ),
]


class Augmented(Dataset[dict[str, Any]]):
    """A map-style dataset whose samples depend on every RNG a worker seeds."""

    def __init__(self, n: int = 53) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "index": i,
            "x": torch.full((2, 3), float(i)) + torch.rand(2, 3),
            "np": np.random.randint(0, 1000, size=4),
            "py": random.random(),
            "name": f"sample-{i}",
        }


class Pair(NamedTuple):
    left: torch.Tensor
    right: int


class Pairs(Dataset[Pair]):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> Pair:
        return Pair(torch.arange(i, i + 3), i)


class Unsharded(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        yield from range(7)


class Seeds(Dataset[tuple[int, ...]]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[int, ...]:
        info = torch.utils.data.get_worker_info()
        ours = aioload.get_worker_info()
        assert info is not None
        # Under torch's own loader ours is None; inside aioload workers both are one object.
        assert ours is None or ours is info, "torch's get_worker_info must return aioload's"
        return (
            info.id,
            info.num_workers,
            info.seed,
            torch.initial_seed(),
            int(np.random.randint(0, 2**31)),
            random.randint(0, 2**31),
        )


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and np.array_equal(a, b)
    else:
        assert a == b, (a, b)


def _both(seed: int, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    """The batches of torch's loader and of ours, each built right after the same seeding."""
    dataset = kwargs.pop("dataset")
    gen_seed = kwargs.pop("gen_seed", None)
    out = []
    for cls in (torch.utils.data.DataLoader, aioload.DataLoader):
        # num_workers=0 draws from the main process's RNGs, so reset all three.
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        gen = None
        if gen_seed is not None:
            gen = torch.Generator()
            gen.manual_seed(gen_seed)
        out.append(list(cls(dataset, generator=gen, **kwargs)))
    return out[0], out[1]


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_batches_as_torch(num_workers: int, shuffle: bool, no_leaks: None) -> None:
    ref, ours = _both(
        5,
        dataset=Augmented(),
        batch_size=4,
        shuffle=shuffle,
        num_workers=num_workers,
        gen_seed=11 if shuffle else None,
    )
    assert len(ours) == len(ref) == 14
    _assert_same(ref, ours)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_last_and_len(num_workers: int, no_leaks: None) -> None:
    ref, ours = _both(1, dataset=Augmented(), batch_size=5, drop_last=True, num_workers=num_workers)
    _assert_same(ref, ours)
    loader = aioload.DataLoader(Augmented(), batch_size=5, drop_last=True)
    assert len(loader) == len(ours) == 10


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_size_none(num_workers: int, no_leaks: None) -> None:
    ref, ours = _both(2, dataset=Augmented(9), batch_size=None, num_workers=num_workers)
    assert len(ours) == 9
    _assert_same(ref, ours)


def _sum_collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "total": torch.stack([b["x"] for b in batch]).sum(0),
        "names": [b["name"] for b in batch],
    }


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_collate(num_workers: int, no_leaks: None) -> None:
    ref, ours = _both(
        3, dataset=Augmented(), batch_size=6, collate_fn=_sum_collate, num_workers=num_workers
    )
    _assert_same(ref, ours)


def test_namedtuple_batches_keep_their_type(no_leaks: None) -> None:
    ref, ours = _both(0, dataset=Pairs(), batch_size=3, num_workers=2)
    assert isinstance(ours[0], Pair)
    _assert_same(ref, ours)


def test_batch_sampler_and_sampler(no_leaks: None) -> None:
    sampler = torch.utils.data.SubsetRandomSampler(list(range(0, 50, 3)))
    ref, ours = _both(0, dataset=Augmented(), batch_size=2, sampler=sampler, num_workers=2)
    _assert_same(ref, ours)
    batches = [[1, 2], [5], [7, 8, 9], [0]]
    ref, ours = _both(0, dataset=Augmented(), batch_sampler=batches, num_workers=2)
    _assert_same(ref, ours)


def _generator(indices: list[int]) -> Iterator[int]:
    yield from indices


@pytest.mark.parametrize("kind", [iter, _generator])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_may_yield_iterators(kind: Any, num_workers: int, no_leaks: None) -> None:
    # torch's fetcher reads each batch's indices once, so an iterator will do (a generator
    # only without workers: torch pickles it for them). aioload reads it into a list first.
    batches = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]
    expected = list(torch.utils.data.DataLoader(Squares(30), batch_sampler=batches))
    got = list(
        aioload.DataLoader(
            Squares(30), batch_sampler=[kind(b) for b in batches], num_workers=num_workers
        )
    )
    _assert_same(expected, got)
    assert [len(b) for b in got] == [3, 2, 4]


class _SeesIndices(Dataset[dict[str, Any]]):
    """Each sample says what its batch's ``__getitems__`` was given: its type, its indices'
    types, and its length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: Any) -> list[dict[str, Any]]:
        given = f"{type(indices).__name__} of {sorted({type(i).__name__ for i in indices})}"
        return [{"index": i, "given": given, "length": len(indices)} for i in indices]


class _Backwards(torch.utils.data.SequentialSampler):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[int]:
        return reversed(range(len(self.data_source)))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sequential_pass_gives_the_dataset_torchs_index_lists(
    num_workers: int, drop_last: bool, no_leaks: None
) -> None:
    # aioload carries a sequential sampler's batches as their bounds (messages.IndexRange); what
    # the dataset is given must still be the list of ints torch's batch sampler makes, with
    # the same batches, the short last one included or dropped.
    ref, ours = _both(
        0, dataset=_SeesIndices(23), batch_size=5, drop_last=drop_last, num_workers=num_workers
    )
    _assert_same(ref, ours)
    assert ours[0]["given"] == ["list of ['int']"] * 5
    assert len(ours) == (4 if drop_last else 5)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sequential_samplers_that_are_not_torchs_own_are_iterated(
    num_workers: int, no_leaks: None
) -> None:
    # A subclass may change the order, and a batch sampler of the user's may yield its own
    # ranges (which torch hands to the dataset as they are).
    ref, ours = _both(
        0,
        dataset=_SeesIndices(11),
        sampler=_Backwards(range(11)),
        batch_size=4,
        num_workers=num_workers,
    )
    _assert_same(ref, ours)
    assert ours[0]["index"].tolist() == [10, 9, 8, 7]
    ranges = [range(0, 3), range(5, 11)]
    ref, ours = _both(0, dataset=_SeesIndices(11), batch_sampler=ranges, num_workers=num_workers)
    _assert_same(ref, ours)
    assert ours[1]["given"] == ["range of ['int']"] * 6


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_iterable_sharded_by_worker_info(num_workers: int, no_leaks: None) -> None:
    ref, ours = _both(0, dataset=Sharded(23), batch_size=4, num_workers=num_workers)
    _assert_same(ref, ours)
    flat = [int(x) for batch in ours for x in batch]
    assert sorted(flat) == list(range(23)), "every sample exactly once"


def test_iterable_unsharded_duplicates_like_torch(no_leaks: None) -> None:
    ref, ours = _both(0, dataset=Unsharded(), batch_size=3, num_workers=2)
    _assert_same(ref, ours)


def test_iterable_batch_size_none(no_leaks: None) -> None:
    ref, ours = _both(0, dataset=Sharded(10), batch_size=None, num_workers=2)
    _assert_same(ref, ours)


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_in_order_false_same_multiset(num_workers: int, no_leaks: None) -> None:
    ref = list(aioload.DataLoader(Sharded(40), batch_size=3, num_workers=num_workers))
    ours = list(
        aioload.DataLoader(Sharded(40), batch_size=3, num_workers=num_workers, in_order=False)
    )
    key = Counter(tuple(b.tolist()) for b in ours)
    assert key == Counter(tuple(b.tolist()) for b in ref)
    ds = Augmented()
    flat = [
        int(i)
        for b in aioload.DataLoader(ds, batch_size=4, num_workers=num_workers, in_order=False)
        for i in b["index"]
    ]
    assert sorted(flat) == list(range(len(ds)))


def test_worker_seeds_and_info_match_torch(no_leaks: None) -> None:
    ref, ours = _both(7, dataset=Seeds(), batch_size=2, num_workers=3)
    _assert_same(ref, ours)
    assert list(aioload.DataLoader(_SameInfo(), batch_size=None, num_workers=2)) == [True] * 4
    ids = {int(b[0][0]) for b in ours}
    assert ids == {0, 1, 2}


class _SameInfo(Dataset[bool]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> bool:
        info = aioload.get_worker_info()
        return info is not None and info is torch.utils.data.get_worker_info()


def test_get_worker_info_is_none_in_main_process() -> None:
    assert aioload.get_worker_info() is None
    seen = list(aioload.DataLoader(_InfoDataset(), batch_size=None))
    assert seen == [None, None]


class _InfoDataset(Dataset[Any]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        return aioload.get_worker_info()


_init_marker: list[int] = []


def _init_fn(worker_id: int) -> None:
    _init_marker.append(worker_id * 100 + os.getpid() % 100)


class _InitSeen(Dataset[int]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        info = aioload.get_worker_info()
        assert info is not None
        assert _init_marker == [info.id * 100 + os.getpid() % 100]
        return info.id


def test_worker_init_fn_runs_in_each_worker(no_leaks: None) -> None:
    out = list(
        aioload.DataLoader(_InitSeen(), batch_size=None, num_workers=3, worker_init_fn=_init_fn)
    )
    assert out == [0, 1, 2, 0, 1, 2]
    assert _init_marker == [], "worker_init_fn must not run in the parent"


class _Pid(Dataset[int]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        return os.getpid()


def test_reiterable_across_epochs(no_leaks: None) -> None:
    loader = aioload.DataLoader(Augmented(), batch_size=8, num_workers=2, shuffle=True)
    epochs = [[int(i) for b in loader for i in b["index"]] for _ in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(53))
    assert epochs[0] != epochs[1], "a new shuffle each epoch"


def test_persistent_workers_keep_processes_between_epochs(no_leaks: None) -> None:
    loader = aioload.DataLoader(_Pid(), batch_size=None, num_workers=2, persistent_workers=True)
    first = set(loader)
    second = set(loader)
    assert len(first) == 2 and first == second
    loader.shutdown()


def test_persistent_workers_match_torch_across_epochs(no_leaks: None) -> None:
    results = []
    for cls in (torch.utils.data.DataLoader, aioload.DataLoader):
        torch.manual_seed(3)
        gen = torch.Generator()
        gen.manual_seed(4)
        loader = cls(
            Augmented(),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            generator=gen,
        )
        results.append([list(loader) for _ in range(3)])
        del loader
    _assert_same(results[0], results[1])


def test_persistent_break_then_next_epoch_is_complete(no_leaks: None) -> None:
    loader = aioload.DataLoader(Augmented(), batch_size=4, num_workers=2, persistent_workers=True)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    flat = [int(i) for b in loader for i in b["index"]]
    assert flat == list(range(53))
    loader.shutdown()


def test_is_a_torch_dataloader_and_len() -> None:
    loader = aioload.DataLoader(Augmented(), batch_size=4)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert len(loader) == len(torch.utils.data.DataLoader(Augmented(), batch_size=4)) == 14
    assert len(iter(loader)) == 14  # type: ignore[arg-type]


def test_exports() -> None:
    for name in (
        "DataLoader",
        "get_worker_info",
        "WorkerInfo",
        "default_collate",
        "default_convert",
        "WorkerError",
        "WorkerDiedError",
        "DataLoaderTimeoutError",
    ):
        assert hasattr(aioload, name), name
    assert aioload.default_collate is torch.utils.data.default_collate
    assert aioload.default_convert is torch.utils.data.default_convert
    assert issubclass(aioload.WorkerInfo, torch.utils.data.dataloader._utils.worker.WorkerInfo)
