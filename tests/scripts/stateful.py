"""Datasets and samplers with torchdata's Stateful protocol (``state_dict()`` and
``load_state_dict()``), for the resume tests; importable by module path, as workers (and Ray
actors) need. Every state here is plain JSON data.

A dataset's state is per worker (``PerWorker``): each worker process moves its own copy of the
dataset, while thread workers share the one object (docs/threads.md), so what a worker moves
is kept under that worker's key, and ``state_dict()``/``load_state_dict()`` read and write the
calling worker's own. The same dataset is then correct under either ``worker_method``, and a
state taken under one resumes under the other."""

from __future__ import annotations

import copy
import os
import random
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler

T = TypeVar("T")


class PerWorker(Generic[T]):
    """One ``T`` per worker, and one for the calling process's own fetches (no worker): what a
    copy of the dataset per worker process would give, with thread workers too.

    A worker's value starts as a copy of the calling process's, as a worker process's copy of
    the dataset does. The key is the worker's id *and* its seed: a fresh pool of workers (the
    next pass without ``persistent_workers``) has new seeds, so its workers start from the
    dataset's own state, as fresh worker processes do, while kept workers go on from theirs."""

    def __init__(self, value: T) -> None:
        self.main = value
        self.workers: dict[tuple[int, int], T] = {}
        self.lock = threading.Lock()

    @staticmethod
    def _key() -> tuple[int, int] | None:
        info = torch.utils.data.get_worker_info()
        return None if info is None else (info.id, info.seed)

    def get(self) -> T:
        key = self._key()
        if key is None:
            return self.main
        with self.lock:  # (threads add their keys at once)
            if key not in self.workers:
                self.workers[key] = copy.deepcopy(self.main)
            return self.workers[key]

    def set(self, value: T) -> None:
        key = self._key()
        if key is None:
            self.main = value
            return
        with self.lock:
            self.workers[key] = value

    def __getstate__(self) -> dict[str, Any]:
        # A copy (a worker process's, pickled in the calling process) starts from the
        # caller's value; a lock does not pickle.
        return {"main": self.get()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.main = state["main"]
        self.workers = {}
        self.lock = threading.Lock()


def _rng_state(rng: random.Random) -> dict[str, Any]:
    version, internal, gauss = rng.getstate()
    return {"version": version, "internal": list(internal), "gauss": gauss}


def _set_rng_state(rng: random.Random, state: dict[str, Any]) -> None:
    rng.setstate((state["version"], tuple(state["internal"]), state["gauss"]))


def _worker() -> tuple[int, int]:
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class RngMap(Dataset[int]):
    """Map-style, with a random draw of its own per sample (its RNG is its state): sample ``i``
    is ``i * 1000 + draw``, so the draw exposes whether each worker's RNG went on where it was."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = PerWorker(random.Random(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index * 1000 + self.rng.get().randrange(1000)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": _rng_state(self.rng.get())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _set_rng_state(self.rng.get(), state["rng"])


class DiesOnce(RngMap):
    """``RngMap`` whose worker dies (SIGKILL) the first time it fetches ``at``: a marker file
    remembers it happened."""

    def __init__(self, n: int, at: int, marker: str) -> None:
        super().__init__(n)
        self.at = at
        self.marker = marker

    def __getitem__(self, index: int) -> int:
        if index == self.at and not os.path.exists(self.marker):
            with open(self.marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


class Counting(Dataset[tuple[int, int, int]]):
    """Map-style: sample ``i`` is ``(i, worker id, fetches this worker had made before)``; the
    count is its state."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = PerWorker(0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int, int]:
        count = self.count.get()
        self.count.set(count + 1)
        return (index, _worker()[0], count)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count.get()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count.set(state["count"])


@dataclass
class _Position:
    """Where an ``EpochStream`` stands: its epoch and its position in it."""

    epoch: int = 0
    pos: int = 0


class EpochStream(IterableDataset[int]):
    """An IterableDataset whose state (its position and an epoch counter it moves itself when a
    pass ends) is the dataset's: each pass yields ``epoch * 1000 + i``, the ``i`` split among
    the workers, plus ``100_000 * (worker seed % 97)`` in a worker (its seed changes with each
    pool of fresh workers) unless ``seeded`` is False."""

    def __init__(self, n: int, seeded: bool = True) -> None:
        self.n = n
        self.seeded = seeded
        self.position = PerWorker(_Position())

    def __iter__(self) -> Iterator[int]:
        worker, workers = _worker()
        info = torch.utils.data.get_worker_info()
        seeded = 0 if info is None or not self.seeded else 100_000 * (info.seed % 97)
        at = self.position.get()
        while at.pos < self.n:
            i = at.pos
            at.pos += 1
            if i % workers == worker:
                yield seeded + at.epoch * 1000 + i
        at.pos = 0
        at.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        at = self.position.get()
        return {"epoch": at.epoch, "pos": at.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        at = self.position.get()  # (in place: a stream already made reads this one)
        at.epoch, at.pos = state["epoch"], state["pos"]


class SelfIterating(IterableDataset[int]):
    """A dataset that is its own iterator: ``iter()`` starts it over, and its position is known
    only once it has been iterated (so its state must be loaded after ``iter()``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> SelfIterating:
        self.position = 0
        return self

    def __next__(self) -> int:
        worker, workers = _worker()
        while self.position < self.n:
            self.position += 1
            if (self.position - 1) % workers == worker:
                return self.position - 1
        raise StopIteration

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class _Cursor:
    """The Stateful iterator ``CursorStream`` returns."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.at = 0

    def __iter__(self) -> _Cursor:
        return self

    def __next__(self) -> int:
        if self.at >= len(self.items):
            raise StopIteration
        self.at += 1
        return self.items[self.at - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.at = state["at"]


class CursorStream(IterableDataset[int]):
    """An IterableDataset without a state of its own whose iterator has one."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> _Cursor:
        worker, workers = _worker()
        return _Cursor(list(range(worker, self.n, workers)))


class RngSampler(Sampler[int]):
    """A sampler with its own RNG, whose state also holds where it is in the current order (a
    resumed iterator goes on from there, as torchdata's samplers do)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.order: list[int] | None = None
        self.position = 0
        self.resuming = False

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if not self.resuming:
            self.order = list(range(self.n))
            self.rng.shuffle(self.order)
            self.position = 0
        self.resuming = False
        assert self.order is not None
        while self.position < self.n:
            self.position += 1
            yield self.order[self.position - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": _rng_state(self.rng), "order": self.order, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _set_rng_state(self.rng, state["rng"])
        self.order, self.position = state["order"], state["position"]
        self.resuming = self.order is not None and self.position < self.n


class RngBatchSampler(Sampler[list[int]]):
    """A batch sampler with its own RNG and state: random batches of ``size``."""

    def __init__(self, n: int, size: int, seed: int = 0) -> None:
        self.sampler = RngSampler(n, seed)
        self.size = size

    def __len__(self) -> int:
        return -(-self.sampler.n // self.size)

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.size:
                yield batch
                batch = []
        if batch:
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
