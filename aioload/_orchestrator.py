"""The async engine behind both iterators: dispatch, reorder, health, timeouts, shutdown.

One Orchestrator serves one pass over the sampler. It is pure bookkeeping on the event loop: it
sends ``(task_id, indices)`` to workers, keeps at most ``prefetch_factor * num_workers`` tasks
between "sent" and "yielded", and hands batches out in task-id order (or as they complete, with
``in_order=False``). It starts no tasks of its own: all of its work happens inside the
consumer's ``await engine.next()``, so it needs no task group, cannot leak a background task,
and is cancelled exactly when the consumer is.

Worker assignment follows torch's DataLoader (round robin over active workers, and with
``in_order=False`` a per-worker cap), so each index lands on the same worker id as it would under
torch, and datasets with per-worker random augmentation produce the same batches.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import anyio

from ._fetch import PassPlan
from ._pinning import PinStage, Transfer
from ._resume import PassProgress, StreamPoint, YieldedPositions
from ._workers import Outcome
from .errors import DataLoaderTimeoutError
from .stats import PassStats

__all__ = ["END", "PENDING", "Orchestrator"]


class _End:
    def __repr__(self) -> str:
        return "END"


END: Any = _End()
PENDING: Any = object()


class Source(Protocol):
    """What the orchestrator needs from the worker pool (or from the in-process stand-in)."""

    num_workers: int
    broken: BaseException | None
    stale: bool
    stream_states: dict[int, tuple[int, Any, bool]]
    # Where answers of this pass report their workers' fetch times.
    stats: PassStats | None

    def begin_epoch(self, first: bool, plans: list[PassPlan]) -> int: ...
    def submit(self, worker_id: int, task_id: int, indices: Any) -> None: ...
    def flush(self) -> None: ...
    def poll(self) -> list[tuple[int, int, Outcome]]: ...
    async def wait(self, deadline: float) -> bool: ...
    def check_health(self) -> None: ...
    def pid(self, worker_id: int) -> int | None: ...
    def watch(self, fd: int) -> None: ...
    def take_restarted(self) -> list[int]: ...
    def kill(self, worker_id: int) -> None: ...

    restarts_left: int

    def close(self, grace: float = ...) -> None: ...


# The source before the first next() starts it (every use checks for this first).
_NOT_STARTED: Any = object()


class PassResources:
    """What one pass must release: its pin stage, and its source when it owns it. A finalizer
    holds this, not the orchestrator, so an abandoned pass (``break``, ``del``) is still
    cleaned up when it is collected."""

    def __init__(self) -> None:
        self.source: Source | None = None
        self.stage: PinStage | None = None

    def close(self) -> None:
        # The stage first: it may be working on a batch, and nothing after it needs it.
        stage, self.stage = self.stage, None
        if stage is not None:
            stage.close()
        source, self.source = self.source, None
        if source is not None:
            source.close()


class Orchestrator:
    def __init__(
        self,
        source: Callable[[], Source],
        *,
        sampler_iter: Iterator[Any],
        prefetch: int,
        in_order: bool,
        timeout: float,
        owns_source: bool,
        first_epoch: bool,
        iterable_len: int | None,
        dataset: Any,
        num_workers: int,
        offload_start: bool,
        plans: list[PassPlan],
        progress: PassProgress,
        skip: YieldedPositions | None = None,
        start: int = 0,
        transfer: Transfer | None = None,
        stats: PassStats | None = None,
    ) -> None:
        # The source (worker pool) is built on the first next(): under ``async for`` that runs
        # in a thread, because forking workers takes milliseconds each and must not hold the
        # caller's event loop.
        self._make_source = source
        self.owned = PassResources()
        self._source: Source = _NOT_STARTED
        self._transfer = transfer
        self._stage: PinStage | None = None
        self._prefetch = prefetch
        self._offload_start = offload_start
        self._first_epoch = first_epoch
        self._plans = plans
        # Batches leave through _deliver, which records them here for state_dict().
        self.progress = progress
        # (sampler position, indices); positions a resumed pass had already yielded skipped.
        self._sampler_iter = _positions(sampler_iter, skip, start)
        self._num_workers = num_workers
        self._capacity = prefetch * num_workers
        self._in_order = in_order
        self._timeout = timeout
        self._owns_source = owns_source
        self._iterable_len = iterable_len
        self._dataset = dataset
        self.stats = stats if stats is not None else PassStats(num_workers, False, False)

        self._send_idx = 0  # id of the next task to send
        self._rcvd_idx = 0  # id of the next task to yield (in order)
        # Tasks sent and not yet answered: task id -> (worker id, indices).
        self._inflight: dict[int, tuple[int, Any]] = {}
        # Tasks sent and not yet yielded: task id -> (worker id, sampler position, where the
        # worker's IterableDataset stream stood after it, once answered).
        self._assigned: dict[int, tuple[int, int, StreamPoint | None]] = {}
        # Task ids handed to the pin stage, in order (it keeps order).
        self._staged: deque[int] = deque()
        # Answered, waiting for their turn (in order): task id -> (worker id, outcome).
        self._reorder_buffer: dict[int, tuple[int, Outcome]] = {}
        # Answered, in arrival order (in_order=False): (task id, worker id, outcome).
        self._completed: deque[tuple[int, int, Outcome]] = deque()
        # Tasks between "sent" and "yielded or skipped", the quantity prefetch bounds.
        self._unyielded = 0
        self._per_worker = [0] * self._num_workers
        # A resumed IterableDataset pass: streams that had run dry stay so.
        self._active = [not progress.streams[w].ended for w in range(self._num_workers)]
        # Samples each IterableDataset stream had drawn by its last answer.
        self._samples_seen = [progress.streams[w].samples_seen for w in range(num_workers)]
        # torch's round robin; a resumed IterableDataset pass starts where the last one was.
        self._next_worker = progress.next_worker % self._num_workers
        self._sampler_done = False
        self._num_yielded = len(progress.yielded)
        self._fatal: BaseException | None = None
        self._finished = False
        self._closed = False
        self._busy = False

    # -- the one entry point -----------------------------------------------------------------

    def _over(self) -> bool:
        """Whether the pass is over; raises if it cannot go on (a fatal error, or a second
        consumer while one is waiting)."""
        if self._busy:
            raise RuntimeError("aioload: this iterator is already waiting for a batch")
        if self._fatal is not None:
            raise self._fatal
        return self._finished or self._closed

    def step(self) -> Any:
        """Everything that can be done without waiting: send tasks, take in answers, and
        return the next batch if it is already here, END if the pass is over, or PENDING.

        ``next`` is this plus waiting. The sync front end calls it first, and enters its event
        loop only when it really has to wait: with workers prefetching, most batches are
        already here.
        """
        if self._over():
            return END
        if self._source is _NOT_STARTED:
            return PENDING
        self._dispatch()
        self._source.flush()
        for worker_id, task_id, outcome in self._source.poll():
            self._accept(worker_id, task_id, outcome)
        if self._source.broken is not None:
            self._fail(self._source.broken)
        for worker_id in self._source.take_restarted():
            self._resend(worker_id)
        stage = self._stage
        if stage is None:
            ready = self._pop_ready()
            if ready is not None:
                return self._deliver(*ready)
        else:
            stage.drain_wake()
            while True:
                while stage.has_room():
                    # An IterableDataset's "end" goes through the stage too, so that it is
                    # recorded only once every batch before it has been yielded.
                    ready = self._pop_ready(through_stage=True)
                    if ready is None:
                        break
                    self._staged.append(ready[0])
                    stage.submit(ready[1])
                staged = stage.take()
                if staged is not None and staged[0] == "end":
                    self._end_reached(self._staged.popleft())
                    self.stats.dropped(staged)
                    continue
                break
            if staged is not None:
                return self._deliver(self._staged.popleft(), staged)
            if stage.pending:
                return PENDING
        if not self._inflight and (self._sampler_done or not any(self._active)):
            self._finished = True
            self.progress.finished = True
            return END
        return PENDING

    async def next(self) -> Any:
        """The next batch, or END when the pass is over."""
        if self._over():
            return END
        self._busy = True
        try:
            if self._source is _NOT_STARTED:
                await self._start()
                if self._closed:
                    return END
        finally:
            self._busy = False
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else math.inf
        while True:
            result = self.step()
            if result is not PENDING:
                return result
            if time.monotonic() >= deadline:
                stuck = self._stuck_worker()
                if stuck is not None and self._source.restarts_left > 0:
                    # A hung worker, and healing is on: kill it; its death is handled as any
                    # other (replaced, its tasks sent again) and the wait starts over.
                    self._source.kill(stuck)
                    deadline = time.monotonic() + self._timeout
                    continue
                self._source.stale = True
                raise self._timeout_error()
            self._busy = True
            try:
                if not await self._source.wait(deadline):
                    self._source.check_health()
            finally:
                self._busy = False

    async def _start(self) -> None:
        if self._offload_start:
            with anyio.CancelScope(shield=True):
                # Shielded: a pool half-made when a cancellation arrives would be orphaned.
                source = await anyio.to_thread.run_sync(self._make_source)
        else:
            source = self._make_source()
        self._source = source
        source.stats = self.stats
        if self._owns_source:
            self.owned.source = source
        if self._transfer is not None:
            self._stage = PinStage(self._transfer, depth=self._prefetch)
            self._stage.stats = self.stats
            self.owned.stage = self._stage
        if self._closed:
            # Closed while it was starting (a cancelled, then abandoned iterator).
            self._close_source()
            return
        source.begin_epoch(self._first_epoch, self._plans)
        if self._stage is not None:
            # After begin_epoch, which forgets the pipes watched for earlier passes: watched
            # before it, this pass's pipe was dropped too, and each batch through the stage
            # then waited for the 1 s health-check bound instead of the stage's wake-up.
            source.watch(self._stage.wake_r)

    # -- dispatch ----------------------------------------------------------------------------

    def _pick_worker(self) -> int | None:
        # torch's rule: the next active worker in the cycle; with in_order=False also one that
        # holds fewer than its share of the prefetch budget.
        active = sum(self._active)
        for _ in range(self._num_workers):
            worker_id = self._next_worker
            self._next_worker = (worker_id + 1) % self._num_workers
            if self._active[worker_id] and (
                self._in_order or self._per_worker[worker_id] < self._capacity // active
            ):
                return worker_id
        return None

    def _dispatch(self) -> None:
        while not self._sampler_done and self._unyielded < self._capacity:
            worker_id = self._pick_worker()
            if worker_id is None:
                return
            try:
                position, indices = next(self._sampler_iter)
            except StopIteration:
                self._sampler_done = True
                return
            task_id = self._send_idx
            self._send_idx += 1
            self._source.submit(worker_id, task_id, indices)
            self._inflight[task_id] = (worker_id, indices)
            self._assigned[task_id] = (worker_id, position, None)
            self._per_worker[worker_id] += 1
            self._unyielded += 1

    # -- results -----------------------------------------------------------------------------

    def _resend(self, worker_id: int) -> None:
        """A replaced worker's unanswered tasks go to its successor, with the same task ids: the
        reorder buffer neither loses nor duplicates a batch. (Answers its predecessor sent
        before dying were taken in first.)"""
        self.stats.restarted(worker_id)
        for task_id in sorted(self._inflight):
            owner, indices = self._inflight[task_id]
            if owner == worker_id:
                self._source.submit(worker_id, task_id, indices)
        self._source.flush()

    def _accept(self, worker_id: int, task_id: int, outcome: Outcome) -> None:
        sent = self._inflight.pop(task_id, None)
        if sent is None:
            return
        samples = self.stats.count(sent[1])
        if outcome[0] == "end":
            # This worker's IterableDataset copy has run dry for this epoch.
            self._active[worker_id] = False
        elif self.progress.iterable:
            stream = self._source.stream_states.pop(task_id, None)
            if stream is not None:
                # The stream's own count says what the batch holds (a short last batch, or a
                # collate whose result has no batch dimension).
                samples = stream[0] - self._samples_seen[worker_id]
                self._samples_seen[worker_id] = stream[0]
                _, position, _ = self._assigned[task_id]
                point = StreamPoint(stream[0], stream[1] is not None, stream[1], stream[2])
                self._assigned[task_id] = (worker_id, position, point)
        self.stats.answered(outcome, samples)
        if self._in_order:
            self._reorder_buffer[task_id] = (worker_id, outcome)
        else:
            self._completed.append((task_id, worker_id, outcome))

    def _pop_ready(self, through_stage: bool = False) -> tuple[int, Outcome] | None:
        while True:
            if self._in_order:
                entry = self._reorder_buffer.pop(self._rcvd_idx, None)
                if entry is None:
                    return None
                task_id = self._rcvd_idx
                self._rcvd_idx += 1
                worker_id, outcome = entry
            else:
                if not self._completed:
                    return None
                task_id, worker_id, outcome = self._completed.popleft()
            self._unyielded -= 1
            if outcome[0] == "end":
                if through_stage:
                    return task_id, outcome
                self._end_reached(task_id)
                self.stats.dropped(outcome)
                continue
            self._per_worker[worker_id] -= 1
            self.stats.handed(outcome)
            return task_id, outcome

    def _end_reached(self, task_id: int) -> None:
        assigned = self._assigned.pop(task_id, None)
        if assigned is not None:
            self.progress.streams[assigned[0]].ended = True
        self._note_next_worker(task_id)

    def _note_next_worker(self, task_id: int) -> None:
        # In order, the batch after this one is task_id + 1: the worker it went to, or (not
        # sent yet) the one the round robin will pick.
        following = self._assigned.get(task_id + 1)
        self.progress.next_worker = following[0] if following else self._next_worker

    def _record_yield(self, task_id: int) -> None:
        assigned = self._assigned.pop(task_id, None)
        if assigned is None:
            return
        worker_id, position, point = assigned
        progress = self.progress
        progress.yielded.add(position)
        if progress.iterable:
            if point is not None:
                progress.streams[worker_id] = point
            self._note_next_worker(task_id)

    def _deliver(self, task_id: int, outcome: Outcome) -> Any:
        # Recorded before an error is raised too: a batch whose error reached the consumer
        # has been delivered, and a resumed pass does not fetch it again.
        self._record_yield(task_id)
        kind, value = outcome
        samples = self.stats.delivering()
        if kind == "err":
            # The epoch goes on after this if the caller catches it, as in torch.
            value.reraise()
        if kind == "raise":
            raise value
        self._num_yielded += 1
        self.stats.yielded(
            value,
            samples,
            in_flight=len(self._inflight),
            waiting=len(self._reorder_buffer) + len(self._completed) + len(self._staged),
        )
        if self._iterable_len is not None and self._num_yielded > self._iterable_len:
            warn_msg = (
                f"Length of IterableDataset {self._dataset} was reported to be "
                f"{self._iterable_len}(when accessing len(dataloader)), but "
                f"{self._num_yielded} samples have been fetched. "
            )
            if self._source.pid(0) is not None:
                warn_msg += (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker."
                )
            warnings.warn(warn_msg, stacklevel=4)
        return value

    # -- failures ----------------------------------------------------------------------------

    def _stuck_worker(self) -> int | None:
        if not self._inflight:
            return None
        return self._inflight[min(self._inflight)][0]

    def _timeout_error(self) -> DataLoaderTimeoutError:
        message = f"DataLoader timed out after {self._timeout} seconds"
        waiting = min(self._inflight) if self._inflight else None
        if waiting is not None:
            worker_id, indices = self._inflight[waiting]
            message += (
                f" (waiting for batch {waiting} from DataLoader worker {worker_id}, "
                f"pid {self._source.pid(worker_id)}, holding indices {_short(indices)})"
            )
        return DataLoaderTimeoutError(message, timeout=self._timeout)

    def _fail(self, error: BaseException) -> None:
        # A dead worker ends the pass: its tasks cannot be answered. Shut the pool down now
        # (a broken persistent pool too: the loader builds a fresh one next epoch).
        self._fatal = error
        self._closed = True
        self.stats.end()
        self._close_source()  # the pin stage, and the pool if this pass owns it
        self._source.close()  # a persistent pool too: it is broken
        raise error

    # -- shutdown ----------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release what this pass owns. Safe to call more than once, and from ``__del__``."""
        self.stats.end()
        if self._closed:
            return
        self._closed = True
        self._close_source()

    def _close_source(self) -> None:
        self.owned.close()
        self._stage = None

    async def aclose(self) -> None:
        """``close`` without blocking the event loop: stopping workers may wait (boundedly) for
        them to exit, so that wait runs in a thread. Shielded, so a cancelled caller still
        leaves nothing behind."""
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.close)


def _positions(
    sampler_iter: Iterator[Any], skip: YieldedPositions | None, start: int
) -> Iterator[tuple[int, Any]]:
    """Number the sampler's batches; on resume, leave out those already yielded."""
    for position, indices in enumerate(sampler_iter, start):
        if skip is None or position not in skip:
            yield position, indices


def _short(indices: Any, limit: int = 16) -> str:
    try:
        items = list(indices)
    except TypeError:
        return repr(indices)
    if len(items) <= limit:
        return repr(items)
    return repr(items[:limit])[:-1] + f", ... ({len(items)} in all)]"
