"""The same work as a loader's workers, with no loader: ``n`` plain Python threads, or ``n``
forked processes, each making batches (``dataset[i]`` for a batch's indices, then torch's
``default_collate``) on its own share of the indices, and handing none of them over.

:mod:`benchmarks.threads` runs it as the loaders ``bare-threads`` and ``bare-processes``: their
ratio is how threads compare with processes on this interpreter and machine before any
loader's costs. On a standard (GIL) build, what a sample does while holding the GIL is done by
one thread at a time; processes have no such limit.

Each worker runs torch's ops on one intra-op thread, as the loader's workers do: a process with
``torch.set_num_threads(1)`` (as torch's workers), a thread with its own OpenMP limit (as
aioload's thread workers, ``aioload._backends.thread``).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

KINDS = ("bare-threads", "bare-processes")


def _make_batches(
    dataset: Any, first: int, batch_size: int, min_seconds: float, started: float
) -> tuple[int, float, float]:
    """Batches from index ``first`` on, for ``min_seconds``: (items, seconds, first batch's
    time from ``started``)."""
    from torch.utils.data import default_collate

    size, items, index, first_s = len(dataset), 0, first, 0.0
    begun = time.perf_counter()
    while True:
        default_collate([dataset[(index + j) % size] for j in range(batch_size)])
        index += batch_size
        now = time.perf_counter()
        if not first_s:
            first_s, begun = now - started, now  # steady state from the first batch on
            continue
        items += batch_size
        if now - begun >= min_seconds:
            return items, now - begun, first_s


def _in_thread(dataset: Any, first: int, args: tuple[int, float, float], out: list[Any]) -> None:
    from aioload._backends.thread import _one_intra_op_thread

    _one_intra_op_thread()
    out.append(_make_batches(dataset, first, *args))


def _in_process(dataset: Any, first: int, args: tuple[int, float, float], out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    out.put(_make_batches(dataset, first, *args))


def run_bare(
    kind: str, dataset: Any, workers: int, batch_size: int, min_seconds: float
) -> dict[str, Any]:
    """Items/s summed over the workers (each over its own steady state), and the first batch
    (the earliest worker's, from the start of the run)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    stride = len(dataset) // workers
    started = time.perf_counter()
    args = (batch_size, min_seconds, started)
    results: list[tuple[int, float, float]] = []
    if kind == "bare-threads":
        threads = [
            threading.Thread(target=_in_thread, args=(dataset, k * stride, args, results))
            for k in range(workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_in_process, args=(dataset, k * stride, args, queue))
            for k in range(workers)
        ]
        for p in procs:
            p.start()
        results = [queue.get(timeout=max(60.0, 10 * min_seconds)) for _ in procs]
        for p in procs:
            p.join()
    return {
        "items_per_s": sum(items / seconds for items, seconds, _ in results),
        "first_batch_s": min(first for _, _, first in results),
    }
