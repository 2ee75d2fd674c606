"""Waiting on the caller's event loop without blocking it: the readiness wait that the engine
awaits between answers, and the thread hop for the blocking steps of a pass's start and end.

Both work under asyncio (and uvloop) without importing anyio, and under trio through anyio.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["ReadableWait", "WakeWatch", "run_off_loop", "running_asyncio_loop"]

T = TypeVar("T")


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio (or uvloop) loop; None under trio, the only other loop anyio runs
    on, whose waits and threads go through anyio."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# How many calls of ReadableWait's reader in a row may find nobody waiting before it stops
# watching (see ReadableWait._readable).
_UNHEARD_LIMIT = 8


class ReadableWait:
    """Waits, wait after wait, until one descriptor (a backend's selector) is readable or a
    timeout passes: the one await of a backend's ``wait``. Cancellable like any await.

    Under asyncio (and uvloop) a wait is a future, a reader and a timer on the running loop.
    The reader stays registered from one wait to the next: adding and removing it every time
    cost two ``epoll_ctl`` calls per wait, and the async front end of a data-bound consumer
    waits for nearly every batch (about 14 us of the parent's CPU per batch on the tiny
    workload). It is removed when it keeps firing with nobody waiting (readiness is
    level-triggered, so it would run on every turn of the loop while the consumer awaits
    something else; the next wait adds it again), when a wait runs on another loop, and by
    ``close``.

    The loop watches a duplicate of the descriptor, owned here. The backend closes its own
    descriptor when a pass ends, often in a worker thread (``aclose``) or a finalizer, where
    the loop's registration cannot be touched; the duplicate keeps the number from being
    reused under the loop until the loop's own thread removes the reader and closes it.

    Cancellation needs no scope: a cancelled task is interrupted at ``await waiter``, and the
    ``finally`` cancels the timer. Under trio, anyio's (trio's own) primitives do the wait.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: int | None = None  # the duplicate registered with ``_loop``
        self._waiter: asyncio.Future[bool] | None = None
        # Calls of the reader in a row that found nobody waiting (see _readable).
        self._unheard = 0

    async def wait(self, timeout: float) -> bool:
        """True once the descriptor is readable, False after ``timeout`` seconds."""
        loop = running_asyncio_loop()
        if loop is None:
            import anyio

            with anyio.move_on_after(timeout):
                await anyio.wait_readable(self.fd)
                return True
            return False
        if self._loop is not loop:
            self.close()
            watched = os.dup(self.fd)
            try:
                loop.add_reader(watched, self._readable)
            except BaseException:
                os.close(watched)
                raise
            self._loop, self._watched = loop, watched
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        self._unheard = 0
        timer = loop.call_later(timeout, _settle, waiter, False)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _readable(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            # (Done already: fired again before the woken task ran. Nothing to do.)
            self._unheard = 0
            _settle(waiter, True)
            return
        # Nobody waits. A few such calls are the normal course of a pass: one queued before
        # the last wait ended (the loop runs it after the woken task), one or two while the
        # consumer's next ``__anext__`` passes its checkpoint with an answer already in. Many
        # in a row mean the consumer is awaiting something else while answers wait, and this
        # would run on every turn of the loop: stop watching until the next wait.
        self._unheard += 1
        if self._unheard > _UNHEARD_LIMIT:
            self.close()

    def close(self) -> None:
        """Stop watching. From any thread: the loop's own thread removes the reader."""
        loop, watched = self._loop, self._watched
        self._loop = self._watched = None
        if loop is None or watched is None:
            return
        if running_asyncio_loop() is loop or not loop.is_running():
            # On the loop's thread, or no thread is inside the loop: safe to touch it here.
            _stop_watching(loop, watched)
            return
        try:
            loop.call_soon_threadsafe(_stop_watching, loop, watched)
        except RuntimeError:  # closed meanwhile: its registrations went with it
            os.close(watched)

    def forget_after_fork(self) -> None:
        """In a forked child: drop the duplicate without touching the parent's loop."""
        watched, self._watched, self._loop = self._watched, None, None
        if watched is not None:
            with contextlib.suppress(OSError):
                os.close(watched)


def _settle(waiter: asyncio.Future[bool], readable: bool) -> None:
    if not waiter.done():
        waiter.set_result(readable)


def _stop_watching(loop: asyncio.AbstractEventLoop, watched: int) -> None:
    with contextlib.suppress(Exception):  # a closed loop has let go of it already
        loop.remove_reader(watched)
    os.close(watched)


async def run_off_loop(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread and return its result, for the blocking steps of a pass's start
    and end (forking workers, waiting for them to exit) that must not stall the caller's loop.
    Shielded from anyio's cancellation: a pool half-made, or half-closed, when a cancel scope
    fires would be orphaned. A native ``Task.cancel()`` does end the await early (no shield
    holds it off, anyio's included); ``fn`` then runs on to its end in its thread, which is
    why the callers make ``fn`` safe to finish unobserved (see ``Orchestrator._start``).

    Under asyncio with anyio not imported, no anyio cancel scope can exist, so nothing needs
    shielding from one: the call is a thread of its own and a future on the loop, without
    importing anyio and its asyncio backend (25-40 ms, paid by ``async for``'s first batch).
    A thread per call, not the loop's default executor: these run once or twice per pass, and
    a user's own blocking jobs queued on that executor must not hold up a start or a close.
    """
    loop = running_asyncio_loop()
    if loop is not None and "anyio" not in sys.modules:
        return await _in_own_thread(loop, fn)
    # trio, or anyio in use on asyncio (its cancel scopes may be around this call).
    import anyio
    import anyio.to_thread

    with anyio.CancelScope(shield=True):
        outcome = await anyio.to_thread.run_sync(fn)
    return outcome


async def _in_own_thread(loop: asyncio.AbstractEventLoop, fn: Callable[[], T]) -> T:
    done: asyncio.Future[T] = loop.create_future()

    def settle(outcome: T | None, error: BaseException | None) -> None:
        if done.done():
            return  # the awaiting task was cancelled
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(outcome)  # type: ignore[arg-type]

    def run() -> None:
        outcome: T | None = None
        error: BaseException | None = None
        try:
            outcome = fn()
        except BaseException as exc:  # handed to the awaiting task, as anyio's threads do
            error = exc
        # A closed loop: nobody is waiting for this any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, outcome, error)

    # Not a daemon: a daemon thread still running when the interpreter exits is stopped
    # wherever it stands, which with native code on its stack can abort the process. And a
    # cancelled caller leaves this thread finishing a start or a close, which the interpreter
    # should wait for at exit rather than cut short (both are bounded).
    thread = threading.Thread(target=run, name="aioload-off-loop")
    thread.start()
    try:
        return await done
    finally:
        if done.done() and not done.cancelled():
            # The thread has settled the future and has only its return left: joined, so
            # that it is gone before the caller goes on (and, at the end of a program, before
            # the interpreter shuts down). Microseconds: join releases the GIL the thread
            # needs. (Not when the caller was cancelled: then fn may still be running.)
            thread.join()


class WakeWatch:
    """The engine's wake-up descriptor (its pin stage's pipe) among the descriptors a backend's
    selector watches, so that the backend's one wait also ends when the stage has a batch.

    The engine hands the descriptor to every wait; it changes only from pass to pass. The
    previous pass's pipe is closed by the time a new pass starts, and its number may come
    back for the new pipe: a closed descriptor leaves epoll by itself, so the selector's
    record of it must go too (``forget``), or the new pipe would never be registered.
    """

    def __init__(self, selector: selectors.BaseSelector, data: object) -> None:
        self._selector = selector
        self._data = data  # what the selector's key carries, to tell this descriptor apart
        self.fd: int | None = None

    def watch(self, fd: int | None) -> None:
        if fd == self.fd:
            return
        self.forget()
        self.fd = fd
        if fd is not None:
            self._selector.register(fd, selectors.EVENT_READ, self._data)

    def forget(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(fd)
