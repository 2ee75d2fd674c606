"""``num_workers="auto"``, ``prefetch_factor="auto"``, ``worker_concurrency="auto"``: a
controller that reads a pass's own counters and adjusts the loader while it runs.

Two parts, in two modules:

- :class:`Controller` (here) is pure: it is fed one :class:`Window` of measurements at a time (the
  consumer's waiting share, the workers' busy share, idle cores, the parent's CPU, queue
  depths, batch bytes) and answers with :class:`Change` records, each with its reason. It reads
  no clock and no counter of its own, so tests drive it with scripted windows.
- ``PassTuning`` (:mod:`.pass_tuning`) is one pass's side of it: it turns the pass's ``PassStats`` counters into
  windows (one every ``min_batches`` batches and ``min_seconds`` seconds, or ``max_seconds``),
  and the orchestrator applies what the controller decides (``Orchestrator._apply_tuning``).
  A worker's trial is judged on a double window.

How the controller decides (docs/tuning.md says the same for users):

- It changes one knob at a time, and only on a clear signal: the consumer waits for data at
  least ``WAIT_HIGH`` of its time (grow), or at most ``WAIT_LOW`` with the workers mostly idle
  (shrink: a worker while the others would be at most ``SHRINK_BUSY`` busy without it, else
  the depth while the workers are at most ``SHRINK_DEPTH_BUSY`` busy). Between the two it
  holds.
- Every change is a trial, judged on the next window (after a worker is added, on the one
  after: the new worker starts during the first). A growth must bring at least ``GAIN`` more
  samples/s (``CONCURRENCY_GAIN`` for concurrency) or leave the consumer fed; a shrink must
  keep ``KEEP`` of the throughput with the consumer still fed. A trial that fails is undone,
  and the value it left becomes a ceiling (or floor) for ``RETRY_WINDOWS`` windows. A knob
  that turns direction ``MAX_REVERSALS`` times in a pass is settled for that pass. So it
  cannot oscillate: within a pass each knob makes a bounded number of moves.
- Growth order when the consumer waits: concurrency (an async dataset's fetches in flight,
  from 4, fourfold while the consumer waits at least half its time, else twofold, up to 256;
  a fourfold step undone leaves the twofold one as the ceiling, to be tried next;
  an automatic depth moves with it in the same trial, so that it fills at most half of the
  prefetch x batch size samples a worker has to fetch), then workers (only while cores are
  measured idle and the workers are busy), then prefetch depth (+1 per worker, within
  [1, 8], only while the workers have slack and a core is idle: a deeper queue does not make
  a saturated worker faster, nor one waiting for a core, and more slabs in flight cost
  cache).
- ``max_memory`` bounds ``(workers x depth + 2) x batch bytes``: the batches in flight plus the
  one the consumer holds and one being handed over. It is enforced as soon as a batch's size is
  known, by lowering depth first, then workers.
"""

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from .._named_tuple import NamedTuple

__all__ = [
    "AUTO",
    "Change",
    "Controller",
    "ControllerSettings",
    "Window",
]


AUTO = "auto"

# The knobs, by the DataLoader argument each one stands for.
WORKERS = "num_workers"
DEPTH = "prefetch_factor"
CONCURRENCY = "worker_concurrency"

START_WORKERS = 2
START_DEPTH = 2
MIN_DEPTH, MAX_DEPTH = 1, 8
START_CONCURRENCY = 4
MAX_CONCURRENCY = 256

# The consumer's waiting share above which it is data-bound, and below which it is fed.
WAIT_HIGH = 0.10
WAIT_LOW = 0.03
# Waiting at least this share, an async dataset's concurrency grows fourfold, not twofold.
WAIT_MOSTLY = 0.50
# Workers are added only while they are this busy (below it, more of them would idle too).
BUSY_FOR_WORKERS = 0.60
# Depth grows only while the workers are less busy than this (they wait for tasks).
BUSY_SATURATED = 0.85
# A worker is retired when the others would be at most this busy without it.
SHRINK_BUSY = 0.70
# Depth shrinks while the consumer is fed and the workers are at most this busy.
SHRINK_DEPTH_BUSY = 0.50
# Cores that must be idle (measured) before a worker is added.
IDLE_MIN = 0.5
# What a trial must bring to be kept.
GAIN = 1.05
CONCURRENCY_GAIN = 1.10
KEEP = 0.95
MAX_REVERSALS = 4
# A bound learned from a failed trial is tried again after this many windows (a window can be
# unlucky on a busy machine); MAX_REVERSALS still bounds the moves.
RETRY_WINDOWS = 12
# A window: at least this many batches and seconds, or this many seconds (and 2 batches).
MIN_BATCHES = 4
MIN_SECONDS = 0.2
MAX_SECONDS = 2.0
# Changes kept for stats() (the oldest are dropped first).
MAX_CHANGES = 100
_SETTLING_START = "settling: the pass's workers start during its first window"

# -- the controller ---------------------------------------------------------------------------


class Window(NamedTuple):
    """What one window of a pass measured (shares are of the window's wall time)."""

    seconds: float
    batches: int
    samples: int
    # The consumer's time waiting inside next() over its whole time (0..1).
    waiting: float
    # The active workers' time on tasks over their wall time, averaged (0..1; an async worker
    # with several tasks at once counts as fully busy).
    busy: float
    # Idle cores (of those the process may use) over the window; None where unknown.
    idle_cores: float | None = None
    # The parent's CPU (all its threads) over the window, in cores.
    parent_cpu: float = 0.0
    # Mean tasks in flight, and answers waiting for their turn (in-order head-of-line), when
    # a batch was handed over.
    in_flight: float = 0.0
    head_of_line: float = 0.0
    # Bytes of the largest batch handed over in the window (0: unknown), and the parent's RSS.
    batch_bytes: int = 0
    rss_bytes: int = 0

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def per_batch(self) -> float:
        """Samples per batch (1 for a window without a batch)."""
        return self.samples / self.batches if self.batches else 1.0

    def as_dict(self) -> dict[str, Any]:
        data = self._asdict()
        data["samples_per_s"] = self.throughput
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in data.items()}


class Change(NamedTuple):
    """One decision: ``knob`` went from ``old`` to ``new``, for ``reason``."""

    knob: str
    old: int
    new: int
    reason: str
    # The pass (0 for the loader's first) and seconds since that pass's first batch.
    pass_index: int = 0
    at_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "knob": self.knob,
            "from": self.old,
            "to": self.new,
            "reason": self.reason,
            "pass": self.pass_index,
            "at_s": round(self.at_s, 3),
        }


class Knob:
    __slots__ = (
        "auto",
        "ceiling",
        "direction",
        "floor",
        "high",
        "low",
        "name",
        "retry_at",
        "reversals",
        "value",
    )

    def __init__(self, name: str, auto: bool, value: int, low: int, high: int) -> None:
        self.name = name
        self.auto = auto
        self.value = value
        self.low = low
        self.high = high
        self.begin_pass()

    def begin_pass(self) -> None:
        # Bounds learned from failed trials, and the moves' directions: per pass.
        self.ceiling = self.high
        self.floor = self.low
        self.retry_at = 0
        self.direction = 0
        self.reversals = 0

    def can_grow(self) -> bool:
        return self.auto and self.reversals < MAX_REVERSALS and self.value < self.ceiling

    def can_shrink(self) -> bool:
        return self.auto and self.reversals < MAX_REVERSALS and self.value > self.floor

    def moved(self, new: int) -> None:
        direction = 1 if new > self.value else -1
        if self.direction and direction != self.direction:
            self.reversals += 1
        self.direction = direction
        self.value = new

    def as_dict(self) -> dict[str, Any]:
        return {"auto": self.auto, "value": self.value, "min": self.low, "max": self.high}


class _Trial(NamedTuple):
    knob: Knob
    old: int
    new: int
    baseline: float  # samples/s before the change
    # The prefetch depth that moved with an async dataset's concurrency (its old value), so
    # that undoing the trial puts both back.
    depth_before: int | None = None


@dataclass(frozen=True)
class ControllerSettings:
    """What a :class:`Controller` is made from. ``workers``/``depth``/``concurrency``: an int
    pins the knob; None makes it automatic. ``max_workers``: the slots the backend has (the
    cores the process may use). ``per_pass_workers``: an IterableDataset's worker count, which
    cannot change within a pass (each worker holds its own stream): chosen at the start of
    each pass from the previous pass's measurements (``Controller.pass_workers``). The window:
    ``min_batches`` batches and ``min_seconds``, or ``max_seconds``."""

    workers: int | None
    depth: int | None
    concurrency: int | None
    max_workers: int
    cores: int
    max_memory: int | None = None
    per_pass_workers: bool = False
    min_batches: int = MIN_BATCHES
    min_seconds: float = MIN_SECONDS
    max_seconds: float = MAX_SECONDS


class Controller:
    """The decisions of one loader, across its passes, from its :class:`ControllerSettings`."""

    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings
        self.cores = settings.cores
        self.max_memory = settings.max_memory
        self.per_pass_workers = per_pass_workers = settings.per_pass_workers
        self.min_batches = settings.min_batches
        self.min_seconds = settings.min_seconds
        self.max_seconds = settings.max_seconds
        workers, depth, concurrency = settings.workers, settings.depth, settings.concurrency
        cores = settings.cores
        max_workers = max(1, settings.max_workers)
        if workers is None:
            start = min(START_WORKERS, max_workers)
            if per_pass_workers:
                # The first pass cannot grow: start at the cores less one for the consumer.
                start = min(max_workers, max(start, cores - 1))
            self.workers = Knob(WORKERS, True, start, 1, max_workers)
        else:
            self.workers = Knob(WORKERS, False, workers, workers, workers)
        if depth is None:
            self.depth = Knob(DEPTH, True, START_DEPTH, MIN_DEPTH, MAX_DEPTH)
        else:
            self.depth = Knob(DEPTH, False, depth, depth, depth)
        if concurrency is None:
            self.concurrency = Knob(
                CONCURRENCY, True, START_CONCURRENCY, START_CONCURRENCY, MAX_CONCURRENCY
            )
        else:
            self.concurrency = Knob(CONCURRENCY, False, concurrency, concurrency, concurrency)
        self.changes: deque[Change] = deque(maxlen=MAX_CHANGES)
        self.passes = 0
        self.last_window: Window | None = None
        # The whole current pass so far, as one window (what an IterableDataset's next pass
        # is chosen from).
        self.pass_window: Window | None = None
        self.note = "no measurement yet"
        self._trial: _Trial | None = None
        self._skip = 0
        self._starting = False
        self._pass_index = -1
        self._at_s = 0.0
        self._windows = 0

    @property
    def window_factor(self) -> int:
        """How many ordinary windows long the next one is: a new worker is given a double
        window to start, and its trial is judged on a double window (a worker costs a fork and
        a core, so one unlucky stretch should decide less). Depth and concurrency act at once,
        and are judged on the next ordinary window."""
        trial = self._trial
        return 2 if self._skip or (trial is not None and trial.knob is self.workers) else 1

    @property
    def knobs(self) -> tuple[Knob, Knob, Knob]:
        return (self.workers, self.depth, self.concurrency)

    @property
    def any_auto(self) -> bool:
        return any(k.auto for k in self.knobs)

    # -- passes --------------------------------------------------------------------------------

    def begin_pass(self, hold_workers: int | None = None, starting: bool = False) -> None:
        """A pass starts from the values the last one ended with; what trials taught about
        the last pass's bounds is forgotten (the data may differ). An IterableDataset's count
        is chosen here from the last pass, unless ``hold_workers`` fixes it (its persistent
        workers are kept, or a checkpoint's streams are resumed).

        ``starting``: the pass starts its workers (not kept ones). Its first window then
        measures their start (the consumer waits for each worker's first batch, forked at
        one of its waits), not the data: it moves neither workers nor depth on it. An async
        dataset's concurrency still grows on it: a latency-bound pass is short, and that
        signal is the data's."""
        if self.per_pass_workers and self.workers.auto:
            if hold_workers is not None:
                self.workers.value = max(1, hold_workers)
            elif self.pass_window is not None:
                self._plan_next_pass(self.pass_window)
        self._pass_index += 1
        self.passes += 1
        for knob in self.knobs:
            knob.begin_pass()
        self._trial = None
        self._skip = 0
        self._starting = starting and self.workers.value > 0
        self.pass_window = None

    def pass_workers(self) -> int:
        return self.workers.value

    def _plan_next_pass(self, whole: Window) -> None:
        """An IterableDataset's worker count for the next pass, from the whole last pass: one
        step, by the same signals as within a pass."""
        knob = self.workers
        n = knob.value
        new = n
        if whole.waiting >= WAIT_HIGH and whole.busy >= BUSY_FOR_WORKERS and n < knob.high:
            idle = whole.idle_cores
            room = math.floor(idle) if idle is not None else knob.high - n
            if room >= 1:
                new = min(knob.high, n + max(1, min(n, room)))
            reason = (
                f"data-bound {whole.waiting:.0%} over the last pass, workers {whole.busy:.0%} busy"
            )
        elif whole.waiting <= WAIT_LOW and n > 1 and whole.busy * n / (n - 1) <= SHRINK_BUSY:
            new = n - 1
            reason = (
                f"the consumer waited {whole.waiting:.0%} over the last pass and the workers "
                f"were {whole.busy:.0%} busy: one fewer is enough"
            )
        if new != n:
            self._record(knob, new, reason + " (an IterableDataset's count holds for a pass)")

    # -- one window ----------------------------------------------------------------------------

    def observe(self, window: Window, at_s: float = 0.0) -> list[Change]:
        """Take one window's measurements; the changes made (often none)."""
        self.last_window = window
        self._at_s = at_s
        self._windows += 1
        for knob in self.knobs:
            if knob.retry_at and self._windows >= knob.retry_at:
                knob.ceiling, knob.floor, knob.retry_at = knob.high, knob.low, 0
        changes = self._fit_memory(window)
        if changes:
            self._trial = None
            return changes
        if self._skip:
            self._skip -= 1
            self.note = "settling: a worker was added in the last window"
            return []
        trial, self._trial = self._trial, None
        if trial is not None:
            undone = self._judge(trial, window)
            if undone is not None:
                return [undone]
        starting, self._starting = self._starting, False
        return self._decide(window, starting)

    def _record(self, knob: Knob, new: int, reason: str) -> Change:
        change = Change(knob.name, knob.value, new, reason, max(0, self._pass_index), self._at_s)
        knob.moved(new)
        self.changes.append(change)
        self.note = reason
        return change

    def _try(
        self, knob: Knob, new: int, window: Window, reason: str, depth: int | None = None
    ) -> list[Change]:
        """Make one trial move; ``depth``: a prefetch depth that moves with it (concurrency)."""
        moved_depth = depth is not None and depth != self.depth.value
        self._trial = _Trial(
            knob, knob.value, new, window.throughput, self.depth.value if moved_depth else None
        )
        if knob is self.workers and new > knob.value:
            self._skip = 1  # the new workers start during the next window
        changes = [self._record(knob, new, reason)]
        if moved_depth:
            assert depth is not None
            changes.append(
                self._record(
                    self.depth, depth, f"follows {knob.name}={new}: room for its fetches in flight"
                )
            )
        return changes

    def _judge(self, trial: _Trial, window: Window) -> Change | None:
        knob = trial.knob
        if knob.value != trial.new:
            return None  # moved since (the memory budget)
        now, before = window.throughput, trial.baseline
        if trial.new > trial.old:
            need = CONCURRENCY_GAIN if knob is self.concurrency else GAIN
            if now >= before * need or window.waiting <= WAIT_LOW:
                self.note = f"kept {knob.name}={trial.new}: {before:.0f} -> {now:.0f} samples/s"
                return None
            # A fourfold step of concurrency that did not pay leaves the twofold one between
            # untried: that is the ceiling, so the next growth tries it.
            untried = knob is self.concurrency and trial.new > 2 * trial.old
            knob.ceiling = 2 * trial.old if untried else trial.old
            knob.retry_at = self._windows + RETRY_WINDOWS
            undone = self._record(
                knob,
                trial.old,
                f"undone: {knob.name} {trial.old} -> {trial.new} brought {before:.0f} -> "
                f"{now:.0f} samples/s (less than {need - 1:.0%} more); {knob.ceiling} is the "
                f"ceiling for the next {RETRY_WINDOWS} windows",
            )
            if trial.depth_before is not None and self.depth.value != trial.depth_before:
                self._record(self.depth, trial.depth_before, f"with {knob.name}: {undone.reason}")
            return undone
        if now >= before * KEEP and window.waiting < WAIT_HIGH:
            self.note = f"kept {knob.name}={trial.new}: {before:.0f} -> {now:.0f} samples/s"
            return None
        knob.floor = trial.old
        knob.retry_at = self._windows + RETRY_WINDOWS
        return self._record(
            knob,
            trial.old,
            f"undone: {knob.name} {trial.old} -> {trial.new} took {before:.0f} -> {now:.0f} "
            f"samples/s with the consumer waiting {window.waiting:.0%}; {trial.old} is the "
            f"floor for the next {RETRY_WINDOWS} windows",
        )

    def _fits(self, workers: int, depth: int, window: Window) -> bool:
        budget, size = self.max_memory, window.batch_bytes
        if budget is None or size <= 0:
            return True
        return (workers * depth + 2) * size <= budget

    def _fit_memory(self, window: Window) -> list[Change]:
        budget, size = self.max_memory, window.batch_bytes
        if budget is None or size <= 0 or self._fits(self.workers.value, self.depth.value, window):
            return []
        changes: list[Change] = []
        fits = max(0, budget // size - 2)  # batches in flight the budget holds
        reason = (
            f"memory budget: max_memory={budget} holds {fits} batches of {size} bytes in flight"
        )
        depth, workers = self.depth, self.workers
        if depth.auto and depth.value > depth.low:
            new = max(depth.low, min(depth.value - 1, fits // max(1, workers.value)))
            depth.ceiling = new
            changes.append(self._record(depth, new, reason))
        if (
            not self._fits(workers.value, depth.value, window)
            and workers.auto
            and not self.per_pass_workers
            and workers.value > 1
        ):
            new = max(1, min(workers.value - 1, fits // max(1, depth.value)))
            workers.ceiling = new
            changes.append(self._record(workers, new, reason))
        if not changes:
            self.note = reason + ", but nothing left to lower"
        return changes

    def _decide(self, window: Window, starting: bool = False) -> list[Change]:
        if window.waiting >= WAIT_HIGH:
            return self._grow(window, starting)
        if starting:
            self.note = _SETTLING_START
            return []
        if window.waiting <= WAIT_LOW:
            return self._shrink(window)
        self.note = f"holding: the consumer waits {window.waiting:.0%} of its time"
        return []

    def _grow(self, w: Window, starting: bool = False) -> list[Change]:
        workers, depth, concurrency = self.workers, self.depth, self.concurrency
        waiting = f"the consumer waits {w.waiting:.0%} of its time"
        if concurrency.can_grow():
            moved = self._grow_concurrency(w, waiting)
            if moved:
                return moved
        if starting:
            self.note = _SETTLING_START
            return []
        n = workers.value
        idle = w.idle_cores
        if idle is None:
            idle = self.cores - w.parent_cpu - w.busy * n
        if (
            workers.can_grow()
            and not self.per_pass_workers
            and w.busy >= BUSY_FOR_WORKERS
            and idle >= IDLE_MIN
        ):
            # The supply the consumer would take: n / (1 - waiting) workers, at most
            # doubling, and no more than the idle cores.
            wanted = math.ceil(n / max(0.05, 1.0 - w.waiting))
            new = min(workers.ceiling, 2 * n, n + max(1, math.floor(idle)), max(n + 1, wanted))
            while new > n and not self._fits(new, depth.value, w):
                new -= 1
            if new > n:
                return self._try(
                    workers,
                    new,
                    w,
                    f"{waiting}, workers {w.busy:.0%} busy, {idle:.1f} cores idle",
                )
        # Workers that are not busy for want of a core, not of tasks, gain nothing from more
        # tasks in flight: each would only take cache and memory (the slabs in flight).
        if (
            depth.can_grow()
            and w.busy < BUSY_SATURATED
            and idle >= IDLE_MIN
            and self._fits(workers.value, depth.value + 1, w)
        ):
            return self._try(
                depth,
                depth.value + 1,
                w,
                f"{waiting} while the workers are {w.busy:.0%} busy: more tasks in flight",
            )
        self.note = f"holding: {waiting}, but " + self._why_not(w)
        return []

    def _grow_concurrency(self, w: Window, waiting: str) -> list[Change]:
        """More fetches in flight per worker for an async dataset: doubled, or quadrupled while
        the consumer waits most of its time (a latency-bound dataset gains in proportion, and
        a pass is short: slow start costs more than an overshoot, which the trial undoes).

        The samples a worker may fetch at once are its tasks in flight times their size; the
        concurrency fills at most half of them, so that a worker has the next batch's samples
        to start while a batch's last ones finish. An automatic depth moves with it, in the
        same trial, and so is undone with it; a pinned depth caps it at all of them."""
        concurrency, depth, workers = self.concurrency, self.depth, self.workers
        c = concurrency.value
        factor = 4 if w.waiting >= WAIT_MOSTLY else 2
        new = min(concurrency.ceiling, c * factor)
        new_depth = depth.value
        if depth.auto:
            wanted = math.ceil(2 * new / max(1.0, w.per_batch))
            new_depth = max(depth.value, min(depth.ceiling, wanted))
            while new_depth > depth.value and not self._fits(workers.value, new_depth, w):
                new_depth -= 1
        room = new_depth * w.per_batch
        # Beyond the samples in flight a worker holds, more fetches at once do nothing.
        new = min(new, max(c, math.floor(room)))
        if new <= c:
            return []
        return self._try(
            concurrency,
            new,
            w,
            f"{waiting}: more fetches in flight per worker",
            depth=new_depth,
        )

    def _why_not(self, w: Window) -> str:
        if self.workers.auto and self.workers.value >= self.workers.ceiling:
            return f"num_workers={self.workers.value} is the most this pass allows"
        if self.workers.auto and w.busy < BUSY_FOR_WORKERS:
            return f"the workers are only {w.busy:.0%} busy"
        if self.workers.auto or self.depth.auto:
            return "no core is idle"
        return "nothing automatic is left to raise"

    def _shrink(self, w: Window) -> list[Change]:
        workers = self.workers
        n = workers.value
        if workers.can_shrink() and not self.per_pass_workers and n > 1:
            projected = w.busy * n / (n - 1)
            if projected <= SHRINK_BUSY:
                return self._try(
                    workers,
                    n - 1,
                    w,
                    f"the consumer is the bottleneck (waits {w.waiting:.0%}); the workers are "
                    f"{w.busy:.0%} busy, {projected:.0%} with one fewer",
                )
        # Then the depth: a worker busy at most half its time finishes a task in less than
        # the time the consumer takes to use the batches of the others, so a queue of one task
        # each keeps the consumer fed, with fewer batches (and slabs) in flight. An async
        # dataset's concurrency keeps the room it fills (half of depth x batch size).
        depth, concurrency = self.depth, self.concurrency
        if (
            depth.can_shrink()
            and w.busy <= SHRINK_DEPTH_BUSY
            and (concurrency.value <= 1 or 2 * concurrency.value <= (depth.value - 1) * w.per_batch)
        ):
            return self._try(
                depth,
                depth.value - 1,
                w,
                f"the consumer is fed (waits {w.waiting:.0%}) and the workers are "
                f"{w.busy:.0%} busy: fewer batches in flight",
            )
        self.note = f"holding: the consumer is fed (waits {w.waiting:.0%})"
        return []

    # -- reading -------------------------------------------------------------------------------

    def brief(self) -> str:
        """The current choice, for the progress bar: "auto: 4 workers, prefetch 2"."""
        parts = []
        if self.workers.auto:
            parts.append(f"{self.workers.value} workers")
        if self.depth.auto:
            parts.append(f"prefetch {self.depth.value}")
        if self.concurrency.auto:
            parts.append(f"concurrency {self.concurrency.value}")
        return "auto: " + ", ".join(parts)

    def report(self) -> dict[str, Any]:
        return {
            WORKERS: self.workers.as_dict(),
            DEPTH: self.depth.as_dict(),
            CONCURRENCY: self.concurrency.as_dict(),
            "max_memory": self.max_memory,
            "cores": self.cores,
            "changes": [c.as_dict() for c in self.changes],
            "now": self.note,
            "last_window": None if self.last_window is None else self.last_window.as_dict(),
            "pass_window": None if self.pass_window is None else self.pass_window.as_dict(),
        }
