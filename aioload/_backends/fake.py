"""A scripted backend, shipped with the package: the engine's tests drive the orchestrator over
it with no process, socket or clock of a real worker, and a new backend can be checked against
the same contract.

It answers each task after a scripted delay, can lose a worker when it is handed a given task
(taking every task it held down with it), can answer a task with a worker error, can end a
worker's IterableDataset stream from a given task on, and can hang on a task (``HANG``). It
records what the engine asked of it (``submits``, ``restarts``, ``abandoned``, ``awaited``) so
that a test can check the engine's side of the contract too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, ClassVar

from .._wire.messages import Answer, Batch, Event, Failed, PassPlan, StreamEnded, WorkerLost
from ..errors import WorkerDiedError
from .base import OUT_OF_PROCESS, BackendTraits, WorkerBackend

__all__ = ["HANG", "FakeBackend"]

# A delay that never ends: the task is never answered.
HANG = math.inf


class FakeBackend:
    """A scripted ``WorkerBackend``. ``delay(task_id) -> seconds`` (HANG: never answers);
    ``lose_on``: task ids whose first delivery kills the worker that gets it;
    ``fail``: task ids answered with a worker error; ``ends``: worker -> task id from which
    that worker's IterableDataset stream answers StreamEnded."""

    # Answers come from elsewhere, as a pool's would: the engine sends ahead.
    TRAITS: ClassVar[BackendTraits] = OUT_OF_PROCESS

    def __init__(
        self,
        num_workers: int,
        delay: Callable[[int], float] = lambda task_id: 0.0,
        lose_on: set[int] | None = None,
        fail: set[int] | None = None,
        ends: dict[int, int] | None = None,
    ) -> None:
        self.num_workers = num_workers
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

    # -- the seam --------------------------------------------------------------------------

    def start_pass(self, plans: list[PassPlan]) -> None:
        assert len(plans) == self.num_workers
        self.started_passes += 1

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        assert not self.closed
        self.submits.append((worker_id, task_id))
        if task_id in self.lose_on:
            self.lose_on.discard(task_id)
            self._lose(worker_id)
            return
        if worker_id in self.lost:
            return  # a dead worker answers nothing
        self.pending.append((time.monotonic() + self.delay(task_id), worker_id, task_id, indices))
        self.max_outstanding = max(self.max_outstanding, len(self.pending))

    def _lose(self, worker_id: int) -> None:
        self.lost.append(worker_id)
        self.pending = [p for p in self.pending if p[1] != worker_id]

    def poll(self) -> list[Event]:
        now = time.monotonic()
        events: list[Event] = []
        ready = sorted(p for p in self.pending if p[0] <= now)
        self.pending = [p for p in self.pending if p[0] > now]
        for _, worker_id, task_id, indices in ready:
            self.answered.append(task_id)
            if task_id in self.fail:
                events.append(Answer(worker_id, task_id, Failed(_worker_error(task_id))))
            elif worker_id in self.ends and task_id >= self.ends[worker_id]:
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

    def _wait_s(self, deadline: float) -> float:
        soonest = min((p[0] for p in self.pending), default=math.inf)
        until = min(soonest, deadline, time.monotonic() + 1.0)
        return max(0.0, until - time.monotonic())

    async def wait(
        self, deadline: float, wake_fd: int | None = None, awaited: int | None = None
    ) -> None:
        self.awaited.append((awaited, {p[2]: p[1] for p in self.pending}))
        import anyio  # under asyncio and trio alike

        await anyio.sleep(self._wait_s(deadline))

    def wait_blocking(
        self, deadline: float, wake_fd: int | None = None, awaited: int | None = None
    ) -> bool:
        # What the engine said it waits for, with what was in flight then (task id -> worker).
        self.awaited.append((awaited, {p[2]: p[1] for p in self.pending}))
        time.sleep(self._wait_s(deadline))
        return True

    def restart(self, worker_id: int, plan: PassPlan | None = None) -> None:
        self.restarts.append(worker_id)

    def abandon(self, worker_id: int) -> None:
        self.abandoned.append(worker_id)
        self._lose(worker_id)

    def retire(self) -> None:
        self.retired = True

    def describe(self, worker_id: int) -> str:
        return f"fake {worker_id}"

    def close(self) -> None:
        self.closed = True
        self.retired = True


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
