"""One pass's side of the ``"auto"`` controller (:mod:`.tuning`), and the loader's "auto"
arguments: :class:`PassTuning` turns a pass's ``PassStats`` counters into windows (one every
``min_batches`` batches and ``min_seconds`` seconds, or ``max_seconds``) for the controller,
and :func:`auto_arguments` checks ``num_workers``/``prefetch_factor``/``worker_concurrency``
and ``max_memory`` and makes the controller where one of them is ``"auto"``."""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

from .._named_tuple import NamedTuple
from .measure import IdleCpus, affinity, batch_bytes, rss_bytes, usable_cores
from .tuning import (
    AUTO,
    CONCURRENCY,
    DEPTH,
    START_DEPTH,
    Controller,
    ControllerSettings,
    Knob,
    Window,
)

__all__ = ["AutoArguments", "PassTuning", "auto_arguments"]


class _Mark(NamedTuple):
    at: float
    batches: int
    samples: int
    waiting_s: float
    between_s: float
    busy_s: tuple[float, ...]
    cpu_s: float


class PassTuning:
    """One pass's feed to the controller: called by the orchestrator for every batch it hands
    over (a counter and a clock read), it closes a window every ``min_batches`` batches and
    ``min_seconds`` (or ``max_seconds``), and returns True when the controller changed
    something the orchestrator must apply."""

    def __init__(self, controller: Controller, stats: Any) -> None:
        self.controller = controller
        self.stats = stats
        stats.tuning = self
        self._idle = IdleCpus(affinity())
        self._first: _Mark | None = None
        self._first_idle: tuple[int, int] | None = None
        self._mark: _Mark | None = None
        self._batches = 0
        self._in_flight = 0
        self._waiting = 0
        self._largest = 0

    @property
    def workers(self) -> int:
        return self.controller.workers.value

    @property
    def depth(self) -> int:
        return self.controller.depth.value

    @property
    def concurrency(self) -> int | None:
        knob = self.controller.concurrency
        return knob.value if knob.auto else None

    def report(self) -> dict[str, Any]:
        return self.controller.report()

    def brief(self) -> str:
        return self.controller.brief()

    def _take_mark(self, now: float) -> _Mark:
        stats = self.stats
        return _Mark(
            now,
            stats.batches,
            stats.samples,
            stats.waiting_s,
            stats.between_s,
            tuple(w.busy_s for w in stats.workers),
            time.process_time(),
        )

    def after_batch(self, batch: Any, in_flight: int, waiting: int) -> bool:
        now = time.perf_counter()
        mark = self._mark
        if mark is None:
            self._first = self._mark = self._take_mark(now)
            self._idle.sample()
            self._first_idle = self._idle.last
            return False
        self._batches += 1
        self._in_flight += in_flight
        self._waiting += waiting
        controller = self.controller
        elapsed = now - mark.at
        factor = controller.window_factor
        if not (
            (
                self._batches >= controller.min_batches * factor
                and elapsed >= controller.min_seconds * factor
            )
            or (self._batches >= 2 and elapsed >= controller.max_seconds)
        ):
            return False
        size = batch_bytes(batch)
        window = self._window(mark, now, max(self._largest, size))
        first = self._first
        assert first is not None
        controller.pass_window = self._window(first, now, max(self._largest, size), whole=True)
        self._mark = self._take_mark(now)
        self._batches = self._in_flight = self._waiting = 0
        self._largest = 0
        return bool(controller.observe(window, now - first.at))

    def _window(self, mark: _Mark, now: float, size: int, whole: bool = False) -> Window:
        stats, controller = self.stats, self.controller
        seconds = now - mark.at
        waiting_s = stats.waiting_s - mark.waiting_s
        between_s = stats.between_s - mark.between_s
        consumer = waiting_s + between_s
        active = min(controller.workers.value, len(stats.workers), len(mark.busy_s)) or 1
        busy_s = sum(stats.workers[w].busy_s - mark.busy_s[w] for w in range(active))
        busy = busy_s / (seconds * active) if seconds > 0 else 0.0
        batches = stats.batches - mark.batches
        idle = self._idle.sample(self._first_idle if whole else None)
        if idle is not None and controller.cores < len(self._idle.names):
            # A CPU quota below the affinity: the quota's own headroom counts.
            used = (time.process_time() - mark.cpu_s) / seconds + busy * active
            idle = min(idle, controller.cores - used)
        return Window(
            seconds=seconds,
            batches=batches,
            samples=stats.samples - mark.samples,
            waiting=waiting_s / consumer if consumer > 0 else 0.0,
            busy=min(1.0, max(0.0, busy)),
            idle_cores=idle,
            parent_cpu=(time.process_time() - mark.cpu_s) / seconds if seconds > 0 else 0.0,
            in_flight=self._in_flight / batches if batches and not whole else 0.0,
            head_of_line=self._waiting / batches if batches and not whole else 0.0,
            batch_bytes=size,
            rss_bytes=rss_bytes() if not whole else 0,
        )


# -- the DataLoader's arguments ---------------------------------------------------------------


class AutoArguments(NamedTuple):
    """What a loader with an "auto" argument gives torch's ``__init__`` (integers it accepts),
    and the controller that keeps the rest."""

    num_workers: int
    prefetch_factor: int | None
    worker_concurrency: int
    controller: Controller


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _budget_bytes(max_memory: Any) -> int:
    """``max_memory`` as whole bytes: an integer (numpy's too), or a float such as ``2e9``;
    a bool, a string or anything under one byte is refused."""
    value: int | None = None
    if not isinstance(max_memory, bool):
        if isinstance(max_memory, numbers.Integral):
            value = int(max_memory)
        elif isinstance(max_memory, numbers.Real) and math.isfinite(float(max_memory)):
            value = math.floor(float(max_memory))
    if value is None or value < 1:
        raise ValueError(
            "max_memory option should be None or a positive number of bytes, but got "
            f"max_memory={max_memory!r}"
        )
    return value


def auto_arguments(
    num_workers: Any,
    prefetch_factor: Any,
    worker_concurrency: Any,
    max_memory: Any,
    *,
    iterable: bool,
    is_async: bool,
) -> AutoArguments | None:
    """Validate the "auto" arguments and ``max_memory``; None when there is nothing to tune
    (every number is the user's, and no budget): the loader then behaves exactly as before.
    Integers are left for the usual checks (torch's, and the loader's own)."""
    for name, value, kind in (
        ("num_workers", num_workers, "a non-negative"),
        ("prefetch_factor", prefetch_factor, "a positive"),
        ("worker_concurrency", worker_concurrency, "a positive"),
    ):
        if isinstance(value, str) and value != AUTO:
            raise ValueError(
                f"{name} option should be {kind} integer or 'auto', but got {name}={value!r}"
            )
    if max_memory is not None:
        max_memory = _budget_bytes(max_memory)
    auto_workers = _is_auto(num_workers)
    auto_depth = _is_auto(prefetch_factor)
    # A sync dataset fetches one sample at a time: "auto" has only 1 to choose from.
    auto_concurrency = _is_auto(worker_concurrency) and is_async
    if not (auto_workers or auto_depth or auto_concurrency):
        if max_memory is not None:
            raise ValueError(
                "max_memory bounds what num_workers='auto' and prefetch_factor='auto' choose: "
                "pass one of them with it"
            )
        return None
    if not auto_workers and num_workers == 0 and auto_depth:
        # torch's own refusal of a prefetch_factor without workers.
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    cores = usable_cores()
    controller = Controller(
        ControllerSettings(
            workers=None if auto_workers else int(num_workers),
            depth=None if auto_depth else None if prefetch_factor is None else int(prefetch_factor),
            concurrency=None if auto_concurrency else 1,
            max_workers=cores,
            cores=cores,
            max_memory=max_memory,
            per_pass_workers=iterable,
        )
    )
    if not auto_depth and prefetch_factor is None:
        controller.depth = Knob(DEPTH, False, START_DEPTH, START_DEPTH, START_DEPTH)
    if not auto_concurrency:
        value = 1 if _is_auto(worker_concurrency) else worker_concurrency
        controller.concurrency = Knob(CONCURRENCY, False, value, value, value)
    # torch's __init__ sees what the pool is built with: every slot (map-style), or the first
    # pass's count (an IterableDataset, whose count holds for a pass).
    torch_workers = num_workers
    if auto_workers:
        torch_workers = controller.workers.value if iterable else controller.workers.high
    torch_prefetch = prefetch_factor
    if auto_depth:
        torch_prefetch = START_DEPTH if torch_workers else None
    return AutoArguments(
        num_workers=torch_workers,
        prefetch_factor=torch_prefetch,
        worker_concurrency=controller.concurrency.value,
        controller=controller,
    )
