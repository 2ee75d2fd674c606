"""Resume where the randomness is global: datasets whose state *is* the process's torch RNG
(``state_dict()`` returns ``torch.get_rng_state()``) and whose samples draw ``torch.randint``
from it, in the workers and in the calling process, and a shuffle with no ``generator=``.

A resumed loader must draw from the process-wide generators exactly what an uninterrupted one
draws, in the same order, around the restore of each dataset's state: a draw too many or too
few (a base seed drawn after the dataset's RNG state was restored, a state taken before the
pass drew) shifts every sample after the checkpoint by one draw. Each check compares with the
uninterrupted run, as torchdata's StatefulDataLoader suite does for the same datasets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import aioload

pytestmark = [
    # Each worker process has its own torch RNG, which is these datasets' state; thread workers
    # share the process-wide generators (docs/threads.md; tests/features/test_threads.py).
    pytest.mark.processes_only(
        "a dataset's state is its worker process's own torch RNG: thread workers share one"
    ),
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.timeout(120),
]

N = 24


def _identity(batch: Any) -> Any:
    return batch


class RngDrawingMap(Dataset[int]):
    """Sample ``i`` is ``i * 1000`` plus a draw from torch's global RNG; its state is that RNG."""

    def __init__(self, draw: bool = True) -> None:
        self.draw = draw

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index * 1000 + (int(torch.randint(1000, (1,)).item()) if self.draw else 0)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["rng"])


class _DrawingIterator:
    """An iterator with a state (its position and torch's global RNG) over its worker's share."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.position = 0

    def __iter__(self) -> _DrawingIterator:
        return self

    def __next__(self) -> int:
        if self.position >= len(self.items):
            raise StopIteration
        self.position += 1
        return self.items[self.position - 1] * 1000 + int(torch.randint(1000, (1,)).item())

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]
        torch.set_rng_state(state["rng"])


class RngDrawingStream(IterableDataset[int]):
    """An IterableDataset with no state of its own; the iterator it returns has one."""

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return _DrawingIterator(list(range(worker, N, workers)))


class RngDrawingSelfIterator(IterableDataset[int], _DrawingIterator):
    """An IterableDataset that is its own iterator, its state the iterator's."""

    def __init__(self) -> None:
        _DrawingIterator.__init__(self, list(range(N)))

    def __iter__(self) -> RngDrawingSelfIterator:
        return self


def _make(kind: str, workers: int, **extra: Any) -> Callable[[], aioload.DataLoader[Any]]:
    def make() -> aioload.DataLoader[Any]:
        if kind == "map":
            dataset: Any = RngDrawingMap()
            generator = torch.Generator().manual_seed(13)
            extra.setdefault(
                "sampler", torch.utils.data.RandomSampler(dataset, generator=generator)
            )
            extra.setdefault("batch_size", 3)
        else:
            dataset = RngDrawingStream() if kind == "stream" else RngDrawingSelfIterator()
        return aioload.DataLoader(dataset, num_workers=workers, collate_fn=_identity, **extra)

    return make


CASES = [
    (kind, workers, interrupt)
    for kind in ("map", "stream", "self-iterating")
    for workers in (0, 2)
    for interrupt in (0, 1, 5)
    if not (kind == "self-iterating" and workers)  # (one object, one stream)
]


@pytest.mark.parametrize(("kind", "workers", "interrupt"), CASES)
def test_mid_pass_resume_draws_as_the_uninterrupted_run(
    kind: str, workers: int, interrupt: int
) -> None:
    """Checkpointed after ``interrupt`` batches (0: right after ``iter()``), the rest of the
    pass, and a fresh loader resumed from the state in the same process: the same samples.
    (Before, with num_workers=0 and a state taken right after iter(), every sample after it
    was off by one draw: the state held the dataset's RNG as it was before the pass drew its
    base seed.)"""
    make = _make(kind, workers)
    loader = make()
    iterator = iter(loader)
    for _ in range(interrupt):
        next(iterator)
    state = loader.state_dict()
    expected = list(iterator)
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == expected


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_state_taken_right_after_iter_on_persistent_workers(kind: str) -> None:
    """The state right after ``iter()``, the pass run out, then the state loaded back into the
    same loader: its kept workers had drawn through the whole pass, so the resumed pass runs
    on fresh ones seeded as the state says (before, on the kept ones: other samples)."""
    loader = _make(kind, 2, persistent_workers=True)()
    iterator = iter(loader)
    state = loader.state_dict()
    expected = list(iterator)
    loader.load_state_dict(state)
    assert list(loader) == expected
    loader.shutdown()


def test_the_first_state_loaded_into_a_loader_three_batches_in() -> None:
    """A state taken before any pass, loaded into a persistent loader that has already
    yielded 3 batches: the whole first pass again, as the first loader had it."""
    make = _make("map", 2, persistent_workers=True, sampler=None, shuffle=False)
    first = make()
    state = first.state_dict()
    expected = list(first)
    first.shutdown()
    loader = make()
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    loader.load_state_dict(state)
    assert list(loader) == expected
    loader.shutdown()


def test_states_loaded_back_and_forth_in_the_calling_process() -> None:
    """num_workers=0, a shuffle from the global RNG and a dataset drawing from it: the state
    right after iter(), 4 batches, the state then, the rest of the pass resumed from that one,
    then the whole pass again from the first: the same samples."""
    loader = aioload.DataLoader(RngDrawingMap(), shuffle=True, collate_fn=_identity)
    iterator = iter(loader)
    first = loader.state_dict()
    expected = [next(iterator) for _ in range(4)]
    fourth = loader.state_dict()
    loader.load_state_dict(fourth)
    expected += list(loader)
    loader.load_state_dict(first)
    assert list(loader) == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_a_between_epochs_state_in_the_same_process(workers: int) -> None:
    """Two epochs, ``state_dict()``, a new loader given it, two more epochs: the orders of a
    four-epoch run after the same ``torch.manual_seed(0)``, with ``shuffle=True`` and no
    ``generator=``: each epoch's order comes from the global RNG, which the same process has
    moved the same way. The dataset's state is that RNG too (before, with num_workers=0,
    loading it after the pass had drawn its order put the RNG back, and the fourth epoch
    repeated the third's order)."""

    def make() -> aioload.DataLoader[Any]:
        return aioload.DataLoader(RngDrawingMap(draw=False), shuffle=True, num_workers=workers)

    torch.manual_seed(0)
    loader = make()
    got = [[int(i) for i in batch] for _ in range(2) for batch in loader]
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    got += [[int(i) for i in batch] for _ in range(2) for batch in resumed]
    torch.manual_seed(0)
    again = make()
    assert got == [[int(i) for i in batch] for _ in range(4) for batch in again]
