"""The floor of a workload: its samples made and stacked in ``num_workers`` processes, no loader.

Each process takes every ``num_workers``-th batch (as the loaders' round-robin does), makes its
samples with the same dataset the loaders read (the async version, with the same concurrency,
where aioload reads that one) and ``torch.stack``s them into one reused shared-memory buffer.
Nothing is sent anywhere: what a loader adds on top (transport, reordering, the consumer's side)
is the gap between its items/s and this one's. Each process counts its own steady state (after
its first batch) for at least ``min_seconds``; the floor is the sum of their rates.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Iterator
from typing import Any

import torch

from aioload._worker.heap import HeapPolicy
from benchmarks.workloads import WORKLOADS, make_dataset


def _kwargs(workload: str) -> dict[str, Any]:
    """aioload's extra arguments for ``workload`` (none for the sweep's ``bytes:N``)."""
    known = WORKLOADS.get(workload)
    return dict(known.aioload_kwargs) if known else {}


class _Stacker:
    """Stacks a batch of samples into one buffer, allocated in shared memory on first use and
    reused while the batch's shape and dtype stay the same.

    It keeps the malloc thresholds aioload's workers pin (``aioload._worker.heap``): without them
    glibc may give each batch's freed samples back to the kernel and fault them in again for
    the next, and the floor, the machine's limit for this work, would be what that chance
    made it."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.heap = HeapPolicy()

    def stack(self, samples: list[torch.Tensor]) -> torch.Tensor:
        shape = (len(samples), *samples[0].shape)
        buf = self.buffer
        if buf is None or buf.shape != shape or buf.dtype != samples[0].dtype:
            buf = torch.empty(shape, dtype=samples[0].dtype).share_memory_()  # type: ignore[no-untyped-call]
            self.buffer = buf
            self.heap.batch_made(buf.numel() * buf.element_size())
        return torch.stack(samples, out=buf)


def _my_batches(size: int, batch_size: int, worker_id: int, num_workers: int) -> Iterator[range]:
    batch = worker_id
    while batch * batch_size < size:
        start = batch * batch_size
        yield range(start, min(size, start + batch_size))
        batch += num_workers


class _Count:
    def __init__(self) -> None:
        self.items = 0
        self.batches = 0
        self.t_first = 0.0
        self.t_last = 0.0
        # This process's CPU time at its first and its last batch.
        self.cpu_first = 0.0
        self.cpu_last = 0.0

    def add(self, n: int) -> None:
        now = time.perf_counter()
        cpu = time.process_time()
        if self.batches == 0:
            self.t_first = now
            self.cpu_first = cpu
        else:
            self.items += n
        self.t_last = now
        self.cpu_last = cpu
        self.batches += 1

    def enough(self, min_seconds: float) -> bool:
        return self.batches > 0 and self.t_last - self.t_first >= min_seconds


def _sync_floor(dataset: Any, cfg: Any, worker_id: int, count: _Count) -> None:
    stacker = _Stacker()
    for _epoch in range(cfg.max_epochs):
        for indices in _my_batches(cfg.size, cfg.batch_size, worker_id, cfg.num_workers):
            stacker.stack([dataset[i] for i in indices])
            count.add(len(indices))
            if count.enough(cfg.min_seconds):
                return


class _AsyncPass:
    """One epoch of a worker's indices, fetched ``concurrency`` at a time."""

    def __init__(self, dataset: Any, cfg: Any, worker_id: int, count: _Count) -> None:
        self.dataset = dataset
        self.cfg = cfg
        self.count = count
        self.stacker = _Stacker()
        batches = _my_batches(cfg.size, cfg.batch_size, worker_id, cfg.num_workers)
        self.indices = iter([i for batch in batches for i in batch])
        self.done: list[torch.Tensor] = []
        self.stop = False

    async def pull(self) -> None:
        size = self.cfg.batch_size
        for i in self.indices:
            if self.stop:
                return
            # Awaited first: `self.done` is rebound below, and an append bound before the await
            # would land in a list already taken.
            sample = await self.dataset[i]
            self.done.append(sample)
            if len(self.done) >= size:
                batch, self.done = self.done[:size], self.done[size:]
                self.stacker.stack(batch)
                self.count.add(len(batch))
                self.stop = self.count.enough(self.cfg.min_seconds)


async def _async_floor(dataset: Any, cfg: Any, worker_id: int, count: _Count) -> None:
    """``concurrency`` samples in flight at once, as aioload's worker keeps them."""
    concurrency = int(_kwargs(cfg.workload).get("worker_concurrency", 1))
    context = dataset if hasattr(dataset, "__aenter__") else contextlib.nullcontext(dataset)
    async with context:
        for _epoch in range(cfg.max_epochs):
            one = _AsyncPass(dataset, cfg, worker_id, count)
            await asyncio.gather(*(one.pull() for _ in range(concurrency)))
            if one.stop:
                return


def _floor_process(cfg: Any, worker_id: int, conn: multiprocessing.connection.Connection) -> None:
    torch.set_num_threads(1)  # as a loader's worker runs
    asynchronous = bool(_kwargs(cfg.workload))
    dataset = make_dataset(
        cfg.workload, cfg.size, cfg.cpu_iters, asynchronous=asynchronous, url=cfg.url
    )
    count = _Count()
    if asynchronous:
        import uvloop

        # The loop aioload's workers run (uvloop), so the floor is not held back by its loop.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_async_floor(dataset, cfg, worker_id, count))
    else:
        _sync_floor(dataset, cfg, worker_id, count)
    conn.send(
        (count.items, count.t_last - count.t_first, count.batches, count.cpu_last - count.cpu_first)
    )
    conn.close()


def measure_floor(cfg: Any) -> dict[str, Any]:
    """Run the floor's processes; the result has the keys a loader run reports."""
    ctx = multiprocessing.get_context("fork")
    t0 = time.perf_counter()
    pipes, procs = [], []
    for worker_id in range(cfg.num_workers):
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_floor_process, args=(cfg, worker_id, sender), daemon=True)
        proc.start()
        sender.close()
        pipes.append(receiver)
        procs.append(proc)
    results = [pipe.recv() for pipe in pipes]
    for proc in procs:
        proc.join()
    items = sum(r[0] for r in results)
    rate = sum(r[0] / r[1] for r in results if r[1] > 0)
    cpu = sum(r[3] for r in results)
    return {
        "items": items,
        "batches": sum(r[2] for r in results),
        "epochs": 1,
        "steady_items": items,
        "steady_s": min((r[1] for r in results), default=0.0),
        "items_per_s": rate if rate > 0 else float("nan"),
        "parent_cpu_per_batch_s": float("nan"),
        # The floor's processes stand where a loader's workers do.
        "worker_cpu_per_item_s": cpu / items if items > 0 and cpu > 0 else float("nan"),
        "ttfb_s": float("nan"),
        "construct_s": 0.0,
        "teardown_s": 0.0,
        "total_s": time.perf_counter() - t0,
    }
