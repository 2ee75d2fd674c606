"""Shared fixtures: leak checks that every test which starts workers runs under; each test's
``timeout`` marker scaled by ``AIOLOAD_TEST_TIME_SCALE`` (see ``tests.helpers.within``)."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
from collections.abc import Iterator

import psutil
import pytest

from aioload._aio import sync_loop as _sync
from tests.helpers import TIME_SCALE, within
from tests.leaks import ProcessTree, shm_entries, shm_leaks, worker_threads


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test's ``pytest.mark.timeout(seconds)`` is a hang guard like any other: on a machine
    ``AIOLOAD_TEST_TIME_SCALE`` times slower it becomes ``within(seconds)``. (The ini's default
    and ``--timeout`` are left as given.)"""
    if TIME_SCALE == 1:
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None and marker.args:
            scaled = pytest.mark.timeout(within(marker.args[0]), *marker.args[1:], **marker.kwargs)
            item.add_marker(scaled, append=False)


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _nothing() -> None:
    return None


@pytest.fixture(scope="session", autouse=True)
def _warm_private_loop() -> None:
    """The sync iterator's private event loop is made once per thread and kept (its epoll,
    eventfd and pipes are not a leak); make it before any test counts descriptors. Likewise the
    helper thread's loop, used when sync iteration happens inside a running loop."""
    _sync.run(_nothing())

    async def inside_a_loop() -> None:
        _sync.run(_nothing())

    asyncio.run(inside_a_loop())


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap(_warm_private_loop: None) -> None:
    """Move everything alive when a test module starts (torch, numpy, pytest, every collected
    test module, and what earlier tests imported lazily: griffe, lightning; ~0.4 s of objects
    per full collection) out of the collector's reach. ``no_leaks`` collects four times per
    test; each collection then walks only what this module's tests made, which is all a leak
    check needs to see."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fails the test if it leaves worker processes, descriptors or /dev/shm entries behind.
    Only the /dev/shm entries this process and its descendants made count: the directory is
    the whole machine's, and other programs (another test run) come and go in it meanwhile
    (see tests/leaks.py)."""
    gc.collect()
    shm_before = shm_entries()
    fds_before = _fds()
    with ProcessTree() as tree:
        yield
    # Cyclic garbage with finalizers can take more than one pass: an exception that ended an
    # ``async for`` sits in a cycle with its task, its traceback's frames and the iterator, and
    # the iterator's finalizer (which stops the workers) runs on one pass, the freeing on the
    # next.
    for _ in range(3):
        gc.collect()
    deadline = 50
    while _children() and deadline:
        psutil.wait_procs(_children(), timeout=0.1)
        deadline -= 1
    leftover = _children()
    assert not leftover, f"worker processes left behind: {[p.pid for p in leftover]}"
    threads = worker_threads(wait=5.0)
    assert not threads, f"worker threads left behind: {[t.name for t in threads]}"
    leaked = shm_leaks(shm_before, tree.pids)
    assert not leaked, f"new /dev/shm entries left behind: {leaked}"
    # A few descriptors may be opened lazily by libraries (e.g. anyio's thread pool, uvloop);
    # a leak of worker sockets or slabs would show as many more.
    assert _fds() - fds_before <= 4, f"descriptor growth: {fds_before} -> {_fds()}"


@pytest.fixture
def stop_mp_helpers(no_leaks: None) -> Iterator[None]:
    """spawn and forkserver start multiprocessing's own helpers (the resource tracker, the
    fork server), which live as long as the interpreter: stop them after the test, before the
    leak check (which this fixture depends on, so it runs last) counts children.
    The tracker leaves only when no process holds its pipe any more, so a pass kept alive by
    a caught exception's traceback is collected first (its workers inherited that pipe)."""
    yield
    gc.collect()
    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    multiprocessing.resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]


@pytest.fixture
def patient_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shutdown waits up to ten seconds (scaled), not half a second, for workers to leave by
    themselves before it kills them (or abandons a thread): for tests whose proof is what a
    worker does as it leaves. A loaded machine may not schedule a worker within the half
    second, and one killed then writes nothing; a worker that never leaves still fails the
    test, as it is killed all the same."""
    from aioload._backends import process, thread

    monkeypatch.setattr(process, "SHUTDOWN_GRACE_S", within(10))
    monkeypatch.setattr(thread, "CLOSE_GRACE_S", within(10))
