"""The data-bound report: is the training loop waiting for data?

``DataLoader.stats()`` turns the newest pass's counters (``_engine.counters.PassStats``) into
a :class:`LoaderStats` snapshot: plain numbers, a table for ``print`` and a dict for loggers.
A skipped sample is one :class:`SkippedSample` record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["LoaderStats", "SkippedSample", "WorkerStats"]


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
        reorder_bytes_peak: The most bytes of answers waiting for their turn at a hand-over,
            each counted at the largest batch size known then (an estimate: batches are sized
            now and then, and each one that waits behind a late head).
        run_ahead_limit: In order, while the head of the line is late, workers run ahead of it
            beyond the prefetch window (docs/tuning.md, "Run-ahead"): the most batches beyond
            the window the pass may send (0: none, as with ``in_order=False`` or before the
            first batch). The bound now: larger batches shrink it, so ``run_ahead_peak``, sent
            under an earlier bound, may be over it.
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
