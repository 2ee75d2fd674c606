"""Datasets that hold multiprocessing objects work under every start method, as with torch.

A Lock, Event, Condition or Value of the loader's ``multiprocessing_context`` may only reach a
child while multiprocessing is spawning it. torch hands the dataset to ``Process(args=...)``;
aioload pickled it itself beforehand, which failed with "... objects should only be shared
between processes through inheritance" under spawn and forkserver.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import aioload
from tests.helpers import batches_and_errors

pytestmark = pytest.mark.timeout(60)

METHODS = ["fork", "spawn", "forkserver"]


class Synchronised(Dataset[torch.Tensor]):
    """Uses one object of each kind in every sample."""

    def __init__(self, context: Any, n: int) -> None:
        self.n = n
        self.lock = context.Lock()
        self.started = context.Event()
        self.condition = context.Condition()
        self.count = context.Value("i", 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.lock:
            self.count.value += 1
        with self.condition:
            self.condition.notify_all()
        return torch.tensor([i, int(self.started.is_set())])


class DiesOnce(Synchronised):
    """The first worker to reach ``victim`` exits; the Value says it has happened."""

    def __init__(self, context: Any, n: int, victim: int) -> None:
        super().__init__(context, n)
        self.victim = victim
        self.died = context.Value("i", 0)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.victim:
            with self.died.get_lock():
                first = self.died.value == 0
                self.died.value = 1
            if first:
                os._exit(3)
        return super().__getitem__(i)


class FailsAt(Synchronised):
    def __init__(self, context: Any, n: int, bad: int) -> None:
        super().__init__(context, n)
        self.bad = bad

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            with self.lock:
                raise ValueError(f"sample {i} is bad")
        return super().__getitem__(i)


def _count_worker(counter: Any, worker_id: int) -> None:
    with counter.get_lock():
        counter.value += 1


def _init_fails(event: Any, worker_id: int) -> None:
    event.set()
    raise KeyError(f"worker {worker_id} cannot start")


def _indices(batches: list[torch.Tensor]) -> list[int]:
    return sorted(int(row[0]) for batch in batches for row in batch)


@pytest.mark.parametrize("method", METHODS)
def test_lock_event_condition_value_reach_the_workers(method: str, stop_mp_helpers: None) -> None:
    context = multiprocessing.get_context(method)
    dataset = Synchronised(context, 12)
    started_workers = context.Value("i", 0)
    loader = aioload.DataLoader(
        dataset,
        batch_size=3,
        num_workers=2,
        multiprocessing_context=method,
        worker_init_fn=functools.partial(_count_worker, started_workers),
    )
    dataset.started.set()  # after the loader is built: the workers see the shared event
    batches = list(loader)
    assert _indices(batches) == list(range(12))
    assert all(int(row[1]) == 1 for batch in batches for row in batch)
    assert dataset.count.value == 12  # every worker incremented the one shared Value
    assert started_workers.value == 2


def test_replaced_and_persistent_workers_get_them_too(stop_mp_helpers: None) -> None:
    """A replacement worker (max_worker_restarts) and a second epoch of persistent workers,
    under spawn, where each start pickles the dataset again."""
    context = multiprocessing.get_context("spawn")
    dataset = DiesOnce(context, 12, victim=4)
    loader = aioload.DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        multiprocessing_context=context,
        persistent_workers=True,
        max_worker_restarts=1,
    )
    dataset.started.set()
    with pytest.warns(RuntimeWarning, match="replaced it with a new worker"):
        first = list(loader)
    second = list(loader)
    loader.shutdown()
    assert _indices(first) == _indices(second) == list(range(12))
    assert dataset.died.value == 1
    assert dataset.count.value == 24


def test_getitem_error_keeps_torchs_type_and_message(stop_mp_helpers: None) -> None:
    context = multiprocessing.get_context("forkserver")
    loader = aioload.DataLoader(
        FailsAt(context, 8, bad=5), batch_size=2, num_workers=1, multiprocessing_context=context
    )
    out = batches_and_errors(loader, (ValueError,))
    errors = [str(x) for x in out if isinstance(x, ValueError)]
    seen = [int(row[0]) for batch in out if not isinstance(batch, ValueError) for row in batch]
    # Batch [4, 5] failed in worker 0, and the pass went on, as in torch.
    assert seen == [0, 1, 2, 3, 6, 7]
    assert len(errors) == 1
    assert errors[0].startswith(
        "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback"
    )
    assert errors[0].rstrip().endswith("ValueError: sample 5 is bad")


def test_worker_init_fn_error_keeps_torchs_type_and_message(stop_mp_helpers: None) -> None:
    context = multiprocessing.get_context("spawn")
    event = context.Event()
    loader = aioload.DataLoader(
        Synchronised(context, 4),
        batch_size=2,
        num_workers=1,
        multiprocessing_context=context,
        worker_init_fn=functools.partial(_init_fails, event),
    )
    with pytest.raises(KeyError) as caught:
        next(iter(loader))
    message = str(caught.value.args[0])
    assert message.startswith("Caught KeyError in DataLoader worker process 0.\nOriginal Trace")
    assert "KeyError: 'worker 0 cannot start'" in message
    assert event.is_set()  # the worker's set() reached the parent's Event
