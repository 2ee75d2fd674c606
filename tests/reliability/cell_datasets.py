"""Datasets, collates and init functions for the failure matrix (``tests.reliability.cell``).

They live in an importable module so that any start method can unpickle them. Each failure
fires once: the first process to reach it creates ``marker`` (atomically, ``O_EXCL``) and writes
``pid worker_id time.monotonic()`` into it, so the cell knows which worker failed and when, and
the next epoch over the same loader runs clean.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate


class CellError(Exception):
    """An ordinary exception type raised by user code in a worker."""


def fire_once(marker: str) -> bool:
    """True in the first process (and the first time) that gets here; records who and when."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    info = get_worker_info()
    worker_id = -1 if info is None else info.id
    try:
        os.write(fd, f"{os.getpid()} {worker_id} {time.monotonic()!r}".encode())
    finally:
        os.close(fd)
    return True


def die(how: str) -> None:
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "segv":
        ctypes.string_at(0)
    elif how == "exit3":
        os._exit(3)
    else:  # pragma: no cover
        raise AssertionError(how)
    time.sleep(60)  # pragma: no cover - the signal is on its way


class Cell(Dataset[Any]):
    """``torch.full(shape, i)`` for each index ``i``.

    ``how`` says what happens at index ``fail_at`` (once): ``sigkill``, ``segv``, ``exit3``
    (the worker dies), ``raise`` (CellError), ``lock`` (an unpicklable sample) or ``hang``
    (sleeps ``hang_s``). ``slow_s`` is a delay per sample while the file ``fast_flag`` does not
    exist. ``unpicklable`` gives the dataset itself a lock, so it cannot be pickled.
    """

    def __init__(
        self,
        n: int,
        *,
        fail_at: int = -1,
        how: str = "",
        marker: str = "",
        shape: tuple[int, ...] = (1,),
        slow_s: float = 0.0,
        fast_flag: str = "",
        hang_s: float = 30.0,
        unpicklable: bool = False,
    ) -> None:
        self.n = n
        self.fail_at = fail_at
        self.how = how
        self.marker = marker
        self.shape = shape
        self.slow_s = slow_s
        self.fast_flag = fast_flag
        self.hang_s = hang_s
        self.lock = threading.Lock() if unpicklable else None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if self.slow_s and not os.path.exists(self.fast_flag):
            time.sleep(self.slow_s)
        if i == self.fail_at and fire_once(self.marker):
            if self.how == "raise":
                raise CellError(f"getitem-marker index {i}")
            if self.how == "lock":
                return threading.Lock()
            if self.how == "hang":
                time.sleep(self.hang_s)
            else:
                die(self.how)
        return torch.full(self.shape, i, dtype=torch.int64)


class CellStream(IterableDataset[torch.Tensor]):
    """``0..n-1`` split round robin between workers; ``__iter__`` raises CellError in worker
    ``fail_worker`` (once)."""

    def __init__(self, n: int, *, fail_worker: int, marker: str) -> None:
        self.n = n
        self.fail_worker = fail_worker
        self.marker = marker

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker_id, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        if worker_id == self.fail_worker and fire_once(self.marker):
            raise CellError(f"iter-marker worker {worker_id}")
        return (
            torch.full((1,), i, dtype=torch.int64) for i in range(worker_id, self.n, num_workers)
        )


class FailingCollate:
    """default_collate, raising CellError (once) for the batch holding index ``fail_at``."""

    def __init__(self, fail_at: int, marker: str) -> None:
        self.fail_at = fail_at
        self.marker = marker

    def __call__(self, batch: list[torch.Tensor]) -> torch.Tensor:
        stacked: torch.Tensor = default_collate(batch)
        if self.fail_at in stacked.flatten().tolist() and fire_once(self.marker):
            raise CellError(f"collate-marker saw index {self.fail_at}")
        return stacked


class FailingInit:
    """A worker_init_fn raising CellError (once) in worker ``fail_worker``."""

    def __init__(self, fail_worker: int, marker: str) -> None:
        self.fail_worker = fail_worker
        self.marker = marker

    def __call__(self, worker_id: int) -> None:
        if worker_id == self.fail_worker and fire_once(self.marker):
            raise CellError(f"init-marker worker {worker_id}")
