"""One cell of the failure matrix, run in a process of its own by ``test_matrix.py``.

Usage::

    python -m tests.reliability.cell CASE --mode sync|async [--backend asyncio|trio]
        [--persistent 0|1] [--pin 0|1]

The cell builds a loader, makes it fail in the way CASE names, catches and describes what the
consumer sees, and times it. Then, still here, it checks what is left: worker processes
(psutil, waiting up to 5 s where they must be gone), descriptors against the count before the
loader existed, and /dev/shm entries against the listing before. Where it makes sense it runs
one more epoch over the same loader and checks every batch. It prints one line,
``RESULT {json}``; the test asserts on it.

``sigint`` and ``parent-sigkill`` print a ``READY {json}`` line first (with the worker pids)
and wait for the test to signal this process.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import faulthandler
import gc
import json
import os
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import psutil
import torch

import aioload
from aioload._wire import slabs as _transport
from tests.helpers import within
from tests.leaks import ProcessTree, shm_entries, shm_leaks
from tests.reliability.cell_datasets import Cell, CellStream, FailingCollate, FailingInit

DEATHS = ("sigkill", "segv", "exit3")
USER_ERRORS = ("getitem", "iter", "collate", "init", "unpicklable-sample")
N = 16
BATCH = 2
# Index 7 is in batch 3, which torch's round robin (and ours) gives to worker 1.
FAIL_AT = 7
TIMEOUT_S = 0.5

# -- measuring -------------------------------------------------------------------------------


def children() -> list[int]:
    """Pids of this process's live descendants (zombies count as gone)."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(out)


def zombies() -> list[int]:
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    return sorted(out)


def wait_gone(since: float, timeout: float = 5.0) -> dict[str, Any]:
    """Wait up to ``within(timeout)`` s for every child to be gone; seconds are counted from
    ``since``."""
    deadline = time.monotonic() + within(timeout)
    while (left := children()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return {"children": left, "gone_s": time.monotonic() - since}


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class Baseline:
    """What was there before the loader: descriptors, and /dev/shm entries. /dev/shm is the
    machine's, so only new entries this process tree made count (tests/leaks.py); the tree is
    watched from here on, so that workers that have exited by the check still count."""

    def __init__(self) -> None:
        gc.collect()
        self.fds = fd_count()
        self.shm = shm_entries()
        self.tree = ProcessTree().start()

    def compare(self) -> dict[str, Any]:
        gc.collect()
        # The watcher opens /proc files: stopped while descriptors are counted, then started
        # again (it keeps the pids seen so far, for a later compare()).
        self.tree.stop()
        result = {
            "fd_growth": fd_count() - self.fds,
            "shm_new": shm_leaks(self.shm, self.tree.pids),
        }
        self.tree.start()
        return result


def after_pass(since: float, base: Baseline, must_close: bool) -> dict[str, Any]:
    """What is left once a pass has ended (``since``). ``must_close``: its workers must stop,
    first by reference counting alone (the iterator is unreachable once the exception or the
    ``for`` loop is gone; automatic collection is off in this process, so this is exact),
    then, whatever is still there, after ``gc.collect()``."""
    if not must_close:
        return {"children": children()}
    # Automatic collection is off: however long this waits, only reference counting can stop
    # the workers before the gc.collect() below (the order is the point, not the time).
    out = {"left_without_gc": wait_gone(since)["children"]}
    gc.collect()
    return {**out, **wait_gone(since), **base.compare()}


def read_marker(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    pid, worker_id, at = path.read_text().split()
    return {"pid": int(pid), "worker_id": int(worker_id), "at": float(at)}


def describe(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "message": str(exc),
        "is_runtime_error": isinstance(exc, RuntimeError),
        "worker_id": getattr(exc, "worker_id", None),
        "pid": getattr(exc, "pid", None),
        "exitcode": getattr(exc, "exitcode", None),
        "timeout": getattr(exc, "timeout", None),
    }


# -- iterating -------------------------------------------------------------------------------


class Pass:
    """What one pass over a loader produced."""

    def __init__(self, keep: bool = False) -> None:
        self.started_at = time.monotonic()
        self.last_at = self.started_at
        self.values: list[list[int]] = []
        self.contents_ok = True
        self.pinned: list[bool] = []
        self.workers: list[int] = []
        self.error: dict[str, Any] | None = None
        self.raised_at: float | None = None
        self.stopped_at: float | None = None
        self.keep = keep
        self.kept: list[torch.Tensor] = []

    def add(self, batch: torch.Tensor) -> None:
        flat = batch.reshape(batch.shape[0], -1) if batch.dim() else batch.reshape(1, 1)
        self.values.append(flat[:, 0].tolist())
        self.contents_ok &= bool((flat == flat[:, :1]).all())
        self.pinned.append(bool(batch.is_pinned()))
        if len(self.values) == 1:
            self.workers = children()
        if self.keep:
            self.kept.append(batch)
        self.last_at = time.monotonic()

    def take(self, batch: torch.Tensor, stop_after: int) -> bool:
        """``add`` the batch; whether the pass stops here, ``stop_after`` batches in."""
        self.add(batch)
        if len(self.values) == stop_after:
            self.stopped_at = time.monotonic()
            return True
        return False

    def fail(self, exc: BaseException) -> None:
        # Only a description is kept: the exception's traceback would hold the iterator.
        self.raised_at = time.monotonic()
        self.error = describe(exc)

    def check_kept(self) -> bool:
        """Every kept batch still holds its own values (no slab was reused under it)."""
        return all(
            bool((b.reshape(b.shape[0], -1) == torch.tensor(v)[:, None]).all())
            for b, v in zip(self.kept, self.values, strict=True)
        )

    def summary(self) -> dict[str, Any]:
        return {
            "values": self.values,
            "contents_ok": self.contents_ok,
            "all_pinned": all(self.pinned),
            "workers": self.workers,
            "error": self.error,
        }


def run_async(fn: Callable[[], Any], backend: str) -> Any:
    if backend == "trio":
        return anyio.run(fn, backend="trio")
    return asyncio.run(fn())


def for_each(loader: Any, opts: argparse.Namespace, see: Callable[[Any], None]) -> None:
    """The whole pass, with ``for`` or ``async for`` (``opts.mode``, on ``opts.backend``),
    handing each batch to ``see``."""
    if opts.mode == "sync":
        for batch in loader:
            see(batch)
        return

    async def consume() -> None:
        async for batch in loader:
            see(batch)

    run_async(consume, opts.backend)


def run_pass(
    loader: Any, mode: str, backend: str = "asyncio", stop_after: int = 0, keep: bool = False
) -> Pass:
    """One pass; an Exception ends it and is recorded, ``stop_after`` batches ``break`` it."""
    rec = Pass(keep=keep)
    if mode == "sync":
        try:
            for batch in loader:
                if rec.take(batch, stop_after):
                    break
        except Exception as exc:
            rec.fail(exc)
        return rec

    async def consume() -> None:
        try:
            async for batch in loader:
                if rec.take(batch, stop_after):
                    break
        except Exception as exc:
            rec.fail(exc)

    run_async(consume, backend)
    return rec


def new_epoch(loader: Any, opts: argparse.Namespace, workers_before: list[int]) -> dict[str, Any]:
    rec = run_pass(loader, opts.mode, opts.backend)
    out = rec.summary()
    out["same_workers"] = bool(workers_before) and rec.workers == workers_before
    return out


def finish(loader: Any, opts: argparse.Namespace, base: Baseline) -> dict[str, Any]:
    """Stop a persistent pool, then everything must be gone."""
    if opts.persistent:
        loader.shutdown()
    gone = wait_gone(time.monotonic())
    return {**gone, **base.compare(), "zombies": zombies()}


def map_loader(dataset: Any, opts: argparse.Namespace, **kwargs: Any) -> aioload.DataLoader[Any]:
    kwargs.setdefault("batch_size", BATCH)
    return aioload.DataLoader(
        dataset,
        num_workers=2,
        persistent_workers=bool(opts.persistent),
        pin_memory=bool(opts.pin),
        **kwargs,
    )


# -- the cases -------------------------------------------------------------------------------


def failure_cell(opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A failure the consumer must see as an exception: a dead worker, an error in user code,
    an unpicklable sample or dataset, a timeout."""
    case = opts.case
    marker = tmp / "marker"
    kwargs: dict[str, Any] = {}
    if case in DEATHS:
        dataset: Any = Cell(N, fail_at=FAIL_AT, how=case, marker=str(marker))
    elif case == "getitem":
        dataset = Cell(N, fail_at=FAIL_AT, how="raise", marker=str(marker))
    elif case == "iter":
        dataset = CellStream(N, fail_worker=1, marker=str(marker))
    elif case == "collate":
        dataset = Cell(N)
        kwargs["collate_fn"] = FailingCollate(FAIL_AT, str(marker))
    elif case == "init":
        dataset = Cell(N)
        kwargs["worker_init_fn"] = FailingInit(1, str(marker))
    elif case == "unpicklable-sample":
        dataset = Cell(N, fail_at=FAIL_AT, how="lock", marker=str(marker))
        kwargs["batch_size"] = None
    elif case == "unpicklable-dataset":
        dataset = Cell(N, unpicklable=True)
        kwargs["multiprocessing_context"] = "spawn"
    elif case == "timeout":
        dataset = Cell(N, fail_at=FAIL_AT, how="hang", marker=str(marker))
        kwargs["timeout"] = TIMEOUT_S
    else:
        raise AssertionError(case)

    base = Baseline()
    loader = map_loader(dataset, opts, **kwargs)
    rec = run_pass(loader, opts.mode, opts.backend)
    result: dict[str, Any] = {"first": rec.summary(), "marker": read_marker(marker)}
    if rec.raised_at is not None:
        result["since_start_s"] = rec.raised_at - rec.started_at
        result["since_last_batch_s"] = rec.raised_at - rec.last_at
        if result["marker"] is not None:
            result["report_s"] = rec.raised_at - result["marker"]["at"]
    # A dead worker breaks the pass (and a persistent pool); an error in user code does not.
    pool_closes = not opts.persistent or case in DEATHS or case == "unpicklable-dataset"
    result["after_error"] = after_pass(rec.raised_at or time.monotonic(), base, pool_closes)

    if case == "unpicklable-dataset":
        # Nothing to heal: the same error again, at once, and nothing started.
        again = run_pass(loader, opts.mode, opts.backend)
        result["again"] = again.summary()
        result["again_s"] = (again.raised_at or time.monotonic()) - again.started_at
    else:
        result["new_epoch"] = new_epoch(
            loader, opts, result["after_error"]["children"] if not pool_closes else []
        )
    result["final"] = finish(loader, opts, base)
    return result


def shm_full_cell(opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Shared memory runs out: each process may create one slab, the next fails with ENOSPC.
    Batches must still arrive whole (by value), kept batches must stay intact."""
    log = tmp / "memfd-log"
    real = _transport._create_memfd
    made: dict[int, int] = {}

    def limited(size: int) -> int:
        pid = os.getpid()
        made[pid] = made.get(pid, 0) + 1
        denied = made[pid] > 1
        with open(log, "a") as f:
            f.write("denied\n" if denied else "made\n")
        if denied:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(size)

    _transport._create_memfd = limited  # workers are forked after this, and inherit it
    base = Baseline()
    # 2 x 32 KiB per batch: large enough for the worker's collate-into-slab path too.
    loader = map_loader(Cell(N, shape=(64, 64)), opts)
    rec = run_pass(loader, opts.mode, opts.backend, keep=True)
    result: dict[str, Any] = {
        "first": rec.summary(),
        "kept_intact": rec.check_kept(),
        "epoch_s": rec.last_at - rec.started_at,
    }
    rec.kept.clear()
    result["new_epoch"] = new_epoch(loader, opts, rec.workers if opts.persistent else [])
    lines = log.read_text().split() if log.exists() else []
    result["memfd"] = {"made": lines.count("made"), "denied": lines.count("denied")}
    result["final"] = finish(loader, opts, base)
    return result


def stop_cell(opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The consumer stops mid-epoch: ``break``, ``del`` of the iterator, a cancelled asyncio
    task, an anyio / trio cancel scope. Workers are stopped (or kept, if persistent), and the
    loader runs a whole new epoch afterwards."""
    case = opts.case
    fast = tmp / "fast"
    # Slow until ``fast`` exists: 12 samples of 0.05 s per worker, so the pass is mid-epoch.
    dataset = Cell(24, slow_s=0.05, fast_flag=str(fast))
    base = Baseline()
    loader = map_loader(dataset, opts)
    result: dict[str, Any] = {}
    if case == "break":
        rec = run_pass(loader, opts.mode, opts.backend, stop_after=3)
        stopped_at = rec.stopped_at
    elif case == "del":
        rec = Pass()
        if opts.mode == "sync":
            it = iter(loader)
            for _ in range(3):
                rec.add(next(it))
            stopped_at = time.monotonic()
            del it
        else:

            async def delete() -> float:
                it = aiter(loader)
                for _ in range(3):
                    rec.add(await anext(it))
                at = time.monotonic()
                del it
                return at

            stopped_at = run_async(delete, opts.backend)
    elif case == "task-cancel":
        rec = Pass()

        async def cancel() -> tuple[float, bool, float]:
            async def consume() -> None:
                async for batch in loader:
                    rec.add(batch)

            task = asyncio.create_task(consume())
            deadline = time.monotonic() + within(10)
            while len(rec.values) < 2 and not task.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            at = time.monotonic()
            task.cancel()
            cancelled = False
            try:
                await task
            except asyncio.CancelledError:
                cancelled = True
            return at, cancelled, time.monotonic() - at

        stopped_at, result["cancelled"], result["cancel_s"] = asyncio.run(cancel())
    elif case == "anyio-cancel":
        rec = Pass()

        async def scoped() -> tuple[float, bool, float]:
            # The scope's deadline is on the backend's clock (trio's is offset): convert.
            offset = time.monotonic() - anyio.current_time()
            with anyio.move_on_after(0.3) as scope:
                async for batch in loader:
                    rec.add(batch)
            return scope.deadline + offset, scope.cancelled_caught, time.monotonic()

        stopped_at, result["cancelled"], left_at = run_async(scoped, opts.backend)
        result["cancel_s"] = left_at - stopped_at
    else:
        raise AssertionError(case)
    assert stopped_at is not None
    result["first"] = rec.summary()
    # A pass that stops does not stop a persistent loader's workers.
    result["after_stop"] = after_pass(stopped_at, base, not opts.persistent)
    fast.touch()
    result["new_epoch"] = new_epoch(loader, opts, rec.workers if opts.persistent else [])
    result["final"] = finish(loader, opts, base)
    return result


def sigint_cell(opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Iterates a slow epoch; the test sends SIGINT once READY is printed."""
    fast = tmp / "fast"
    base = Baseline()
    loader = map_loader(Cell(400, slow_s=0.02, fast_flag=str(fast)), opts)
    rec = Pass()
    result: dict[str, Any] = {"interrupted": False}

    def see(batch: torch.Tensor) -> None:
        rec.add(batch)
        if len(rec.values) == 3:
            print("READY " + json.dumps({"workers": children()}), flush=True)

    try:
        for_each(loader, opts, see)
    except KeyboardInterrupt:
        result["interrupted"] = True
        result["caught_at"] = time.monotonic()
    result["first"] = rec.summary()
    result["after_error"] = after_pass(result.get("caught_at", time.monotonic()), base, True)
    fast.touch()
    result["new_epoch"] = new_epoch(loader, opts, [])
    result["final"] = finish(loader, opts, base)
    return result


def parent_sigkill_cell(opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Iterates forever; the test SIGKILLs this process once READY is printed."""
    loader = map_loader(Cell(100_000, slow_s=0.02, fast_flag=str(tmp / "never")), opts)
    reported = False

    def see(batch: torch.Tensor) -> None:
        nonlocal reported
        workers = children()
        if not reported and len(workers) == 2:
            reported = True
            print("READY " + json.dumps({"workers": workers}), flush=True)

    for_each(loader, opts, see)
    return {"error": "the endless epoch ended"}


def warm_up(opts: argparse.Namespace) -> None:
    """One clean pass in the same mode first: the sync front end's private loop and anyio's
    thread pool are made once and kept, and must not count as descriptor growth."""
    loader = aioload.DataLoader(Cell(4), batch_size=2, num_workers=2, pin_memory=bool(opts.pin))
    rec = run_pass(loader, opts.mode, opts.backend)
    assert rec.error is None and rec.values == [[0, 1], [2, 3]], rec.summary()
    del loader, rec
    wait_gone(time.monotonic())


CASES: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    **{case: failure_cell for case in (*DEATHS, *USER_ERRORS)},
    "unpicklable-dataset": failure_cell,
    "timeout": failure_cell,
    "shm-full": shm_full_cell,
    "break": stop_cell,
    "del": stop_cell,
    "task-cancel": stop_cell,
    "anyio-cancel": stop_cell,
    "sigint": sigint_cell,
    "parent-sigkill": parent_sigkill_cell,
}


def main() -> None:
    # A child started by a non-interactive shell or a test runner may inherit SIGINT as
    # ignored; restore what a terminal user has.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--mode", choices=["sync", "async"], default="sync")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--persistent", type=int, choices=[0, 1], default=0)
    parser.add_argument("--pin", type=int, choices=[0, 1], default=0)
    opts = parser.parse_args()
    # Cycles are collected only where the cell says so (see after_pass).
    gc.disable()
    # A hang shows where it is, before the test's hard timeout kills us.
    faulthandler.dump_traceback_later(25, exit=True)
    result: dict[str, Any] = {"case": opts.case, "accelerator": torch.accelerator.is_available()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            warm_up(opts)
            with tempfile.TemporaryDirectory(prefix="aioload-cell-") as tmp:
                result.update(CASES[opts.case](opts, Path(tmp)))
        except BaseException:
            result["crash"] = traceback.format_exc()
    result["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
