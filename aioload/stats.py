"""Counters and the data-bound report: is the training loop waiting for data?

One :class:`PassStats` belongs to each pass over a loader (one iterator). The front ends time
the consumer, the worker pool feeds it each worker's fetch time (measured inside the worker and
sent with its answer), the orchestrator counts yielded batches, samples, restarts and queue
depths, and the pin stage times its transfers. ``DataLoader.stats()`` turns the newest pass's
counters into a :class:`LoaderStats` snapshot: plain numbers, a table for ``print`` and a dict
for loggers.

Collection is on the per-batch path, so it is kept to a few additions and ``perf_counter``
calls per batch; everything derived (rates, percentiles) is computed only when a snapshot is
taken. Memory does not grow with the length of a pass: fetch times are kept in a bounded
reservoir per worker.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import TooManySampleErrors

__all__ = ["LoaderStats", "PassStats", "SkipCap", "SkippedSample", "Stall", "WorkerStats"]

# Fetch times kept per worker for percentiles. Up to this many tasks the percentiles are exact;
# beyond it, each later time replaces a kept one with the probability that keeps the sample
# uniform over the whole pass (reservoir sampling).
RESERVOIR_SIZE = 1024


@dataclass(frozen=True)
class SkippedSample:
    """One sample the pass skipped (``on_sample_error="skip"``, or the callable said so).

    Attributes:
        index: The sampler's index (map-style); for an IterableDataset, the element's position
            in its worker's stream (0 for the first element that worker drew this pass).
        error: The exception's type and message, as text: ``"OSError: image file is
            truncated"``.
        worker: The worker that fetched it; ``None`` for the calling process
            (``num_workers=0``).
        tries: How many times it was tried: ``1 + sample_retries`` for a fetch that kept
            failing, 1 for a sample that could not be collated or sent (those are not retried).
    """

    index: Any
    error: str
    worker: int | None
    tries: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "error": self.error,
            "worker": self.worker,
            "tries": self.tries,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SkippedSample:
        worker = data["worker"]
        return cls(
            index=data["index"],
            error=str(data["error"]),
            worker=None if worker is None else int(worker),
            tries=int(data["tries"]),
        )


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


@dataclass(frozen=True)
class WorkerStats:
    """One worker slot (a replacement worker keeps its predecessor's slot).

    Attributes:
        worker_id: The worker's id, as ``get_worker_info().id`` gives it in the worker.
        tasks: The tasks (batches) it answered this pass.
        busy_s: Seconds it spent on them (fetch, collate, copy into shared memory).
        busy_fraction: ``busy_s`` over the wall time of the pass so far (0 to 1).
        fetch_p50_s: The median time a task took in the worker, in seconds; ``None`` before
            the first task.
        fetch_p90_s: The 90th percentile of the same; ``None`` before the first task.
        fetch_p99_s: The 99th percentile of the same; ``None`` before the first task.
        restarts: How many times this slot's worker was replaced (``max_worker_restarts``).
        where: Where the worker runs, as error messages name it: ``"pid 1234"`` for a local
            process, the actor and its node for a Ray worker (``None`` in the calling
            process).
    """

    worker_id: int
    tasks: int
    busy_s: float
    busy_fraction: float
    fetch_p50_s: float | None
    fetch_p90_s: float | None
    fetch_p99_s: float | None
    restarts: int
    where: str | None = None


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of one pass over a loader: ``print(loader.stats())`` or ``.as_dict()``.

    ``data_bound_pct`` answers "is my training data-bound?": the share of the consumer's time
    spent waiting inside ``next()`` for a batch, against the time it spent on each batch
    between two ``next()`` calls. Near 100 %, the loop waits on data (more workers, cheaper
    samples); near 0 %, the data is ready before the loop asks for it.

    Attributes:
        running: Whether the pass has begun and is still open (neither exhausted nor closed).
        batches: Batches yielded so far.
        samples: Samples in those batches.
        elapsed_s: Seconds from the consumer's first ``next()`` to its last return:
            ``waiting_s + between_s``.
        waiting_s: Seconds the consumer spent inside ``next()`` (or ``__anext__``), waiting
            for a batch.
        between_s: Seconds the consumer spent between two ``next()`` calls: its own work on
            each batch.
        data_bound_pct: ``100 * waiting_s / elapsed_s``; ``None`` before the first batch.
        batches_per_s: Batches yielded per second of ``elapsed_s``; ``None`` before the first
            batch.
        samples_per_s: Samples yielded per second of ``elapsed_s``; ``None`` before the first
            batch.
        in_flight: Tasks sent to workers and not yet answered, when the last batch was handed
            over.
        waiting_in_order: Answers waiting for their turn (reordering, or the pin stage), when
            the last batch was handed over.
        in_flight_mean: The mean of ``in_flight`` over the pass; ``None`` before the first
            batch.
        waiting_in_order_mean: The mean of ``waiting_in_order`` over the pass; ``None`` before
            the first batch.
        pin_batches: Batches the pin / host-to-device stage transferred (zero when the pass
            has none), prefetched ones abandoned by a ``break`` included.
        pin_s: The stage thread's seconds on them. With ``device="cuda"`` the copy itself is
            asynchronous on the stage's stream, so this is pinning plus issuing the copy, not
            the copy's duration on the GPU.
        in_process: Whether the data is loaded in the calling process (``num_workers=0``),
            which then counts as worker 0.
        workers: One `WorkerStats` per worker slot.
        skipped: The samples this pass skipped (``on_sample_error``), as `SkippedSample`
            records, oldest first; a resumed pass carries on the list of the pass it resumes.
        skipped_count: How many samples this pass skipped (a resumed pass's count included).
        tuning: With ``"auto"`` for ``num_workers``, ``prefetch_factor`` or
            ``worker_concurrency`` (see docs/tuning.md): the current choice, each change with
            its reason and time, and the measurements used; ``None`` when every number is the
            user's.
        waiting_in_order_peak: In order, the most answers that waited for their turn at a
            hand-over.
        reorder_bytes_peak: Those answers' bytes at the largest batch size seen (an estimate:
            batches are sized now and then, not each).
        run_ahead_limit: In order, while the head of the line is late, workers run ahead of it
            beyond the prefetch window (docs/tuning.md, "Run-ahead"): the most batches beyond
            the window the pass may send (0: none, as with ``in_order=False`` or before the
            first batch).
        run_ahead_peak: The most batches beyond the window the pass sent at once.
        stalled: "Is it hung, and where?": the latest batch of the pass that the consumer
            waited for longer than the loader's ``hang_report_after`` (the one the hang report
            was logged for), or None. A dict: ``batch`` (its number in the pass, from 0, as a
            timeout's message names it), ``worker`` (the worker id holding it; None for the
            calling process), ``where`` (``"pid 1234"``, as error messages name the worker),
            ``indices``, ``waited_s`` (how long the consumer has waited for it, still counting
            while ``waiting``), ``waiting`` (True until the consumer's ``next()`` returns) and
            ``stack`` (the worker's Python stack when the report was made, every thread's; None
            where its backend cannot read it).
    """

    running: bool
    batches: int
    samples: int
    elapsed_s: float
    waiting_s: float
    between_s: float
    data_bound_pct: float | None
    batches_per_s: float | None
    samples_per_s: float | None
    in_flight: int
    waiting_in_order: int
    in_flight_mean: float | None
    waiting_in_order_mean: float | None
    pin_batches: int
    pin_s: float
    in_process: bool
    workers: list[WorkerStats] = field(default_factory=list)
    skipped: list[SkippedSample] = field(default_factory=list)
    skipped_count: int = 0
    tuning: dict[str, Any] | None = None
    waiting_in_order_peak: int = 0
    reorder_bytes_peak: int = 0
    run_ahead_limit: int = 0
    run_ahead_peak: int = 0
    stalled: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data (numbers, None, lists and dicts) for loggers and ``json.dumps``."""
        return asdict(self)

    def __str__(self) -> str:
        return _table(self)


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
    __slots__ = ("busy_s", "fetch_times", "restarts", "tasks")

    def __init__(self) -> None:
        self.tasks = 0
        self.busy_s = 0.0
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
            reorder_bytes_peak=self.waiting_peak * self.batch_bytes,
            run_ahead_limit=self.run_ahead_limit,
            run_ahead_peak=self.run_ahead_peak,
            stalled=self.stalled.as_dict() if self.stalled is not None else None,
        )

    def _tuning_report(self) -> dict[str, Any] | None:
        """The "auto" controller's report, with worker_method="auto"'s choice beside it."""
        report = self.tuning.report() if self.tuning is not None else None
        if self.method_choice is not None:
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


def _bytes(value: int) -> str:
    if value < 1 << 20:
        return f"{value / 1024:.0f} KiB"
    return f"{value / (1 << 20):.1f} MiB"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f} us"
    if value < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


# The stats table lists this many of the latest skipped samples.
_SKIPS_SHOWN = 5


def _clip(text: str, limit: int = 100) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _tuning_line(tuning: dict[str, Any]) -> str:
    chosen = ", ".join(
        f"{name}={knob['value']}{' (auto)' if knob['auto'] else ''}"
        for name in ("num_workers", "prefetch_factor", "worker_concurrency")
        if (knob := tuning.get(name)) is not None
    )
    changes = tuning.get("changes") or []
    last = f"; last change: {changes[-1]['reason']}" if changes else ""
    return f"tuning: {chosen}; {len(changes)} changes{last}"


def _stall_line(stall: dict[str, Any]) -> str:
    holder = "the calling process" if stall["worker"] is None else f"worker {stall['worker']}"
    if stall["where"] is not None and stall["worker"] is not None:
        holder += f" ({stall['where']})"
    state = ", still waiting" if stall["waiting"] else ""
    return (
        f"stalled (hang_report_after): batch {stall['batch']} from {holder}, "
        f"waited {stall['waited_s']:.1f} s{state}"
    )


def _table(stats: LoaderStats) -> str:
    state = "finished" if stats.elapsed_s > 0 else "not started"
    if stats.running:
        state = "running"
    rate = f", {stats.batches_per_s:.1f} batches/s" if stats.batches_per_s is not None else ""
    pct = "-" if stats.data_bound_pct is None else f"{stats.data_bound_pct:.1f} %"
    in_flight_mean = "-" if stats.in_flight_mean is None else f"{stats.in_flight_mean:.1f}"
    waiting_mean = (
        "-" if stats.waiting_in_order_mean is None else f"{stats.waiting_in_order_mean:.1f}"
    )
    lines = [
        f"aioload stats ({state}): {stats.batches} batches, {stats.samples} samples "
        f"in {stats.elapsed_s:.2f} s{rate}",
        f"  data-bound {pct}: waiting for data {stats.waiting_s:.2f} s, "
        f"between batches {stats.between_s:.2f} s",
        f"  queues: in flight {stats.in_flight} (mean {in_flight_mean}), "
        f"waiting in order {stats.waiting_in_order} (mean {waiting_mean}, "
        f"peak {stats.waiting_in_order_peak})",
    ]
    if stats.run_ahead_peak:
        lines.append(
            f"  run-ahead: up to {stats.run_ahead_peak} batches beyond the prefetch window "
            f"(limit {stats.run_ahead_limit}), reorder buffer peak ~{_bytes(stats.reorder_bytes_peak)}"
        )
    if stats.pin_batches:
        lines.append(
            f"  pin/H2D: {stats.pin_batches} batches, {stats.pin_s:.2f} s "
            f"({_seconds(stats.pin_s / stats.pin_batches)} each)"
        )
    if stats.tuning is not None:
        lines.append("  " + _tuning_line(stats.tuning))
    if stats.stalled is not None:
        lines.append("  " + _stall_line(stats.stalled))
    if stats.skipped_count:
        lines.append(f"  skipped samples: {stats.skipped_count} (on_sample_error)")
        shown = stats.skipped[-_SKIPS_SHOWN:]
        if len(shown) < stats.skipped_count:
            lines.append(f"    ... {stats.skipped_count - len(shown)} earlier, then:")
        for record in shown:
            where = "main" if record.worker is None else f"worker {record.worker}"
            tries = f", {record.tries} tries" if record.tries > 1 else ""
            lines.append(f"    index {record.index!r} ({where}{tries}): {_clip(record.error)}")
    header = ("worker", "tasks", "busy", "fetch p50", "p90", "p99", "restarts")
    rows = [
        (
            "main" if stats.in_process else str(w.worker_id),
            str(w.tasks),
            f"{100 * w.busy_fraction:.0f} %",
            _seconds(w.fetch_p50_s),
            _seconds(w.fetch_p90_s),
            _seconds(w.fetch_p99_s),
            str(w.restarts),
        )
        for w in stats.workers
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  " + "  ".join(cells))
    return "\n".join(lines)
