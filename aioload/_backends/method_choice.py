"""``worker_method="auto"``: threads or processes, chosen by measurement.

Decided once per loader, before its first pass with workers (``_engine.setup.auto_worker_method``),
and reported with its figures in ``stats().as_dict()["tuning"]["worker_method"]``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from typing import Any

from .base import WorkerSpec

__all__ = ["choose_worker_method"]

# How long each half of the trial fetches (one thread, then the workers' threads at once).
_TRIAL_S = 0.15
# The most samples one thread fetches in a half (a fast dataset is decided in far less time,
# yet in enough samples that starting the threads does not weigh on its rate).
_TRIAL_MAX_SAMPLES = 2048
# What a worker process spends per sample beyond the dataset's own work, that a thread does
# not: its share of the batch's trip to the consumer (packing, the socket, the slab, and the
# consumer's unpacking), and of the process's bookkeeping. Set from the tiny benchmark, where
# it is all there is: 2 worker processes deliver about 70 % of twice what one thread fetches.
_PROCESS_OVERHEAD_PER_SAMPLE_S = 1.5e-6
# Threads are chosen where they fetch at least this share of what the processes are estimated
# to deliver: within the estimate's error, threads are the cheaper (no copy of the dataset per
# worker, no /dev/shm, a faster first batch).
_THREADS_AT_LEAST = 0.9
# The trial threads' generators (``get_worker_info().rng``) are seeded from this, not from the
# pass's base seed, which is not drawn yet (drawing it would move torch's generator).
_TRIAL_BASE_SEED = 0


def choose_worker_method(spec: WorkerSpec, cores: int) -> dict[str, Any]:
    """``worker_method="auto"``, decided once per loader, before its first pass with
    workers: threads on a free-threaded interpreter; otherwise a short trial in this process
    measures how the dataset's samples scale across threads (the GIL decides it: decoding and
    I/O release it, pure-Python samples do not). Threads are chosen where
    ``n = min(num_workers, cores)`` threads fetch at least ``_THREADS_AT_LEAST`` times what
    ``n`` processes are estimated to deliver: ``n`` times one thread's rate, each sample
    costing a process ``_PROCESS_OVERHEAD_PER_SAMPLE_S`` more (its trip to the consumer), so
    that a fast sample, where that trip is most of the cost, can go to threads that scale
    less than ``n`` times. The trial restores the process-wide generators it may have drawn
    from. Returns the choice with its reason and figures (``stats()["tuning"]``)."""
    choice: dict[str, Any] = {"auto": True}
    is_gil_enabled = getattr(sys, "_is_gil_enabled", None)
    if is_gil_enabled is not None and not is_gil_enabled():
        return {**choice, "value": "thread", "reason": "free-threaded interpreter"}
    workers = max(1, min(spec.num_workers, cores))
    dataset = spec.dataset
    from .._worker.async_detect import is_async_dataset
    from .._worker.datapipes import is_datapipe
    from .._worker.fetch import is_stateful

    untried = None
    if is_datapipe(dataset):
        untried = "a DataPipe is sharded and reseeded in each worker's own copy"
    elif spec.dataset_kind == 1:
        untried = "an IterableDataset is not tried (its stream would be drawn from)"
    elif is_async_dataset(dataset, spec.dataset_kind) or is_stateful(dataset):
        untried = "an async or Stateful dataset is not tried"
    elif workers < 2:
        untried = "one usable core: threads cannot run in parallel"
    if untried is not None:
        return {**choice, "value": "multiprocessing", "reason": untried}
    drew_rng = threading.Event()
    try:
        one, many = _trial(spec, workers, drew_rng)
    except Exception as error:
        return {**choice, "value": "multiprocessing", "reason": f"the trial failed: {error!r}"}
    processes = _processes_estimate(one, workers)
    threads = many >= _THREADS_AT_LEAST * processes
    reason = (
        f"{workers} threads fetched {many:.0f} samples/s, "
        f"{'at least' if threads else 'under'} {_THREADS_AT_LEAST:g}x the "
        f"{processes:.0f} estimated for {workers} processes"
    )
    if drew_rng.is_set():
        # Written for thread workers: a worker process's get_worker_info().rng is None, as
        # torch's is, and every sample would fail there.
        threads = True
        reason = "the dataset uses get_worker_info().rng, which thread workers alone have"
    return {
        **choice,
        "value": "thread" if threads else "multiprocessing",
        "reason": reason,
        "samples_per_s_one_thread": round(one, 1),
        f"samples_per_s_{workers}_threads": round(many, 1),
        f"samples_per_s_{workers}_processes_estimated": round(processes, 1),
    }


def _processes_estimate(one: float, workers: int) -> float:
    """What ``workers`` processes would deliver, each on a core of its own, each sample
    costing what it cost one thread plus a process's overhead per sample."""
    if one <= 0:
        return 0.0
    return workers / (1.0 / one + _PROCESS_OVERHEAD_PER_SAMPLE_S)


def _trial(spec: WorkerSpec, workers: int, drew_rng: threading.Event) -> tuple[float, float]:
    """Samples per second of one thread, then of ``workers`` threads at once, each fetching
    for ``_TRIAL_S`` (map-style: indices from 0 on, wrapping round); ``drew_rng`` is set if a
    sample used its ``get_worker_info().rng``."""
    from .._worker.fetch import RngStates

    size = len(spec.dataset)
    if size == 0:
        raise ValueError("an empty dataset")
    saved = RngStates()
    try:
        one = _rate(spec, size, 1, drew_rng)
        many = _rate(spec, size, workers, drew_rng)
    finally:
        saved.install()
    return one, many


class _WatchedRng:
    """A trial thread's ``get_worker_info().rng``: its generators, noting that the dataset
    asked for one."""

    __slots__ = ("_rng", "_used")

    def __init__(self, rng: Any, used: threading.Event) -> None:
        self._rng = rng
        self._used = used

    def __getattr__(self, name: str) -> Any:
        self._used.set()
        return getattr(self._rng, name)


def _as_worker(spec: WorkerSpec, worker_id: int, drew_rng: threading.Event) -> None:
    """The calling trial thread's ``get_worker_info()``: a thread worker's, as worker
    ``worker_id`` of the loader's ``num_workers`` (a dataset written for thread workers reads
    its ``id`` or draws from its ``rng``), with generators of the trial's own, seeded from
    ``_TRIAL_BASE_SEED``: the workers' real ones, seeded from the pass's base seed, are not
    drawn from. No ``worker_init_fn``: it runs once per worker, in the workers."""
    from .._worker.info import install_thread_hook, set_thread_worker_info

    install_thread_hook()
    set_thread_worker_info(
        _TRIAL_BASE_SEED,
        worker_id,
        functools.partial(_WatchedRng, used=drew_rng),
        num_workers=spec.num_workers,
        dataset=spec.dataset,
        rank=spec.rank,
        world_size=spec.world_size,
    )


def _rate(spec: WorkerSpec, size: int, workers: int, drew_rng: threading.Event) -> float:
    from .._worker.info import _set_thread_worker_info

    dataset = spec.dataset
    counts = [0] * workers
    errors: list[BaseException] = []
    start = threading.Barrier(workers + 1)

    def fetch(k: int) -> None:
        try:
            _as_worker(spec, k, drew_rng)
            start.wait()
            deadline = time.perf_counter() + _TRIAL_S
            index = k
            while counts[k] < _TRIAL_MAX_SAMPLES and time.perf_counter() < deadline:
                dataset[index % size]
                counts[k] += 1
                index += workers
        except BaseException as error:  # (reported to the caller)
            errors.append(error)
            start.abort()  # (the caller's wait ends, and so do the other threads')
        finally:
            _set_thread_worker_info(None)

    threads = [
        threading.Thread(target=fetch, args=(k,), name="aioload-trial", daemon=True)
        for k in range(workers)
    ]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait()
    for thread in threads:
        # (Bounded: a sample that hangs here leaves the choice to processes.)
        thread.join(_TRIAL_S * 20)
    took = time.perf_counter() - began
    if errors:
        raise errors[0]
    if any(thread.is_alive() for thread in threads):
        raise TimeoutError("a sample took too long")
    return sum(counts) / took if took > 0 else 0.0
