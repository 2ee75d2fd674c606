"""The engine alone: the orchestrator over the shipped fake backend (``_backends.fake``), no
processes.

The fake answers each task after a scripted delay, can lose a worker when it is handed a given
task (taking every task it held down with it), and can hang on a task. These tests cover the
reorder buffer, ``in_order=False``, healing (a lost worker's tasks are sent again, exactly once)
and the timeout directly; the process-backed suites cover the same paths end to end.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from aioload import DataLoaderTimeoutError, WorkerDiedError
from aioload._backends.base import OUT_OF_PROCESS, Place, Waitable
from aioload._backends.fake import HANG, FakeBackend, VirtualClock
from aioload._engine.orchestrator import END, NEEDS_LOOP, Orchestrator, PassSetup
from aioload._engine.resume import PassProgress, numbered_batches
from aioload._wire.messages import Event, PassPlan
from aioload._worker.main import RemoteError


def _remote_error(task_id: int) -> RemoteError:
    try:
        raise KeyError(f"bad sample in task {task_id}")
    except KeyError:
        return RemoteError(0)


def _engine(
    backend: FakeBackend,
    batches: list[list[int]],
    *,
    in_order: bool = True,
    timeout: float = 0,
    restarts: int = 0,
    prefetch: int = 2,
    iterable: bool = False,
) -> Orchestrator:
    progress = PassProgress(
        epoch=0, rng={}, sample_seed=None, iterable=iterable, num_streams=backend.num_workers
    )
    setup = PassSetup(
        batches=numbered_batches(iter(batches), None, 0),
        num_workers=backend.num_workers,
        prefetch=prefetch,
        in_order=in_order,
        timeout=timeout,
        max_worker_restarts=restarts,
        progress=progress,
        plans=[PassPlan()] * backend.num_workers,
        traits=OUT_OF_PROCESS,
    )
    return Orchestrator(lambda: backend, setup, owns_backend=True)


# Which door the tests drain an engine through: ``next`` (the async front end) or
# ``next_blocking`` (the sync front end, which waits with no event loop). Every test runs both.
_front = "async"


@pytest.fixture(autouse=True, params=["async", "blocking"])
def front(request: pytest.FixtureRequest) -> Iterator[str]:
    global _front
    _front = request.param
    yield request.param
    _front = "async"


def _next(engine: Orchestrator) -> Any:
    """One batch through the door under test."""
    if _front == "blocking":
        return engine.next_blocking()
    return anyio.run(engine.next)


def _drain(engine: Orchestrator) -> list[Any]:
    if _front == "blocking":
        got = []
        while (batch := engine.next_blocking()) is not END:
            assert batch is not NEEDS_LOOP, "a fake backend can always wait without a loop"
            got.append(batch)
        return got

    async def consume() -> list[Any]:
        got = []
        while (batch := await engine.next()) is not END:
            got.append(batch)
        return got

    return anyio.run(consume)


BATCHES = [[2 * i, 2 * i + 1] for i in range(12)]


def test_reorder_restores_sampler_order_whatever_the_answer_order() -> None:
    # Later tasks answer first: the reorder buffer must hold them until their turn. On the
    # virtual clock the answers come in exactly the scripted order: each window of six
    # (prefetch 2 x 3 workers) answers last task first.
    backend = FakeBackend(3, delay=lambda t: 0.002 * (12 - t))
    backend.clock = VirtualClock()
    engine = _engine(backend, BATCHES)
    got = _drain(engine)
    assert backend.answered == [5, 4, 3, 2, 1, 0, 11, 10, 9, 8, 7, 6]
    assert got == BATCHES
    engine.close()  # as the front ends do at END
    assert backend.closed, "a pass that owns its backend closes it"


def test_each_wait_names_the_worker_whose_batch_is_next(front: str) -> None:
    # In order, each wait of either front end names the worker holding the next batch (the
    # process pool then sleeps on that worker's answers alone); out of order, no worker.
    # (On the virtual clock: every answer is waited for, whatever the machine's load.)
    backend = FakeBackend(3, delay=lambda t: 0.002 * (12 - t))  # later tasks answer first
    backend.clock = VirtualClock()
    assert _drain(_engine(backend, BATCHES)) == BATCHES
    assert len(backend.awaited) >= 3
    # (Once the first window is handed over, workers may run ahead of a late head, and then
    # any answer ends a wait: RunAhead.wakes_on_any, tested in test_run_ahead.)
    for awaited, unanswered in backend.awaited[:3]:
        assert awaited == unanswered[min(unanswered)]
    for awaited, unanswered in backend.awaited:
        assert awaited is None or awaited == unanswered[min(unanswered)]
    backend = FakeBackend(3, delay=lambda t: 0.002 * (12 - t))
    backend.clock = VirtualClock()
    got = _drain(_engine(backend, BATCHES, in_order=False))
    assert sorted(got) == BATCHES
    assert backend.awaited and all(awaited is None for awaited, _ in backend.awaited)


def test_prefetch_bounds_what_is_outstanding() -> None:
    backend = FakeBackend(2, delay=lambda t: 0.001)
    _drain(_engine(backend, BATCHES, prefetch=2))
    assert 0 < backend.max_outstanding <= 2 * 2
    # torch's round robin: task t goes to worker t % 2.
    assert all(worker == task % 2 for worker, task in backend.submits)


class _AnswersTaskZeroLast(FakeBackend):
    """Task 0 hangs until every other task has been answered: an order of answers, scripted,
    not a race between a delay and the clock."""

    def __init__(self, num_workers: int) -> None:
        super().__init__(num_workers, delay=lambda t: HANG if t == 0 else 0.0)

    def poll(self) -> list[Event]:
        events = super().poll()
        if sorted(self.answered) == list(range(1, len(BATCHES))):
            self.pending = [(-math.inf if p[2] == 0 else p[0], *p[1:]) for p in self.pending]
        return events


def test_in_order_false_yields_as_answers_arrive() -> None:
    # Task 0 answers last: with in_order=False every other batch overtakes it.
    backend = _AnswersTaskZeroLast(2)
    got = _drain(_engine(backend, BATCHES, in_order=False))
    assert sorted(map(tuple, got)) == sorted(map(tuple, BATCHES))
    assert got[-1] == BATCHES[0]


def test_a_lost_worker_is_replaced_and_its_tasks_sent_again_exactly_once() -> None:
    # Worker 1 dies when handed task 5, taking task 3 (sent before, not yet answered) with it.
    backend = FakeBackend(2, delay=lambda t: 0.01, lose_on={5})
    engine = _engine(backend, BATCHES, restarts=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _drain(engine)
    assert got == BATCHES, "every batch exactly once, in order"
    assert backend.restarts == [1]
    assert sorted(backend.answered) == list(range(12)), "no task answered twice"
    resent = [task for worker, task in backend.submits if worker == 1]
    assert resent.count(5) == 2  # the first copy died with the worker
    assert engine.stats.workers[1].restarts == 1
    assert engine.stats.snapshot().workers[1].where == "fake 1"
    assert any("replaced it with a new worker 1" in str(w.message) for w in caught)


class _SlowReplacement(FakeBackend):
    """A replacement that starts slowly, as a Ray actor does: until the engine has waited
    once since the restart, its place is provisional (not started)."""

    def __init__(self) -> None:
        super().__init__(2, delay=lambda t: 0.01, lose_on={5})
        self.fresh: int | None = None
        self.waits_since_restart = 0

    def restart(self, worker_id: int, plan: PassPlan | None = None) -> None:
        super().restart(worker_id, plan)
        self.fresh, self.waits_since_restart = worker_id, 0

    def waitable(self, awaited: int | None = None) -> Waitable:
        self.waits_since_restart += 1
        return super().waitable(awaited)

    def place(self, worker_id: int) -> Place:
        if worker_id != self.fresh:
            return Place(f"fake {worker_id}")
        if self.waits_since_restart == 0:
            return Place(f"fake {worker_id}, starting (node not known yet)", started=False)
        return Place(f"fake {worker_id}, replaced, on its node")


def test_a_replacement_not_started_yet_is_named_again_once_it_has() -> None:
    # Worker 1 dies on task 5; its replacement has only a provisional place at first. The
    # engine must ask again after its waits, as it does for workers starting with the pass.
    backend = _SlowReplacement()
    engine = _engine(backend, BATCHES, restarts=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _drain(engine) == BATCHES
    assert backend.restarts == [1]
    assert engine.stats.snapshot().workers[1].where == "fake 1, replaced, on its node"


def test_a_lost_worker_without_restarts_ends_the_pass() -> None:
    backend = FakeBackend(2, lose_on={3})
    engine = _engine(backend, BATCHES)
    with pytest.raises(WorkerDiedError, match=r"fake 1"):
        _drain(engine)
    assert backend.closed and backend.restarts == []
    with pytest.raises(WorkerDiedError):
        _drain(engine)  # the pass stays failed


def test_timeout_names_the_worker_and_indices_and_retires_the_backend() -> None:
    backend = FakeBackend(2, delay=lambda t: HANG if t == 4 else 0.0)
    engine = _engine(backend, BATCHES, timeout=0.2)
    got: list[Any] = []
    started = time.monotonic()
    with pytest.raises(DataLoaderTimeoutError) as info:
        while True:
            got.append(_next(engine))
    assert time.monotonic() - started >= 0.2
    assert got == BATCHES[:4]
    assert str(info.value) == (
        "DataLoader timed out after 0.2 seconds (waiting for batch 4 from DataLoader worker 0, "
        "fake 0, holding indices [8, 9])"
    )
    assert backend.retired and backend.abandoned == []


def test_timeout_with_restarts_abandons_the_hung_worker_and_goes_on() -> None:
    hung = {4}

    def delay(task_id: int) -> float:
        if task_id in hung:
            hung.discard(task_id)  # hangs once; the resent copy answers
            return HANG
        return 0.0

    backend = FakeBackend(2, delay=delay)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = _drain(_engine(backend, BATCHES, timeout=0.2, restarts=1))
    assert got == BATCHES
    assert backend.abandoned == [0] and backend.restarts == [0]


def test_a_worker_error_reaches_the_consumer_in_place_and_the_pass_goes_on() -> None:
    backend = FakeBackend(2, fail={2})
    engine = _engine(backend, BATCHES)

    got: list[Any] = []
    while True:
        try:
            batch = _next(engine)
        except KeyError as exc:
            got.append(("error", "bad sample in task 2" in str(exc)))
            continue
        if batch is END:
            break
        got.append(batch)
    assert got == [*BATCHES[:2], ("error", True), *BATCHES[3:]]
    assert engine.progress.yielded.prefix == 12, "the failed batch counts as delivered"


def test_a_stream_that_ends_stops_its_worker_only() -> None:
    # IterableDataset: worker 0's stream runs dry from task 4 on, worker 1's never does.
    backend = FakeBackend(2, ends={0: 4})
    engine = _engine(backend, BATCHES, iterable=True)
    got = _drain(engine)
    # Tasks sent to worker 0 before its first "end" arrived end too; the rest go to worker 1.
    assert backend.ended and min(backend.ended) == 4
    assert all(task % 2 == 0 for task in backend.ended)
    assert got == [b for t, b in enumerate(BATCHES) if t not in backend.ended]
    assert engine.progress.streams[0].ended and not engine.progress.streams[1].ended


def test_closing_mid_pass_closes_the_backend_once() -> None:
    backend = FakeBackend(2, delay=lambda t: 0.0)
    engine = _engine(backend, BATCHES)

    assert [_next(engine), _next(engine)] == BATCHES[:2]
    engine.close()
    engine.close()
    assert backend.closed
    assert _next(engine) is END


class _CountingBackend(FakeBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.polls = 0

    def poll(self) -> list[Event]:
        self.polls += 1
        return super().poll()


def test_a_next_that_waits_polls_once_after_the_wait() -> None:
    """A data-bound consumer waits for nearly every batch. The look before the wait takes in
    nothing new (a waiting answer ends the wait at once anyway): one poll per batch, after
    the wait, not one before it that finds nothing and one after."""
    backend = _CountingBackend(2, delay=lambda task_id: 0.02)
    engine = _engine(backend, [[i] for i in range(6)])
    got = _drain(engine)
    assert got == [[i] for i in range(6)]
    assert backend.polls <= 6 + 2, backend.polls
