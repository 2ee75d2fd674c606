"""Datasets shared by the test files.

They live in an importable module (``tests.scripts.datasets``) so that workers started with the
``spawn`` and ``forkserver`` contexts, and the child scripts in this folder, can unpickle them.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset


class FnDataset(Dataset[Any]):
    """``n`` samples, each what ``fn`` makes of its index."""

    def __init__(self, fn: Callable[[int], Any], n: int) -> None:
        self.fn = fn
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.fn(i)


class Squares(Dataset[torch.Tensor]):
    """``[i, i*i]`` for each index."""

    def __init__(self, n: int = 37) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


class Numbers(Dataset[torch.Tensor]):
    """``[i, -i]`` for each index, each sample taking ``delay`` seconds."""

    def __init__(self, n: int = 40, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor([i, -i])


class Scalars(Dataset[torch.Tensor]):
    """``tensor(i)`` for each index, each sample taking ``delay`` seconds; index ``fail_at``
    raises ``ValueError("bad sample <i>")``."""

    def __init__(self, n: int, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.n = n
        self.delay = delay
        self.fail_at = fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fail_at:
            raise ValueError(f"bad sample {i}")
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor(i)


class DistinctiveError(Exception):
    """An ordinary exception type, re-creatable from a message."""


class TwoArgError(Exception):
    """An exception whose constructor cannot take a single message argument."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code={code} detail={detail}")
        self.code = code
        self.detail = detail


class FailingAt(Dataset[torch.Tensor]):
    """Raises at one index; the exception object raised last is kept in ``raised`` (visible in
    the calling process only, which is what ``num_workers=0`` tests need)."""

    def __init__(self, n: int, bad: int, two_arg: bool = False) -> None:
        self.n = n
        self.bad = bad
        self.two_arg = two_arg
        self.raised: list[BaseException] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            try:
                if self.two_arg:
                    raise TwoArgError(7, f"two-arg-marker index {i}")
                raise DistinctiveError(f"getitem-marker index {i}")
            except Exception as exc:
                self.raised.append(exc)
                raise
        return torch.tensor([i])


# What collate_failing_on_5 raised in this process (num_workers=0 tests check the identity).
COLLATE_RAISED: list[BaseException] = []


def collate_failing_on_5(batch: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(batch)
    if 5 in stacked[:, 0].tolist():
        try:
            raise DistinctiveError("collate-marker saw index 5")
        except DistinctiveError as exc:
            COLLATE_RAISED.append(exc)
            raise
    return stacked


def init_failing_on_worker_1(worker_id: int) -> None:
    if worker_id == 1:
        raise DistinctiveError(f"init-marker worker {worker_id}")


class SlowAt(Dataset[torch.Tensor]):
    """Sleeps ``seconds`` at index ``slow`` (touching ``marker`` first, when given)."""

    def __init__(self, n: int, slow: int, seconds: float, marker: str | None = None) -> None:
        self.n = n
        self.slow = slow
        self.seconds = seconds
        self.marker = marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.slow:
            if self.marker is not None:
                Path(self.marker).write_text(str(os.getpid()))
            time.sleep(self.seconds)
        return torch.tensor([i])


class Slow(Dataset[torch.Tensor]):
    """Every sample takes ``seconds``; each sample is ``[i, pid of the process that made it]``."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n = n
        self.seconds = seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.seconds)
        return torch.tensor([i, os.getpid()])


class Pids(Dataset[torch.Tensor]):
    """``[i, pid of the process that made it]``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, os.getpid()])


class Noisy(Dataset[torch.Tensor]):
    """``[i, a number from the worker's torch RNG]``: equal across runs only if every worker
    is seeded the same way."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 1_000_000, ()))])


class LazyFile(Dataset[torch.Tensor]):
    """Opens ``path`` on first use in whichever process fetches (as datasets do with h5py or
    lmdb handles), runs a garbage collection, then reads through the handle."""

    def __init__(self, n: int, path: str) -> None:
        self.n = n
        self.path = path
        self.handle: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.handle is None:
            self.handle = open(self.path, "rb")  # noqa: SIM115 - kept open, like a db handle
        gc.collect()
        self.handle.seek(0)
        return torch.tensor([i, len(self.handle.read(10))])


class DiesAt(Dataset[torch.Tensor]):
    """The process fetching index ``at`` dies (once: ``marker`` records that it happened, with
    the pid and the ``time.monotonic()`` at which the fatal fetch started).

    ``how``: ``"sigkill"`` (kills itself), ``"segv"`` (reads address 0) or ``"exit3"``
    (``os._exit(3)``).
    """

    def __init__(self, n: int, at: int, how: str, marker: str) -> None:
        self.n = n
        self.at = at
        self.how = how
        self.marker = marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.at and not os.path.exists(self.marker):
            Path(self.marker).write_text(f"{os.getpid()} {time.monotonic()!r}")
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.how == "segv":
                ctypes.string_at(0)
            elif self.how == "exit3":
                os._exit(3)
            else:  # pragma: no cover
                raise AssertionError(self.how)
            time.sleep(60)  # pragma: no cover - the signal is on its way
        return torch.tensor([i])


class MallocBatches(Dataset[torch.Tensor]):
    """Each sample makes and frees a batch's worth of heap blocks (64 of 150 KiB, as a batch
    of decoded images does), and is the page faults its process took since its previous
    sample: with the worker heap policy (aioload._worker.heap), none after the first few."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.last: int | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        import resource

        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        size = 150 * 1024
        blocks = [libc.malloc(size) for _ in range(64)]
        for block in blocks:
            ctypes.memset(block, 1, size)
        for block in blocks:
            libc.free(block)
        now = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        faults = -1 if self.last is None else now - self.last
        self.last = now
        return torch.tensor(faults)


class KillsItselfOnce(Dataset[int]):
    """SIGKILLs its worker the first time it reaches ``at`` (a marker file remembers)."""

    def __init__(self, n: int, at: int, marker: Path) -> None:
        self.n = n
        self.at = at
        self.marker = str(marker)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.at and not os.path.exists(self.marker):
            with open(self.marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        return i


class Sharded(IterableDataset[int]):
    """Splits ``range(n)`` between workers with ``get_worker_info()``, as torch documents:
    worker ``k`` of ``m`` yields ``k, k + m, ...`` (uneven shards where ``m`` does not divide
    ``n``); without workers, all of it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


class StuckAfter(Dataset[torch.Tensor]):
    """``[i, pid]`` for the first ``fast`` indices; every later one gets stuck in user code for
    ``seconds``: sleeping (``how="sleep"``), or holding the GIL in C code (``how="gil"``, a
    regular expression that backtracks for longer than any test runs)."""

    def __init__(self, n: int, fast: int, seconds: float = 40.0, how: str = "sleep") -> None:
        self.n = n
        self.fast = fast
        self.seconds = seconds
        self.how = how

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= self.fast:
            if self.how == "gil":
                import re

                re.match(r"(a+)+$", "a" * 64 + "b")
            else:
                time.sleep(self.seconds)
        return torch.tensor([i, os.getpid()])
