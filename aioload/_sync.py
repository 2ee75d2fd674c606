"""The sync front end's event loop.

``for batch in loader`` drives the same orchestrator as ``async for``, on a private event loop
(uvloop when installed). One loop per thread is made once and reused, so a batch costs one
``Runner.run`` and no loop set-up.

``asyncio.Runner.run`` is used rather than ``run_until_complete`` for what it does with Ctrl-C:
on the main thread it turns SIGINT into a cancellation of the step, so KeyboardInterrupt reaches
the caller with the orchestrator's state consistent and its shutdown able to run.

A thread that already runs an event loop (a Jupyter cell, or sync iteration inside a coroutine)
cannot run a second one. There the steps go to one helper thread with its own loop, and the
calling thread waits for each. It is slower, and it keeps ``for batch in loader`` working
wherever torch's loader works.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")

_local = threading.local()
_helper_lock = threading.Lock()
_helper: _LoopThread | None = None


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop
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


def _runner() -> asyncio.Runner:
    runner: asyncio.Runner | None = getattr(_local, "runner", None)
    if runner is None:
        runner = asyncio.Runner(loop_factory=_loop_factory())
        _local.runner = runner
    return runner


async def _into(box: list[Any], coro: Coroutine[Any, Any, Any]) -> None:
    box.append(await coro)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run one step of an orchestrator to completion from sync code."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        # The batch comes back through ``box``, not as the task's result: on Python 3.11,
        # Runner.run ends with signal.getsignal(), which formats a ValueError holding repr() of
        # its SIGINT handler, whose repr includes the task and so its result. With a batch as
        # the result that repr formats every tensor in it, costing milliseconds per batch.
        box: list[T] = []
        _runner().run(_into(box, coro))
        return box[0]
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = _LoopThread()
    return _helper.run(coro)
