"""Helpers shared by the test files: running a coroutine on a named event loop, waiting on
processes or conditions with a generous deadline instead of a fixed sleep, and ``within``, the
one place a test's time bound is scaled for a slow or busy machine.

Datasets live in ``tests.scripts.datasets`` (importable by module path, which ``spawn`` and
``forkserver`` workers need); this module holds what runs in the test process only.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

import anyio
import psutil
import torch
import uvloop

import aioload

_REPO = str(Path(__file__).resolve().parents[1])

#: How much slower than a quiet developer machine this one may be: every bound that only guards
#: against a hang (see ``within``) is multiplied by it. ``AIOLOAD_TEST_TIME_SCALE=3 make test``
#: on a loaded CI runner or under a debugger; 1 by default.
TIME_SCALE = float(os.environ.get("AIOLOAD_TEST_TIME_SCALE", "1"))


def ignore_fork_in_threads() -> None:
    """Inside ``warnings.catch_warnings()``: drop Python 3.12+'s DeprecationWarning that a
    process with more than one OS thread forks. CPython counts the OS threads, torch's own
    thread pools among them, so it is said for torch's loader and aioload's alike, depending on
    what ran before in the process; the tests that compare warnings with torch's compare what
    the loaders say, not that."""
    warnings.filterwarnings(
        "ignore", message=r"This process \(pid=\d+\) is multi-threaded", category=DeprecationWarning
    )


def within(seconds: float) -> float:
    """``seconds`` times ``AIOLOAD_TEST_TIME_SCALE`` (``TIME_SCALE``, default 1).

    For a wall-clock bound that is not what its test measures: a guard that turns a hang (a
    worker that never stops, a cancellation that waits out a 30 s sleep) into a failure. Such a
    bound should be far from both what the code takes and what a hang takes, and scale with the
    machine. Where the order of events is the point, a test checks the events or a count, not
    the clock; where the time itself is the point (the heartbeat's stall bound), it keeps a
    fixed number and says so beside it.
    """
    return seconds * TIME_SCALE


def run_fresh(script: str, *args: str, timeout: float = 100) -> str:
    """Run ``script`` (Python source) in a fresh interpreter that imports this checkout's
    aioload, and return the last line it printed; fails the test if it exits non-zero. For what
    the test process cannot show: it has imported anyio, numpy.random and the rest already."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=within(timeout),
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def ray_namespace_problem() -> str | None:
    """Why Ray cannot run here in a private network namespace with nothing but loopback (Ray
    binds to the machine's external interface; tests/ray and the Ray example run in one), or
    None where it can."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "no unshare or ip command to make a loopback-only network namespace"
    probe = subprocess.run(
        ["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"cannot make a private network namespace here: {probe.stderr.strip()}"
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'aioload[ray]')"
    return None


def run_on(backend: str, fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``fn()`` on a fresh event loop: ``"asyncio"``, ``"uvloop"`` or ``"trio"``."""
    if backend == "asyncio":
        return asyncio.run(fn())
    if backend == "uvloop":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(fn())
    if backend == "trio":
        return anyio.run(fn, backend="trio")
    raise ValueError(f"unknown backend {backend!r}")


def batches_and_errors(
    iterable: Iterable[Any],
    catch: tuple[type[BaseException], ...] = (Exception,),
    limit: int | None = None,
) -> list[Any]:
    """One pass of ``for`` over ``iterable``: every batch, with each exception of a ``catch``
    type in its place (the pass goes on after it, as torch's does). With ``limit``, an iterator
    that keeps raising fails the test instead of looping forever."""
    out: list[Any] = []
    it = iter(iterable)
    while True:
        assert limit is None or len(out) <= limit, "the iterator does not end"
        try:
            out.append(next(it))
        except StopIteration:
            return out
        except catch as exc:
            out.append(exc)


def consume(loader: Any, mode: str, pause: float = 0.0, stop_after: int | None = None) -> int:
    """Iterate with ``for`` (``mode="sync"``) or ``async for`` (``"async"``, on anyio's default
    loop), sleeping ``pause`` s per batch and stopping after ``stop_after`` batches; how many
    batches it saw."""

    def body(count: int) -> bool:
        if pause:
            time.sleep(pause)
        return stop_after is not None and count >= stop_after

    if mode == "sync":
        seen = 0
        for _batch in loader:
            seen += 1
            if body(seen):
                break
        return seen

    async def run() -> int:
        seen = 0
        async for _batch in loader:
            seen += 1
            if body(seen):
                break
        return seen

    return int(anyio.run(run))


def values(batches: list[Any]) -> list[list[int]]:
    """Each batch's numbers, flattened: batches compared by content."""
    return [b.flatten().tolist() for b in batches]


def flat(batches: Any) -> list[int]:
    """Every sample's number across ``batches`` (any iterable of batches), in order."""
    return [int(x) for batch in batches for x in batch]


def _running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs. A zombie (dead, not yet reaped) counts as gone, and so does
    a process that exits between its listing and the look at its status (psutil then raises
    NoSuchProcess)."""
    try:
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def live_children(recursive: bool = False) -> list[psutil.Process]:
    """This process's children still running (see ``_running``): a thread that kills workers
    must not die of the one it just killed."""
    return [proc for proc in psutil.Process().children(recursive=recursive) if _running(proc)]


def alive(pids: list[int] | set[int]) -> list[int]:
    """The pids still running; a zombie (dead, not yet reaped) counts as gone."""
    out = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if _running(proc):
            out.append(pid)
    return out


def wait_gone(pids: list[int] | set[int], timeout: float = 5.0) -> list[int]:
    """The pids still running after up to ``within(timeout)`` seconds."""
    deadline = time.monotonic() + within(timeout)
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def children() -> list[int]:
    """Pids of this process's running descendants."""
    return [proc.pid for proc in live_children(recursive=True)]


def wait_no_children(
    timeout: float = 5.0, running: Callable[[], list[int]] = children
) -> list[int]:
    """What ``running`` (by default: the pids of this process's descendants) still lists after
    up to ``within(timeout)`` seconds."""
    deadline = time.monotonic() + within(timeout)
    while (left := running()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Poll ``condition`` until it holds or ``within(timeout)`` seconds pass; whether it held.

    The deadline is generous on purpose: it only turns a hang into a failure, and is not what
    the caller tests.
    """
    deadline = time.monotonic() + within(timeout)
    while not condition():
        if time.monotonic() >= deadline:
            return condition()
        time.sleep(0.01)
    return True


async def max_stall(
    loader: Any, each: Callable[[int, Any], None] | None = None
) -> tuple[float, int]:
    """Stream ``loader`` with ``async for`` while a 1 ms heartbeat runs on the same loop: the
    longest gap between two of its ticks, and how many batches came (``each(k, batch)`` sees
    batch ``k``).

    Measured from the first batch on: while batches stream. Before it the workers start, and
    fork() holds the GIL for 3-5 ms per worker, which the loop sees as one gap of about 10-15 ms
    per pool start (measured on the 2-core machine); Ray's actors start likewise.
    """
    gaps: list[float] = []
    done = anyio.Event()

    async def heartbeat() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    batches = 0
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        await anyio.sleep(0.05)  # let the heartbeat settle before measuring
        async for batch in loader:
            if batches == 0:
                gaps.clear()
            if each is not None:
                each(batches, batch)
            batches += 1
        done.set()
    return max(gaps), batches


def seeded_per_sample(dataset: Any, num_workers: Any, **kwargs: Any) -> aioload.DataLoader[Any]:
    """``dataset`` 4 samples a batch under ``seed_per_sample``, its generator seeded with 7:
    each sample's random draws depend on the seed and its index, not on which worker (or how
    many) fetched it."""
    return aioload.DataLoader(
        dataset,
        batch_size=4,
        num_workers=num_workers,
        seed_per_sample=True,
        generator=torch.Generator().manual_seed(7),
        **kwargs,
    )
