"""The counters of one pass (``PassStats``), its skip cap and its stall record.

One :class:`PassStats` belongs to each pass over a loader (one iterator). The front ends time
the consumer, the worker pool feeds it each worker's fetch time (measured inside the worker and
sent with its answer), the orchestrator counts yielded batches, samples, restarts and queue
depths, and the pin stage times its transfers. ``DataLoader.stats()`` turns the newest pass's
counters into a ``LoaderStats`` snapshot (``aioload.stats``).

Collection is on the per-batch path, so it is kept to a few additions and ``perf_counter``
calls per batch; everything derived (rates, percentiles) is computed only when a snapshot is
taken. Memory does not grow with the length of a pass: fetch times are kept in a bounded
reservoir per worker.

The report's types are imported when a snapshot is first taken (or a sample skipped), not
with the engine: making their dataclasses costs milliseconds of the first batch, where a
script waits for it (docs/benchmarks.md, time to the first batch).
"""

from __future__ import annotations

import math
import random
import time
from typing import TYPE_CHECKING, Any

from ..errors import TooManySampleErrors

if TYPE_CHECKING:
    from ..stats import LoaderStats, SkippedSample

__all__ = ["RESERVOIR_SIZE", "PassStats", "SkipCap", "Stall", "empty_stats"]


# Fetch times kept per worker for percentiles. Up to this many tasks the percentiles are exact;
# beyond it, each later time replaces a kept one with the probability that keeps the sample
# uniform over the whole pass (reservoir sampling).
RESERVOIR_SIZE = 1024


class SkipCap:
    """``max_skipped`` for one pass: an int is a count; a float in (0, 1) a fraction of the
    pass's samples (``total``: the sampler's length, or an IterableDataset's ``len``).

    An IterableDataset without ``len`` has no known total: the fraction is then taken of the
    samples its streams have drawn so far, and checked once at least ``1 / fraction`` have been
    drawn (so that one early skip does not count as 100 %), and again when the pass ends."""

    # How many of the latest skips the error message lists.
    SHOWN = 5

    def __init__(self, max_skipped: int | float, total: int | None) -> None:
        self.max_skipped = max_skipped
        self.fraction = isinstance(max_skipped, float)
        self.limit: int | None = None
        if not self.fraction:
            self.limit = int(max_skipped)
        elif total is not None:
            self.limit = math.floor(max_skipped * total)
        self.total = total

    def error(
        self, skipped: list[SkippedSample], drawn: int, final: bool
    ) -> TooManySampleErrors | None:
        count = len(skipped)
        limit = self.limit
        if limit is None:
            # A fraction of an unknown total: of what was drawn so far.
            if drawn <= 0 or (not final and drawn < math.ceil(1 / self.max_skipped)):
                return None
            limit = math.floor(self.max_skipped * drawn)
        if count <= limit:
            return None
        if self.fraction:
            of = f"{self.total} samples" if self.total is not None else f"{drawn} drawn so far"
            cap = f"max_skipped={self.max_skipped} (at most {limit} of {of})"
        else:
            cap = f"max_skipped={self.max_skipped}"
        last = "; ".join(
            f"index {r.index!r} ({'main' if r.worker is None else f'worker {r.worker}'}): "
            f"{r.error.splitlines()[0] if r.error else ''}"
            for r in skipped[-self.SHOWN :]
        )
        message = (
            f"aioload: {count} samples skipped in this pass, more than {cap} allows. "
            f"Last {min(count, self.SHOWN)}: {last}"
        )
        return TooManySampleErrors(message, max_skipped=limit, count=count, skipped=tuple(skipped))


class Stall:
    """A batch the consumer waited for past ``hang_report_after``: what the hang report said
    (``_engine.hang``), for ``LoaderStats.stalled``. Written by the thread that reports it,
    and ended by the consumer's (``PassStats.leave``)."""

    __slots__ = ("batch", "ended", "indices", "since", "stack", "where", "worker")

    def __init__(
        self, batch: int, worker: int | None, where: str | None, indices: Any, since: float
    ) -> None:
        self.batch = batch
        self.worker = worker
        self.where = where
        self.indices = indices
        # When the consumer began to wait for it, and when its ``next()`` returned
        # (``time.monotonic``).
        self.since = since
        self.ended: float | None = None
        self.stack: str | None = None

    def waited_s(self) -> float:
        end = self.ended if self.ended is not None else time.monotonic()
        return end - self.since

    def as_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "worker": self.worker,
            "where": self.where,
            "indices": self.indices,
            "waited_s": self.waited_s(),
            "waiting": self.ended is None,
            "stack": self.stack,
        }


class _WorkerCounter:
    __slots__ = ("busy_s", "busy_sq", "fetch_times", "first_s", "restarts", "tasks")

    def __init__(self) -> None:
        self.tasks = 0
        self.busy_s = 0.0
        # The first task's time, and the sum of the squares of the others': with busy_s, the
        # spread of the task times (RunAhead.survey). A worker's first task is left out: it
        # also pays for the worker's start (cold caches, the dataset's first use).
        self.first_s = 0.0
        self.busy_sq = 0.0
        self.restarts = 0
        self.fetch_times: list[float] = []


class PassStats:
    """The mutable counters of one pass. Not thread-safe beyond what the GIL gives single
    attribute updates: each counter has one writer (the consumer's thread, or the pin stage's
    thread for ``pin_*``)."""

    def __init__(self, num_workers: int, in_process: bool, auto_collation: bool) -> None:
        self.in_process = in_process
        # With automatic batching a task's sample count is its number of indices (an
        # IterableDataset's stream reports its own count, see Orchestrator._accept); without,
        # each item is one sample whatever its key is.
        self._auto_collation = auto_collation
        self.workers = [_WorkerCounter() for _ in range(num_workers)]
        self.where: list[str | None] = [None] * num_workers
        self._reservoir_rng = random.Random(0)  # never the user's global RNG
        self.started: float | None = None
        self.last_return: float | None = None
        self.last_answer: float | None = None
        self.ended_at: float | None = None
        self.finished = False
        self.waiting_s = 0.0
        self.between_s = 0.0
        self.batches = 0
        self.samples = 0
        self.in_flight = 0
        self.waiting_in_order = 0
        self._in_flight_sum = 0
        self._waiting_sum = 0
        self.waiting_peak = 0
        # Written by the orchestrator's run-ahead (``_engine.runahead``).
        self.run_ahead_limit = 0
        self.run_ahead_peak = 0
        self.batch_bytes = 0
        self.reorder_bytes_peak = 0
        self.pin_batches = 0
        self.pin_s = 0.0
        # Skipped samples, recorded when their batch is delivered. The loader makes this the
        # same list as the pass's PassProgress.skipped, so a checkpoint carries it.
        self.skipped: list[SkippedSample] = []
        # Batches a resumed pass had yielded before its checkpoint (a progress bar starts there).
        self.resumed_batches = 0
        # The pass's feed to the "auto" controller (``_engine.pass_tuning.PassTuning``), if any:
        # it has ``report()`` and ``brief()``.
        self.tuning: Any = None
        # The latest batch waited for past hang_report_after (``_engine.hang``), if any.
        self.stalled: Stall | None = None
        # worker_method="auto": what was chosen, why, and the trial's figures.
        self.method_choice: dict[str, Any] | None = None

    # -- the consumer (front ends) ------------------------------------------------------------

    def enter(self) -> float:
        """The consumer asks for a batch; returns the time, for ``leave``."""
        now = time.perf_counter()
        if self.finished:
            return now  # asking again after the end: not part of the pass
        if self.last_return is not None:
            self.between_s += now - self.last_return
        elif self.started is None:
            self.started = now
        return now

    def leave(self, entered: float) -> None:
        """A batch (or the end) reached the consumer."""
        stalled = self.stalled
        if stalled is not None and stalled.ended is None:
            # (Also where next() raised: the consumer has stopped waiting for it.)
            stalled.ended = time.monotonic()
        if self.finished:
            return
        now = time.perf_counter()
        self.waiting_s += now - entered
        self.last_return = now

    def end(self) -> None:
        """The pass is over: time after this is not between batches."""
        if self.finished:
            return
        self.finished = True
        self.ended_at = self.last_return
        self.last_return = None

    # -- workers ------------------------------------------------------------------------------

    def fetched(self, worker_id: int, seconds: float) -> None:
        """A worker answered a task of this pass after working on it for ``seconds``."""
        counter = self.workers[worker_id]
        counter.tasks += 1
        counter.busy_s += seconds
        if counter.tasks == 1:
            counter.first_s = seconds
        else:
            counter.busy_sq += seconds * seconds
        times = counter.fetch_times
        if len(times) < RESERVOIR_SIZE:
            times.append(seconds)
        else:
            slot = self._reservoir_rng.randrange(counter.tasks)
            if slot < RESERVOIR_SIZE:
                times[slot] = seconds
        self.last_answer = time.perf_counter()

    def restarted(self, worker_id: int) -> None:
        self.workers[worker_id].restarts += 1

    # -- batches (orchestrator) ---------------------------------------------------------------

    def count(self, indices: Any) -> int:
        """Samples in a task: its index list with automatic batching, else one item."""
        return len(indices) if self._auto_collation else 1

    def yielded(self, batch: Any, samples: int, in_flight: int, waiting: int) -> None:
        self.batches += 1
        self.samples += samples
        self.in_flight = in_flight
        self.waiting_in_order = waiting
        self._in_flight_sum += in_flight
        self._waiting_sum += waiting
        if waiting > self.waiting_peak:
            self.waiting_peak = waiting
        # (At the batch size known then: batches that grow later do not inflate an old peak.)
        if waiting * self.batch_bytes > self.reorder_bytes_peak:
            self.reorder_bytes_peak = waiting * self.batch_bytes

    # -- pin stage (its own thread) -----------------------------------------------------------

    def transferred(self, seconds: float) -> None:
        self.pin_batches += 1
        self.pin_s += seconds

    # -- reading ------------------------------------------------------------------------------

    def data_bound_pct(self) -> float | None:
        """The live figure, cheap enough for a progress bar."""
        total = self.waiting_s + self.between_s
        return 100.0 * self.waiting_s / total if total > 0 else None

    def snapshot(self) -> LoaderStats:
        from ..stats import LoaderStats, WorkerStats

        started = self.started
        last = self.last_return if self.last_return is not None else self.ended_at
        elapsed = last - started if started is not None and last is not None else 0.0
        # Every task of the pass was sent after its first next(), so fetch time cannot exceed
        # the time from then to the later of the last answer and the last hand-over.
        wall = elapsed
        if started is not None and self.last_answer is not None:
            wall = max(wall, self.last_answer - started)
        workers = []
        for worker_id, counter in enumerate(self.workers):
            times = sorted(counter.fetch_times)
            workers.append(
                WorkerStats(
                    worker_id=worker_id,
                    tasks=counter.tasks,
                    busy_s=counter.busy_s,
                    busy_fraction=counter.busy_s / wall if wall > 0 else 0.0,
                    fetch_p50_s=_percentile(times, 50),
                    fetch_p90_s=_percentile(times, 90),
                    fetch_p99_s=_percentile(times, 99),
                    restarts=counter.restarts,
                    where=self.where[worker_id],
                )
            )
        batches = self.batches
        return LoaderStats(
            running=self.started is not None and not self.finished,
            batches=batches,
            samples=self.samples,
            elapsed_s=elapsed,
            waiting_s=self.waiting_s,
            between_s=self.between_s,
            data_bound_pct=self.data_bound_pct() if batches else None,
            batches_per_s=batches / elapsed if batches and elapsed > 0 else None,
            samples_per_s=self.samples / elapsed if batches and elapsed > 0 else None,
            in_flight=self.in_flight,
            waiting_in_order=self.waiting_in_order,
            in_flight_mean=self._in_flight_sum / batches if batches else None,
            waiting_in_order_mean=self._waiting_sum / batches if batches else None,
            pin_batches=self.pin_batches,
            pin_s=self.pin_s,
            in_process=self.in_process,
            workers=workers,
            skipped=list(self.skipped),
            skipped_count=len(self.skipped),
            tuning=self._tuning_report(),
            waiting_in_order_peak=self.waiting_peak,
            reorder_bytes_peak=self.reorder_bytes_peak,
            run_ahead_limit=self.run_ahead_limit,
            run_ahead_peak=self.run_ahead_peak,
            stalled=self.stalled.as_dict() if self.stalled is not None else None,
        )

    def _tuning_report(self) -> dict[str, Any] | None:
        """The "auto" controller's report, with worker_method="auto"'s choice beside it."""
        report = self.tuning.report() if self.tuning is not None else None
        if self.method_choice:  # (empty until "auto"'s trial has chosen)
            report = {**(report or {}), "worker_method": dict(self.method_choice)}
        return report


def empty_stats(num_workers: int) -> LoaderStats:
    """The snapshot of a loader that has not been iterated yet."""
    return PassStats(max(1, num_workers), num_workers == 0, False).snapshot()


def _percentile(sorted_times: list[float], pct: float) -> float | None:
    """Nearest-rank percentile (a value that was actually observed)."""
    if not sorted_times:
        return None
    rank = math.ceil(pct / 100 * len(sorted_times))
    return sorted_times[max(0, rank - 1)]
