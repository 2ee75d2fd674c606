"""Samplers and batch samplers: the same batches, in the same order, and the same len()."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from .conftest import Reference, batches, plain
from .datasets import Batched, Indices

N = 23


class EveryThird(Sampler[int]):
    """A user sampler (a Sampler subclass with __len__)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, self.n, 3))

    def __len__(self) -> int:
        return len(range(0, self.n, 3))


class PairsOfBatches(Sampler[list[int]]):
    """A user batch sampler whose batches have different sizes."""

    def __iter__(self) -> Iterator[list[int]]:
        yield [0]
        yield [5, 4, 3]
        yield [22, 1]
        yield [7, 8, 9, 10, 11]

    def __len__(self) -> int:
        return 4


def _generator(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Each case builds the loader's keyword arguments afresh (samplers and generators hold state).
SAMPLING: dict[str, Callable[[], dict[str, Any]]] = {
    "sequential": lambda: {"batch_size": 4},
    "sequential drop_last": lambda: {"batch_size": 4, "drop_last": True},
    "shuffle with generator": lambda: {"batch_size": 5, "shuffle": True, "generator": _generator()},
    "shuffle drop_last": lambda: {
        "batch_size": 5,
        "shuffle": True,
        "drop_last": True,
        "generator": _generator(),
    },
    "random with replacement": lambda: {
        "batch_size": 3,
        "sampler": RandomSampler(
            range(N), replacement=True, num_samples=17, generator=_generator()
        ),
    },
    "random without replacement, more samples than data": lambda: {
        "batch_size": 4,
        "sampler": RandomSampler(range(N), num_samples=30, generator=_generator()),
    },
    "weighted": lambda: {
        "batch_size": 4,
        "sampler": WeightedRandomSampler(
            [0.1] * 10 + [2.0] * 13, num_samples=15, generator=_generator()
        ),
    },
    "weighted without replacement": lambda: {
        "batch_size": 2,
        "sampler": WeightedRandomSampler(
            [float(i + 1) for i in range(N)], 9, replacement=False, generator=_generator()
        ),
    },
    "subset random": lambda: {
        "batch_size": 3,
        "sampler": SubsetRandomSampler([2, 4, 6, 8, 10, 12, 14], generator=_generator()),
    },
    "user sampler": lambda: {"batch_size": 2, "sampler": EveryThird(N)},
    "plain list as sampler": lambda: {"batch_size": 2, "sampler": [3, 1, 4, 1, 5, 9, 2, 6]},
    "user batch_sampler": lambda: {"batch_sampler": PairsOfBatches()},
    "plain lists as batch_sampler": lambda: {"batch_sampler": [[1, 2], [3], [20, 21, 22]]},
    "torch BatchSampler": lambda: {
        "batch_sampler": BatchSampler(SequentialSampler(range(N)), batch_size=6, drop_last=True)
    },
    "batch_size None": lambda: {"batch_size": None},
    "batch_size None with shuffle": lambda: {
        "batch_size": None,
        "shuffle": True,
        "generator": _generator(),
    },
    "batch_size larger than dataset": lambda: {"batch_size": 100},
}


def _epochs(loader_cls: type[Any], kwargs: dict[str, Any], num_workers: int) -> dict[str, Any]:
    loader = loader_cls(Indices(N), num_workers=num_workers, **kwargs)
    try:
        length: Any = len(loader)
    except TypeError as error:  # a plain-list batch_sampler has a len; a generator would not
        length = str(error)
    # Two epochs: the second shows that the sampler's generator moves on as in torch.
    return {"len": length, "epochs": [batches(loader), batches(loader)]}


@pytest.mark.parametrize("case", list(SAMPLING))
def test_sampling_single_process(case: str, loader_cls: type[Any], reference: Reference) -> None:
    got = reference.run(lambda cls: _epochs(cls, SAMPLING[case](), num_workers=0))
    expected = reference(lambda cls: _epochs(cls, SAMPLING[case](), num_workers=0))
    assert got == expected
    # What users rely on: len(loader) is the number of batches a pass yields.
    assert got["len"] == len(got["epochs"][0])


def test_sampling_with_workers(loader_cls: type[Any], reference: Reference, no_leaks: None) -> None:
    """Workers do not change the batches: torch's with workers, and the single-process run."""
    for case in ("shuffle drop_last", "user batch_sampler", "batch_size None"):

        def scenario(cls: type[Any], case: str = case) -> dict[str, Any]:
            return _epochs(cls, SAMPLING[case](), num_workers=2)

        got = reference.run(scenario, case)
        assert got == reference(scenario, case)
        assert got == _epochs(loader_cls, SAMPLING[case](), num_workers=0), case


def test_global_seed_drives_default_shuffle(loader_cls: type[Any], reference: Reference) -> None:
    """Without a generator, the shuffle draws from torch's global RNG: the same
    ``torch.manual_seed`` gives the same order as torch's loader."""

    def scenario(cls: type[Any]) -> Any:
        torch.manual_seed(2024)
        loader = cls(Indices(N), batch_size=4, shuffle=True)
        first = batches(loader)
        return first, batches(loader), torch.rand(3).tolist()

    got = reference.run(scenario)
    expected = reference(scenario)
    assert got == expected
    assert got[0] != got[1]  # a new order each epoch


def test_sampler_is_iterated_in_the_calling_process(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """A sampler that reads state the caller changes between epochs sees the change (torch
    iterates the sampler in the calling process, at each pass)."""

    class Window(Sampler[int]):
        def __init__(self) -> None:
            self.start = 0

        def __iter__(self) -> Iterator[int]:
            return iter(range(self.start, self.start + 4))

        def __len__(self) -> int:
            return 4

    def scenario(cls: type[Any]) -> Any:
        sampler = Window()
        loader = cls(Indices(N), batch_size=2, sampler=sampler, num_workers=1)
        first = batches(loader)
        sampler.start = 10
        return first, batches(loader)

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got[0] != got[1]


def test_getitems_is_used_for_batches(loader_cls: type[Any], reference: Reference) -> None:
    def scenario(cls: type[Any]) -> Any:
        return [plain(batch) for batch in cls(Batched(), batch_size=4)]

    got = reference.run(scenario)
    assert got == reference(scenario)
    # Each sample says how many indices its __getitems__ call had: the whole batch at once.
    sizes = [batch[1].tolist() for batch in loader_cls(Batched(), batch_size=4)]
    assert sizes == [[4, 4, 4, 4], [4, 4, 4, 4], [2, 2]]


def test_growing_dataset_len(loader_cls: type[Any], reference: Reference) -> None:
    """len(loader) follows the dataset's current length, as torch's does."""

    def scenario(cls: type[Any]) -> Any:
        data = [1, 2, 3]
        loader = cls(data, batch_size=2, shuffle=False)  # type: ignore[arg-type]
        before = len(loader)
        data.extend([4, 5, 6])
        return before, len(loader), batches(loader)

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got[0] != got[1]
