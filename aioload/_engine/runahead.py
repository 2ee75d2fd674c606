"""In order, without waiting in line: how far workers may run ahead of a late batch.

In order, torch keeps ``prefetch_factor * num_workers`` tasks between "sent" and "yielded",
and sends the next one only when a batch is handed over. When one batch is slow (a large
image, a remote read, a retry), the batches after it finish and wait for their turn in the
reorder buffer; once they fill the window, every other worker sits idle until the slow one
arrives. With uneven sample times that halves what the workers could deliver.

So, while the head of the line is late, the orchestrator keeps each worker's own queue at
``prefetch_factor`` unanswered tasks (torch's depth per worker), even though the answers
behind the head take the window's room: the workers *run ahead* (``RunAhead.top_up``, called
by the orchestrator's step when nothing is ready).
The tasks still go round robin, to the worker torch would give them, so which worker fetches
which batch (and with it a dataset's per-worker randomness) is torch's; only how far ahead
they are sent changes. The consumer still gets every batch in order, exactly once.

What it may cost is bounded: at most ``limit`` batches beyond the window, where ``limit`` is
the smaller of ``RUN_AHEAD_WINDOWS`` windows and what fits in ``RUN_AHEAD_BYTES`` (or, with
``max_memory``, in what the budget leaves beside the window: ``(window + 2)`` batches are
already the controller's, see ``_engine.tuning``), at the largest batch size seen. The first survey of that size comes once a window of
batches has been handed over; until then the limit is 0. A pass's first batches are late
because its workers are starting, not because samples are uneven, and it starts with torch's
window exactly: ``prefetch_factor * num_workers`` tasks, then one more per batch.

A late head is noticed only when the engine wakes: in order it sleeps until the head's
worker answers (``Ledger.awaited``). While the head is late and the workers could run further,
any worker's answer ends the wait instead (``wakes_on_any``), and that worker is topped up at
once: waiting on the head's worker alone, the others ran dry behind it. With three workers or
more, while answers wait behind a late head, the sleep is also cut to ``tick``, half the mean
time a task takes (within ``TICK_MIN_S`` and ``TICK_MAX_S``). With two workers, only where
task times are uneven (see ``resize``). While the head is on time, neither costs a wake-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .measure import batch_bytes

if TYPE_CHECKING:
    from .counters import PassStats
    from .ledger import Ledger

__all__ = ["RUN_AHEAD_BYTES", "RUN_AHEAD_WINDOWS", "RunAhead"]

# The most a pass runs ahead of a late head, beyond its window: this many windows of
# prefetch_factor x num_workers batches ...
RUN_AHEAD_WINDOWS = 16
# ... and no more bytes of batches than this (without max_memory).
RUN_AHEAD_BYTES = 256 << 20
# How often (in batches handed over) the batch size and the mean task time are read again.
SURVEY_EVERY = 64
# The engine's sleep while the workers could run ahead, cut to the mean task time within these.
TICK_MIN_S = 0.001
TICK_MAX_S = 0.100
# ... at this share of it: a worker with a short queue finishes its tasks in less.
TICK_SHARE = 0.5
# With two workers, any answer ends a wait behind a late head only where the workers' task
# times spread this much: their standard deviation over their mean (within each worker), see
# RunAhead.resize. Measured on 2 cores (2 workers, the default batch sizes): jpeg 0.21, tiny
# 0.28, image 0.22; samples that sleep a lognormal time of sigma 0.25, 0.5 and 1 (batch 1):
# 0.25, 0.54, 1.40.
UNEVEN_SPREAD = 0.4
# ... judged once the workers have answered this many tasks each (their first left out) on
# average; until then a survey comes at every window.
SPREAD_MIN_TASKS = 4
# A worker whose tasks take this many times the others' mean (over this many tasks of its own
# at least) is slow for good, not late by chance: see RunAhead.slow_for_good. (The head's
# worker is asked when the head is late, that is, often after its slowest samples. Drawn at
# random from a lognormal of sigma 1, two tasks average four times the mean 1.5 % of the time,
# eight tasks 0.1 %.)
SLOW_FOR_GOOD = 4.0
SLOW_MIN_TASKS = 8


class RunAhead:
    """One pass's run-ahead: its bound (``limit``, batches beyond the window), the sleep that
    lets the engine notice idle workers (``tick``), and the top-up itself. ``enabled``: in
    order, with workers that run ahead (else it never does anything). ``max_memory``: the
    loader's budget, if any (with ``"auto"``). The first survey (and with it any run-ahead)
    comes after ``first_survey`` batches handed over. ``round_robin``: tasks go to the worker
    torch would give them (else to the least busy, see ``slow_for_good``)."""

    __slots__ = (
        "_ledger",
        "_max_memory",
        "_round_robin",
        "_stats",
        "_surveyed",
        "_ticks",
        "_uneven",
        "batch_bytes",
        "capacity",
        "limit",
        "next_survey",
        "tick",
    )

    def __init__(
        self,
        ledger: Ledger,
        stats: PassStats,
        capacity: int,
        *,
        enabled: bool,
        max_memory: int | None = None,
        first_survey: int = 1,
        round_robin: bool = True,
    ) -> None:
        self._ledger = ledger
        self._round_robin = round_robin
        self._stats = stats
        self._max_memory = max_memory
        self.capacity = capacity
        self.limit = 0
        self.tick = TICK_MAX_S
        self.batch_bytes = 0
        self._surveyed = False
        # Whether the engine's sleep is cut to ``tick`` while workers run ahead (3 workers or
        # more, see resize).
        self._ticks = False
        # Whether the workers' task times are uneven (UNEVEN_SPREAD), as of the last survey.
        self._uneven = False
        # The number of batches handed over at which to survey (again); never, disabled.
        self.next_survey: float = first_survey if enabled else math.inf

    def survey(self, batch: Any, yielded: int) -> None:
        """A batch handed over (``yielded`` so far): read its size and the workers' mean task
        time, and set the limit."""
        self.next_survey = yielded + SURVEY_EVERY
        self._surveyed = True
        self.batch_bytes = max(self.batch_bytes, batch_bytes(batch))
        tasks = busy = 0.0
        for counter in self._stats.workers:
            tasks += counter.tasks
            busy += counter.busy_s
        if tasks:
            self.tick = min(TICK_MAX_S, max(TICK_MIN_S, TICK_SHARE * busy / tasks))
        if not self._ticks and not self._judge_spread():
            self.next_survey = yielded + self.capacity
        self.resize(self.capacity)

    def answered(self, outcome: Any) -> None:
        """An answer just filed: if it waits behind a late head, a batch larger than any seen
        shrinks the limit at once. Batches that grow in the middle of a pass (sorted or
        bucketed by size) would otherwise run ahead at the small ones' limit until the next
        survey, and the answers waiting in order could fill several times the bound. (Not
        sized otherwise: a batch's walk costs the consumer's thread.)"""
        if not self.limit or not self._ledger.head_late():
            return
        size = batch_bytes(outcome)
        if size > self.batch_bytes:
            self.batch_bytes = size
            self.resize(self.capacity)

    def _judge_spread(self) -> bool:
        """Set ``_uneven`` from the workers' task times (their first left out); False while
        they are too few to tell."""
        workers = self._stats.workers
        tasks = busy = squares = 0.0
        for counter in workers:
            n = counter.tasks - 1
            if n > 0:
                # (each worker's own spread: one worker slower than another is not uneven)
                own = counter.busy_s - counter.first_s
                tasks += n
                busy += own
                squares += counter.busy_sq - own * own / n
        if tasks < SPREAD_MIN_TASKS * len(workers):
            return False
        mean = busy / tasks
        self._uneven = squares > 0 and squares / tasks >= (UNEVEN_SPREAD * mean) ** 2
        return True

    def resize(self, capacity: int, slots: int | None = None) -> None:
        """The limit for a window of ``capacity`` tasks over ``slots`` workers (the controller
        may change both)."""
        self.capacity = capacity
        if slots is not None:
            # NOTE: with two workers, the sleep is never cut to a tick, and any answer ends a
            # wait behind a late head only where task times are uneven (UNEVEN_SPREAD). That
            # is the small machine's case, where each wake-up takes a core from the workers
            # (see Ledger.awaited), and where the head is late at most hand-overs without any
            # sample being slow: the two workers take turns, and one of them may share a core
            # with the consumer. There a tick would wake the consumer several times for each
            # batch (image, 2 workers, 2 cores: 7 % fewer items/s with it), and waking on any
            # answer cost jpeg 8-14 % of its items/s, its workers already 98 % busy. Where
            # samples are uneven, the other worker ran dry behind each slow one: in order, at
            # lognormal sigma 1, 74 % of the floor waiting on the head's worker alone, 92 %
            # waking on any answer (benchmark notes, "Two workers behind a late head").
            self._ticks = slots > 2
        if not self._surveyed:
            return
        # (A batch with no tensors or arrays counts as a byte.)
        size = max(1, self.batch_bytes)
        if self._max_memory is not None:
            fits = self._max_memory // size - (capacity + 2)
        else:
            fits = RUN_AHEAD_BYTES // size
        self.limit = max(0, min(RUN_AHEAD_WINDOWS * capacity, fits))
        stats = self._stats
        stats.run_ahead_limit = self.limit
        stats.batch_bytes = self.batch_bytes

    def top_up(self, slots: int, dispatch: Callable[[Callable[[], bool]], None]) -> None:
        """Nothing is ready: if the head of the line is late, keep every worker's queue (of
        the first ``slots``) at its depth, within the limit, sending through ``dispatch``
        (the orchestrator's, which sends while the predicate it is given holds)."""
        ledger, capacity = self._ledger, self.capacity
        bound = capacity + self.limit
        if ledger.unyielded >= bound or not ledger.head_late():
            return
        depth = max(1, capacity // slots)
        unanswered, active = ledger.unanswered, ledger.active
        # Most calls find every queue full (the consumer is waiting, the workers are busy):
        # asked first, without making the predicate (this runs per wait).
        if not _has_room(unanswered, active, depth, slots):
            return

        def more() -> bool:
            return ledger.unyielded < bound and _has_room(unanswered, active, depth, slots)

        dispatch(more)
        beyond = ledger.unyielded - capacity
        if beyond > self._stats.run_ahead_peak:
            self._stats.run_ahead_peak = beyond

    def wakes_on_any(self) -> bool:
        """Whether the engine's next wait ends at any worker's answer rather than only the
        head's: while the head is late and workers may run further ahead (with two workers,
        where task times are uneven: see ``resize``), unless the head's worker is slow for
        good. A worker that answers then has its queue topped up at once; waiting on the
        head's worker alone, the others would run dry behind it and sit idle until it
        answers."""
        ledger = self._ledger
        return (
            self.limit > 0
            and (self._ticks or self._uneven)
            and ledger.unyielded < self.capacity + self.limit
            and ledger.head_late()
            and not self.slow_for_good(ledger.inflight[ledger.rcvd_idx].worker_id)
        )

    def slow_for_good(self, worker_id: int) -> bool:
        """Whether the head's worker (``worker_id``) is slower than the others for good: its
        tasks have taken ``SLOW_FOR_GOOD`` times theirs on average. Tasks going round robin,
        the pass then runs at that worker's pace whatever the others do: running ahead of it
        would only fill memory up to the limit, and wake the consumer at each of their answers
        on the way. (Late by chance, a slow sample, it is not: a few slow samples move a mean
        over many tasks little.) With tasks going to the least busy worker, the others do take
        over its share, so there it never counts."""
        if not self._round_robin:
            return False
        own_tasks, own_busy, tasks, busy = 0, 0.0, 0, 0.0
        for wid, counter in enumerate(self._stats.workers):
            if wid == worker_id:
                own_tasks, own_busy = counter.tasks, counter.busy_s
            else:
                tasks += counter.tasks
                busy += counter.busy_s
        if own_tasks < SLOW_MIN_TASKS or not tasks:
            return False
        return own_busy * tasks >= SLOW_FOR_GOOD * busy * own_tasks

    def sleep_bound(self, wakes_on_any: bool) -> float:
        """The longest the engine may sleep: while workers are ahead of a late head (their
        answers wait behind it) and could run further (``wakes_on_any``, as just asked),
        ``tick``, so that it notices those that run dry; else no bound (and none with fewer
        than three workers: see ``resize``)."""
        if self._ticks and wakes_on_any and self._ledger.answered_waiting():
            return self.tick
        return math.inf


def _has_room(unanswered: list[int], active: list[bool], depth: int, slots: int) -> bool:
    """Whether an active worker among the first ``slots`` holds fewer than ``depth`` tasks."""
    for worker_id in range(slots):  # noqa: SIM110 - a generator costs more, at every wait
        if unanswered[worker_id] < depth and active[worker_id]:
            return True
    return False
