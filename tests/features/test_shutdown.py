"""Every way a pass can end leaves nothing behind, fast; workers never outlive their parent.

The ``no_leaks`` fixture checks each test: no worker process, no descriptor growth and no new
/dev/shm entry once the test is over.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import torch

import aioload
from tests.helpers import (
    alive,
    children,
    run_on,
    values,
    wait_gone,
    wait_no_children,
    wait_until,
    within,
)
from tests.scripts.datasets import LazyFile, Noisy, Pids, Slow, SlowAt, Squares

pytestmark = pytest.mark.timeout(60)

APIS = ["sync", "async"]
SCRIPTS = Path(__file__).parents[1] / "scripts"
REPO = Path(__file__).resolve().parents[2]


# -- helpers ---------------------------------------------------------------------------------


def _epoch(loader: Any, api: str) -> list[Any]:
    """One whole pass, with ``for`` (``api="sync"``) or ``async for``."""
    if api == "sync":
        return list(loader)

    async def main() -> list[Any]:
        return [b async for b in loader]

    return asyncio.run(main())


# -- the ways a pass ends --------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_exhaustion(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Squares(23), batch_size=4, num_workers=2)
    batches = _epoch(loader, api)
    assert [b[:, 0].tolist() for b in batches] == [
        list(range(i, min(i + 4, 23))) for i in range(0, 23, 4)
    ]
    # The pass closed itself at its end, without waiting for garbage collection.
    assert wait_no_children() == []


@pytest.mark.parametrize("api", APIS)
def test_break_mid_epoch(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Squares(200), batch_size=2, num_workers=2)
    seen: list[Any] = []
    if api == "sync":
        for batch in loader:
            seen.append(batch)
            if len(seen) == 3:
                break
    else:

        async def main() -> None:
            async for batch in loader:
                seen.append(batch)
                if len(seen) == 3:
                    break

        asyncio.run(main())
    assert [b[:, 0].tolist() for b in seen] == [[0, 1], [2, 3], [4, 5]]
    assert wait_no_children() == []


@pytest.mark.parametrize("api", APIS)
def test_del_iterator_then_gc(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Squares(200), batch_size=2, num_workers=2)
    if api == "sync":
        it = iter(loader)
        next(it)
        pids = children()
        assert len(pids) == 2
        del it
        gc.collect()
    else:

        async def main() -> list[int]:
            it = aiter(loader)
            await anext(it)
            pids = children()
            del it
            gc.collect()
            return pids

        pids = asyncio.run(main())
        assert len(pids) == 2
    assert wait_gone(pids) == []


@pytest.mark.parametrize("api", APIS)
def test_explicit_close(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Squares(200), batch_size=2, num_workers=2)
    if api == "sync":
        it = iter(loader)
        next(it)
        it.close()  # type: ignore[attr-defined]
        assert wait_no_children(timeout=2) == []
        with pytest.raises(StopIteration):
            next(it)
    else:

        async def main() -> None:
            async with aiter(loader) as it:  # type: ignore[attr-defined]
                await anext(it)
            assert wait_no_children(timeout=2) == []
            with pytest.raises(StopAsyncIteration):
                await anext(it)

        asyncio.run(main())


class ConsumerError(Exception):
    pass


@pytest.mark.parametrize("api", APIS)
def test_exception_in_the_loop_body(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Squares(200), batch_size=2, num_workers=2)
    if api == "sync":
        with pytest.raises(ConsumerError):
            for i, _ in enumerate(loader):
                if i == 2:
                    raise ConsumerError("from the loop body")
    else:

        async def main() -> None:
            i = 0
            async for _ in loader:
                i += 1
                if i == 3:
                    raise ConsumerError("from the loop body")

        with pytest.raises(ConsumerError):
            asyncio.run(main())
    gc.collect()
    assert wait_no_children() == []


# -- cancellation ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "uvloop"])
def test_wait_for_timeout_cancels_the_pass(backend: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Slow(100, 30.0), batch_size=1, num_workers=2)
    got: list[Any] = []

    async def consume() -> None:
        async for batch in loader:
            got.append(batch)

    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(consume(), 0.3)
        return time.monotonic() - started

    elapsed = run_on(backend, main)
    assert got == []  # every sample takes 30 s: the cancellation did not wait for one
    assert elapsed < within(5)  # a hang guard: a cancellation stuck behind a sample waits 30 s
    gc.collect()
    assert wait_no_children() == []


@pytest.mark.parametrize("use_async_with", [False, True], ids=["async-for", "async-with"])
def test_task_cancel_while_awaiting_next(use_async_with: bool, no_leaks: None) -> None:
    loader = aioload.DataLoader(Slow(100, 0.5), batch_size=1, num_workers=2)
    got: list[Any] = []

    async def consume() -> None:
        if use_async_with:
            async with aiter(loader) as it:  # type: ignore[attr-defined]
                async for batch in it:
                    got.append(batch)
        else:
            async for batch in loader:
                got.append(batch)

    async def main() -> None:
        task = asyncio.create_task(consume())
        while len(got) < 2:  # well inside the epoch, then waiting for the next slow sample
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The loop is still responsive and nothing was left running in it.
        await asyncio.sleep(0)

    asyncio.run(main())
    assert len(got) >= 2
    gc.collect()
    assert wait_no_children() == []


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_anyio_cancel_scope_around_async_for(backend: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Slow(100, 0.4), batch_size=1, num_workers=2)

    async def main() -> tuple[list[Any], bool]:
        got: list[Any] = []
        with anyio.move_on_after(1.0) as scope:
            async for batch in loader:
                got.append(batch)
        return got, scope.cancelled_caught

    got, cancelled = anyio.run(main, backend=backend)
    assert cancelled
    # What came before the deadline came in order; all 100 could not have.
    assert len(got) < 100
    assert [int(b[0, 0]) for b in got] == list(range(len(got)))
    gc.collect()
    assert wait_no_children() == []


# -- a worker stuck in user code -------------------------------------------------------------


@pytest.mark.parametrize("how", ["break", "close"])
@pytest.mark.parametrize("api", APIS)
def test_break_while_a_worker_is_stuck(api: str, how: str, tmp_path: Path, no_leaks: None) -> None:
    # Worker 1 gets index 1 and sleeps 30 s in __getitem__; it touches the marker first.
    marker = tmp_path / "stuck"
    loader = aioload.DataLoader(
        SlowAt(8, slow=1, seconds=30, marker=str(marker)), batch_size=1, num_workers=2
    )

    def wait_until_stuck() -> None:
        assert wait_until(marker.exists), "worker 1 never started index 1"

    if api == "sync":
        started = 0.0
        if how == "break":
            for batch in loader:
                assert int(batch) == 0
                wait_until_stuck()
                started = time.monotonic()
                break
        else:
            it = iter(loader)
            assert int(next(it)) == 0
            wait_until_stuck()
            started = time.monotonic()
            it.close()  # type: ignore[attr-defined]
        elapsed = time.monotonic() - started
    else:

        async def main() -> float:
            started = 0.0
            if how == "break":
                async for batch in loader:
                    assert int(batch) == 0
                    wait_until_stuck()
                    started = time.monotonic()
                    break
            else:
                it = aiter(loader)
                assert int(await anext(it)) == 0
                wait_until_stuck()
                started = time.monotonic()
                await it.aclose()  # type: ignore[attr-defined]
            return time.monotonic() - started

        elapsed = asyncio.run(main())
    # Shutdown waits a short grace period, then SIGKILLs the stuck worker (a hang guard: the
    # worker would sleep 30 s; that the worker is gone is checked below).
    assert elapsed < within(5)
    assert wait_no_children(timeout=0.5) == []


# -- persistent workers ----------------------------------------------------------------------


def _epoch_pids(loader: Any, api: str) -> tuple[list[int], set[int]]:
    batches = _epoch(loader, api)
    return [int(b[0, 0]) for b in batches], {int(b[0, 1]) for b in batches}


@pytest.mark.parametrize("api", APIS)
def test_persistent_workers_survive_epochs_and_die_with_the_loader(
    api: str, no_leaks: None
) -> None:
    loader = aioload.DataLoader(Pids(10), batch_size=1, num_workers=2, persistent_workers=True)
    order1, pids1 = _epoch_pids(loader, api)
    assert order1 == list(range(10))
    assert len(pids1) == 2
    assert pids1 <= set(children())  # alive between epochs
    order2, pids2 = _epoch_pids(loader, api)
    assert order2 == list(range(10))
    assert pids2 == pids1
    del loader
    gc.collect()
    assert wait_gone(pids1) == []


@pytest.mark.parametrize("api", APIS)
def test_persistent_workers_stop_on_shutdown(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Pids(10), batch_size=1, num_workers=2, persistent_workers=True)
    _, pids1 = _epoch_pids(loader, api)
    _, pids2 = _epoch_pids(loader, api)
    assert pids1 == pids2
    loader.shutdown()
    assert wait_gone(pids1, timeout=2) == []
    # The loader is still usable: a new epoch starts new workers.
    order3, pids3 = _epoch_pids(loader, api)
    assert order3 == list(range(10))
    assert len(pids3) == 2
    assert not pids3 & pids1
    loader.shutdown()
    assert wait_gone(pids3, timeout=2) == []


@pytest.mark.parametrize("api", APIS)
def test_shutdown_during_a_pass_ends_it_with_an_error_that_says_so(
    api: str, no_leaks: None
) -> None:
    loader = aioload.DataLoader(Pids(40), batch_size=2, num_workers=2, persistent_workers=True)
    loop = asyncio.new_event_loop()
    step = (
        (lambda it: next(it))
        if api == "sync"
        else (lambda it: loop.run_until_complete(it.__anext__()))
    )
    try:
        it = iter(loader) if api == "sync" else loader.__aiter__()
        pids = {int(pid) for pid in step(it)[:, 1]}
        loader.shutdown()
        loader.shutdown()  # twice: nothing more to stop
        assert wait_gone(pids, timeout=2) == []
        for _ in range(2):  # and again: the same error, no hang
            with pytest.raises(RuntimeError, match=r"stopped by DataLoader\.shutdown\(\)"):
                step(it)
        # A new pass starts fresh workers.
        batches = _epoch(loader, api)
        assert [int(i) for b in batches for i in b[:, 0]] == list(range(40))
        new_pids = {int(pid) for b in batches for pid in b[:, 1]}
        assert new_pids and not new_pids & pids
        loader.shutdown()
        assert wait_gone(new_pids, timeout=2) == []
    finally:
        loop.close()


def test_shutdown_from_another_thread_ends_the_pass_in_iteration(no_leaks: None) -> None:
    loader = aioload.DataLoader(
        Slow(4000, 0.002), batch_size=2, num_workers=2, persistent_workers=True
    )
    taken: list[int] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for _batch in loader:
                taken.append(1)
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=consume)
    thread.start()
    assert wait_until(lambda: len(taken) >= 5)
    loader.shutdown()
    thread.join(within(20))
    assert not thread.is_alive()
    assert len(errors) == 1 and "DataLoader.shutdown()" in str(errors[0]), errors


def test_a_newer_pass_on_persistent_workers_ends_the_older_one_with_an_error(
    no_leaks: None,
) -> None:
    loader = aioload.DataLoader(Squares(20), batch_size=2, num_workers=2, persistent_workers=True)
    first = iter(loader)
    next(first)
    second = iter(loader)
    assert int(next(second)[0, 0]) == 0
    with pytest.raises(RuntimeError, match="a newer pass over this loader"):
        next(first)
    assert len(list(second)) == 9
    second.close()
    second.close()  # twice: nothing more to close
    loader.shutdown()


@pytest.mark.parametrize("api", APIS)
def test_persistent_workers_after_a_break(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Pids(40), batch_size=1, num_workers=2, persistent_workers=True)
    if api == "sync":
        for i, _ in enumerate(loader):
            if i == 3:
                break
    else:

        async def main() -> None:
            i = 0
            async for _ in loader:
                i += 1
                if i == 4:
                    break

        asyncio.run(main())
    pids = set(children())
    assert len(pids) == 2  # a break ends the pass, not the workers
    order, pids2 = _epoch_pids(loader, api)
    assert order == list(range(40))  # nothing of the abandoned pass leaks into this one
    assert pids2 == pids
    loader.shutdown()
    assert wait_gone(pids) == []


# -- the parent dies -------------------------------------------------------------------------


# Each start method once, and each API once: how the workers notice the death depends on how
# they were started (under forkserver, they are the fork server's children, not the script's),
# not on how the script iterates. A spawned or forkserver worker imports torch afresh, seconds
# of the suite each on a loaded 2-core machine.
@pytest.mark.parametrize(
    "context, api",
    [("default", "sync"), ("default", "async"), ("spawn", "sync"), ("forkserver", "sync")],
)
def test_workers_exit_when_their_parent_is_killed(context: str, api: str, no_leaks: None) -> None:
    if context == "default":
        assert multiprocessing.get_start_method() == "fork" or sys.platform != "linux"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "orphaned.py"), context, api],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by the test's timeout
        assert line.startswith("["), line + (proc.stderr.read() if proc.stderr else "")
        workers = json.loads(line)
        assert len(workers) == 2
        script_children = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert set(workers) <= script_children
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=within(10))
        left = wait_gone(workers, timeout=5)
        assert left == [], f"workers outlived their parent by {within(5):.0f} s: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in alive(workers):  # do not leave them behind if the test failed
            os.kill(pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()


# -- start methods ---------------------------------------------------------------------------


def _noisy_loader(loader_cls: Any, **kwargs: Any) -> Any:
    return loader_cls(
        Noisy(25),
        batch_size=3,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(1234),
        **kwargs,
    )


@functools.cache
def _fork_batches() -> list[list[list[int]]]:
    return [b.tolist() for b in _noisy_loader(aioload.DataLoader, multiprocessing_context="fork")]


def test_fork_batches_match_torch(no_leaks: None) -> None:
    # The reference the other start methods are held to; per-worker seeds included.
    ref = [b.tolist() for b in _noisy_loader(torch.utils.data.DataLoader)]
    gc.collect()
    assert _fork_batches() == ref


# Each start method once, each API once, and the context both by name (under ``for``) and as a
# context object (under ``async for``): the start method decides how the dataset and the
# seeds reach a worker; the API only how batches are taken from it.
@pytest.mark.parametrize("context, api", [("spawn", "sync"), ("forkserver", "async")])
def test_start_methods_give_the_same_batches_as_fork(
    context: str, api: str, stop_mp_helpers: None
) -> None:
    expected = _fork_batches()
    # By name under ``for``, as a context object under ``async for``.
    mp_context = context if api == "sync" else multiprocessing.get_context(context)
    loader = _noisy_loader(aioload.DataLoader, multiprocessing_context=mp_context)
    if api == "sync":
        got = [b.tolist() for b in loader]
    else:

        async def main() -> list[Any]:
            return [b.tolist() async for b in loader]

        got = asyncio.run(main())
    assert got == expected


# The pool is kept the same way whatever started it: one start method other than fork (spawn
# is in the test above).
@pytest.mark.parametrize("context", ["forkserver"])
def test_start_methods_persistent_workers(context: str, stop_mp_helpers: None) -> None:
    loader = aioload.DataLoader(
        Pids(12),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=context,
    )
    _, pids1 = _epoch_pids(loader, "sync")
    _, pids2 = _epoch_pids(loader, "async")
    assert pids1 == pids2
    assert len(pids1) == 2
    loader.shutdown()
    assert wait_gone(pids1) == []


# -- an abandoned pass in a later worker -----------------------------------------------------


def test_abandoned_pass_is_not_finalized_inside_a_later_worker(
    tmp_path: Path, no_leaks: None
) -> None:
    """A worker forked while an abandoned iterator is still uncollected garbage (held only by a
    reference cycle) inherits a copy of it. When the worker's own garbage collector finalizes
    that copy, it must not close descriptors: they are the parent's, and their numbers may have
    been reused in the worker (here, by a file the dataset opened)."""
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 100)
    ds = LazyFile(6, str(data))
    gc.disable()  # keep the cycle uncollected until the second loader's workers are forked
    try:
        first = iter(aioload.DataLoader(ds, batch_size=1, num_workers=2))
        next(first)
        cycle: list[Any] = [first]
        cycle.append(cycle)
        del first, cycle
        batches: list[Any] = []
        error = None
        try:
            batches = list(aioload.DataLoader(ds, batch_size=1, num_workers=2))
        except OSError as exc:  # kept as text: its traceback would hold the loader's workers
            error = str(exc)
    finally:
        gc.enable()
        gc.collect()
    assert error is None, error
    assert values(batches) == [[i, 10] for i in range(6)]
