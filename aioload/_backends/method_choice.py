"""``worker_method="auto"``: threads or processes, chosen by measurement.

Decided once per loader, when its first pass with workers starts them
(``_engine.setup.auto_worker_method``; under ``async for``, in a thread, off the loop), and
reported with its figures in ``stats().as_dict()["tuning"]["worker_method"]``.

NOTE [ the trial in a copy ]
The trial runs the user's dataset in threads that look like worker threads, and it runs in a
forked copy of this process, which reports its figures through a pipe and ends. In the calling
process, the trial's threads left their marks on the one dataset object the workers then get:
what a sample opens per worker (a connection in a dict keyed by ``get_worker_info().id``, made
in a trial thread and bound to it) reached the real worker threads, or was copied into the
forked worker processes; and a sample still running when the trial gave up on it kept running,
holding whatever lock it held while the worker processes were forked, so that they inherited
it locked and hung. In the copy, all of it ends with the copy (the trial's figures are the
same: it runs on the same pages). It also sees whether a sample drew from the process-wide
generators, without restoring them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import select
import signal
import sys
import threading
import time
from typing import Any

import torch

from .._named_tuple import NamedTuple
from .base import WorkerSpec

__all__ = ["choose_worker_method"]

# How long each half of the trial fetches (one thread, then the workers' threads at once),
# after the one thread's untimed warm-up.
_TRIAL_S = 0.15
_WARM_UP_S = 0.05
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
# The most the trial may take, in all, before its copy is stopped and processes are chosen
# (each phase's threads are given _TRIAL_S * 20 to finish their sample: see _rates).
_TRIAL_DEADLINE_S = 10.0
# The trial threads' generators (``get_worker_info().rng``) are seeded from this, not from the
# pass's base seed, which is not drawn yet (drawing it would move torch's generator).
_TRIAL_BASE_SEED = 0


def choose_worker_method(spec: WorkerSpec, cores: int) -> dict[str, Any]:
    """``worker_method="auto"``, decided once per loader, when its first pass with workers
    makes them: threads on a free-threaded interpreter; otherwise a short trial, in a forked
    copy of this process (NOTE [ the trial in a copy ]), measures how the dataset's samples
    scale across threads (the GIL decides it: decoding and I/O release it, pure-Python
    samples do not). Threads are chosen where
    ``n = min(num_workers, cores)`` threads fetch at least ``_THREADS_AT_LEAST`` times what
    ``n`` processes are estimated to deliver: ``n`` times one thread's rate, each sample
    costing a process ``_PROCESS_OVERHEAD_PER_SAMPLE_S`` more (its trip to the consumer), so
    that a fast sample, where that trip is most of the cost, can go to threads that scale
    less than ``n`` times. A dataset that uses its ``get_worker_info().rng`` gets threads, one
    that draws from the process-wide generators processes. Returns the choice with its
    reason and figures (``stats()["tuning"]``)."""
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
    elif spec.num_workers < 2:
        untried = "one worker: a thread shares the GIL with the consumer, a process runs beside it"
    elif workers < 2:
        untried = "one usable core: threads cannot run in parallel"
    if untried is not None:
        return {**choice, "value": "multiprocessing", "reason": untried}
    if not hasattr(os, "fork"):
        return {**choice, "value": "multiprocessing", "reason": "no fork() to try threads in"}
    try:
        trial = _isolated_trial(spec, workers)
    except Exception as error:
        failure = str(error) if isinstance(error, _TrialFailed) else repr(error)
        return {**choice, "value": "multiprocessing", "reason": f"the trial failed: {failure}"}
    one, many = trial.one, trial.many
    processes = _processes_estimate(one, workers)
    threads = many >= _THREADS_AT_LEAST * processes
    reason = (
        f"{workers} threads fetched {many:.0f} samples/s, "
        f"{'at least' if threads else 'under'} {_THREADS_AT_LEAST:g}x the "
        f"{processes:.0f} estimated for {workers} processes"
    )
    if trial.drew_rng:
        # Written for thread workers: a worker process's get_worker_info().rng is None, as
        # torch's is, and every sample would fail there.
        threads = True
        reason = "the dataset uses get_worker_info().rng, which thread workers alone have"
    elif trial.drew_globals and threads:
        # Each worker process seeds its own global generators (and seed_per_sample reseeds
        # them per sample): its draws are reproducible. Threads share one set, drawn from in
        # whatever order they run; "auto" does not trade that away for speed.
        threads = False
        reason = (
            f"{reason}; but the dataset draws from the process-wide generators (random, "
            "numpy's, torch's), which threads share: processes keep its draws reproducible"
        )
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


class _TrialFailed(Exception):
    """The trial raised, in its copy: the error's ``repr`` is this one's message."""


class _Trial(NamedTuple):
    """What the trial measured (samples per second, one thread and ``workers`` at once), and
    what the dataset drew from: its ``get_worker_info().rng``, the process-wide generators."""

    one: float
    many: float
    drew_rng: bool
    drew_globals: bool


def _isolated_trial(spec: WorkerSpec, workers: int) -> _Trial:
    """The trial, run in a forked copy of this process (NOTE [ the trial in a copy ]); raises
    ``_TrialFailed`` naming what it raised there, or ``TimeoutError``."""
    read_end, write_end = os.pipe()
    # What this process has buffered for its stdout and stderr goes out now, once: the copy
    # would inherit it, and write it again when a sample prints (multiprocessing's fork does
    # the same before each fork).
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    pid = os.fork()
    if pid == 0:  # (the copy: it reports, and ends without running anything of the parent's)
        try:
            os.close(read_end)
            _silence()  # (what the trial's samples print is not the user's output)
            # torch's ops on one intra-op thread, as in a worker process (torch's own call) and
            # in a thread worker (its own OpenMP limit): the trial measures what they would do.
            torch.set_num_threads(1)
            gc.freeze()  # (a collection would write to every page shared with the parent)
            try:
                report = json.dumps(_trial(spec, workers)._asdict())
            except BaseException as error:
                report = json.dumps({"error": repr(error)})
            with os.fdopen(write_end, "w") as out:
                out.write(report)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        report_text = _read_report(read_end, time.monotonic() + _TRIAL_DEADLINE_S)
    finally:
        os.close(read_end)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # (gone by now, unless it overran the deadline)
        os.waitpid(pid, 0)
    if report_text is None:
        raise TimeoutError(f"the trial took over {_TRIAL_DEADLINE_S:g} s")
    report = json.loads(report_text)
    if "error" in report:
        raise _TrialFailed(report["error"])
    return _Trial(**report)


def _silence() -> None:
    """In the trial's copy: its stdout and stderr go nowhere."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.dup2(null, fd)
    os.close(null)


def _read_report(fd: int, deadline: float) -> str | None:
    """All the copy writes before it ends, or None at ``deadline``."""
    chunks: list[bytes] = []
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks).decode()
        chunks.append(chunk)
    return None


def _trial(spec: WorkerSpec, workers: int) -> _Trial:
    """Samples per second of one thread, then of ``workers`` threads at once (map-style:
    indices from 0 on, wrapping round), and what the samples drew from."""
    from .._worker.fetch import RngStates

    size = len(spec.dataset)
    if size == 0:
        raise ValueError("an empty dataset")
    drew_rng = threading.Event()
    before = RngStates()
    one, many = _rates(spec, size, workers, drew_rng)
    return _Trial(one, many, drew_rng.is_set(), not before.same_as(RngStates()))


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


def _rates(
    spec: WorkerSpec, size: int, workers: int, drew_rng: threading.Event
) -> tuple[float, float]:
    """Samples per second of one thread, then of ``workers`` threads at once, each half
    fetching for ``_TRIAL_S``. The one thread is the first of the ``workers``, as a worker
    thread serves pass after pass: what a sample keeps per worker thread (a connection bound
    to the thread that opened it) is found again by the same thread."""
    from .._worker.info import _set_thread_worker_info

    dataset = spec.dataset
    # (A warm-up first, by the one thread, untimed: in the trial's copy the first samples
    # touch pages still shared with the parent, each touch a copy, which the one thread's
    # rate would otherwise pay alone, making the threads look better than they are.)
    phases = ((_WARM_UP_S, False), (_TRIAL_S, False), (_TRIAL_S, True))
    counts = [[0] * workers for _ in phases]
    errors: list[BaseException] = []
    in_step = threading.Barrier(workers + 1)  # (each phase starts, and ends, for all at once)

    def fetch(k: int) -> None:
        try:
            _as_worker(spec, k, drew_rng)
            for phase, (seconds, all_threads) in enumerate(phases):
                in_step.wait()
                fetching = all_threads or k == 0
                step = workers if all_threads else 1
                deadline = time.perf_counter() + seconds
                index = k
                while fetching and counts[phase][k] < _TRIAL_MAX_SAMPLES:
                    dataset[index % size]
                    counts[phase][k] += 1
                    index += step
                    fetching = time.perf_counter() < deadline
                in_step.wait()
        except threading.BrokenBarrierError:
            pass  # (the trial gave up: the caller says why)
        except BaseException as error:  # (reported to the caller)
            errors.append(error)
            in_step.abort()  # (the caller's wait ends, and so do the other threads')
        finally:
            _set_thread_worker_info(None)

    for k in range(workers):
        threading.Thread(target=fetch, args=(k,), name="aioload-trial", daemon=True).start()
    rates = []
    for phase in range(len(phases)):
        try:
            # (Bounded: a sample that hangs here leaves the choice to processes.)
            in_step.wait(_TRIAL_S * 20)
            began = time.perf_counter()
            in_step.wait(_TRIAL_S * 20)
        except threading.BrokenBarrierError:
            if errors:
                raise errors[0] from None
            raise TimeoutError("a sample took too long") from None
        took = time.perf_counter() - began
        rates.append(sum(counts[phase]) / took if took > 0 else 0.0)
    return rates[1], rates[2]
