"""Waiting without blocking the caller's event loop: the engine's sleep between two polls of
its backend (``Waiter``, on the descriptor the backend offers and the engine's own wake-up
pipe), the readiness wait under it (``ReadableWait``), and the thread hop for the blocking
steps of a pass's start and end.

All of it works under asyncio (and uvloop) without importing anyio, and under trio through
anyio; ``Waiter`` also blocks the calling thread for the sync front end, with no loop at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Descriptor", "ReadableWait", "Waiter", "run_off_loop", "running_asyncio_loop"]

T = TypeVar("T")


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio (or uvloop) loop; None under trio, the only other loop anyio runs
    on, whose waits and threads go through anyio."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# How early ReadableWait's timer may fire for a wait that has timed out: the loop runs a timer
# up to its clock's resolution before its time (asyncio's ``_clock_resolution``, a
# nanosecond on Linux; uvloop's clock counts milliseconds).
_TIMER_SLACK_S = 1e-3
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

    The timer that ends a wait at its timeout stays armed from one wait to the next too: a
    timer made and cancelled for every wait cost the loop's bookkeeping (a handle, a heap
    entry, the cancellation's count) for every batch of a data-bound consumer, whose waits
    nearly all end by readiness. A wait whose own end comes no sooner than the armed timer's
    keeps it; when it fires, a wait that is not yet due is given a timer at its own end, so
    each wait still ends at its timeout (within ``_TIMER_SLACK_S``).

    Cancellation needs no scope: a cancelled task is interrupted at ``await waiter``. Under
    trio, anyio's (trio's own) primitives do the wait.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        # The process whose loop it watches: a forked child's copy must not touch that loop.
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watched: int | None = None  # the duplicate registered with ``_loop``
        # A poll of that duplicate, which checks a readiness the loop reports (_readable).
        self._probe: select.poll | None = None
        self._waiter: asyncio.Future[bool] | None = None
        # When the current wait times out (the loop's clock), and the armed timer, if any,
        # with when it fires.
        self._due = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
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
            probe = select.poll()
            probe.register(watched, select.POLLIN)
            self._loop, self._watched, self._probe = loop, watched, probe
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        self._unheard = 0
        # (No timer for a wait without end: a loop's timers need a finite time. One armed
        # for an earlier wait may still fire meanwhile; _expired then finds this one not due.)
        self._due = due = math.inf if timeout == math.inf else loop.time() + timeout
        if due < self._timer_at:
            self._arm(loop, due)
        try:
            return await waiter
        finally:
            self._waiter = None

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(when, self._expired), when

    def _expired(self) -> None:
        """The armed timer fired (on the loop's thread): the wait times out if it is due, and
        otherwise gets a timer at its own end. With nobody waiting, nothing is armed again."""
        self._timer, self._timer_at = None, math.inf
        waiter, loop = self._waiter, self._loop
        if waiter is None or loop is None or self._due == math.inf:
            return
        # (The loop fires a timer up to its clock's resolution early: a wait due by then has
        # timed out, as under the timer the wait made for itself before.)
        if self._due > loop.time() + _TIMER_SLACK_S:
            self._arm(loop, self._due)
            return
        _settle(waiter, False)

    def _readable(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            # (Done already: fired again before the woken task ran. Nothing to do.)
            self._unheard = 0
            # NOTE [stale readiness]. The loop queues this call when its own poll finds the
            # descriptor readable, and runs it later in the same turn, after the callbacks
            # queued before it. When one of those is the task an earlier readiness woke, that
            # task reads the answer, often awaits again at once (a data-bound consumer), and
            # this call then finds a new wait, which the answer already read would end for
            # nothing: a step with no batch, one wake-up of the parent too many. (The backend
            # may also have changed meanwhile what its descriptor reports: another worker's
            # answers, ``_AwaitedEpoll``.) So the readiness is checked again, with one poll
            # that does not block; readiness is level-triggered, so a wait left on is called
            # again as soon as the descriptor is readable.
            probe = self._probe
            if probe is not None and not waiter.done() and not probe.poll(0):
                return
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
        """Stop watching. From any thread: the loop's own thread removes the reader. In a
        forked child (a copy of a pass collected there), only the duplicate is closed."""
        if os.getpid() != self._pid:
            self.forget_after_fork()
            return
        loop, watched, timer = self._loop, self._watched, self._timer
        self._loop = self._watched = self._timer = self._probe = None
        self._timer_at = math.inf
        if loop is None or watched is None:
            return
        if running_asyncio_loop() is loop or not loop.is_running():
            # On the loop's thread, or no thread is inside the loop: safe to touch it here.
            _stop_watching(loop, watched, timer)
            return
        try:
            loop.call_soon_threadsafe(_stop_watching, loop, watched, timer)
        except RuntimeError:  # closed meanwhile: its registrations went with it
            os.close(watched)

    def forget_after_fork(self) -> None:
        """In a forked child: drop the duplicate without touching the parent's loop."""
        watched, self._watched, self._loop, self._probe = self._watched, None, None, None
        self._timer, self._timer_at = None, math.inf
        if watched is not None:
            with contextlib.suppress(OSError):
                os.close(watched)


def _settle(waiter: asyncio.Future[bool], readable: bool) -> None:
    if not waiter.done():
        waiter.set_result(readable)


def _stop_watching(
    loop: asyncio.AbstractEventLoop, watched: int, timer: asyncio.TimerHandle | None
) -> None:
    if timer is not None:
        timer.cancel()
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


class Descriptor:
    """A descriptor that a backend offers the engine to wait on (``WorkerBackend.waitable``):
    readable when the backend's ``poll`` may have something. One object per open file: the
    engine's waits keep a duplicate of it registered from wait to wait, and a new file the
    backend makes (a new epoll, after a worker was replaced) may reuse the old one's number,
    so the engine tells them apart by the object, never by the number.

    The backend owns and closes the descriptor; a wait holds its own duplicate meanwhile."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd


class Waiter:
    """The engine's sleep between two polls of its backend: until the backend's descriptor is
    readable, the engine's own wake-up descriptor is (its pin stage's pipe, which the backend
    never sees), or a timeout passes. Async under asyncio, uvloop and trio (``wait``); in the
    calling thread for the sync front end (``wait_blocking``). Both report whether anything
    woke them.

    What it watches is made once per backend descriptor and kept from wait to wait: under
    asyncio a reader stays on the loop (see ``ReadableWait``), and making it costs two
    ``epoll_ctl`` calls and the loop's bookkeeping. One descriptor is watched as it is; the
    backend's and the wake-up pipe together through an epoll of the waiter's own, since the
    loop's one reader (and trio's one ``wait_readable``) watches one descriptor. With nothing
    to watch, a wait sleeps out its timeout.
    """

    def __init__(self, wake_fd: int | None) -> None:
        self._wake_fd = wake_fd
        # What the watch below was made for, and whether one was made.
        self._source: Descriptor | None = None
        self._made = False
        self._fds: tuple[int, ...] = ()
        self._epoll: select.epoll | None = None  # the backend's and the wake-up pipe together
        self._readable: ReadableWait | None = None  # the async wait, made on first use
        self._poller: select.poll | None = None  # the blocking wait, made on first use

    def _watch(self, source: Descriptor | None) -> None:
        if self._made and source is self._source:
            return
        self.close()
        self._source, self._made = source, True
        fds = [source.fd] if source is not None else []
        self._fds = (*fds, self._wake_fd) if self._wake_fd is not None else tuple(fds)

    async def wait(self, source: Descriptor | None, timeout: float) -> bool:
        """Wait, without blocking the loop, until ``source`` or the wake-up pipe is readable
        (True) or ``timeout`` seconds pass (False). Cancellable like any await."""
        if not self._made or source is not self._source:  # (a call only when it changes)
            self._watch(source)
        if not self._fds:
            return await _sleep(timeout)
        if self._readable is None:
            fd = self._fds[0]
            if len(self._fds) > 1:
                epoll = self._epoll = select.epoll()
                for each in self._fds:
                    epoll.register(each, select.EPOLLIN)
                fd = epoll.fileno()
            self._readable = ReadableWait(fd)
        return await self._readable.wait(timeout)

    def wait_blocking(self, source: Descriptor | None, timeout: float) -> bool:
        """``wait`` in the calling thread, with no loop. Ctrl-C interrupts it as it would any
        blocking call."""
        if not self._made or source is not self._source:  # (a call only when it changes)
            self._watch(source)
        if not self._fds:
            if timeout != math.inf:
                try:
                    time.sleep(timeout)
                except BaseException as error:
                    _mark_in_wait(error)
                    raise
            return False
        if self._poller is None:
            self._poller = select.poll()
            for fd in self._fds:
                self._poller.register(fd, select.POLLIN)
        return bool(_poll_blocking(self._poller, timeout))

    def close(self) -> None:
        """Stop watching; from any thread (the loop's own thread removes its reader)."""
        readable, epoll = self._readable, self._epoll
        self._readable = self._epoll = self._poller = None
        self._made = False
        if readable is not None:
            readable.close()
        if epoll is not None:
            # (The loop watches a duplicate of it, which it closes itself.)
            epoll.close()


async def _sleep(timeout: float) -> bool:
    """Nothing to watch: sleep out ``timeout`` (at once for a wait without end, which nothing
    could end)."""
    if timeout == math.inf:
        return False
    if running_asyncio_loop() is None:
        import anyio

        await anyio.sleep(timeout)
    else:
        await asyncio.sleep(timeout)
    return False


def _poll_blocking(poller: select.poll, timeout: float) -> list[tuple[int, int]]:
    """``poller.poll()`` for at most ``timeout`` seconds (poll takes milliseconds, and rounds a
    fraction up). A function of its own so that a profile tells the sleep from the work around
    it (``benchmarks.parent_profile``)."""
    try:
        return poller.poll(None if timeout == math.inf else timeout * 1e3)
    except BaseException as error:
        _mark_in_wait(error)
        raise


# NOTE [an interrupt in the wait]. A signal handler's exception (Ctrl-C's KeyboardInterrupt)
# is raised where the main thread is when the signal is handled: almost always here, in the
# blocking wait, where the pass's state is whole; rarely in the bookkeeping around it, where
# an answer may be half taken in. Marked here, the sync front end keeps a pass interrupted in
# its wait (torch's iterator goes on after a Ctrl-C too) and ends one interrupted anywhere
# else, whose next ``next()`` then says so (``loader._ended_early``).
_IN_WAIT = "_aioload_raised_in_wait"


def _mark_in_wait(error: BaseException) -> None:
    with contextlib.suppress(Exception):  # (an exception type without attributes)
        setattr(error, _IN_WAIT, True)


def raised_in_wait(error: BaseException) -> bool:
    """Whether ``error`` came out of a blocking wait itself (NOTE [an interrupt in the wait])."""
    return bool(getattr(error, _IN_WAIT, False))
