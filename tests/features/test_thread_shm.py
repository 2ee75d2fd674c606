"""A loader with thread workers creates nothing in shared memory: no ``/dev/shm`` file, no
memfd, while it runs or after. Batches are handed over by reference (docs/threads.md).

Watched from inside this process (``/proc/self/maps`` and ``/proc/self/fd``), since
``/dev/shm`` is the whole machine's and other programs come and go in it. A loader with worker
processes, whose batches arrive in shared-memory slabs, shows that the watch sees them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import aioload

pytestmark = [
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.own_worker_method("every test here says which worker methods it runs"),
]


def _shared(path: str) -> bool:
    return path.startswith("/dev/shm/") or path.startswith("/memfd:")


def shared_memory_in_use() -> set[str]:
    """The shared-memory files this process maps or holds a descriptor of."""
    seen = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _shared(fields[5]):
            seen.add(fields[5])
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (the listing's own descriptor, closed by now)
        if _shared(target):
            seen.add(target)
    return seen


class Images(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 64, 64), i, dtype=torch.uint8)


def new_shared_memory_while_loading(**kwargs: Any) -> tuple[set[str], int]:
    """What shared memory appeared while the loader ran (its batches all kept alive), and
    how many batches it made."""
    before = shared_memory_in_use()
    loader = aioload.DataLoader(Images(), batch_size=4, num_workers=2, **kwargs)
    appeared: set[str] = set()
    kept = []
    for batch in loader:
        kept.append(batch)
        appeared |= shared_memory_in_use() - before
    appeared |= shared_memory_in_use() - before
    return appeared, len(kept)


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_thread_workers_create_nothing_in_shared_memory(persistent_workers: bool) -> None:
    appeared, batches = new_shared_memory_while_loading(
        worker_method="thread", persistent_workers=persistent_workers
    )
    assert batches == 12
    assert appeared == set()


def test_the_watch_sees_the_slabs_of_worker_processes() -> None:
    appeared, batches = new_shared_memory_while_loading(worker_method="multiprocessing")
    assert batches == 12
    assert appeared, "worker processes' batches arrive in shared memory the watch should see"


def test_the_watch_sees_a_tensor_moved_to_shared_memory() -> None:
    # A user's collate_fn that moves the batch to shared memory (torch's file_descriptor
    # strategy: a /dev/shm file unlinked once opened, or a memfd): seen, under threads too.
    def to_shared(samples: list[torch.Tensor]) -> torch.Tensor:
        batch = torch.stack(samples)
        batch.share_memory_()  # type: ignore[no-untyped-call]
        return batch

    appeared, _ = new_shared_memory_while_loading(worker_method="thread", collate_fn=to_shared)
    assert appeared
