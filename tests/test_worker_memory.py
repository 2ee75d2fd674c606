"""What a worker does with memory between batches: the C heap keeps a batch's freed samples
for the next batch, freed slabs reach the worker before it needs them (small ones on its next
task, instead of in a write of their own), and a collate_fn of the user's own stacks into the
slab without ever seeing what it keeps overwritten."""

from __future__ import annotations

import collections
import os
import select
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import aioload
from aioload import _channel, _transport, _worker_main
from aioload._messages import FreeSlabs, Task

from .helpers import run_fresh

# One "batch" made and freed with libc's own malloc: 64 blocks of 150 KiB, each written, then
# all freed, as a worker does with a batch of decoded images. Prints the page faults per batch.
_MALLOC_BATCHES = """
import ctypes, os, resource, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "policy":
    from aioload._heap import HeapPolicy
    HeapPolicy()
SIZE = 150 * 1024
def batch():
    blocks = [libc.malloc(SIZE) for _ in range(64)]
    for block in blocks:
        ctypes.memset(block, 1, SIZE)
    for block in blocks:
        libc.free(block)
batch(); batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    batch()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""

_PAGES_PER_BATCH = 64 * 150 * 1024 // 4096


def _faults_per_batch(mode: str) -> float:
    return float(run_fresh(_MALLOC_BATCHES, mode))


def test_the_heap_keeps_a_freed_batch_for_the_next() -> None:
    """glibc gives a whole freed batch back to the kernel (it coalesces at the top of the
    heap), so every batch faults all of its pages in again; the worker's policy keeps it."""
    assert _faults_per_batch("none") > 0.9 * _PAGES_PER_BATCH  # the case the policy is for
    assert _faults_per_batch("policy") < 10


def test_the_heap_policy_leaves_a_users_malloc_settings_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The user asked for trimming above 128 KiB, heap allocations up to 1 MiB: theirs to keep.
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert _faults_per_batch("policy") > 0.9 * _PAGES_PER_BATCH


class _MallocBatches(Dataset[torch.Tensor]):
    """Each sample makes and frees a batch's worth of heap blocks, and is the page faults its
    worker took since its previous sample."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.last: int | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        import ctypes
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


@pytest.mark.timeout(60)
def test_workers_keep_freed_samples_for_the_next_batch(no_leaks: None) -> None:
    loader = aioload.DataLoader(_MallocBatches(24), batch_size=2, num_workers=2)
    faults = torch.cat(list(loader)).tolist()
    # Each worker's first samples set its heap up; after that, nothing is faulted in again.
    steady = faults[8:]
    assert max(steady) < _PAGES_PER_BATCH // 4, faults


def _worker_over(sock: socket.socket, pool: _transport.WorkerSlabPool) -> Any:
    """A worker's message handling over a real socket, without the process."""
    worker: Any = object.__new__(_worker_main._ProcessWorker)
    worker.channel = _channel.WorkerChannel(sock)
    worker.slabs = pool
    worker.step = type("Step", (), {"generation": 0})()
    worker.pending = collections.deque()
    worker.drained = False
    worker.parent_pid = os.getppid()
    worker.poller = select.poll()
    worker.poller.register(sock.fileno(), select.POLLIN)
    return worker


@pytest.fixture
def over_a_socket() -> Iterator[tuple[_transport.WorkerSlabPool, Any, _channel.ParentChannel]]:
    """A worker's slab pool and message handling, and the parent's end of its socket."""
    pool = _transport.WorkerSlabPool(max_idle=3)
    parent_sock, worker_sock = socket.socketpair()
    try:
        yield pool, _worker_over(worker_sock, pool), _channel.ParentChannel(parent_sock)
    finally:
        parent_sock.close()
        worker_sock.close()
        for kept in pool.slabs.values():
            fd = kept.take_fd()
            if fd is not None:
                os.close(fd)


def test_a_slab_freed_right_behind_a_task_is_used_for_it(
    over_a_socket: tuple[_transport.WorkerSlabPool, Any, _channel.ParentChannel],
) -> None:
    """The parent refills the window as it hands a batch over, and frees that batch's slab a
    moment later: both can arrive in the worker's one read. The task must find the slab free,
    not make another."""
    pool, worker, parent = over_a_socket
    slab = pool.acquire(_transport._MIN_SLAB)  # in the parent's hands
    parent.queue(Task(7, 0, [0, 1]))
    parent.queue(FreeSlabs([slab.id]))
    parent.pump_out()
    task = worker._next_message()
    assert task.task_id == 7
    assert worker._current(task)
    assert pool.acquire(_transport._MIN_SLAB) is slab
    assert len(pool.slabs) == 1


def test_slabs_freed_on_a_task_are_free_for_it(
    over_a_socket: tuple[_transport.WorkerSlabPool, Any, _channel.ParentChannel],
) -> None:
    """Small freed slabs ride on the worker's next task (Task.freed_slabs)."""
    pool, worker, parent = over_a_socket
    slab = pool.acquire(_transport._MIN_SLAB)
    parent.queue(Task(3, 0, [4, 5], (slab.id,)))
    parent.pump_out()
    task = worker._next_message()
    assert task.task_id == 3 and worker._current(task)
    assert pool.acquire(_transport._MIN_SLAB) is slab


@pytest.mark.timeout(60)
def test_small_freed_slabs_ride_along_with_the_next_task(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two workers, the batch the consumer drops and the task that refills the window go
    to different workers; a small slab's free then waits for its worker's next task rather
    than costing a write of its own: about one write per batch, not two."""
    writes = 0
    pump_out = _channel.ParentChannel.pump_out

    def counting(self: _channel.ParentChannel) -> None:
        nonlocal writes
        if self.outbox and not self.closed:
            writes += 1
        pump_out(self)

    monkeypatch.setattr(_channel.ParentChannel, "pump_out", counting)
    n_batches = 200
    loader = aioload.DataLoader(list(range(4 * n_batches)), batch_size=4, num_workers=2)
    seen = 0
    for batch in loader:
        seen += len(batch)
        del batch
    assert seen == 4 * n_batches
    # One write per task, plus each worker's pass announcement and a few frees that find no
    # task to ride with; two per batch before.
    assert writes <= n_batches + 10, writes


class _Images(Dataset[torch.Tensor]):
    """Sample i is a 64 KiB tensor full of i: big enough to be stacked into the slab."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((16, 1024), index, dtype=torch.int32)


class _KeepFirstBatch:
    """A collate_fn of the user's own that calls default_collate and keeps the first batch it
    made (or a view of it), answering every fourth batch with it: the "fall back to the last
    good batch" pattern. What it keeps must never be overwritten by a later batch."""

    def __init__(self, keep_view: bool) -> None:
        self.keep_view = keep_view
        self.first: torch.Tensor | None = None
        self.calls = 0

    def __call__(self, samples: list[torch.Tensor]) -> torch.Tensor:
        from torch.utils.data import default_collate

        batch = default_collate(samples)
        self.calls += 1
        if self.first is None:
            self.first = batch[:1] if self.keep_view else batch
        elif self.calls % 4 == 0:
            return self.first
        return batch


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep_view", [False, True], ids=["batch", "view"])
def test_a_batch_a_collate_fn_keeps_is_never_overwritten(no_leaks: None, keep_view: bool) -> None:
    loader = aioload.DataLoader(
        _Images(), batch_size=2, num_workers=1, collate_fn=_KeepFirstBatch(keep_view)
    )
    first_rows = 1 if keep_view else 2
    for epoch in range(2):
        got = [batch.clone() for batch in loader]
        assert len(got) == 32
        for k, batch in enumerate(got):
            if (k + 1) % 4 == 0 and k > 0:
                # The kept first batch of this pass's worker: samples 0 (and 1).
                want = torch.stack(
                    [torch.full((16, 1024), i, dtype=torch.int32) for i in range(first_rows)]
                )
            else:
                want = torch.stack(
                    [torch.full((16, 1024), i, dtype=torch.int32) for i in (2 * k, 2 * k + 1)]
                )
            assert torch.equal(batch, want), (epoch, k)


def _default_collate_of_own(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.utils.data import default_collate

    return {"img": default_collate(samples), "n": torch.tensor(len(samples))}


@pytest.mark.timeout(60)
def test_a_collate_fn_of_ones_own_stacks_into_the_slab(no_leaks: None) -> None:
    """default_collate inside a collate_fn of the user's own stacks into the batch's slab:
    the batch arrives whole, and each worker's slabs stay the size of one batch (a private
    stack copied into the slab would not change that; its cost is in make bench)."""
    loader = aioload.DataLoader(
        _Images(), batch_size=4, num_workers=2, collate_fn=_default_collate_of_own
    )
    for k, batch in enumerate(loader):
        want = torch.stack(
            [torch.full((16, 1024), i, dtype=torch.int32) for i in range(4 * k, 4 * k + 4)]
        )
        assert torch.equal(batch["img"], want) and int(batch["n"]) == 4
