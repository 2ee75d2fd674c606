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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
import torch

import aioload
from tests import helpers
from tests.helpers import alive, run_on, values, wait_until, within
from tests.scripts import datasets
from tests.scripts.datasets import DistinctiveError, FailingAt, LazyFile, Noisy, Squares

pytestmark = [pytest.mark.timeout(60)]

APIS = ["sync", "async"]
SCRIPTS = Path(__file__).parents[1] / "scripts"
REPO = Path(__file__).resolve().parents[2]


# -- helpers ---------------------------------------------------------------------------------

# Ends the samples that sleep "for longer than the test runs" once the test has seen what it
# checks: a worker process in one is killed, but a thread worker cannot be, and an abandoned one
# still in its sample would outlive the test. (A worker process has its own copy: this event
# never wakes it.)
_RELEASE = threading.Event()


@pytest.fixture
def no_leaks(no_leaks: None) -> Iterator[None]:
    """The leak check (tests/conftest.py), with every stuck sample let go before it."""
    _RELEASE.clear()
    yield
    _RELEASE.set()


def _thread_number(thread: threading.Thread) -> int | None:
    """A worker thread as a number no pid and no other thread has: minus its serial (its
    name's last part; a thread's ident is reused once it ends)."""
    if not thread.name.startswith("aioload-worker-"):
        return None
    return -int(thread.name.rsplit("-", 1)[1]) - 1


def _me() -> int:
    """The worker a sample runs in: its thread's number in a thread worker, else its pid."""
    number = _thread_number(threading.current_thread())
    return os.getpid() if number is None else number


def _worker_threads() -> list[int]:
    return [n for t in threading.enumerate() if (n := _thread_number(t)) is not None]


def children() -> list[int]:
    """The workers running: this process's descendants (pids) and its worker threads (their
    numbers), whichever the loader's workers are."""
    return helpers.children() + _worker_threads()


def wait_gone(workers: list[int] | set[int], timeout: float = 5.0) -> list[int]:
    """The workers (pids or thread numbers) still running after up to ``within(timeout)``
    seconds."""
    deadline = time.monotonic() + within(timeout)
    while True:
        threads = set(_worker_threads())
        left = [w for w in workers if w in threads] + alive([w for w in workers if w > 0])
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def wait_no_children(timeout: float = 5.0) -> list[int]:
    """The workers (pids or thread numbers) still running after up to ``within(timeout)``
    seconds."""
    return helpers.wait_no_children(timeout, children)


class Pids(datasets.Pids):
    """``[i, the worker that made it]`` (``_me``)."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, _me()])


class Slow(datasets.Slow):
    """Every sample takes ``seconds`` (or until ``_RELEASE``); ``[i, the worker]``."""

    def __getitem__(self, i: int) -> torch.Tensor:
        _RELEASE.wait(self.seconds)
        return torch.tensor([i, _me()])


class SlowAt(datasets.SlowAt):
    """Waits ``seconds`` (or until ``_RELEASE``) at index ``slow``, touching ``marker`` first."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.slow:
            if self.marker is not None:
                Path(self.marker).write_text(str(_me()))
            _RELEASE.wait(self.seconds)
        return torch.tensor([i])


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
    # A thread worker cannot be killed: it leaves once its stuck sample ends.
    _RELEASE.set()
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
    # A thread worker cannot be killed: it leaves once its stuck sample ends.
    _RELEASE.set()
    assert wait_no_children() == []


# -- an error that escapes the loop, kept ----------------------------------------------------


class _NoCollection:
    """Automatic garbage collection off, and the escaped errors kept (as a notebook keeps the
    last one, or a logger or a test does): workers must then stop through reference counts
    alone, never through a collection."""

    def __init__(self) -> None:
        self.kept: list[BaseException] = []

    def __enter__(self) -> _NoCollection:
        gc.collect()
        gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kept.clear()
        gc.enable()
        gc.collect()


def _error_loader(error: str, tmp_path: Path) -> aioload.DataLoader[Any]:
    if error == "timeout":
        # Worker 1 hangs in index 1; the pass times out waiting for it.
        ds: Any = SlowAt(8, slow=1, seconds=30, marker=str(tmp_path / "stuck"))
        return aioload.DataLoader(ds, batch_size=1, num_workers=2, timeout=0.5)
    return aioload.DataLoader(FailingAt(13, bad=4), batch_size=1, num_workers=2)


@pytest.mark.parametrize("error", ["timeout", "dataset"])
@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_an_error_out_of_the_event_loop_stops_the_workers(
    backend: str, error: str, tmp_path: Path, no_leaks: None
) -> None:
    """The error ends ``asyncio.run`` (or trio's run): the task and the error hold each other,
    and the error's traceback held the iterator, so the workers (the hung one too) stayed
    until a garbage collection. The pass now ends as the error leaves the ``async for``."""
    loader = _error_loader(error, tmp_path)

    async def main() -> None:
        async for _ in loader:
            pass

    with _NoCollection() as no_gc:
        try:
            run_on(backend, main)
        except (aioload.DataLoaderTimeoutError, DistinctiveError) as exc:
            no_gc.kept.append(exc)
        assert len(no_gc.kept) == 1
        # A thread worker cannot be killed: it leaves once its stuck sample ends.
        _RELEASE.set()
        assert wait_no_children() == []


@pytest.mark.parametrize("error", ["timeout", "dataset", "interrupt"])
def test_an_error_out_of_a_for_loop_stops_the_workers(
    error: str, tmp_path: Path, no_leaks: None
) -> None:
    """The same under ``for``, with the error kept: a Ctrl-C ends the pass where it lands (as
    under ``async for``); any other error ends it as it leaves the loop."""
    loader = _error_loader("timeout" if error == "interrupt" else error, tmp_path)
    if error == "interrupt":
        loader.timeout = 0  # waits on the hung worker until the interrupt

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    with _NoCollection() as no_gc:
        try:
            if error == "interrupt":
                signal.setitimer(signal.ITIMER_REAL, 1.0)
            for _ in loader:
                pass
        except (aioload.DataLoaderTimeoutError, DistinctiveError, KeyboardInterrupt) as exc:
            no_gc.kept.append(exc)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert len(no_gc.kept) == 1
        # A thread worker cannot be killed: it leaves once its stuck sample ends.
        _RELEASE.set()
        assert wait_no_children() == []


@pytest.mark.parametrize("api", APIS)
def test_a_caught_error_inside_the_loop_keeps_the_pass(api: str, no_leaks: None) -> None:
    """The other side of the two tests above: the traceback no longer holds the pass, but a
    consumer that catches the error and goes on still has it, whole, with the error kept."""
    loader = aioload.DataLoader(FailingAt(9, bad=4), batch_size=1, num_workers=2, progress=True)
    kept: list[BaseException] = []
    got: list[int] = []

    def take(step: Callable[[], Any]) -> bool:
        try:
            got.append(int(step()))
        except DistinctiveError as exc:
            kept.append(exc)
        except (StopIteration, StopAsyncIteration):
            return False
        return True

    with _NoCollection():
        if api == "sync":
            it = iter(loader)
            while take(lambda: next(it)):
                pass
        else:

            async def main() -> None:
                it = aiter(loader)
                while True:
                    try:
                        got.append(int(await anext(it)))
                    except DistinctiveError as exc:
                        kept.append(exc)
                    except StopAsyncIteration:
                        return

            asyncio.run(main())
        assert got == [0, 1, 2, 3, 5, 6, 7, 8]
        assert len(kept) == 1
        assert wait_no_children() == []


# -- a fork in user code --------------------------------------------------------------------


def _forked(case: str, persistent: bool) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "forked.py"), case, str(int(persistent))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=within(40),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("RESULT ") :]), proc.stderr


_PAIRS = [[i, i + 1] for i in range(0, 40, 2)]


@pytest.mark.no_local_workers("a script of its own (tests/scripts/forked.py) runs the loader")
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("case", ["exit", "same", "new"])
def test_a_fork_in_user_code_leaves_the_parents_pass_whole(
    case: str, persistent: bool, no_leaks: None
) -> None:
    """``os.fork()`` while a pass runs. The child's normal exit no longer SIGTERMs the parent's
    workers (multiprocessing's exit handler used the list of children the fork copied); the
    parent's iterator in the child raises, saying whose it is, instead of a bare
    AttributeError; a pass of the child's own works, with workers of its own."""
    result, stderr = _forked(case, persistent)
    assert result["parent"] == _PAIRS
    assert result["child_status"] == 0
    assert "can only join a child process" not in stderr
    if case == "same":
        assert result["child"]["error"].startswith("RuntimeError: aioload: this DataLoader ")
        assert "copied into this one" in result["child"]["error"]
    elif case == "new":
        assert result["child"] == {"batches": _PAIRS}


@pytest.mark.no_local_workers("a script of its own (tests/scripts/forked.py) runs the loader")
def test_a_fork_inside_a_worker_never_answers_for_it(no_leaks: None) -> None:
    """A dataset forks in ``__getitem__`` and the copy returns into the worker's loop: it used
    to take and answer tasks on the worker's socket (a batch made by the copy reached the
    consumer). Now it finds the socket closed and leaves, saying why."""
    result, stderr = _forked("inside", False)
    assert result["parent"] == [[i, i * i] for i in range(12)]
    assert "returned into the worker's loop" in stderr


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


@pytest.mark.timeout(60)
def test_two_threads_starting_passes_at_once_on_persistent_workers(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """Two threads that call iter() on one loader with persistent workers at the same moment:
    one pass supersedes the other, which raises. Neither may end its epoch quietly short (both
    used to find no pass on the kept workers, and both ran on them)."""
    from aioload._engine.passes import PassPlanner

    plan = PassPlanner._plan

    def slow_plan(self: Any, *args: Any) -> Any:
        planned = plan(self, *args)
        time.sleep(0.2)  # (the other thread's iter() comes now)
        return planned

    monkeypatch.setattr(PassPlanner, "_plan", slow_plan)
    loader = aioload.DataLoader(Squares(20), batch_size=2, num_workers=2, persistent_workers=True)
    outcomes: dict[str, Any] = {}
    start = threading.Barrier(2)

    def consume(name: str) -> None:
        taken = 0
        start.wait()
        try:
            for _batch in loader:
                taken += 1
            outcomes[name] = taken
        except RuntimeError as error:
            outcomes[name] = error

    threads = [threading.Thread(target=consume, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(within(30))
    assert not any(thread.is_alive() for thread in threads)
    finished = [v for v in outcomes.values() if not isinstance(v, BaseException)]
    superseded = [v for v in outcomes.values() if isinstance(v, BaseException)]
    assert finished == [10], outcomes
    assert len(superseded) == 1 and "a newer pass" in str(superseded[0]), outcomes
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


@pytest.mark.processes_only("SIGKILL of the parent, whose worker processes must leave")
# Each start method once, and each API once: how the workers notice the death depends on how
# they were started (under forkserver, they are the fork server's children, not the script's;
# under ``async for`` they are forked from short-lived threads, and the kernel's death signal,
# which follows the forking thread, is not asked for), not on how the script iterates. A
# spawned or forkserver worker imports torch afresh, seconds of the suite each on a loaded
# 2-core machine. ``where``: between two samples, or inside a sample that sleeps (or holds the
# GIL in C code) for longer than the test runs.
@pytest.mark.parametrize(
    "context, api, where",
    [
        ("default", "sync", "between"),
        ("default", "async", "between"),
        ("spawn", "sync", "between"),
        ("forkserver", "sync", "between"),
        ("default", "sync", "sleep"),
        ("default", "async", "sleep"),
        ("spawn", "async", "sleep"),
        ("forkserver", "sync", "sleep"),
        ("default", "sync", "gil"),
    ],
)
def test_workers_exit_when_their_parent_is_killed(
    context: str, api: str, where: str, no_leaks: None
) -> None:
    if context == "default":
        assert multiprocessing.get_start_method() == "fork" or sys.platform != "linux"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "orphaned.py"), context, api, where],
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
        if where != "between":
            time.sleep(0.5)  # each worker is inside its stuck sample by now
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


@pytest.mark.processes_only(
    "start methods, and the process-wide generators reseeded per worker (Noisy)"
)
def test_fork_batches_match_torch(no_leaks: None) -> None:
    # The reference the other start methods are held to; per-worker seeds included.
    ref = [b.tolist() for b in _noisy_loader(torch.utils.data.DataLoader)]
    gc.collect()
    assert _fork_batches() == ref


@pytest.mark.processes_only("start methods: how a worker process starts")
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


@pytest.mark.processes_only("start methods: how a worker process starts")
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


@pytest.mark.processes_only("a worker process forked with a copy of an abandoned pass")
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
