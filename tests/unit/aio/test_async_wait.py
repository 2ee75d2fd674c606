"""The async front end's wait on the worker pool's selector (``waiting.ReadableWait``): its
reader stays registered from one batch to the next, does not spin while the consumer awaits
something else, and lets go of its descriptor however and wherever the pass ends."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvloop

import aioload
from aioload._aio import waiting
from tests.helpers import run_on

pytestmark = pytest.mark.timeout(120)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _loader(n: int = 400, **kwargs: Any) -> aioload.DataLoader[Any]:
    return aioload.DataLoader(list(range(n)), batch_size=4, num_workers=2, **kwargs)


def test_the_reader_is_added_once_for_a_data_bound_pass(no_leaks: None) -> None:
    """asyncio's own loop (a Python class, so its add_reader can be counted): one reader for a
    pass whose consumer waits for nearly every batch, not one per wait."""
    added: list[int] = []

    async def main() -> int:
        loop = asyncio.get_running_loop()
        add_reader = loop.add_reader

        def counting(fd: int, callback: Callable[..., Any], *args: Any) -> None:
            added.append(fd)
            add_reader(fd, callback, *args)

        loop.add_reader = counting  # type: ignore[method-assign]
        got = 0
        async for batch in _loader():
            got += len(batch)
        return got

    assert asyncio.run(main()) == 400
    # Once, and again only if it fired while the consumer was not waiting.
    assert 1 <= len(added) <= 10, len(added)


@pytest.mark.parametrize("backend", ["asyncio", "uvloop"])
def test_no_spinning_while_the_consumer_awaits_elsewhere(no_leaks: None, backend: str) -> None:
    """Readiness is level-triggered: an answer waiting while the consumer sleeps must not call
    the reader on every turn of the loop."""
    fired = 0
    readable = waiting.ReadableWait._readable

    def counting(self: waiting.ReadableWait) -> None:
        nonlocal fired
        fired += 1
        readable(self)

    async def main() -> None:
        it = aiter(_loader())
        for _ in range(5):
            await anext(it)
            await asyncio.sleep(0.05)  # the workers answer meanwhile
        await it.aclose()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(waiting.ReadableWait, "_readable", counting)
        run_on(backend, main)
    assert fired < 50, fired


@pytest.mark.parametrize("backend", ["asyncio", "uvloop"])
def test_every_way_a_pass_ends_lets_go_of_the_descriptor(backend: str) -> None:
    """Exhaustion (closed in a thread), break then garbage collection (on the loop), aclose,
    cancellation, and a pass dropped only after its loop has closed: no descriptor is left
    behind, twenty times over."""

    async def exhaust() -> None:
        async for _ in _loader(40):
            pass

    async def brk() -> None:
        async for _ in _loader():
            break
        gc.collect()

    async def close() -> None:
        it = aiter(_loader())
        await anext(it)
        await it.aclose()

    async def cancel() -> None:
        async def consume() -> None:
            async for _ in _loader(4000):
                await asyncio.sleep(0.001)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    kept: list[Any] = []

    async def outlive_loop() -> None:
        it = aiter(_loader())
        await anext(it)
        kept.append(it)  # dropped after the loop has closed

    gc.collect()
    before = _fds()
    for _ in range(4):
        for scenario in (exhaust, brk, close, cancel, outlive_loop):
            run_on(backend, scenario)
        kept.clear()
        gc.collect()
    assert _fds() - before <= 4, (before, _fds())


def test_a_persistent_pool_waits_on_one_loop_after_another(no_leaks: None) -> None:
    """Persistent workers outlive the loop of one epoch: the next epoch, on a new loop (a fresh
    ``asyncio.run``, then uvloop), registers there."""
    loader = _loader(40, persistent_workers=True)

    async def epoch() -> list[int]:
        return [int(x) for batch in [b async for b in loader] for x in batch]

    assert asyncio.run(epoch()) == list(range(40))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(epoch()) == list(range(40))
    assert asyncio.run(epoch()) == list(range(40))
    loader.shutdown()


def test_closing_from_another_thread_leaves_the_removal_to_the_loop() -> None:
    """A pass closed in a worker thread (what aclose does) while the loop runs: the loop's own
    thread removes the reader and closes the duplicate."""
    read_end, write_end = os.pipe()
    wait = waiting.ReadableWait(read_end)

    async def main() -> None:
        os.write(write_end, b"x")
        assert await wait.wait(1.0)
        assert wait._watched is not None
        watched = wait._watched
        closer = threading.Thread(target=wait.close)
        closer.start()
        closer.join()
        await asyncio.sleep(0.01)  # the loop runs the removal
        with pytest.raises(OSError):
            os.fstat(watched)

    try:
        asyncio.run(main())
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.fixture
def pipe_wait() -> Iterator[tuple[int, int, waiting.ReadableWait]]:
    """A pipe, and a wait on its read end; the pipe is closed after the test."""
    read_end, write_end = os.pipe()
    try:
        yield read_end, write_end, waiting.ReadableWait(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)


async def _woken_each_time(
    pipe_wait: tuple[int, int, waiting.ReadableWait], times: int, timeout: float = 1.0
) -> None:
    """``times`` waits, each ended by a byte written before it and read after it."""
    read_end, write_end, wait = pipe_wait
    for _ in range(times):
        os.write(write_end, b"x")
        assert await wait.wait(timeout)
        os.read(read_end, 1)


@pytest.mark.parametrize("backend", ["asyncio", "uvloop"])
def test_a_readiness_seen_before_a_wait_began_does_not_end_it(
    backend: str, pipe_wait: tuple[int, int, waiting.ReadableWait]
) -> None:
    """NOTE [stale readiness]: the task that a readiness woke reads what was there and waits
    again at once; the loop's call for a readiness it saw before that read must not end the
    new wait (a step with nothing to take). A readiness during the wait still ends it."""
    _read_end, write_end, wait = pipe_wait

    async def main() -> list[bool]:
        ends = []
        for _ in range(20):
            await _woken_each_time(pipe_wait, 1)
            ends.append(await wait.wait(0.02))
        asyncio.get_running_loop().call_later(0.01, os.write, write_end, b"y")
        assert await wait.wait(5.0)
        wait.close()
        return ends

    assert run_on(backend, main) == [False] * 20, "woken with nothing to read"


@pytest.mark.parametrize("backend", ["asyncio", "uvloop"])
def test_a_wait_times_out_at_its_own_timeout_with_one_timer_kept(
    monkeypatch: pytest.MonkeyPatch, backend: str, pipe_wait: tuple[int, int, waiting.ReadableWait]
) -> None:
    """The timer that ends a wait stays armed from wait to wait: waits that readiness ends
    arm it once, and each wait that nothing ends still returns False at its own timeout, not
    at an earlier wait's, nor before it."""
    _read_end, _write_end, wait = pipe_wait
    armed: list[float] = []
    arm = waiting.ReadableWait._arm
    timeouts = (0.2, 0.05, 0.02, 0.06)

    def counting(self: waiting.ReadableWait, loop: asyncio.AbstractEventLoop, when: float) -> None:
        armed.append(when)
        arm(self, loop, when)

    monkeypatch.setattr(waiting.ReadableWait, "_arm", counting)

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        await _woken_each_time(pipe_wait, 50, timeout=0.2)
        assert len(armed) == 1, "one timer for every wait that readiness ended"
        took = []
        # The timer armed by the first wait fires halfway through the first wait below, which
        # is not due then; a shorter wait (a new timer), then a longer one again: each times
        # out at its own end.
        # (A wait may end at once, True, for readiness the loop saw before the last read.)
        await asyncio.sleep(0.1)
        for timeout in timeouts:
            while True:
                started = loop.time()
                if not await wait.wait(timeout):
                    break
            took.append(loop.time() - started)
        wait.close()
        return took

    took = run_on(backend, main)
    for timeout, spent in zip(timeouts, took, strict=True):
        assert timeout - 0.002 <= spent < timeout + 0.5, (timeout, spent)
    assert wait._timer is None
