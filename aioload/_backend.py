"""The seam between the engine and its workers, and the policy that keeps workers between passes.

The orchestrator (``_orchestrator.py``) schedules ``(task_id, indices)`` tasks; a
``WorkerBackend`` runs them somewhere and reports back. Three implementations:

- ``_workers.WorkerPool``: local worker processes (shared-memory batches, sockets, sentinels);
- ``_inline.InlineBackend``: ``num_workers=0``, the calling process as the one worker;
- ``_ray.RayBackend``: Ray actors (optional, ``aioload[ray]``).

Everything a backend says to the engine is a ``_messages.Event``: an ``Answer`` to a task, or a
``WorkerLost``. Health checks, descriptors and transports stay inside each backend; restart
policy (how many, which tasks go again) is the engine's, the same for every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ._fetch import PassPlan
from ._messages import Event

__all__ = [
    "BackendKeeper",
    "ReadableWait",
    "WorkerBackend",
    "run_off_loop",
    "running_asyncio_loop",
]

T = TypeVar("T")


class WorkerBackend(Protocol):
    """What the engine needs from whatever runs its workers."""

    # Worker slots, numbered 0..num_workers-1 (a replacement keeps its slot).
    num_workers: int
    # No longer fit for another pass (a worker's setup failed, or one hung): a persistent
    # loader starts a fresh backend next pass. Closed backends are retired too.
    retired: bool

    def start_pass(self, plans: list[PassPlan]) -> None:
        """A pass begins: answers to older passes' tasks are dropped from now on, and worker
        ``i`` makes its fetcher from ``plans[i]``."""

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        """Ask worker ``worker_id`` for one batch. May be buffered until ``poll``/``wait``."""

    def poll(self) -> list[Event]:
        """Send what was submitted; return every answer and loss that has arrived, without
        waiting. A lost worker's answers sent before it died come first."""

    async def wait(
        self, deadline: float, wake_fd: int | None = None, awaited: int | None = None
    ) -> None:
        """Wait until ``poll`` may have something, ``wake_fd`` is readable (the pin stage),
        or ``deadline`` (``time.monotonic()`` seconds) passes. Never blocks the event loop.
        ``awaited``: as in ``wait_blocking``."""

    def wait_blocking(
        self, deadline: float, wake_fd: int | None = None, awaited: int | None = None
    ) -> bool:
        """``wait`` for the sync front end: blocks the calling thread, with no event loop.
        Returns False at once, having waited for nothing, where waiting needs a loop (an async
        dataset in the calling process); the front end then runs ``wait`` on its own loop.

        ``awaited`` is the worker whose answer the consumer needs next, where the engine knows
        it (in-order delivery): a backend may then sleep until that worker answers (or any
        worker is lost, or ``wake_fd`` or ``deadline``) rather than until any answer arrives.
        The others' answers are taken in by the ``poll`` after the wait."""

    def restart(self, worker_id: int) -> None:
        """Replace a lost worker in its slot, on this pass's plan."""

    def abandon(self, worker_id: int) -> None:
        """Stop a worker that stopped answering; ``poll`` then reports it lost."""

    def retire(self) -> None:
        """Serve out this pass, but no other (a worker is stuck)."""

    def describe(self, worker_id: int) -> str:
        """How error messages name this worker ("pid 1234", "actor ... on node ...")."""

    def close(self) -> None:
        """Stop every worker and release everything, bounded in time. Idempotent."""


class BackendKeeper:
    """Which backend a pass runs on: a fresh one per pass, or (``persistent_workers``) one kept
    for the loader's life and replaced only when it is closed or retired."""

    def __init__(self, owner: object, persistent: bool) -> None:
        self._owner = weakref.ref(owner)
        self.persistent = persistent
        self.kept: WorkerBackend | None = None
        # The pass that runs on the kept backend: superseded (closed) when the next begins.
        self.current_pass: Callable[[], Any] | None = None

    def reusable(self) -> bool:
        """Whether the next pass runs on the kept backend (and so draws no base seed)."""
        kept = self.kept if self.persistent else None
        return kept is not None and not kept.retired

    def for_pass(
        self, make: Callable[[int], WorkerBackend], base_seed: int | None
    ) -> tuple[Callable[[], WorkerBackend], bool]:
        """A factory for this pass's backend (called on the pass's first ``next()``), and
        whether the pass owns it (closes it when it ends)."""
        if not self.persistent:
            assert base_seed is not None
            seed = base_seed
            return (lambda: make(seed)), True
        previous = self.current_pass() if self.current_pass is not None else None
        if previous is not None:
            previous.close()  # one pass at a time on a kept backend
        if self.reusable():
            kept = self.kept
            assert kept is not None
            return (lambda: kept), False
        self.shutdown()
        assert base_seed is not None
        seed = base_seed

        def start() -> WorkerBackend:
            backend = make(seed)
            self.kept = backend
            owner = self._owner()
            if owner is not None:
                # The workers die with the loader (or at interpreter exit), not with a pass.
                weakref.finalize(owner, backend.close)
            return backend

        return start, False

    def shutdown(self) -> None:
        kept, self.kept = self.kept, None
        if kept is not None:
            kept.close()


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
