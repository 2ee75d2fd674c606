"""``num_workers=0``: batches are loaded in the calling process, as torch does.

This is a stand-in for the worker pool with the interface the orchestrator uses, so both
kinds of loading share one engine. Under ``async for`` the fetch runs in a thread of the
caller's event loop (dataset code never runs on the loop itself); under ``for`` it runs directly
on the private loop, which has nothing else to do.

An async dataset is the exception: its coroutines are awaited on the loop itself (the caller's
under ``async for``, with anyio so that trio works too; the private one under ``for``), with up
to ``worker_concurrency`` samples in flight. Cancelling the consumer cancels them.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Any

import anyio
import anyio.from_thread

from . import _sync
from ._async_fetch import AsyncFetcher, StreamEnd, has_async_context, is_async_dataset
from ._fetch import Fetcher, PassPlan
from ._workers import Outcome, WorkerSpec
from .stats import PassStats

__all__ = ["InlineSource"]


class InlineSource:
    num_workers = 1
    broken: BaseException | None = None
    stale = False
    stats: PassStats | None = None

    def __init__(self, spec: WorkerSpec, offload: bool) -> None:
        self.spec = spec
        self.offload = offload
        self.fetcher: Any = None
        self.task: tuple[int, Any] | None = None
        self.result: tuple[int, int, Outcome] | None = None
        self.generation = 0
        self.watched: int | None = None
        self.plan = PassPlan()
        self.stream_states: dict[int, tuple[int, Any, bool]] = {}
        self.is_async = is_async_dataset(spec.dataset, spec.dataset_kind)
        # The dataset's async context (its per-worker setup), entered on the loop that fetches,
        # at the first fetch of the pass, and exited when the pass's source is closed.
        self.context_entered = False

    def begin_epoch(self, first: bool, plans: list[PassPlan]) -> int:
        # The fetcher (and an IterableDataset's iterator) is made on the first fetch, in the
        # thread that fetches, as torch makes it lazily too.
        self.plan = plans[0]
        self.fetcher = None
        self.stream_states.clear()
        return self.generation

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        assert self.task is None, "one task at a time in the calling process"
        self.task = (task_id, indices)

    def flush(self) -> None:
        pass

    def check_health(self) -> None:
        pass

    def pid(self, worker_id: int) -> int | None:
        return None

    def watch(self, fd: int) -> None:
        self.watched = fd

    # Nothing to heal in the calling process.
    restarts_left = 0

    def take_restarted(self) -> list[int]:
        return []

    def kill(self, worker_id: int) -> None:
        pass

    def poll(self) -> list[tuple[int, int, Outcome]]:
        if self.result is None:
            return []
        result, self.result = self.result, None
        return [result]

    async def wait(self, deadline: float) -> bool:
        assert deadline == math.inf
        if self.task is None:
            if self.watched is not None:
                # Only the pin stage has work: wait for it.
                await anyio.wait_readable(self.watched)
            return True
        started = time.perf_counter()
        if self.is_async:
            outcome = await self._fetch_async(*self.task)
        elif self.offload:
            # Not abandoned on cancel: the fetch finishes (one batch at most) before the
            # cancellation goes on, so two fetches never run at once on one dataset.
            outcome = await anyio.to_thread.run_sync(self._fetch, *self.task)
        else:
            outcome = self._fetch(*self.task)
        if self.stats is not None:
            # The calling process is the one "worker" here.
            self.stats.fetched(0, time.perf_counter() - started)
        task_id = self.task[0]
        self.task = None
        self.result = (0, task_id, outcome)
        return True

    def _fetch(self, task_id: int, indices: Any) -> Outcome:
        spec = self.spec
        try:
            if self.fetcher is None:
                self.fetcher = Fetcher(
                    spec.dataset_kind,
                    spec.dataset,
                    spec.auto_collation,
                    spec.collate_fn,
                    spec.drop_last,
                    self.plan,
                    in_calling_process=True,
                    policy=spec.sample_policy,
                )
            batch = self.fetcher.fetch(indices)
            self._record_stream(task_id)
            return ("ok", batch)
        except StopIteration as exc:
            if spec.dataset_kind == 1:
                return ("end", None)
            return ("raise", exc)
        except Exception as exc:
            # Raised as it is, with its own traceback, as torch does in this mode.
            return ("raise", exc)

    def _record_stream(self, task_id: int) -> None:
        """Where an IterableDataset's stream stands after this task's batch (for state_dict),
        as a worker's "state" frame says it."""
        fetcher = self.fetcher
        if fetcher.iterable:
            # A copy: in this process the dataset's state object may be the live one, which
            # later batches would change under the checkpoint.
            state = copy.deepcopy(fetcher.state())
            self.stream_states[task_id] = (fetcher.samples_seen, state, fetcher.ended)

    async def _fetch_async(self, task_id: int, indices: Any) -> Outcome:
        spec = self.spec
        try:
            if self.fetcher is None:
                if not self.context_entered and has_async_context(spec.dataset):
                    await spec.dataset.__aenter__()
                    self.context_entered = True
                self.fetcher = AsyncFetcher(
                    spec.dataset_kind,
                    spec.dataset,
                    spec.auto_collation,
                    spec.collate_fn,
                    spec.drop_last,
                    self.plan,
                    spec.worker_concurrency,
                    policy=spec.sample_policy,
                )
            batch = await self.fetcher.fetch(indices)
            self._record_stream(task_id)
            return ("ok", batch)
        except StreamEnd:
            return ("end", None)
        except Exception as exc:
            return ("raise", exc)

    def close(self, grace: float = 0.0) -> None:
        fetcher, self.fetcher = self.fetcher, None
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
        if not done and not self.offload:
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
