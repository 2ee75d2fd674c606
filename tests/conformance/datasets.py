"""Datasets and helpers the conformance tests share.

They live in a module of their own (not in a test file) so that workers started with ``spawn``
or ``forkserver`` can import them by name.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset


class Indices(Dataset[int]):
    """Sample ``i`` is ``i``: what a batch holds shows which indices the sampler chose."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class WorkerReport(Dataset[dict[str, Any]]):
    """Each sample says which worker fetched it, with that worker's info and random draws: the
    draws depend on every RNG torch seeds in a worker (torch, ``random``, numpy)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        # A thread worker's own generators are its info's (worker_method="thread"): the
        # process-wide ones are every thread's. They are seeded as a process worker's
        # globals are, so the draws compare with torch's all the same.
        rng = getattr(info, "rng", None) if _is_thread(info) else None
        return {
            "index": i,
            "worker_id": -1 if info is None else info.id,
            "num_workers": 0 if info is None else info.num_workers,
            "seed": -1 if info is None else info.seed,
            "initial_seed": torch.initial_seed()
            if rng is None
            else rng.torch_generator.initial_seed(),
            "dataset_type": "" if info is None else type(info.dataset).__name__,
            "dataset_is_self": info is not None and info.dataset is self,
            "torch": (
                torch.rand(()) if rng is None else torch.rand((), generator=rng.torch_generator)
            ).item(),
            "random": (random if rng is None else rng.random_generator).random(),
            "numpy": int((np.random if rng is None else rng.numpy_generator).randint(0, 2**31)),
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "thread": threading.get_ident(),
            "init_mark": getattr(_init_marks, "mark", ""),
        }


def _is_thread(info: Any) -> bool:
    return info is not None and getattr(info, "worker_method", None) == "thread"


# What worker_init_fn marks, per thread: a worker process's only thread, or a worker thread.
_init_marks = threading.local()


def mark_worker(worker_id: int) -> None:
    """A worker_init_fn whose effect the samples can see (``WorkerReport.init_mark``)."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    _init_marks.mark = f"init-{worker_id}-of-{info.num_workers}"


class Failing(Dataset[int]):
    """Raises ``error`` for index ``bad`` (in whichever process fetches it)."""

    def __init__(self, n: int, bad: int, error: BaseException) -> None:
        self.n = n
        self.bad = bad
        self.error = error

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad:
            raise self.error
        return i


class TwoArgError(Exception):
    """An exception that cannot be rebuilt from a message alone."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code
        self.detail = detail


def failing_init(worker_id: int) -> None:
    raise ValueError(f"worker_init_fn refuses worker {worker_id}")


def failing_collate(batch: list[Any]) -> Any:
    raise ValueError(f"collate refuses a batch of {len(batch)}")


class Sleepy(Dataset[int]):
    """Index ``slow`` takes ``seconds`` to fetch; the others are instant."""

    def __init__(self, n: int, slow: int, seconds: float) -> None:
        self.n = n
        self.slow = slow
        self.seconds = seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.slow:
            time.sleep(self.seconds)
        return i


class Suicidal(Dataset[int]):
    """The worker that fetches index ``bad`` kills itself with ``signum``."""

    def __init__(self, n: int, bad: int, signum: int) -> None:
        self.n = n
        self.bad = bad
        self.signum = signum

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.bad and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), self.signum)
            time.sleep(30)  # the signal ends the process before this does
        return i


KILL = signal.SIGKILL


class Unsharded(IterableDataset[int]):
    """Does not shard itself: every worker yields all of it, in torch as in aioload."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


class LyingLength(IterableDataset[int]):
    """Reports a ``__len__`` smaller than what it yields: torch warns when it notices."""

    def __init__(self, n: int, reported: int) -> None:
        self.n = n
        self.reported = reported

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.reported

    def __repr__(self) -> str:
        # torch's warning names the dataset; a fixed repr keeps the two messages comparable.
        return f"LyingLength(n={self.n}, reported={self.reported})"


class UnevenIterable(IterableDataset[int]):
    """Worker ``k`` yields ``k * 3`` items: one worker yields nothing at all."""

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        return iter(range(100 * worker, 100 * worker + 3 * worker))


class Point(NamedTuple):
    x: torch.Tensor
    label: int


class Mixed(Dataset[dict[str, Any]]):
    """Samples of every type default_collate handles: tensors, numpy arrays and scalars, Python
    numbers, strings, dicts, lists and namedtuples."""

    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "tensor": torch.arange(3, dtype=torch.float32) + i,
            "int_tensor": torch.tensor(i, dtype=torch.int16),
            "array": np.arange(2, dtype=np.int32) * i,
            "np_scalar": np.float64(i) / 2,
            "int": i,
            "float": i / 4,
            "bool": i % 2 == 0,
            "str": f"s{i}",
            "bytes": f"b{i}".encode(),
            "list": [i, i + 1],
            "nested": {"point": Point(torch.ones(2) * i, i)},
        }


class Points(Dataset[Point]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Point:
        return Point(torch.full((2,), float(i)), i)


class CustomPinBatch:
    """A batch type with its own ``pin_memory()``, as torch's docs show; it records the call."""

    def __init__(self, samples: list[int]) -> None:
        self.data = torch.tensor(samples)
        self.pinned = False

    def pin_memory(self) -> CustomPinBatch:
        self.data = self.data.pin_memory()
        self.pinned = True
        return self


def collate_custom_pin(samples: list[int]) -> CustomPinBatch:
    return CustomPinBatch(samples)


def collate_as_sum(samples: list[int]) -> dict[str, Any]:
    return {"sum": sum(samples), "count": len(samples), "samples": tuple(samples)}


class Batched(Dataset[int]):
    """Has ``__getitems__``, which torch's fetcher calls with a whole batch of indices."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        raise AssertionError("__getitems__ should be used")

    def __getitems__(self, indices: list[int]) -> list[tuple[int, int]]:
        return [(i, len(indices)) for i in indices]


class FetchLog(Dataset[int]):
    """Appends each fetched index to a file (one line, O_APPEND, so concurrent workers do not
    interleave): what was fetched, whatever process fetched it."""

    def __init__(self, n: int, path: Path) -> None:
        self.n = n
        self.path = str(path)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{i}\n".encode())
        finally:
            os.close(fd)
        return i


def fetched(path: Path) -> list[int]:
    try:
        return [int(line) for line in path.read_text().split()]
    except FileNotFoundError:
        return []


class Gated(Dataset[int]):
    """Index ``gated`` waits until ``gate`` exists (for at most ``limit`` seconds): the consumer
    opens the gate after it has seen another batch, so batches can finish out of order."""

    def __init__(self, n: int, gated: int, gate: Path, limit: float = 10.0) -> None:
        self.n = n
        self.gated = gated
        self.gate = str(gate)
        self.limit = limit

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.gated:
            deadline = time.monotonic() + self.limit
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        return i


class Tensors(Dataset[torch.Tensor]):
    """Tensor samples, so that batches cross the process boundary as shared memory."""

    def __init__(self, n: int, size: int = 64) -> None:
        self.n = n
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.size,), float(i))


class HoldsEvent(Dataset[bool]):
    """Holds an Event of the loader's start method, as datasets that coordinate with the main
    process do; samples report whether it is set."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> bool:
        return bool(self.event.is_set())


class Versioned(Dataset[int]):
    """Samples are ``version``: shows which copy of the dataset a worker fetches from."""

    def __init__(self) -> None:
        self.version = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return self.version
