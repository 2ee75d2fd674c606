"""The datasets of the contract suite, importable by module path (a worker process or a Ray
actor unpickles them).

Each sample says where it was made: ``[index, worker id (-1 in the calling process), pid]``.
What a case needs a worker to do at a given sample (wait for another batch, die, hang, fail)
is done by ``Scripted`` around the plain dataset, with files in the test's temporary folder as
the signals: they reach a worker whatever runs it (a process, a thread, an actor).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, get_worker_info

from tests.helpers import within

# How long a scripted wait (a gate, a hang) lasts at most: a hang guard, far past what any
# case needs, so that a thread left waiting still ends.
LONGEST_WAIT_S = 30.0


def _worker_id() -> int:
    info = get_worker_info()
    return -1 if info is None else info.id


class Where(Dataset[torch.Tensor]):
    """``n`` samples, each ``[index, worker id, pid]``."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, _worker_id(), os.getpid()])


class FailsAt(Where):
    """``Where``, but sample ``bad`` is missing (a ``KeyError``, as a dict lookup raises)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.bad:
            raise KeyError(f"sample {index} is missing")
        return super().__getitem__(index)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + within(LONGEST_WAIT_S)
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.005)


def _first_time(path: Path) -> bool:
    """Whether this is the first call for ``path`` in any process: it makes the file."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    return True


@dataclass
class Script:
    """What ``Scripted`` does, by sample index (None: nothing), with its signal files in
    ``folder``. ``late``: ``(index, signal)``: sample ``index`` waits until the file
    ``signal`` is in ``folder`` (``started-<j>`` once sample ``j`` has been started).
    ``kill``: the worker fetching this sample SIGKILLs itself, the first time. ``hang``:
    fetching this sample hangs, the first time, until the test ends."""

    folder: Path
    late: tuple[int, str] | None = None
    kill: int | None = None
    hang: int | None = None

    def signal(self, name: str) -> None:
        (self.folder / name).touch()

    def release(self) -> None:
        """Ends every hang: the test is over."""
        (self.folder / "released").touch()


class Scripted(Dataset[torch.Tensor]):
    """``dataset`` with ``script`` applied to its samples."""

    def __init__(self, dataset: Dataset[torch.Tensor], script: Script) -> None:
        self.dataset = dataset
        self.script = script

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> torch.Tensor:
        script = self.script
        folder = script.folder
        (folder / f"started-{index}").touch()
        if script.late is not None and index == script.late[0]:
            _wait_for(folder / script.late[1])
        if index == script.kill and _first_time(folder / "killed"):
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(LONGEST_WAIT_S)  # the signal ends the process before this does
        if index == script.hang and _first_time(folder / "hung"):
            _wait_for(folder / "released")
        return self.dataset[index]


def record_init(log: Path, worker_id: int) -> None:
    """A ``worker_init_fn`` (bound to ``log`` with ``functools.partial``): one line per call,
    the id it was given, the id ``get_worker_info()`` says, and the pid."""
    with open(log, "a") as out:
        out.write(f"{worker_id} {_worker_id()} {os.getpid()}\n")
