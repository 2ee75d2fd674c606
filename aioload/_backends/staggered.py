"""A pool's staggered start (``StaggeredStart``): worker 0 forked with the pool, each other
one at one of the engine's waits, so that the first batch does not wait for every fork.
"""

from __future__ import annotations

import functools
import threading
from typing import Protocol

from .._aio.waiting import run_off_loop
from .base import Waitable
from .worker_process import WorkerHandle

__all__ = ["StaggeredStart"]


class _Pool(Protocol):
    """What a staggered start reads of its pool (``_backends.process.WorkerPool``)."""

    num_workers: int
    workers: list[WorkerHandle]
    # Slots the engine dispatches to (num_workers="auto").
    active: int
    closed: bool
    fork_lock: threading.RLock

    def _fork(self, worker: WorkerHandle) -> None: ...


class StaggeredStart:
    """NOTE [staggered start]. A pool forks worker 0 as it starts and each other worker at
    one of the engine's waits, one fork per wait, not as its first task goes out. A fork
    costs the parent milliseconds (most of it copying its page tables), and forking them all
    before the first wait made the first batch wait for every fork: its time grew with
    num_workers. Now worker 0 starts on the first batch while the parent forks the others,
    and the parent takes that batch in between two forks. A task sent to a worker not forked
    yet waits in its socket; the consumer's own worker, when it waits for one, is forked
    first. Every worker is still started, as torch starts them all: those that got no task
    (fewer tasks than workers) are forked together at the first wait that finds no other.

    Each fork is work that the engine runs in place of a sleep (``CallerWork``): under
    ``for`` in the calling thread; under ``async for`` in a thread of its own, as the pool's
    start is. Not on the loop's thread: a child forked there would inherit that thread's
    state (its running event loop, a trio run) and could not run a loop of its own. A fork
    holds the GIL, so the loop stalls for it either way; the thread spares it the rest of a
    process's start.

    A native ``Task.cancel()`` ends the await of such a thread while its fork goes on (see
    ``run_off_loop``): the pool's ``fork_lock`` makes a close wait for that fork (and stop
    the worker it made), and a fork offered before the close forks nothing after it.
    """

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        # Whether no worker that has a task, or is active, waits for its fork: from then on,
        # waits look for none to fork, until a task goes to one not forked yet or more slots
        # are activated (num_workers="auto"). (A replacement is forked as it is made,
        # ``WorkerPool._spawn``.)
        self.done = pool.num_workers == 1
        self._forks: list[WorkerHandle] = []

    def offer(self, awaited: int | None) -> Waitable | None:
        """This wait's fork, as the engine's work: the awaited worker if it waits for its
        fork, else the first with a task waiting; where none has one, every active worker
        left. None where no worker with a task, and no active one, waits for its fork."""
        if self.done:
            return None
        # (Not one whose socket is already closed: its pool is closing. A slot that
        # num_workers="auto" retired before its fork still answers the tasks it was given;
        # one beyond the active ones is forked when activated.)
        waiting = [
            w
            for w in self.pool.workers
            if w.child_end is not None and (w.tasked or w.worker_id < self.pool.active)
        ]
        if not waiting:
            self.done = True
            return None
        chosen = [w for w in waiting if w.worker_id == awaited] or [w for w in waiting if w.tasked]
        self._forks = chosen[:1] or waiting
        return Waitable(work=self)

    async def work(self) -> None:
        await run_off_loop(functools.partial(self._fork_each, self._forks))

    def work_blocking(self) -> bool:
        self._fork_each(self._forks)
        return True

    def _fork_each(self, workers: list[WorkerHandle]) -> None:
        pool = self.pool
        with pool.fork_lock:
            if pool.closed:
                return
            for worker in workers:
                if worker.child_end is not None:
                    pool._fork(worker)
