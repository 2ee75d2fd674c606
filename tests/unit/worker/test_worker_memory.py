"""What a worker does with memory between batches: the C heap keeps a batch's freed samples
for the next batch, freed slabs reach the worker before it needs them (small ones on its next
task, instead of in a write of their own), and a collate_fn of the user's own stacks into the
slab without ever seeing what it keeps overwritten."""

from __future__ import annotations

import collections
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import aioload
from aioload._wire import channel as _channel
from aioload._wire import slabs as _transport
from aioload._wire.messages import FreeSlabs, Task
from aioload._worker import main as _worker_main
from tests.helpers import run_fresh, within
from tests.scripts.datasets import MallocBatches

# One "batch" made and freed with libc's own malloc: 64 blocks of 150 KiB, each written, then
# all freed, as a worker does with a batch of decoded images. Prints the page faults per batch.
_MALLOC_BATCHES = """
import ctypes, os, resource, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "policy":
    from aioload._worker.heap import HeapPolicy
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


@pytest.mark.timeout(60)
def test_workers_keep_freed_samples_for_the_next_batch(no_leaks: None) -> None:
    loader = aioload.DataLoader(MallocBatches(24), batch_size=2, num_workers=2)
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
def _waits_of(pool: _transport.WorkerSlabPool, worker: Any) -> list[float]:
    """Hook the worker's socket up to its pool, as a sync worker process does; the list
    collects how long each call to it was allowed to wait."""
    waits: list[float] = []

    def take_in_frees(wait_s: float) -> None:
        waits.append(wait_s)
        worker._take_in_frees(wait_s)

    pool.take_in_frees = take_in_frees
    return waits


_LARGE = _transport.EAGER_FREE_BYTES


def test_a_worker_waits_for_a_free_rather_than_make_a_third_large_slab(
    over_a_socket: tuple[_transport.WorkerSlabPool, Any, _channel.ParentChannel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two large slabs in use (the batch the consumer holds, the one waiting its turn): the
    third batch waits for the consumer to drop the first instead of making a slab."""
    pool, worker, parent = over_a_socket
    waits = _waits_of(pool, worker)
    monkeypatch.setattr(_transport, "_FREE_PATIENCE_MAX_S", 3600.0)
    pool.batch_s = 1800.0  # an hour's patience: only the free below can end the wait
    held = pool.acquire(_LARGE)
    pool.acquire(_LARGE)
    assert waits == [0.0, 0.0], "the first two slabs are made without waiting"

    def free_later() -> None:
        time.sleep(0.05)
        parent.queue(FreeSlabs([held.id]))
        parent.pump_out()

    sender = threading.Thread(target=free_later)
    sender.start()
    started = time.perf_counter()
    try:
        got = pool.acquire(_LARGE)
    finally:
        sender.join()
    assert got is held and len(pool.slabs) == 2
    assert waits[2:] == [pytest.approx(3600.0, abs=0.01)], "no wait, or not patient"
    assert time.perf_counter() - started < within(20)  # a hang guard: the free ended the wait


def test_a_wait_in_vain_is_short_and_the_next_slabs_are_made_without_one(
    over_a_socket: tuple[_transport.WorkerSlabPool, Any, _channel.ParentChannel],
) -> None:
    """A consumer that keeps its batches (``list(loader)``) never frees a slab: the worker
    waits at most about two batches' time once, then makes slabs without waiting."""
    pool, worker, _ = over_a_socket
    waits = _waits_of(pool, worker)
    pool.batch_s = 0.004
    for _ in range(2):
        pool.acquire(_LARGE)
    started = time.perf_counter()
    pool.acquire(_LARGE)
    waited = time.perf_counter() - started
    assert len(pool.slabs) == 3
    assert waits[2:] == [pytest.approx(0.009)]
    assert waited >= 0.008, "the wait was cut short"
    del waits[:]
    for _ in range(_transport._WAITS_SKIPPED_AFTER_IN_VAIN):
        pool.acquire(_LARGE)
    assert set(waits) == {0.0}, "a wait after one in vain"
    assert len(pool.slabs) == 3 + _transport._WAITS_SKIPPED_AFTER_IN_VAIN
    pool.acquire(_LARGE)
    assert waits[-1] > 0, "the waits resume after the skipped ones"


def test_no_wait_for_a_small_slab_or_a_parent_that_is_gone(
    over_a_socket: tuple[_transport.WorkerSlabPool, Any, _channel.ParentChannel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small slab's free comes with the worker's next task, so none is waited for. A wait
    ends at once when the parent is gone: the worker ends at its next read between tasks."""
    pool, worker, parent = over_a_socket
    waits = _waits_of(pool, worker)
    monkeypatch.setattr(_transport, "_FREE_PATIENCE_MAX_S", 3600.0)
    pool.batch_s = 1800.0  # an hour's patience: only the parent's going can end the wait
    for _ in range(3):
        pool.acquire(_transport._MIN_SLAB)
    assert set(waits) == {0.0}
    for _ in range(2):
        pool.acquire(_LARGE)
    parent.sock.close()
    started = time.perf_counter()
    pool.acquire(_LARGE)
    assert time.perf_counter() - started < within(10)  # a hang guard
    assert waits[-1] == pytest.approx(3600.0, abs=0.01) and len(pool.slabs) == 6


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


class _LargeBatches(Dataset[torch.Tensor]):
    """Sample i is 256 KiB full of i: a batch of 8 is a 2 MiB slab, whose frees the parent
    sends at once and a worker waits for."""

    def __len__(self) -> int:
        return 8 * 48

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((64, 1024), index, dtype=torch.int32)


def _assert_batch(k: int, batch: torch.Tensor) -> None:
    want = torch.arange(8 * k, 8 * k + 8, dtype=torch.int32)
    assert torch.equal(batch[:, 0, 0], want) and torch.equal(batch[:, -1, -1], want), k


@pytest.mark.timeout(60)
def test_large_batches_kept_or_dropped_arrive_whole(no_leaks: None) -> None:
    """End to end, with the waits for a large slab's free: a consumer that keeps every batch
    (its workers wait in vain, then make slabs) and one that drops each as it takes the next
    (they wait and reuse two) both get every batch, none overwritten."""
    loader = aioload.DataLoader(_LargeBatches(), batch_size=8, num_workers=2)
    kept = list(loader)
    assert len(kept) == 48
    for k, batch in enumerate(kept):
        _assert_batch(k, batch)
    assert len({batch.data_ptr() for batch in kept}) == 48
    del kept
    for _ in range(2):
        seen = 0
        for k, batch in enumerate(loader):
            _assert_batch(k, batch)
            seen += 1
        assert seen == 48


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
