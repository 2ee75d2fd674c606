"""What a worker does with a task, wherever it runs: :class:`WorkerStep`.

Its setup (seeds, ``get_worker_info()``, ``worker_init_fn``), the pass's fetcher, one fetch
and collate (sync or async), and one way to answer an error (:class:`RemoteError`). A local
worker process (``_worker.main``), a Ray actor, a worker thread, the fake backend's workers
and the calling process (``num_workers=0``) all run it.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import pickle
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from torch._utils import ExceptionWrapper, KeyErrorMessage

from .._named_tuple import NamedTuple
from .._wire import slabs as _transport
from .._wire.messages import (
    Failure,
    PassPlan,
    Produced,
    Reset,
    StreamEnded,
    StreamState,
    Task,
)
from ..errors import WorkerError
from .async_detect import has_async_context, is_async_dataset
from .datapipes import is_datapipe, reseed, shard_in_worker
from .fetch import Fetcher, FetchSpec, SamplePolicy, is_stateful
from .info import WorkerInfo, _set_worker_info, set_thread_worker_info
from .seeding import seed_worker

if TYPE_CHECKING:
    from .async_fetch import AsyncFetcher

__all__ = [
    "Place",
    "RemoteError",
    "StepResult",
    "WorkerConfig",
    "WorkerStep",
]


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_NO_INDEX: Any = object()


def _failed_index(tb: TracebackType | None) -> Any:
    """The index a failed fetch was for, where the dataset's own ``__getitem__`` raised (or
    something it called): the argument of the first frame outside aioload that aioload's
    fetch code called, when that frame is a ``__getitem__``. ``_NO_INDEX`` for any other
    failure (a batched ``__getitems__``, a ``collate_fn``, ``worker_init_fn``)."""
    called_from_aioload = False
    while tb is not None:
        code = tb.tb_frame.f_code
        ours = code.co_filename.startswith(_PACKAGE_DIR)
        if called_from_aioload and not ours:
            if code.co_name == "__getitem__" and code.co_argcount >= 2:
                return tb.tb_frame.f_locals.get(code.co_varnames[1], _NO_INDEX)
            return _NO_INDEX
        called_from_aioload = ours
        tb = tb.tb_next
    return _NO_INDEX


class RemoteError(ExceptionWrapper):
    """An exception captured in a worker, re-raised in the consumer.

    As torch does, the consumer gets the original exception type with the worker id and the
    worker's traceback in its message. Where that type cannot be built from a message, torch
    raises a bare RuntimeError; we raise WorkerError (a RuntimeError) with the same message.
    """

    def __init__(self, worker_id: int) -> None:
        super().__init__(where=f"in DataLoader worker process {worker_id}")  # type: ignore[no-untyped-call]
        self.worker_id = worker_id
        self.from_init = False
        # The sample whose fetch raised, named beside torch's message (its first lines are
        # torch's, word for word, and its last is the exception's own).
        index = _failed_index(sys.exc_info()[2])
        if index is not _NO_INDEX:
            head, _, frames = self.exc_msg.partition("\n")
            self.exc_msg = f"{head}\n  (fetching the sample at index {index!r})\n{frames}"

    def reraise(self) -> None:
        exc_type: Any = self.exc_type
        msg: str = f"Caught {exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        if exc_type is KeyError:
            msg = KeyErrorMessage(msg)
        elif getattr(exc_type, "message", None):
            raise exc_type(message=msg)
        try:
            exception = exc_type(msg)
        except Exception:
            raise WorkerError(msg, worker_id=self.worker_id) from None
        try:
            raise exception
        finally:
            # This frame is in the exception's traceback: holding the exception in a local
            # would make a reference cycle, and keep the iterator (and its workers) alive
            # until the garbage collector runs.
            del exception


class WorkerConfig(NamedTuple):
    worker_id: int
    num_workers: int
    base_seed: int
    generation: int
    dataset_kind: int
    auto_collation: bool
    drop_last: bool
    # (dataset, collate_fn, worker_init_fn): the objects themselves under fork, or their pickle,
    # made once in the parent and shared by every worker, under spawn and forkserver.
    payload: tuple[Any, Any, Any] | bytes
    slab_collate: bool
    max_idle_slabs: int
    rank: int = 0
    world_size: int = 1
    # Samples an async dataset's worker fetches at once (DataLoader's worker_concurrency).
    worker_concurrency: int = 1
    # on_sample_error and sample_retries (a callable policy runs in this worker).
    sample_policy: SamplePolicy | None = None


StepResult = Produced | Failure | StreamEnded

# Where a WorkerStep runs (see WorkerStep):
# - "worker": a worker's own process (a local worker process, a Ray actor);
# - "beside": a worker's step in the consumer's process, set up as that worker would be (its
#   seeds, ``get_worker_info()``, ``worker_init_fn``), its globals swapped in around each step
#   by whoever drives it (the fake backend, ``_backends.fake``);
# - "caller": the calling process itself, as torch's ``num_workers=0`` (``InlineBackend``);
# - "thread": a worker thread in the consumer's process (``_backends.thread``): set up as a
#   worker (its seed, ``worker_init_fn``), but its ``get_worker_info()`` is its thread's own,
#   with per-worker generators (``rng``), and the process-wide generators, which every thread
#   shares, are not reseeded.
Place = Literal["worker", "beside", "caller", "thread"]


class WorkerStep:
    """What one worker does with one task, whatever carries tasks to it (a process's socket,
    or a Ray actor's method calls): the worker's setup (seeds, ``get_worker_info()``,
    ``worker_init_fn``), the pass's fetcher, and the fetch and collate of one task, sync or
    async. It knows nothing of transports: it returns a :class:`Produced`, a
    :class:`Failure` or :class:`StreamEnded`, and its caller encodes and sends the answer.

    With ``slabs`` (a process worker), a batch is collated straight into a shared-memory slab
    when the collate is torch's default.

    ``place="caller"`` is torch's ``num_workers=0``: the calling process fetches, with no
    worker setup at all (no seeds, no ``get_worker_info()``, no ``worker_init_fn``, no
    DataPipe sharding, which the loader does for that process), from ``config.payload``'s
    objects themselves; a failure is answered with the exception itself, with its own
    traceback, not wrapped; and a seeded fetch puts the caller's RNG states back.
    Wherever the step shares the consumer's process (``"caller"``, ``"beside"``), the stream
    points it answers with are deep copies: the dataset's state object may be the live one,
    which later batches would change under the checkpoint (a worker's reply pickles it).
    """

    def __init__(
        self,
        config: WorkerConfig,
        slabs: _transport.WorkerSlabPool | None,
        *,
        place: Place = "worker",
    ) -> None:
        self.config = config
        self.slabs = slabs
        self.in_caller = place == "caller"
        self.in_thread = place == "thread"
        self.copies_points = place != "worker"
        self.iterable = config.dataset_kind == 1
        # The newest pass announced to this worker; tasks of older ones are skipped.
        self.generation = config.generation
        self.fetcher: Any = None
        # The worker's setup failed: the answer to every task it gets, so it reaches the
        # consumer (and the pool is not reused).
        self.init_error: Any = None
        # An IterableDataset's __iter__ failed this pass (as ``error`` answers it).
        self.fetch_error: Any = None
        # This pass's IterableDataset stream has run dry.
        self.iteration_end = False
        # Where the dataset stood after the last task run (see ``point_of``).
        self.point: StreamState | None = None
        # A Stateful dataset's state when this worker began its first pass: where a kept
        # worker that is rewound to an untouched dataset goes back to (``rewind``).
        self.pristine: Any = None
        self.began = False
        # An async worker_init_fn's coroutine, awaited on the worker's loop before any task.
        self.async_init: Any = None
        self.dataset: Any = None
        self.collate_fn: Any = None
        # An async dataset's fetches at once (worker_concurrency; "auto" changes it).
        self.concurrency = config.worker_concurrency

        wid = config.worker_id
        seed: int | None = None
        if self.in_thread:
            seed = config.base_seed + wid  # torch's worker seed; no process-wide seeding
        elif not self.in_caller:
            seed = seed_worker(config.base_seed, wid)
        try:
            payload = config.payload
            objects = pickle.loads(payload) if isinstance(payload, bytes) else payload
            self.dataset, collate_fn, init_fn = objects
            if config.slab_collate:
                collate_fn = _transport.slab_collate
            self.collate_fn = collate_fn
            if seed is not None:
                self._set_up_worker(wid, seed, init_fn)
        except Exception:
            self.setup_failed()
        self.is_async = self.init_error is None and is_async_dataset(
            self.dataset, config.dataset_kind
        )
        if self.async_init is not None and not self.is_async:
            # The loader refuses an async worker_init_fn with a sync dataset; one that returns
            # an awaitable without being a coroutine function gets here. A sync worker has no
            # loop to await it on.
            close = getattr(self.async_init, "close", None)
            if close is not None:
                close()
            self.async_init = None
            try:
                raise TypeError("worker_init_fn returned an awaitable, but the dataset is sync")
            except TypeError:
                self.setup_failed()

    def _set_up_worker(self, wid: int, seed: int, init_fn: Any) -> None:
        """What a worker does before its first task (not the calling process)."""
        config = self.config
        place = {
            "num_workers": config.num_workers,
            "dataset": self.dataset,
            "rank": config.rank,
            "world_size": config.world_size,
        }
        if self.in_thread:
            set_thread_worker_info(config.base_seed, wid, **place)
        else:
            _set_worker_info(WorkerInfo(id=wid, seed=seed, **place))
        if is_datapipe(self.dataset):
            # As torch's workers do, before the user's worker_init_fn.
            shard_in_worker(self.dataset, config.num_workers, wid, config.world_size, config.rank)
        if init_fn is not None:
            self.async_init = init_fn(wid)
            if not inspect.isawaitable(self.async_init):
                self.async_init = None

    # -- errors: the one way a task's failure is answered --------------------------------------

    def error(self) -> Failure:
        """The exception being handled, as this worker's answer (type and traceback kept)."""
        return Failure(self._caught())

    def _caught(self) -> Any:
        """The exception being handled, as this step's answers carry it: wrapped with the
        worker's traceback for the consumer (a ``RemoteError``), or in the calling process the
        exception itself, raised as it is (torch's ``num_workers=0``)."""
        if self.in_caller:
            return sys.exc_info()[1]
        return RemoteError(self.config.worker_id)

    def set_concurrency(self, concurrency: int) -> None:
        """worker_concurrency="auto" (``SetConcurrency``): this pass's fetcher and the next."""
        self.concurrency = concurrency
        resize = getattr(self.fetcher, "set_concurrency", None)
        if resize is not None:
            resize(concurrency)

    def setup_failed(self) -> None:
        """The exception being handled broke the worker's setup: every task gets it."""
        self.init_error = self._caught()
        if not self.in_caller:
            self.init_error.from_init = True

    async def finish_async_init(self) -> None:
        """Await an async ``worker_init_fn``'s coroutine, once, on the loop that will fetch;
        its failure is the setup's (``setup_failed``). A process worker and a Ray actor both
        run it before their first task."""
        if self.async_init is None:
            return
        init, self.async_init = self.async_init, None
        try:
            await init
        except Exception:
            self.setup_failed()

    async def enter_async_context(self) -> bool:
        """Enter an async dataset's context (its per-worker setup, say an HTTP session) on
        the loop that fetches, where the setup went well and the dataset has one; its failure
        is the setup's. Returns whether it was entered: the caller exits it when it is done."""
        if self.init_error is not None or not has_async_context(self.dataset):
            return False
        try:
            await self.dataset.__aenter__()
        except Exception:
            self.setup_failed()
            return False
        return True

    def preamble(self) -> Failure | StreamEnded | None:
        """The answer to a task that needs no fetch: the worker's setup or this pass's stream
        failed, or its IterableDataset stream has run dry. None: fetch it."""
        if self.init_error is not None or self.fetch_error is not None:
            self.point = None
        error = self.init_error or self.fetch_error
        if error is not None:
            return Failure(error)
        if self.iteration_end:
            return StreamEnded()
        return None

    # -- a pass --------------------------------------------------------------------------------

    def accepts(self, reset: Reset) -> bool:
        """Whether a Reset still concerns this worker (not superseded, setup fine)."""
        return reset.generation >= self.generation and self.init_error is None

    def fetch_spec(self) -> FetchSpec:
        """What this worker's fetchers are made from (its dataset and collate, as set up)."""
        config = self.config
        return FetchSpec(
            config.dataset_kind,
            self.dataset,
            config.auto_collation,
            self.collate_fn,
            config.drop_last,
            config.sample_policy,
        )

    def new_pass(self, plan: PassPlan) -> None:
        # An IterableDataset's __iter__ runs here, once per pass: its failure is this pass's,
        # and the next pass tries again.
        self.fetch_error = None
        self.iteration_end = False
        self.fetcher = None
        try:
            if not self.in_caller:  # (the loader reseeds the calling process's dataset)
                self.rewind(plan)
                if plan.shared_seed is not None:
                    # Every worker's shuffle seeded alike, anew each pass (an IterDataPipe).
                    reseed(self.dataset, plan.shared_seed)
            self.fetcher = Fetcher(self.fetch_spec(), plan, in_calling_process=self.in_caller)
        except Exception:
            self.fetch_error = self._caught()

    def rewind(self, plan: PassPlan) -> None:
        """Before a pass: note a Stateful dataset's state at this worker's first pass; a kept
        worker told to rewind (``plan.rewind``) with no state to load had an untouched dataset
        at the last batch the consumer received from it, and goes back to that state."""
        if not self.began:
            self.began = True
            if is_stateful(self.dataset):
                try:
                    self.pristine = copy.deepcopy(self.dataset.state_dict())
                except Exception:
                    # (A dataset that is its own iterator may know its state only once
                    # iterated: nothing to go back to.)
                    self.pristine = None
        if plan.rewind and plan.dataset_state is None and self.pristine is not None:
            self.dataset.load_state_dict(copy.deepcopy(self.pristine))

    def new_async_pass(self, plan: PassPlan) -> AsyncFetcher | None:
        from .async_fetch import AsyncFetcher

        self.fetch_error = None
        self.iteration_end = False
        self.fetcher = None
        try:
            if not self.in_caller:
                self.rewind(plan)
            # (A map-style dataset's checkpointed state is loaded here: it may fail.)
            fetcher = AsyncFetcher(self.fetch_spec(), plan, self.concurrency)
        except Exception:
            self.fetch_error = self._caught()
            return None
        self.fetcher = fetcher
        return fetcher

    async def start_async_stream(self, plan: PassPlan) -> None:
        """An async IterableDataset's new pass: close the previous stream, open the next (its
        __aiter__ runs now, after a resumed pass's state is loaded)."""
        previous = self.fetcher
        if previous is not None:
            with contextlib.suppress(Exception):
                await previous.aclose()
        fetcher = self.new_async_pass(plan)
        if fetcher is None:
            return
        try:
            await fetcher.start()
        except Exception:
            self.fetch_error = self._caught()

    # -- a task --------------------------------------------------------------------------------

    def run(self, task: Task) -> StepResult:
        early = self.preamble()
        if early is not None:
            return early
        return self.finish(self.fetcher.fetch, task.indices)

    async def run_async(self, task: Task, fetcher: AsyncFetcher | None = None) -> StepResult:
        """An async dataset's task: gather its samples (with up to worker_concurrency in
        flight), then collate. ``fetcher`` is the pass's, for map-style batches gathered
        concurrently across a pass change."""
        early = self.preamble()
        if early is not None:
            return early
        from .async_fetch import StreamEnd

        active: AsyncFetcher = fetcher if fetcher is not None else self.fetcher
        try:
            samples = await active.gather(task.indices)
        except StreamEnd:
            if not self.iterable:
                return self.error()
            self.iteration_end = True
            self.point = self._point_or_none()
            return StreamEnded()
        except Exception:
            failure = self.error()
            self.point = self._point_or_none()
            return failure
        # No await from here on: the collate is not interrupted by a cancellation.
        return self.finish(active.collate, samples)

    def finish(self, make_batch: Callable[[Any, Any], Any], argument: Any) -> StepResult:
        """Run ``make_batch(argument, arena)`` (a fetch of a task's indices, or an async fetch's
        collate of its samples), with a slab to collate into when this worker has shared
        memory, and note where the stream stands after it."""
        arena = self._arena()
        started = time.perf_counter()
        waited = 0.0 if self.slabs is None else self.slabs.waited_s
        try:
            if arena is not None:
                _transport.collating_into(arena)
            try:
                data = make_batch(argument, arena)
            finally:
                if arena is not None:
                    _transport.collating_into(None)
                    # The arena has a slab only if the collate stacked into it.
                    arena = arena.arena
                if self.slabs is not None:
                    # How long a batch takes to make, a wait for a free left out: the pool
                    # waits at most this long for the next one.
                    took = time.perf_counter() - started
                    self.slabs.batch_s = took - (self.slabs.waited_s - waited)
            # Where the dataset stands now (its state_dict() is the user's code: a failure
            # there is this task's).
            stream = self.point = self._point()
        except StopIteration:
            self.release(arena)
            if not self.iterable:  # only an IterableDataset may run dry
                return self.error()
            self.iteration_end = True
            # The state after the stream ran dry is what the next pass starts from.
            self.point = self._point_or_none()
            return StreamEnded()
        except Exception:
            self.release(arena)
            failure = self.error()
            # A failed task may have moved the dataset on too (a random draw).
            self.point = self._point_or_none()
            return failure
        return Produced(data, stream, arena)

    def _point(self) -> StreamState | None:
        point: StreamState | None = self.fetcher.point()
        if point is not None and self.copies_points:
            # In this process the dataset's state object may be the live one.
            point = copy.deepcopy(point)
        return point

    def _point_or_none(self) -> StreamState | None:
        try:
            return None if self.fetcher is None else self._point()
        except Exception:
            return None

    def point_of(self, result: StepResult) -> StreamState | None:
        """Where the dataset stood after the task that gave ``result`` (for its reply)."""
        if isinstance(result, Produced):
            return result.stream
        return self.point

    def _arena(self) -> Any:
        # Every collate gets one, the user's own too: the default_collate it may call stacks
        # tensors straight into it (_wire.slabs.stack_tensors_privately), so they are copied
        # once, not stacked privately and copied again. A collate_fn that keeps such a tensor
        # after the batch is sent keeps its slab too: a slab still viewed here is never
        # reused (_Slab.referenced).
        if self.slabs is None:
            return None
        try:
            return self.slabs.arena()
        except OSError:
            return None  # no shared memory now: collate as usual, send by value

    def release(self, arena: Any) -> None:
        if arena is not None and self.slabs is not None:
            self.slabs.release(arena.slab.id)
