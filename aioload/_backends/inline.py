"""``num_workers=0``: batches are loaded in the calling process, as torch does.

This is the ``_backends.base.WorkerBackend`` with one worker, the calling process, so every kind of
loading shares one engine. Under ``async for`` the fetch runs in a thread of the
caller's event loop (dataset code never runs on the loop itself); under ``for`` it runs directly
in the calling thread, with no loop at all.

An async dataset is the exception: its coroutines are awaited on the loop itself (the caller's
under ``async for``, with anyio so that trio works too; the private one under ``for``), with up
to ``worker_concurrency`` samples in flight. Cancelling the consumer cancels them.

The fetch itself is a ``_worker.main.WorkerStep``, as in every other backend's workers, made
for the calling process (``place="caller"``: torch's ``num_workers=0``, no worker setup, the
dataset itself, errors raised as they are). This backend only carries tasks to it and its
answers back, and closes what the pass opened.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, ClassVar

# Imported with the module, not lazily: close() reaches the consumer's loop through
# anyio.from_thread, which works only in anyio's worker threads, and _aio.waiting.run_off_loop runs
# aclose()'s close() in one of those exactly when anyio has been imported.
import anyio
import anyio.from_thread

from .._aio import sync_loop as _sync
from .._wire.messages import (
    Answer,
    Batch,
    Event,
    Failure,
    Outcome,
    PassPlan,
    Produced,
    Raised,
    Task,
)
from .._worker.async_fetch import AsyncFetcher
from .._worker.main import StepResult, WorkerStep
from .base import IN_PROCESS, BackendTraits, Place, Waitable, WorkerSpec

__all__ = ["InlineBackend"]


class InlineBackend:
    # Fetches in the calling process, when a batch is asked for; nothing to start.
    TRAITS: ClassVar[BackendTraits] = IN_PROCESS
    num_workers = 1
    # A fresh one per pass: never kept.
    retired = False

    def __init__(self, spec: WorkerSpec, async_for: bool) -> None:
        self.spec = spec
        # Whether the pass is consumed by ``async for``: a plain dataset's fetch then runs in a
        # thread, off the loop.
        self.async_for = async_for
        # The one worker: the dataset and collate_fn themselves, no worker_init_fn.
        config = spec.worker_config(
            0,
            0,
            0,
            payload=(spec.dataset, spec.collate_fn, None),
            shared_memory=False,
        )
        self.step = WorkerStep(config, slabs=None, place="caller")
        self.task: tuple[int, Any] | None = None
        self.answer: Answer | None = None
        self.plan = PassPlan()
        # Whether this pass made its fetcher (which loads the plan's checkpointed state).
        self.fetched = False
        self.is_async = self.step.is_async
        # The dataset's async context (its per-worker setup), entered on the loop that fetches,
        # at the first fetch of the pass, and exited when the pass's source is closed.
        self.context_entered = False
        # The thread running the fetch now, if any (the hang report reads its stack).
        self.fetching: int | None = None

    def start_pass(self, plans: list[PassPlan]) -> None:
        # The fetcher (and an IterableDataset's iterator) is made on the first fetch, in the
        # thread that fetches, as torch makes it lazily too.
        self.plan = plans[0]
        self.fetched = False

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        assert self.task is None, "one task at a time in the calling process"
        self.task = (task_id, indices)

    def poll(self) -> list[Event]:
        if self.answer is None:
            return []
        answer, self.answer = self.answer, None
        return [answer]

    # Nothing to heal in the calling process: no worker can be lost, so none is replaced.
    def restart(self, worker_id: int, plan: PassPlan | None = None) -> None:
        raise AssertionError("the calling process is never restarted")

    def abandon(self, worker_id: int) -> None:
        pass

    def retire(self) -> None:
        pass

    def place(self, worker_id: int) -> Place:
        return Place("the calling process")

    def dump_stack(self, worker_id: int) -> str | None:
        """The stack of the thread running the fetch (the consumer's own under ``for``, a
        thread of the loop's under ``async for``), read from the hang report's watchdog."""
        from .._worker.stacks import format_threads  # (only a hang report needs it)

        fetching = self.fetching
        return format_threads([fetching]) if fetching is not None else None

    def flush(self) -> None:
        pass  # nothing is sent: the fetch runs in the caller

    def waitable(self, awaited: int | None = None) -> Waitable:
        """The answer is the fetch itself, which the caller runs (``work``); with no task, the
        engine's own wake-up alone can end a sleep (its pin stage, handing a batch back)."""
        return Waitable(work=self) if self.task is not None else Waitable()

    async def work(self) -> None:
        """The fetch under ``async for``: a plain dataset in a thread (``async_for``), an async
        one awaited on the loop."""
        assert self.task is not None
        started = time.perf_counter()
        if self.is_async:
            outcome = await self._fetch_async(*self.task)
        elif self.async_for:
            # Not abandoned on cancel: the fetch finishes (one batch at most) before the
            # cancellation goes on, so two fetches never run at once on one dataset.
            outcome = await anyio.to_thread.run_sync(self._fetch, *self.task)
        else:
            outcome = self._fetch(*self.task)
        self._answered(outcome, started)

    def work_blocking(self) -> bool:
        """The fetch under ``for``: a plain dataset right here (the calling thread has nothing
        else to do); an async one needs a loop to run on."""
        assert self.task is not None
        if self.is_async:
            return False
        started = time.perf_counter()
        self._answered(self._fetch(*self.task), started)
        return True

    def _answered(self, result: StepResult, started: float) -> None:
        assert self.task is not None
        task_id = self.task[0]
        self.task = None
        outcome: Outcome
        if isinstance(result, Produced):
            outcome = Batch(result.data)
        elif isinstance(result, Failure):
            outcome = Raised(result.error)  # the exception itself, with its own traceback
        else:
            outcome = result
        # The calling process is the one "worker" here.
        self.answer = Answer(
            0, task_id, outcome, self.step.point_of(result), time.perf_counter() - started
        )

    def _fetch(self, task_id: int, indices: Any) -> StepResult:
        self.fetching = threading.get_ident()
        try:
            if not self.fetched:
                self.fetched = True
                self.step.new_pass(self.plan)
            return self.step.run(Task(task_id, 0, indices))
        finally:
            self.fetching = None

    async def _fetch_async(self, task_id: int, indices: Any) -> StepResult:
        # (The loop's thread: a sample that blocks it shows there.)
        self.fetching = threading.get_ident()
        step = self.step
        try:
            if not self.fetched:
                self.fetched = True
                self.context_entered = await step.enter_async_context()
                if step.iterable:
                    await step.start_async_stream(self.plan)
                else:
                    step.new_async_pass(self.plan)
            return await step.run_async(Task(task_id, 0, indices))
        finally:
            self.fetching = None

    def close(self) -> None:
        fetcher, self.step.fetcher = self.step.fetcher, None
        if not self.fetched and self.plan.dataset_state is not None:
            # A resumed pass that had nothing left to fetch (checkpointed after its last
            # batch): the dataset is still where the checkpoint had it, for the next pass.
            self.fetched = True
            try:
                self.spec.dataset.load_state_dict(self.plan.dataset_state)
            except Exception as exc:
                warnings.warn(
                    f"aioload: loading the checkpointed state of "
                    f"{type(self.spec.dataset).__name__} failed: {exc!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if self.is_async and (self.context_entered or fetcher is not None):
            self._close_async(fetcher)

    def _close_async(self, fetcher: AsyncFetcher | None) -> None:
        """Close the stream and exit the dataset's context on the loop they were used on.

        ``close`` is synchronous. Under ``async for`` it runs in a worker thread of the
        consumer's loop (``aclose()``, also at the end of a pass), from which anyio can run the
        cleanup back on that loop, under any backend. Under ``for`` the private loop is idle
        between steps, so the cleanup runs on it. Anywhere else (a pass abandoned under
        ``async for`` and collected while its loop runs) nothing can await, and we say so.
        """
        dataset = self.spec.dataset
        entered, self.context_entered = self.context_entered, False

        failures: list[Exception] = []

        async def cleanup() -> None:
            # Errors are collected, not raised: close() also runs from finalizers, and a
            # RuntimeError from here must not read as "not in an anyio thread" below.
            try:
                if fetcher is not None:
                    await fetcher.aclose()
            except Exception as exc:
                failures.append(exc)
            try:
                if entered:
                    await dataset.__aexit__(None, None, None)
            except Exception as exc:
                failures.append(exc)

        done = False
        try:
            anyio.from_thread.run(cleanup)
            done = True
        except RuntimeError:
            pass  # not in one of anyio's worker threads
        if not done and not self.async_for:
            try:
                _sync.run(cleanup())
                done = True
            except Exception as exc:
                failures.append(exc)
        for failure in failures:
            warnings.warn(
                f"aioload: closing {type(dataset).__name__} failed: {failure!r}",
                ResourceWarning,
                stacklevel=2,
            )
        if not done and entered:
            warnings.warn(
                f"aioload: the async context of {type(dataset).__name__} was not exited, "
                "because the pass was abandoned without being closed; with num_workers=0 "
                "under `async for`, close the iterator (`await it.aclose()`, or "
                "`async with aiter(loader) as it`) to exit it",
                ResourceWarning,
                stacklevel=2,
            )
