"""The wait that the engine's step loop prepares (``PlannedWait``), and its two performers: on
the caller's event loop (``async for``) and in the calling thread (``for``).

NOTE [one step loop] in ``_engine/orchestrator.py``: ``Orchestrator._advance`` is the loop of
both ``next`` and ``next_blocking``; where a step has no batch, it plans the wait here and
returns, and its caller performs the wait the way its front end waits, then comes back.
"""

from __future__ import annotations

import asyncio
import math
import sys
from typing import TYPE_CHECKING

from .._aio.waiting import running_asyncio_loop
from .._backends.base import Waitable

if TYPE_CHECKING:
    from .._aio.waiting import Waiter
    from .._backends.base import WorkerBackend
    from .hang import HangWatch
    from .ledger import Ledger
    from .runahead import RunAhead

__all__ = ["PlannedWait"]

# The wait that is no wait: an overdue step's, which only ``next``'s checkpoint follows.
_NO_WAIT = Waitable()


class PlannedWait:
    """One pass's next wait: what may end it (the backend's ``Waitable``) and how long it may
    last, planned by ``plan`` and performed by ``perform`` or ``perform_blocking``. It sleeps
    in the pass's ``Waiter``, on what the backend offers and on the pin stage's pipe."""

    __slots__ = ("_waiter", "seconds", "waitable")

    def __init__(self, waiter: Waiter) -> None:
        self._waiter = waiter
        self.waitable = _NO_WAIT
        self.seconds = 0.0

    def plan(
        self,
        backend: WorkerBackend,
        awaited: int | None,
        deadline: float,
        hang: HangWatch,
        ledger: Ledger,
        ahead: RunAhead,
    ) -> None:
        """What is held back is sent (``flush``), then what may end the wait is asked
        (``waitable``), and how long it may last: the backend's budget, the hang report's
        and ``timeout``'s limit, and run-ahead's bound. While workers run ahead of a late
        head, any worker's answer ends the wait (``RunAhead.wakes_on_any``)."""
        backend.flush()
        # Asked once: it walks the workers' counters while the head is late.
        any_answer = ahead.wakes_on_any()
        if any_answer:
            awaited = None
        self.waitable = waitable = backend.waitable(awaited)
        left = hang.sleep_limit(deadline, waitable, backend, ledger)
        if waitable.work is None:
            self.seconds = min(waitable.budget, left, ahead.sleep_bound(any_answer))

    def skip(self) -> None:
        """No wait at all (an overdue step's): under ``async for`` only its checkpoint."""
        self.waitable, self.seconds = _NO_WAIT, 0.0

    async def perform(self) -> bool:
        """On the caller's loop: until the backend may have something, the pin stage has a
        batch, or the time is up; or the caller's work done instead. True where it went round
        the loop (``Orchestrator.next`` then needs no checkpoint of its own)."""
        waitable = self.waitable
        if waitable.work is not None:
            await waitable.work.work()
        elif (timeout := self.seconds) > 0:
            await self._waiter.wait(waitable.descriptor, timeout)
            if _scope_cancelled():
                await asyncio.sleep(0)  # NOTE [a wait that ended as it was cancelled]
            return waitable.descriptor is not None or timeout != math.inf
        return False

    def perform_blocking(self) -> bool:
        """In the calling thread; False, having waited for nothing, where it needs an event
        loop (an async dataset's fetch in this process)."""
        waitable = self.waitable
        if waitable.work is not None:
            return waitable.work.work_blocking()
        if (timeout := self.seconds) > 0:
            self._waiter.wait_blocking(waitable.descriptor, timeout)
        return True


def _scope_cancelled() -> bool:
    """NOTE [a wait that ended as it was cancelled]: whether an anyio cancel scope around the
    calling task has been cancelled. Under asyncio, anyio delivers a scope's cancellation by
    cancelling the task where it waits; where the future it waits on is already done (a
    worker's answer came in the same turn of the loop), it leaves the task alone and tries
    again on the next turn. The wait then ends as if nothing had been asked, and the batch
    would be handed over past the checkpoint the cancellation was meant for. One more turn of
    the loop (``asyncio.sleep(0)``) lets it through, before the batch is taken. Checked only
    where anyio has been imported (a scope needs it): a lookup of a few microseconds."""
    if "anyio" not in sys.modules or running_asyncio_loop() is None:
        return False
    import anyio

    return anyio.current_effective_deadline() == -math.inf
