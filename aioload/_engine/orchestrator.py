"""The async engine behind both iterators: dispatch, reorder, health, timeouts, shutdown.

One Orchestrator serves one pass over the sampler, described by one frozen ``PassSetup``. It is
pure bookkeeping on the event loop: it sends ``(task_id, indices)`` to the workers of a
``_backends.base.WorkerBackend`` (processes, the calling process, or Ray actors), keeps at most
``prefetch_factor * num_workers`` tasks between "sent" and "yielded", and hands batches out in
task-id order (or as they complete, with ``in_order=False``). It starts no tasks of its own:
all of its work happens inside the consumer's ``await engine.next()``, so it needs no task
group, cannot leak a background task, and is cancelled exactly when the consumer is. What
happened to each task (sent, answered, waiting for its turn, delivered) is recorded in the
pass's ``_engine.ledger.Ledger``; the orchestrator makes the decisions around that record.

The sync front end drives the same orchestrator without an event loop where it can
(``next_blocking``: the waits block the calling thread). anyio is imported only under trio
(or where the program has imported it already), so neither ``for batch in loader`` nor
``async for`` under asyncio pays for importing it.

Worker assignment follows torch's DataLoader (round robin over active workers, and with
``in_order=False`` a per-worker cap), so each index lands on the same worker id as it would under
torch, and datasets with per-worker random augmentation produce the same batches. The one
exception is in order with ``seed_per_sample``, where the worker changes nothing in a batch and
tasks go to the least busy worker (NOTE [balanced in order]).
"""

from __future__ import annotations

import math
import os
import sys
import time
import types
import warnings
import weakref
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, NoReturn

from .._aio.waiting import Waiter, run_off_loop, running_asyncio_loop
from .._backends.base import TunableBackend, WorkerBackend
from .._wire.messages import (
    Answer,
    Batch,
    Failed,
    Outcome,
    Raised,
    WorkerLost,
)
from ..errors import TooManySampleErrors
from .counters import PassStats
from .ledger import Ledger
from .pass_setup import (
    Drawn,
    PassResources,
    PassSetup,
    release_pass_frames,
    replaced,
    timeout_error,
    warn_past_length,
)
from .runahead import RunAhead
from .sleep import PlannedWait

if TYPE_CHECKING:
    from .pinning import PinStage, Transfer

__all__ = [
    "END",
    "NEEDS_LOOP",
    "PENDING",
    "Orchestrator",
    "PassSetup",
    "release_pass_frames",
    "track_pass",
]


class _End:
    def __repr__(self) -> str:
        return "END"


END: Any = _End()


class _Sentinel:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# ``step``: no batch yet (the caller may wait for one).
PENDING: Any = _Sentinel("PENDING")
# ``next_blocking``: the wait that comes next needs an event loop (the backend starts in a
# thread, or an async dataset fetches in this process): run ``next`` on one.
NEEDS_LOOP: Any = _Sentinel("NEEDS_LOOP")
# ``_advance``: a wait is planned; the caller performs it and comes back.
_WAIT: Any = _Sentinel("_WAIT")

# NOTE [one step loop]. ``Orchestrator._advance`` is the loop of ``next`` and ``next_blocking``,
# written once: a step, and where it has no batch, the wait that comes next, planned there
# (``_engine.sleep.PlannedWait``) and returned as _WAIT for the caller to perform: ``next``
# awaits it on the loop, ``next_blocking`` blocks the calling thread. Each caller comes back
# after its wait. A sans-io step rather than a generator that yields its waits: it runs up to
# twice a batch, and a generator per ``next`` (made, sent to, finished) costs more than the
# state kept between calls (``_deadline``, ``_intake``).


# The backend before the first next() starts it (every use checks for this first).
_NOT_STARTED: Any = object()


def _pin_stage(transfer: Transfer, depth: int) -> PinStage:
    """The pass's pin stage; ``_engine.pinning`` is imported only by a pass that has one."""
    from .pinning import PinStage

    return PinStage(transfer, depth=depth)


class Orchestrator:
    def __init__(
        self,
        backend: Callable[[], WorkerBackend],
        setup: PassSetup,
        *,
        owns_backend: bool,
        stats: PassStats | None = None,
    ) -> None:
        # The backend (worker pool) is built on the first next(): under ``async for`` that
        # runs in a thread where the backend is slow to start (BackendTraits.slow_start).
        self._make_backend = backend
        self.owned = PassResources()
        self._backend: WorkerBackend = _NOT_STARTED
        self._wait: PlannedWait = _NOT_STARTED  # made with the pass's start (_adopt)
        self._setup = setup
        self._stage: PinStage | None = None
        # Batches leave through _deliver, which records them here for state_dict().
        self.progress = progress = setup.progress
        self._batches = Drawn(setup.batches)  # (NOTE [a failing sampler])
        num_workers = self._num_workers = setup.num_workers
        self._capacity = setup.prefetch * num_workers
        # Slots dispatched to: the first ``_slots`` workers (num_workers="auto" changes it;
        # the others idle, or are not started yet).
        self._slots = num_workers
        # (Set from the controller's choice when the pass starts on its backend, _adopt.)
        self._tuning = setup.tuning
        self._concurrency: int | None = None
        self._in_order = setup.in_order
        self._pick = _pick_rule(setup)  # which worker a task goes to
        self._timeout = setup.timeout
        self._owns_backend = owns_backend
        self.stats = stats if stats is not None else PassStats(num_workers, False, False)
        self.stats.resumed_batches = len(progress.yielded)
        # Healing: how many more lost workers this pass may replace.
        self._restarts_left = setup.max_worker_restarts

        # Every task, from sent to delivered (and what each worker's dataset reached).
        self._ledger = Ledger(
            progress,
            self.stats,
            num_workers,
            in_order=setup.in_order,
            skip_cap=setup.skip_cap,
            next_worker=progress.next_worker % num_workers,
        )
        # torch's round robin: the worker the next task goes to, unless it cannot take one.
        # A resumed pass starts where its checkpoint says the batch after the last yielded
        # went; the ledger hears where it stands as it moves, for the next checkpoint.
        self._next_worker = progress.next_worker % num_workers
        # In order: how far workers may run ahead of a late head (NOTE [run-ahead]).
        self._ahead = _run_ahead(setup, self._ledger, self.stats, self._capacity)
        self._sampler_done = False
        self._num_yielded = len(progress.yielded)
        self._fatal: BaseException | None = None
        self._finished = False
        self._closed = False
        # Set while a ``next`` waits (or starts the backend): a second consumer is refused.
        self._busy = False
        # Whether stats name every worker (see _name_workers); the calling process is unnamed.
        self._named = not setup.traits.runs_ahead
        # The step loop's state between its calls (NOTE [one step loop]): this ``next``'s
        # deadline, and whether its next step takes in answers.
        self._deadline = math.inf
        self._intake = False

    # -- the one entry point -----------------------------------------------------------------

    def _over(self) -> bool:
        """Whether the pass is over; raises if it cannot go on (fatal error, second consumer)."""
        if self._busy:
            raise RuntimeError("aioload: this iterator is already waiting for a batch")
        if self._fatal is not None:
            raise self._fatal
        return self._finished or self._closed

    def step(self, intake: bool = True) -> Any:
        """Everything that can be done without waiting: send tasks, take in answers, and
        return the next batch if it is already here, END if the pass is over, or PENDING.

        ``next`` is this plus waiting. The sync front end calls it first, and enters its event
        loop only when it really has to wait: with workers prefetching, most batches are
        already here.

        ``intake=False`` takes in nothing new from the backend (no ``poll``): the first step
        of a ``next`` looks only at what is already here, since a wait that follows it would
        see an answer waiting in a socket at once anyway. That saves the data-bound consumer
        one ``select`` per batch: it waits for nearly every batch, and a ``select(0)`` before
        each wait found nothing. (With a pin stage, whose own thread hands batches back, every
        step takes in.)
        """
        if (self._busy or self._fatal is not None or self._finished or self._closed) and (
            self._over()
        ):
            return END
        backend = self._backend
        if backend is _NOT_STARTED:
            return PENDING
        ledger = self._ledger
        try:
            if not self._sampler_done and ledger.unyielded < self._capacity:
                self._dispatch()
            stage = self._stage
            if intake or stage is not None:
                for event in backend.poll():
                    if isinstance(event, Answer):
                        ledger.accept(event)
                        self._ahead.answered(event.outcome)
                    else:
                        self._lost(event)
            if stage is None:
                ready = ledger.pop_ready()
            else:
                stage.drain_wake()
                ready = ledger.through_stage(stage)
                if ready is None and stage.pending:
                    return PENDING
            if ready is not None:
                return self._deliver(*ready)
            if not ledger.inflight and (self._sampler_done or not any(ledger.active)):
                self._batches.raise_error()
                ledger.check_skip_cap(final=True)
                self._finished = True
                self.progress.finished = True
                return END
            if self._ahead.limit and not self._sampler_done:
                self._ahead.top_up(self._slots, self._dispatch)
            return PENDING
        except TooManySampleErrors as error:
            if error is ledger.cap_error:  # past max_skipped: the pass ends (a kept backend stays)
                self._fatal = error
                self.close()
            raise

    async def next(self) -> Any:
        """The next batch, or END when the pass is over.

        A checkpoint, as in trio and anyio: it yields to the loop, and so honours a pending
        cancellation, even when the batch is already here. A training step is mostly
        synchronous; without this, a consumer that always finds a batch waiting would never
        let the loop's other tasks (heartbeats, RPCs, deadlines) run. The checkpoint comes
        before the batch is taken, so a cancellation delivered here loses no batch. Where the
        first step surely takes nothing, the wait after it is the checkpoint (one turn of the
        loop per waited batch, not two); a wait that did not yield is followed by one.
        The loop itself is ``_advance``'s, the same as ``next_blocking``'s: this only waits.
        """
        ledger = self._ledger  # the pass goes on; its first step surely sends and takes nothing
        if checkpointed := not (
            self._stage is None
            and self._backend is not _NOT_STARTED
            and not (self._busy or self._fatal is not None or self._finished or self._closed)
            and (self._sampler_done or ledger.unyielded >= self._capacity)
            and ledger.nothing_ready()
        ):
            await _checkpoint()
        if self._over():
            return END
        if self._backend is _NOT_STARTED:
            self._busy = True
            try:
                await self._start()
            finally:
                self._busy = False
            if self._over():  # (closed while it started: by a newer pass, raising)
                return END
        self._begin_next()
        while (result := self._advance()) is _WAIT:
            self._busy = True
            try:
                checkpointed = await self._wait.perform() or checkpointed
            finally:
                self._busy = False
            if not checkpointed:
                await _checkpoint()
                checkpointed = True
        return result

    def next_blocking(self) -> Any:
        """``next`` for the sync front end: the waits block the calling thread, with no event
        loop. Returns NEEDS_LOOP, having waited for nothing, where a wait needs a loop (the
        backend starts in a thread, or an async dataset runs in this process); the front end
        then runs ``next`` on its private loop.

        A loop would cost the sync path a lot per wait (uvloop makes and closes its signal
        wake-up socketpair per ``run_until_complete``) and buy it nothing. Ctrl-C interrupts
        the blocking ``select``; the state is consistent at every wait, so the pass can be
        closed or resumed as after any other exception.
        """
        if self._over():
            return END
        if self._backend is _NOT_STARTED:
            # In the calling thread, whatever it costs: the sync front end has no loop to run.
            self._adopt(self._make_owned_backend())
            if self._over():  # (as in ``next``)
                return END
        self._begin_next()
        while (result := self._advance()) is _WAIT:
            self._busy = True
            try:
                if not self._wait.perform_blocking():
                    return NEEDS_LOOP
            finally:
                self._busy = False
        return result

    # -- the step loop: one implementation, two ways to wait ---------------------------------

    def _begin_next(self) -> None:
        # A ``next`` begins: its deadline, and its first step takes in nothing (see ``step``).
        timeout = self._timeout
        self._deadline = time.monotonic() + timeout if timeout > 0 else math.inf
        self._intake = False

    def _advance(self) -> Any:
        """The loop of ``next`` and ``next_blocking``: the batch, END, or _WAIT with the next
        wait planned (NOTE [one step loop])."""
        intake = self._intake
        if intake and not self._named:
            self._name_workers()  # (after each wait until every worker has started)
        if (result := self.step(intake)) is not PENDING:
            return result
        self._intake = True
        deadline = self._deadline
        if deadline != math.inf and time.monotonic() >= deadline:
            self._deadline = self._overdue(deadline, intake)
            self._wait.skip()
        else:
            # In order, with no pin stage, the wait is for the next task's worker.
            awaited = self._ledger.awaited() if self._in_order and self._stage is None else None
            hang, ledger = self._setup.hang, self._ledger
            self._wait.plan(self._backend, awaited, deadline, hang, ledger, self._ahead)
        return _WAIT

    def _overdue(self, deadline: float, intake: bool) -> float:
        """A step found the batch missing at ``deadline``: the deadline of the next step. One
        that took in nothing gets another look first. Then, with healing on, the worker holding
        the oldest task is stopped (its loss is handled as any other) and the wait starts over;
        with none, the timeout error is raised."""
        if not intake:
            return deadline
        oldest = self._ledger.oldest()
        if oldest is None or self._restarts_left <= 0:
            # Stuck in a sample: this pass may go on, but no other runs on these workers.
            self._backend.retire()
            raise timeout_error(self._timeout, self._ledger, self._backend)
        self._backend.abandon(oldest[1].worker_id)
        return time.monotonic() + self._timeout

    def _make_owned_backend(self) -> WorkerBackend:
        # The pass takes ownership in the thread that makes the pool, not after the await: a
        # native asyncio Task.cancel() is not held off (see run_off_loop), so the await can end
        # while the thread goes on, and the pool it makes must still close with the pass.
        backend = self._make_backend()
        if self._owns_backend:
            self.owned.backend = backend
            if self._closed:
                self.owned.close()
        return backend

    async def _start(self) -> None:
        if self._setup.traits.slow_start:
            backend = await run_off_loop(self._make_owned_backend)
        else:
            backend = self._make_owned_backend()
        self._adopt(backend)

    def _adopt(self, backend: WorkerBackend) -> None:
        """Take a just-made backend as this pass's and begin the pass on it."""
        self._backend = backend
        if self._setup.transfer is not None:
            self._stage = _pin_stage(self._setup.transfer, depth=self._setup.prefetch)
            self._stage.stats = self.stats
            self.owned.stage = self._stage
        # The engine's sleep: on what the backend offers, and on the stage's pipe.
        self.owned.waiter = waiter = Waiter(self._stage.wake_r if self._stage else None)
        self._wait = PlannedWait(waiter)
        if self._closed:
            # Closed while it was starting (a cancelled, then abandoned iterator).
            self._close_owned()
            return
        backend.start_pass(self._setup.plans)
        if self._tuning is not None:
            self._apply_tuning()
        if self._setup.traits.runs_ahead:
            # The first tasks go out at once: a pool that starts staggered has forked only the
            # first worker, which starts on its task while the waits fork the others; theirs
            # wait in their sockets. (The next step would dispatch them anyway; nothing draws
            # from an RNG in between.)
            self._dispatch()
            self._name_workers()

    def _name_workers(self) -> None:
        """Where each worker runs, for stats and messages. Asked again after each wait until
        every worker is named: a worker may be named only once it has started (a staggered
        pool forks its workers at the waits, one a wait)."""
        named = True
        for worker_id in range(self._slots):
            place = self._backend.place(worker_id)
            self.stats.where[worker_id] = place.name
            named = named and place.started
        self._named = named

    def _apply_tuning(self) -> None:
        """What the controller (``_engine.pass_tuning``) chose: the slots dispatched to (retired
        slots keep the tasks they hold, and answer them; their task ids keep the order), the
        tasks in flight, and an async dataset's fetches in flight per worker."""
        tuning = self._tuning
        assert tuning is not None
        slots = max(1, min(self._num_workers, tuning.workers))
        if slots != self._slots:
            self._slots = slots
            if isinstance(self._backend, TunableBackend):
                self._backend.activate(slots)
            self._named = not self._setup.traits.runs_ahead
        self._capacity = tuning.depth * slots
        self._ahead.resize(self._capacity, slots)
        concurrency = tuning.concurrency
        if concurrency is not None and concurrency != self._concurrency:
            self._concurrency = concurrency
            if isinstance(self._backend, TunableBackend):
                self._backend.set_concurrency(concurrency)

    # -- dispatch ----------------------------------------------------------------------------

    def _dispatch(self, more: Callable[[], bool] | None = None) -> None:
        # The window (or, running ahead, ``more``: NOTE [run-ahead] in _engine/runahead.py).
        ledger = self._ledger
        while not self._sampler_done and (
            ledger.unyielded < self._capacity if more is None else more()
        ):
            worker_id, self._next_worker = self._pick(
                ledger, self._next_worker, self._slots, self._capacity
            )
            if worker_id is None:
                ledger.round_robin_at(self._next_worker)
                return
            try:
                position, indices = next(self._batches)
            except StopIteration:
                self._sampler_done = True
                ledger.round_robin_at(self._next_worker)
                return
            task_id = ledger.sent(worker_id, position, indices, self._next_worker)
            self._backend.submit(worker_id, task_id, indices)

    # -- results -----------------------------------------------------------------------------

    def _lost(self, lost: WorkerLost) -> None:
        """A worker is gone. With restarts left, a successor takes its slot and its unanswered
        tasks, with the same task ids: the reorder buffer neither loses nor duplicates a
        batch. (Answers its predecessor sent before dying were taken in first.) Otherwise the
        pass ends with the backend's error, naming the indices the worker held."""
        held = self._ledger.held_by(lost.worker_id)
        if self._restarts_left <= 0:
            self._fail(lost.error)
        point = self._ledger.answered[lost.worker_id]
        plan = self._setup.plans[lost.worker_id]._replace(
            dataset_state=point.dataset_state, iter_state=point.iter_state
        )
        self._restarts_left -= 1
        message = replaced(lost, self._setup.max_worker_restarts, self._restarts_left)
        warnings.warn(message, RuntimeWarning, stacklevel=4)  # next or next_blocking
        self.stats.restarted(lost.worker_id)
        self._backend.restart(lost.worker_id, plan)
        place = self._backend.place(lost.worker_id)
        self.stats.where[lost.worker_id] = place.name
        if not place.started:  # (a Ray actor: named again after each wait until started)
            self._named = False
        for task_id in held:
            self._backend.submit(lost.worker_id, task_id, self._ledger.inflight[task_id].indices)

    def _deliver(self, task_id: int, outcome: Outcome, samples: int) -> Any:
        # Recorded before an error is raised too: a batch whose error reached the consumer
        # has been delivered, and a resumed pass does not fetch it again.
        ledger = self._ledger
        ledger.record_yield(task_id)
        if type(outcome) is not Batch:  # (the common case, tested without a call)
            if isinstance(outcome, Failed):
                # The epoch goes on after this if the caller catches it, as in torch.
                outcome.error.reraise()
            if isinstance(outcome, Raised):
                raise outcome.error
            assert isinstance(outcome, Batch)
        value = outcome.value
        self._num_yielded += 1
        self.stats.yielded(value, samples, len(ledger.inflight), ledger.waiting())
        if self._num_yielded >= self._ahead.next_survey:
            self._ahead.survey(value, self._num_yielded)
        # torch refills the prefetch window as it hands a batch over (``_process_data`` calls
        # ``_try_put_index``), not at the next request. Doing the same keeps the number of
        # tasks sent after k batches at prefetch + k, and with it which sampler draws happen
        # before a ``break``: a later shuffled epoch then matches torch's order. (In the calling
        # process torch draws a batch's indices only when it is asked for, so nothing is sent
        # ahead there.)
        # The queue depths above are read before the refill: they describe what was waiting
        # when this batch was handed over.
        if self._tuning is not None and self._tuning.after_batch(
            value, len(ledger.inflight), ledger.answered_waiting()
        ):
            self._apply_tuning()
        runs_ahead = self._setup.traits.runs_ahead
        if runs_ahead and not self._sampler_done and ledger.unyielded < self._capacity:
            self._dispatch()
        iterable_len = self._setup.iterable_len
        if iterable_len is not None and self._num_yielded > iterable_len:
            warn_past_length(self._setup, self._num_yielded)
        return value

    # -- failures ----------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> NoReturn:
        # A lost worker ends the pass: its tasks cannot be answered. Shut the backend down
        # now (a persistent one too, so the loader starts a fresh one next epoch).
        self.close(error)  # the pin stage, and the backend if this pass owns it
        self._backend.close()  # a kept backend too: it is broken
        raise error

    # -- shutdown ----------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, error: BaseException | None = None) -> None:
        """Release what this pass owns. Safe to call more than once, and from ``__del__``.
        ``error``: what every later ``next`` of a pass not over yet raises (a failure, or the
        loader's ``shutdown()``, which stopped its workers: it must not pass for a whole one)."""
        self.stats.end()
        if self._closed:
            return
        self._closed = True
        self._fatal = error if error is not None and not self._finished else self._fatal
        self._close_owned()

    def _close_owned(self) -> None:
        self.owned.close()
        self._stage = None

    async def aclose(self) -> None:
        """``close`` without blocking the event loop: stopping workers may wait (boundedly) for
        them to exit, so that wait runs in a thread. Shielded, so a cancelled caller still
        leaves nothing behind. A checkpoint even when already closed, as trio's are."""
        if self._closed:
            await _checkpoint()
            return
        await run_off_loop(self.close)


# Every pass of this process, for the fork hook below.
_passes: weakref.WeakSet[Orchestrator] = weakref.WeakSet()


def track_pass(engine: Orchestrator) -> None:
    """Tell a process forked from this one that ``engine`` is not its own
    (``_disown_after_fork``)."""
    _passes.add(engine)


def _disown_after_fork() -> None:
    """In a forked child (an ``os.fork()`` of the user's, a fork-started process of theirs),
    every pass copied from the parent is the parent's: its workers serve the parent alone, and
    its backend is already closed here (``_backends.process._disown_after_fork``). Such an
    iterator raises at once, saying so, rather than fail somewhere inside; a new pass here
    starts workers of its own. (Its shutdown in the child touches nothing of the parent's.)"""
    parent, child = os.getppid(), os.getpid()
    for engine in list(_passes):
        if not (engine._finished or engine._closed):
            engine._fatal = RuntimeError(
                f"aioload: this DataLoader iterator belongs to process {parent}, and was copied "
                f"into this one (pid {child}) by a fork: its workers serve that process only. "
                "Start a pass of this process's own (iter(loader), or async for over the "
                "loader): it starts its own workers."
            )
    _passes.clear()


os.register_at_fork(after_in_child=_disown_after_fork)


def _pick_rule(setup: PassSetup) -> Callable[[Ledger, int, int, int], tuple[int | None, int]]:
    """How the pass picks the worker the next task goes to: torch's round robin in order,
    with a per-worker cap out of order, and the least busy worker in order where the worker
    changes nothing in a batch (NOTE [balanced in order])."""
    if balanced_in_order(setup):
        return _least_busy
    return _round_robin if setup.in_order else _capped_round_robin


def _round_robin(ledger: Ledger, cursor: int, slots: int, capacity: int) -> tuple[int | None, int]:
    """torch's rule in order: the next active worker in the cycle, and where the round robin
    stands after it (``cursor``: where it stood). (Among the first ``slots`` workers:
    num_workers="auto" may use fewer than it has.)"""
    return _next_in_cycle(ledger, cursor, slots, limit=None)


def _capped_round_robin(
    ledger: Ledger, cursor: int, slots: int, capacity: int
) -> tuple[int | None, int]:
    """torch's rule with in_order=False: the next active worker in the cycle that holds fewer
    than its share of the prefetch budget."""
    active = sum(ledger.active[:slots])
    return _next_in_cycle(ledger, cursor, slots, limit=capacity // active if active else 0)


def _next_in_cycle(
    ledger: Ledger, cursor: int, slots: int, *, limit: int | None
) -> tuple[int | None, int]:
    """The first active worker from ``cursor`` on (holding fewer than ``limit`` tasks, if
    given), and the cursor after it; none, and the cursor after a whole turn."""
    active, held = ledger.active, ledger.per_worker
    for _ in range(slots):
        worker_id = cursor if cursor < slots else 0
        cursor = (worker_id + 1) % slots
        if active[worker_id] and (limit is None or held[worker_id] < limit):
            return worker_id, cursor
    return None, cursor


def balanced_in_order(setup: PassSetup) -> bool:
    """NOTE [balanced in order]: in order, torch gives task ``k`` to worker ``k % n`` (round
    robin), whatever each worker still holds. That keeps per-worker randomness as torch's, but
    it also fixes each worker's share of the pass: with uneven sample times the pass lasts as
    long as its slowest share, however far the others run ahead (run-ahead cannot help past
    that; lognormal times of spread 1 over 8 workers lose about a sixth of the floor that way).

    With ``seed_per_sample``, what a sample's augmentation draws from ``random``, numpy and
    torch is seeded from the sample's own index, not from the worker, so which worker fetches
    a batch changes nothing in it. There, in order, each task goes to the active worker with
    the fewest unanswered tasks (``_least_busy``), as with ``in_order=False``, while batches
    are still yielded in the sampler's order. Not for an IterableDataset: each worker has its
    own stream, and which stream a batch comes from is what it holds."""
    progress = setup.progress
    return (
        setup.in_order
        and setup.traits.runs_ahead
        and progress.sample_seed is not None
        and not progress.iterable
    )


def _least_busy(ledger: Ledger, cursor: int, slots: int, capacity: int) -> tuple[int | None, int]:
    """NOTE [balanced in order]: the active worker (of the first ``slots``) with the fewest
    unanswered tasks, the first such from ``cursor`` on, and the cursor after it."""
    unanswered, active = ledger.unanswered, ledger.active
    best, fewest = None, math.inf
    for step in range(slots):
        worker_id = (cursor + step) % slots
        if active[worker_id] and unanswered[worker_id] < fewest:
            best, fewest = worker_id, unanswered[worker_id]
            if not fewest:
                break
    if best is None:
        return None, cursor
    return best, (best + 1) % slots


def _run_ahead(setup: PassSetup, ledger: Ledger, stats: PassStats, capacity: int) -> RunAhead:
    """The pass's run-ahead (``_engine/runahead.py``): in order, with workers that run ahead
    of the consumer; its first survey after the pass's first window of batches.

    NOTE [run-ahead]: in order, the window (prefetch_factor * num_workers tasks between
    "sent" and "yielded") is torch's, and while the head of the line arrives in time it is
    all there is. When the head is late, the answers behind it fill the window and the other
    workers would sit idle; instead each worker's own queue is kept at its depth
    (prefetch_factor unanswered tasks, torch's per-worker meaning of the window), up to
    ``RunAhead.limit`` batches beyond the window. The tasks still go round robin (the worker
    holding the late head gets its share, queued behind it), so every batch is fetched by the
    worker torch would give it; they are delivered in order, and a checkpoint records only
    what was yielded, so the tasks ahead are fetched again on resume."""
    tuning = setup.tuning
    ahead = RunAhead(
        ledger,
        stats,
        capacity,
        enabled=setup.in_order and setup.traits.runs_ahead,
        max_memory=tuning.controller.max_memory if tuning is not None else None,
        first_survey=len(setup.progress.yielded) + capacity,
        round_robin=not balanced_in_order(setup),
    )
    ahead.resize(capacity, setup.num_workers)
    return ahead


@types.coroutine
def _checkpoint() -> Generator[Any, Any, None]:
    """Yield to the running loop once, raising if the task has been cancelled. Under asyncio
    (and uvloop) that is what ``sleep(0)`` does (and anyio's own checkpoint there), without
    anyio's backend lookup (about 4 us a call); under trio, anyio's checkpoint, which is
    trio's.

    A generator-based coroutine, not ``async def``: under asyncio its bare ``yield`` makes the
    task go round the loop once (a cancellation is thrown in here when it resumes), with no
    coroutine frame around it; this runs for every batch of ``async for``.

    Which loop runs is asked only where trio has been imported: in Python 3.11 every
    ``asyncio.get_running_loop()`` makes a ``getpid`` system call (its check for a forked
    child)."""
    if "trio" in sys.modules and running_asyncio_loop() is None:
        import anyio.lowlevel

        yield from anyio.lowlevel.checkpoint().__await__()  # trio
    else:
        yield
