"""The sync front end's event loop, for the one wait that needs a loop.

``for batch in loader`` drives the same orchestrator as ``async for``, and it waits without an
event loop: ``Orchestrator.next_blocking()`` blocks the calling thread in the backend's own
``select``. Only a backend whose waiting needs a loop (an async dataset run in the calling
process, ``num_workers=0``) steps here, on a private event loop (uvloop, imported on that first
use). One loop per thread is made once and reused, so no step pays for setting a loop up.

A thread that already runs an event loop (a Jupyter cell, or sync iteration inside a coroutine)
cannot run a second one. There the steps go to one helper thread with its own loop, and the
calling thread waits for each. It is slower, and it keeps ``for batch in loader`` working
wherever torch's loader works.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")

# How long a step interrupted by Ctrl-C gets to unwind before it is abandoned.
_UNWIND_S = 1.0

_local = threading.local()
_helper_lock = threading.Lock()
_helper: _LoopThread | None = None


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    # uvloop is imported on the first step that needs a loop, not with the package: `import
    # aioload` stays cheap (docs/benchmarks.md, start-up), and most loaders never need it.
    import uvloop

    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


class _LoopThread:
    """A daemon thread running one event loop, for callers that already run one."""

    def __init__(self) -> None:
        self.loop = _loop_factory()()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="aioload-sync-loop", daemon=True
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise
        finally:
            # As in run(): the future holds the exception, whose traceback holds this frame.
            del future


def _loop() -> asyncio.AbstractEventLoop:
    loop: asyncio.AbstractEventLoop | None = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = _loop_factory()()
        _local.loop = loop
    return loop


async def _into(box: list[Any], coro: Coroutine[Any, Any, Any]) -> None:
    box.append(await coro)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one step of an orchestrator to completion from sync code."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        global _helper
        with _helper_lock:
            if _helper is None:
                _helper = _LoopThread()
        return _helper.run(coro)
    loop = _loop()
    # The batch comes back through ``box`` rather than as the task's result, so that nothing
    # that formats the task (asyncio does, in some debug and error paths) formats a whole batch.
    box: list[T] = []
    task = loop.create_task(_into(box, coro))
    try:
        loop.run_until_complete(task)
    except BaseException:
        # Ctrl-C (KeyboardInterrupt raised from the signal handler while the loop ran) or any
        # other escape: cancel the step and let it unwind, so the orchestrator's state is
        # consistent and its shutdown can run, then re-raise. This is what asyncio.Runner
        # does, without its per-call cost of installing a SIGINT handler (~25 us a step).
        #
        # The unwind is bounded (its own 1 s timer): a KeyboardInterrupt can land inside the
        # loop's or anyio's machinery at a point that leaves the cancelled step with nothing
        # left to wake it, and waiting for it unbounded then hung Ctrl-C (seen about once in 10
        # interrupts). A step that does not finish in time is abandoned; its pass is being
        # interrupted anyway, and its finalizer still stops the workers.
        task.cancel()
        with contextlib.suppress(BaseException):
            loop.run_until_complete(asyncio.wait({task}, timeout=_UNWIND_S))
        raise
    finally:
        # The task holds the exception, whose traceback holds this frame and so the task: a
        # cycle that would keep the iterator, and its workers, alive until a garbage collection.
        del task
    return box[0]
