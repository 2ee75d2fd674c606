"""The hang report: when the consumer has waited for one batch longer than
``hang_report_after``, say where it is, once, and go on waiting.

"My DataLoader hangs" cannot be told from "one sample is slow" by waiting longer. So, past the
threshold, aioload logs one WARNING (logger ``"aioload"``) that names the batch, the worker
holding it, its indices, how long the consumer has waited, and that worker's current Python
stack (``WorkerBackend.dump_stack``), and records the same in ``stats().stalled``. It stops
nothing: ``timeout`` is what ends a wait.

One report per batch: a hang is reported once, and a slow epoch of a hundred slow batches
reports each of them once. The wait for a batch is counted from the consumer's first sleep with
that batch awaited; it ends, for ``stats().stalled``, when the consumer's ``next()`` returns
(``PassStats.leave``).

Where the report is made (``HangWatch.sleep_limit``, asked before each of the engine's waits):

- A wait on a descriptor or a budget (worker processes, Ray, threads): the report is made
  there when it is due, and the sleep lasts no longer than until it is, so it comes on time
  whatever the backend's health-check period is.
- Work the engine runs in the caller instead of a sleep (the calling process's fetch,
  ``num_workers=0``): the consumer's own thread is busy in the sample, so a watchdog thread
  (``_Watchdog``, one per pass, started at the first such wait) makes the report. Arming it
  costs a few attribute writes; it wakes a few times a second while its pass runs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from .._wire.messages import IndexRange
from .counters import PassStats, Stall

if TYPE_CHECKING:
    from .._backends.base import Waitable, WorkerBackend
    from .ledger import Ledger, Sent

__all__ = ["NO_HANG_REPORT", "HangWatch", "logger"]

logger = logging.getLogger("aioload")

# Longest sleep of the watchdog between two looks at the armed work.
_WATCHDOG_PERIOD_S = 0.5


class HangWatch:
    """One pass's hang report (see the module's docstring). ``threshold``: seconds a consumer
    waits for a batch before it is reported; None: never (``NO_HANG_REPORT``)."""

    def __init__(self, threshold: float | None, stats: PassStats | None, *, in_order: bool) -> None:
        self.threshold = threshold
        self._stats = stats
        self._in_order = in_order
        # The task the consumer waits for, and since when (``time.monotonic``).
        self._key: int | None = None
        self._since = 0.0
        # The task last reported: a wait reports once per batch.
        self._reported: int | None = None
        # Work run in the caller, watched (``_arm``): (since, task id, record, backend, ledger).
        self._armed: tuple[float, int, Sent, WorkerBackend, Ledger] | None = None
        self._lock = threading.Lock()
        self._watchdog: _Watchdog | None = None

    def sleep_limit(
        self, deadline: float, waitable: Waitable, backend: WorkerBackend, ledger: Ledger
    ) -> float:
        """The longest the engine's coming wait may last: to the ``timeout`` deadline, and to
        when the hang report is due, which is made here if it is due now. Work run in the
        caller instead of a sleep is watched from another thread meanwhile."""
        left = deadline - time.monotonic() if deadline != math.inf else math.inf
        if self.threshold is None:
            return left
        if waitable.work is None:
            return min(left, self._check(backend, ledger))
        if not backend.TRAITS.runs_ahead:
            self._arm(backend, ledger)
        return left

    def _awaited(self, ledger: Ledger) -> tuple[int, Sent] | None:
        """The task the consumer waits for, if a worker holds it: in order, the next to yield;
        otherwise the oldest unanswered (any answer would do; that one is the likeliest
        hang). Where it is a new one, its wait starts now."""
        if self._in_order:
            sent = ledger.inflight.get(ledger.rcvd_idx)
            awaited = (ledger.rcvd_idx, sent) if sent is not None else None
        else:
            awaited = ledger.oldest()
        if awaited is not None and awaited[0] != self._key:
            self._key, self._since = awaited[0], time.monotonic()
        return awaited

    def _check(self, backend: WorkerBackend, ledger: Ledger) -> float:
        """Before a sleep: report the awaited batch if its wait has passed the threshold.
        Seconds until the report is due (inf: nothing to report)."""
        awaited = self._awaited(ledger)
        if awaited is None or awaited[0] == self._reported:
            return math.inf
        assert self.threshold is not None
        due = self._since + self.threshold - time.monotonic()
        if due > 0:
            return due
        self._reported = awaited[0]
        try:
            self._report(backend, self._since, *awaited)
        except Exception:  # a report must never take the pass down with it
            logger.debug("aioload: the hang report failed", exc_info=True)
        return math.inf

    def _arm(self, backend: WorkerBackend, ledger: Ledger) -> None:
        """Before work run in the caller: the watchdog reports it if it runs past the
        threshold."""
        awaited = self._awaited(ledger)
        if awaited is None or awaited[0] == self._reported:
            return
        self._armed = (self._since, *awaited, backend, ledger)
        if self._watchdog is None:
            self._watchdog = _Watchdog(self)

    def watchdog_look(self) -> bool:
        """From the watchdog's thread: report the armed work if it is due and its task still
        unanswered. False once the pass is over (the watchdog then stops)."""
        if self._stats is None or self._stats.finished:
            return False
        armed = self._armed
        if armed is None:
            return True
        since, task_id, sent, backend, ledger = armed
        assert self.threshold is not None
        due = time.monotonic() - since >= self.threshold
        if due and task_id != self._reported and task_id in ledger.inflight:
            self._report(backend, since, task_id, sent, armed=armed)
        return True

    def _report(
        self,
        backend: WorkerBackend,
        since: float,
        task_id: int,
        sent: Sent,
        armed: tuple[float, int, Sent, WorkerBackend, Ledger] | None = None,
    ) -> None:
        assert self.threshold is not None and self._stats is not None
        worker = sent.worker_id if backend.TRAITS.runs_ahead else None
        where = backend.place(sent.worker_id).name
        stall = Stall(task_id, worker, where, _plain(sent.indices), since)
        # (Read before the lock: it may take a moment; ``dump_stack`` is bounded.)
        stall.stack = backend.dump_stack(sent.worker_id)
        with self._lock:
            if armed is not None and self._armed is not armed:
                return  # (the work moved on meanwhile)
            self._reported = task_id
            self._stats.stalled = stall
        if armed is not None and task_id not in armed[4].inflight:
            # Answered while this was being written (from the watchdog's thread): the
            # consumer's ``next()`` may have returned before it could see the stall.
            stall.ended = time.monotonic()
        logger.warning(_message(stall, self.threshold))


# A pass without a hang report (``hang_report_after=None``): keeps no state.
NO_HANG_REPORT = HangWatch(None, None, in_order=True)


class _Watchdog:
    """A daemon thread that looks at the armed work of one ``HangWatch`` a few times a second
    (every threshold / 2, at most every ``_WATCHDOG_PERIOD_S``), until its pass is over. It
    holds the watch weakly: an abandoned pass takes its watchdog with it."""

    def __init__(self, watch: HangWatch) -> None:
        assert watch.threshold is not None
        stop = threading.Event()
        period = min(_WATCHDOG_PERIOD_S, watch.threshold / 2)
        # (The callback holds the event, not the watch, and wakes the thread to leave.)
        self._ref = weakref.ref(watch, lambda _: stop.set())
        threading.Thread(
            target=_watch_loop,
            args=(self._ref, stop, period),
            name="aioload-hang-watch",
            daemon=True,
        ).start()


def _watch_loop(ref: weakref.ref[HangWatch], stop: threading.Event, period: float) -> None:
    while not stop.wait(period):
        watch = ref()
        if watch is None:
            return
        try:
            if not watch.watchdog_look():
                return
        except Exception:  # a report must never take anything down with it
            logger.debug("aioload: the hang report failed", exc_info=True)
        del watch


def _plain(indices: Any) -> Any:
    """The indices as plain data (for ``stats().as_dict()``), as the dataset sees them."""
    if isinstance(indices, IndexRange):
        return indices.as_list()
    if isinstance(indices, list | tuple | range):
        return list(indices)
    return indices


def _message(stall: Stall, threshold: float) -> str:
    """The report, in short lines (a log line that runs off a terminal is not read)."""
    if stall.worker is None:
        holder = "The calling process (num_workers=0) is fetching it"
    else:
        holder = f"DataLoader worker {stall.worker} ({stall.where}) holds it"
    stack = (
        f"Its Python stack:\n{stall.stack}"
        if stall.stack is not None
        else "Its Python stack could not be read."
    )
    return (
        f"aioload: waited {stall.waited_s():.1f} s for batch {stall.batch}, and still waits "
        f"(nothing is stopped).\n{holder}, {_which(stall.indices)}. {stack}\n"
        f"(hang_report_after={threshold:g} s: once per batch; None turns it off; timeout= "
        "fails the wait.)"
    )


def _which(indices: Any, limit: int = 16) -> str:
    """Which samples the batch is: its indices (an IterableDataset's have none)."""
    if indices is None or (isinstance(indices, list) and all(i is None for i in indices)):
        return "the next batch of its IterableDataset stream"
    if isinstance(indices, list) and len(indices) > limit:
        return "with indices " + repr(indices[:limit])[:-1] + f", ... ({len(indices)} in all)]"
    return f"with indices {indices!r}"
