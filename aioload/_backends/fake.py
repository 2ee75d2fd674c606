"""A scripted backend, shipped with the package: the engine's tests drive the orchestrator over
it with no process, socket or clock of a real worker, and a new backend can be checked against
the same contract.

It answers each task after a scripted delay, can lose a worker when it is handed a given task
(taking every task it held down with it), can answer a task with a worker error, can end a
worker's IterableDataset stream from a given task on, and can hang on a task (``HANG``). Its
delays are counted on the machine's clock, or on a ``VirtualClock`` that jumps to the next
scripted answer whenever the engine would wait for one (trio's ``MockClock`` with an autojump
threshold of 0), so that an ordering script takes no time at all. It records what the engine
asked of it (``submits``, ``restarts``, ``abandoned``, ``awaited``) so that a test can check
the engine's side of the contract too.

Given the loader's ``WorkerSpec`` (``FakeWorkers``, passed as ``DataLoader(workers=...)``), it
also runs the loader itself, forking nothing: each worker slot is a ``_worker.main.WorkerStep``
in the calling process, set up as a worker process would be (its own copy of the dataset, its
seeds, ``get_worker_info()``, ``worker_init_fn``), with the process-wide state a worker has to
itself (the RNGs, ``get_worker_info()``) swapped in around each of its steps. A slot runs a task
when it is handed it, in the order it is handed them, as a worker does, and its answer is
delivered after the scripted delay; a lost, failed or ended task runs nothing. Batches, seeds
and checkpoints are then a worker pool's, and the scripts still apply.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from .._wire.messages import (
    Answer,
    Batch,
    Event,
    Failed,
    PassPlan,
    Produced,
    StreamEnded,
    Task,
    WorkerLost,
    failed_in_setup,
    outcome_of,
)
from ..errors import WorkerDiedError
from .base import OUT_OF_PROCESS, BackendTraits, Place, Waitable, WorkerBackend, WorkerSpec

if TYPE_CHECKING:
    from .._worker.main import WorkerConfig, WorkerStep

__all__ = ["HANG", "FakeBackend", "FakeWorkers", "VirtualClock"]

# A delay that never ends: the task is never answered.
HANG = math.inf


class VirtualClock:
    """The fake's own time, for its scripted delays: it stands still while the engine works,
    and jumps to the next scripted answer when the engine would wait. Only the fake reads it;
    the engine's ``timeout`` is counted on the machine's clock, so a task that hangs (``HANG``)
    is still waited for in real time."""

    def __init__(self) -> None:
        self.now = 0.0

    def jump_to(self, when: float) -> None:
        self.now = max(self.now, when)


class FakeBackend:
    """A scripted ``WorkerBackend``. ``delay(task_id) -> seconds`` (HANG: never answers);
    ``lose_on``: task ids whose first delivery kills the worker that gets it;
    ``fail``: task ids answered with a worker error; ``ends``: worker -> task id from which
    that worker's IterableDataset stream answers StreamEnded. ``serial``: a worker works on
    one task at a time, in the order it was handed them, as a real one does (a task's delay
    then starts when the worker's previous task is answered, not when it is sent). Set
    ``clock`` to a ``VirtualClock`` to count the delays on it instead of on the machine's clock.

    With ``spec`` (the loader's), each slot runs the loader's dataset and collate through its
    own ``WorkerStep``, seeded from ``base_seed`` as a pool's worker is; without, a task is
    answered with its indices (``Batch(list(indices))``)."""

    # Answers come from elsewhere, as a pool's would: the engine sends ahead.
    TRAITS: ClassVar[BackendTraits] = OUT_OF_PROCESS

    def __init__(
        self,
        num_workers: int,
        delay: Callable[[int], float] = lambda task_id: 0.0,
        lose_on: set[int] | None = None,
        fail: set[int] | None = None,
        ends: dict[int, int] | None = None,
        *,
        spec: WorkerSpec | None = None,
        base_seed: int = 0,
        serial: bool = False,
    ) -> None:
        self.num_workers = num_workers
        self.clock: VirtualClock | None = None
        # serial: when each worker's last task is answered (and it is free for the next).
        self.free_at: list[float] | None = [0.0] * num_workers if serial else None
        self.retired = False
        self.closed = False
        self.delay = delay
        self.lose_on = set(lose_on or ())
        self.fail = set(fail or ())
        self.ends = dict(ends or {})
        # (ready at, worker, task id, indices), by worker incarnation.
        self.pending: list[tuple[float, int, int, Any]] = []
        self.lost: list[int] = []
        self.submits: list[tuple[int, int]] = []
        self.answered: list[int] = []
        self.ended: list[int] = []
        self.restarts: list[int] = []
        self.abandoned: list[int] = []
        self.started_passes = 0
        self.max_outstanding = 0
        self.awaited: list[tuple[int | None, dict[int, int]]] = []
        # How many times the engine sent what was held back (``flush``), before its waits.
        self.flushes = 0
        # What dump_stack answers for each worker (the hang report), and whom it was asked for.
        self.stacks: dict[int, str] = {}
        self.dumped: list[int] = []
        # Running the loader's own dataset (``spec``): one slot per worker, and the answers
        # its slots made, by (worker, task id), until they are due.
        self.spec = spec
        self.base_seed = base_seed
        self.generation = 0
        self.plans: list[PassPlan] = [PassPlan()] * num_workers
        self.results: dict[tuple[int, int], Answer] = {}
        self.slots: list[_Slot] = []
        if spec is not None:
            self.slots = [self._start_slot(w) for w in range(num_workers)]
            if self.slots and self.slots[0].step.is_async:
                raise NotImplementedError("the fake backend runs sync datasets only")

    # -- the seam --------------------------------------------------------------------------

    def start_pass(self, plans: list[PassPlan]) -> None:
        assert len(plans) == self.num_workers
        if self.started_passes:
            self.generation += 1
        self.started_passes += 1
        # Answers to older passes' tasks are dropped.
        self.pending.clear()
        self.results.clear()
        self.plans = list(plans)
        for worker_id, slot in enumerate(self.slots):
            slot.new_pass(self.generation, plans[worker_id])

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        assert not self.closed
        self.submits.append((worker_id, task_id))
        if task_id in self.lose_on:
            self.lose_on.discard(task_id)
            self._lose(worker_id)
            return
        if worker_id in self.lost:
            return  # a dead worker answers nothing
        if self.slots and task_id not in self.fail and not self._ended(worker_id, task_id):
            self.results[(worker_id, task_id)] = self.slots[worker_id].run(
                Task(task_id, self.generation, indices), self
            )
        ready = self.now() + self.delay(task_id)
        if self.free_at is not None:
            # After the worker's previous task: its delay starts when that one is answered.
            ready += max(0.0, self.free_at[worker_id] - self.now())
            self.free_at[worker_id] = ready
        self.pending.append((ready, worker_id, task_id, indices))
        self.max_outstanding = max(self.max_outstanding, len(self.pending))

    def now(self) -> float:
        """The time the scripted delays are counted on."""
        return time.monotonic() if self.clock is None else self.clock.now

    def _ended(self, worker_id: int, task_id: int) -> bool:
        return worker_id in self.ends and task_id >= self.ends[worker_id]

    def _lose(self, worker_id: int) -> None:
        self.lost.append(worker_id)
        self.pending = [p for p in self.pending if p[1] != worker_id]
        for key in [key for key in self.results if key[0] == worker_id]:
            del self.results[key]

    def poll(self) -> list[Event]:
        now = self.now()
        events: list[Event] = []
        ready = sorted(p for p in self.pending if p[0] <= now)
        self.pending = [p for p in self.pending if p[0] > now]
        for _, worker_id, task_id, indices in ready:
            self.answered.append(task_id)
            result = self.results.pop((worker_id, task_id), None)
            if result is not None:
                events.append(result)
            elif task_id in self.fail:
                events.append(Answer(worker_id, task_id, Failed(_worker_error(task_id))))
            elif self._ended(worker_id, task_id):
                self.ended.append(task_id)
                events.append(Answer(worker_id, task_id, StreamEnded()))
            else:
                events.append(Answer(worker_id, task_id, Batch(list(indices)), busy_s=0.001))
        for worker_id in self.lost:
            message = f"DataLoader worker (fake {worker_id}) is killed by signal: Killed."
            events.append(
                WorkerLost(
                    worker_id, WorkerDiedError(message, worker_id=worker_id, pid=None, exitcode=-9)
                )
            )
        self.lost = [
            w
            for w in self.lost
            if w not in {e.worker_id for e in events if isinstance(e, WorkerLost)}
        ]
        return events

    def flush(self) -> None:
        self.flushes += 1

    def waitable(self, awaited: int | None = None) -> Waitable:
        """Nothing to watch: the engine sleeps until the soonest scripted answer is due (at
        most a second, as a real backend's health-check period), as it would on a pool. On a
        virtual clock, time jumps to that answer instead, and the engine does not sleep."""
        # What the engine said it waits for, with what was in flight then (task id -> worker).
        self.awaited.append((awaited, {p[2]: p[1] for p in self.pending}))
        soonest = min((p[0] for p in self.pending), default=math.inf)
        if self.clock is not None and soonest != math.inf:
            self.clock.jump_to(soonest)
        return Waitable(budget=max(0.0, min(soonest - self.now(), 1.0)))

    def restart(self, worker_id: int, plan: PassPlan | None = None) -> None:
        self.restarts.append(worker_id)
        if plan is not None:
            self.plans[worker_id] = plan
        if self.slots:
            # A fresh worker in the slot, as a pool starts one: set up anew, on the plan.
            self.slots[worker_id] = slot = self._start_slot(worker_id)
            slot.new_pass(self.generation, self.plans[worker_id])

    def abandon(self, worker_id: int) -> None:
        self.abandoned.append(worker_id)
        self._lose(worker_id)

    def retire(self) -> None:
        self.retired = True

    def place(self, worker_id: int) -> Place:
        return Place(f"fake {worker_id}")

    def dump_stack(self, worker_id: int) -> str | None:
        """The scripted stack of ``worker_id`` (``stacks``), if any; recorded in ``dumped``."""
        self.dumped.append(worker_id)
        return self.stacks.get(worker_id)

    def close(self) -> None:
        self.closed = True
        self.retired = True

    def _start_slot(self, worker_id: int) -> _Slot:
        spec = self.spec
        assert spec is not None
        # The worker's own copy of what it runs, as a forked or spawned worker has.
        payload = copy.deepcopy((spec.dataset, spec.collate_fn, spec.worker_init_fn))
        config = spec.worker_config(
            worker_id, self.base_seed, self.generation, payload=payload, shared_memory=False
        )
        return _Slot(config)


class _Slot:
    """One worker of the fake: its ``WorkerStep``, and the process-wide state a worker process
    has to itself (the global RNGs, ``get_worker_info()``), swapped in around its every step
    and the caller's put back after."""

    def __init__(self, config: WorkerConfig) -> None:
        from .._worker.main import WorkerStep

        self.worker_id: int = config.worker_id
        self.own: _Globals | None = None
        with self.swapped_in():
            self.step: WorkerStep = WorkerStep(config, slabs=None, place="beside")

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        caller = _Globals()
        if self.own is not None:
            self.own.install()
        try:
            yield
        finally:
            self.own = _Globals()
            caller.install()

    def new_pass(self, generation: int, plan: PassPlan) -> None:
        step = self.step
        with self.swapped_in():
            step.generation = max(step.generation, generation)
            if step.init_error is None:
                step.new_pass(plan)

    def run(self, task: Task, backend: FakeBackend) -> Answer:
        """Run ``task`` now, as the worker would; its answer, as the pool would decode it."""
        step = self.step
        started = time.perf_counter()
        with self.swapped_in():
            result = step.run(task)
        stream = step.point_of(result)
        # (The fetcher keeps a batch's samples until it is sent: it is, now.)
        forget = getattr(step.fetcher, "forget", None)
        if forget is not None:
            forget()
        answer = Answer(
            self.worker_id,
            task.task_id,
            outcome_of(result, _produced_data),
            stream,
            time.perf_counter() - started,
        )
        if failed_in_setup(answer):
            backend.retired = True  # as a pool is
        return answer


def _conforms(backend: FakeBackend) -> WorkerBackend:
    # Type-checked: the fake honours the seam's every member, as the real backends must.
    return backend


def _worker_error(task_id: int) -> Any:
    # Imported here: the worker-side wrapper is only needed when a test scripts a failure.
    from .._worker.main import RemoteError

    try:
        raise KeyError(f"bad sample in task {task_id}")
    except KeyError:
        return RemoteError(0)


class _Globals:
    """The global RNG states and ``get_worker_info()`` of this process, now."""

    def __init__(self) -> None:
        from .._worker.fetch import RngStates
        from .._worker.info import get_worker_info

        self.rng = RngStates()
        self.info = get_worker_info()

    def install(self) -> None:
        from .._worker.info import _set_worker_info

        self.rng.install()
        _set_worker_info(self.info)


class FakeWorkers:
    """``DataLoader(..., num_workers=n, workers=FakeWorkers(...))``: the loader's workers as
    the slots of a ``FakeBackend`` that runs the loader's own dataset in the calling process,
    with no process forked, the scripts (``delay``, ``lose_on``, ``fail``, ``ends``, as
    ``FakeBackend`` takes them, and its ``clock``) applied to each pass's backend. The backends
    made, one per pass (or one for a persistent loader), are in ``made``."""

    def __init__(
        self,
        delay: Callable[[int], float] = lambda task_id: 0.0,
        lose_on: set[int] | None = None,
        fail: set[int] | None = None,
        ends: dict[int, int] | None = None,
        clock: VirtualClock | None = None,
        *,
        serial: bool = False,
    ) -> None:
        self.delay = delay
        self.lose_on = set(lose_on or ())
        self.fail = set(fail or ())
        self.ends = dict(ends or {})
        self.clock = clock
        self.serial = serial
        self.made: list[FakeBackend] = []

    def make_backend(self, spec: WorkerSpec, base_seed: int) -> WorkerBackend:
        backend = FakeBackend(
            spec.num_workers,
            self.delay,
            self.lose_on,
            self.fail,
            self.ends,
            spec=spec,
            base_seed=base_seed,
            serial=self.serial,
        )
        backend.clock = self.clock
        self.made.append(backend)
        return backend


def _produced_data(result: Produced) -> Any:
    # A step in the calling process hands its batch over as it is: no slab, no pickle.
    return result.data
