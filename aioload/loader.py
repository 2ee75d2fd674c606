"""aioload.DataLoader: torch's DataLoader, with an asyncio engine behind both iterators."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import torch
import torch.distributed
import torch.utils.data
from torch.utils.data import Dataset, Sampler

from ._aio import lazy_import as _lazy
from ._backends.base import BackendKeeper
from ._backends.choice import WorkerFactory
from ._backends.ray_config import RayWorkers
from ._engine.counters import empty_stats
from ._engine.orchestrator import END, NEEDS_LOOP, Orchestrator, release_pass_frames
from ._engine.passes import PassPlanner
from ._engine.samplers import loader_generators, use_stateful_shuffle
from ._engine.setup import (
    AutoArguments,
    ExtraArguments,
    PassArguments,
    ShardArguments,
    check_extras,
    check_worker_method,
    resolve_arguments,
    shard_index_sampler,
    torch_only_arguments,
)

if TYPE_CHECKING:
    from ._engine.pinning import PinPlan, Transfer
    from .stats import LoaderStats

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)


def make_transfer(plan: PinPlan | None, device: torch.device | None) -> Transfer | None:
    """``_engine.pinning.make_transfer``; ``plan`` None: nothing pinned, nothing to warn.

    NOTE: a pass that neither pins nor copies to a device (no plan, no ``device``) has no stage,
    said here without importing ``_engine.pinning``: its import counted in the time to the
    first batch of every loader, and only a pass with a stage runs it."""
    if plan is None and device is None:
        return None
    from ._engine import pinning

    return pinning.make_transfer(plan or pinning.PinPlan(pin=False), device)


class DataLoader(torch.utils.data.DataLoader[T_co], Generic[T_co]):
    """A drop-in replacement for `torch.utils.data.DataLoader`, with `async for`.

    The same arguments, defaults, validation and batches as torch's loader: it is a subclass
    (`isinstance(loader, torch.utils.data.DataLoader)` holds), and torch's `__init__` checks the
    arguments, builds the samplers and picks the `collate_fn`. What aioload replaces is the
    iterator: worker processes fed over one socket each, batches returned through reused
    shared-memory slabs without a copy, and `async for` on the caller's event loop.

    ```python
    loader = aioload.DataLoader(ds, batch_size=64, num_workers=8, shuffle=True)
    for batch in loader: ...          # classic scripts
    async for batch in loader: ...    # asyncio, uvloop or trio
    ```

    Args:
        dataset: The dataset to load from: map-style (`__getitem__` and `__len__`) or an
            `IterableDataset`, as in torch. Either kind may be async (`async def __getitem__`,
            `async def __getitems__`, or `__aiter__` through `aioload.AsyncIterableDataset`);
            see `worker_concurrency`.
        batch_size: How many samples per batch (default 1). `None` turns off automatic
            batching, as in torch.
        shuffle: Reshuffle the data at every epoch (torch's `RandomSampler`, drawing from
            `generator`).
        sampler: Draws the indices, instead of `shuffle`. It is iterated in the calling
            process, as in torch; under `async for` that is on the event loop, so keep it
            cheap.
        batch_sampler: Draws a list of indices per batch; excludes `batch_size`, `shuffle`,
            `sampler` and `drop_last`.
        num_workers: How many worker processes load the data; 0 loads in the calling process
            (under `async for`, in a thread). `"auto"`: aioload chooses the count and adjusts it
            while a pass runs, from whether the consumer waits and whether workers are busy
            while cores are idle, at most one per usable core; see `max_memory`.
        collate_fn: Merges a list of samples into a batch; runs in the workers. With torch's
            `default_collate` (the default) tensors are stacked straight into shared memory;
            the tensors and arrays of any other's result are copied there. Under `spawn` and
            `forkserver` it must be picklable (a module-level function, not a lambda).
        pin_memory: Copy each batch into page-locked memory before returning it, in a thread
            of its own. Needs an accelerator; without one you get torch's warning and plain
            batches.
        drop_last: Drop the last batch if it is incomplete.
        timeout: Seconds to wait for each batch, 0 for no limit. Past it,
            `aioload.DataLoaderTimeoutError` names the batch, the worker and the indices it
            holds; with `max_worker_restarts`, that worker is replaced instead.
        worker_init_fn: Called in each worker with its id, after seeding and after
            `get_worker_info()` is set. With an async dataset it may be a coroutine function,
            awaited on the worker's event loop.
        multiprocessing_context: How workers start: `"fork"`, `"spawn"`, `"forkserver"` or a
            context object (default: Python's). Under `spawn` and `forkserver` the dataset,
            `collate_fn` and `worker_init_fn` are pickled once in the parent.
        generator: The random generator behind `shuffle`'s order and the workers' base seed.
        prefetch_factor: Batches in flight per worker (default 2 with workers). `0` with
            workers raises `ValueError` (torch accepts it, then fails while iterating).
            `"auto"`: adjusted while a pass runs, between 1 and 8, when the consumer waits for
            data while the workers have time to spare.
        persistent_workers: Keep the workers from one pass to the next. A pool that broke is
            replaced on the next pass; `shutdown()` stops the workers at once.
        pin_memory_device: Deprecated by torch and ignored, with torch's warning: pinning
            targets the current accelerator.
        in_order: `True` yields batches in sampler order; `False` as they complete, so a slow
            sample does not hold back the others. No effect with `num_workers=0`. In order,
            while a slow batch holds up the line, the other workers run ahead of it beyond
            `prefetch_factor`, within a memory bound (`stats().run_ahead_limit`; see
            docs/tuning.md, "Run-ahead").
        worker_method: `"multiprocessing"` (processes, the default); `"thread"`: threads of
            this process, sharing the dataset, batches by reference (nothing in `/dev/shm`),
            each with its own `get_worker_info()` and `.rng` (docs/threads.md); `"auto"`: a
            short trial before the first pass picks threads where they scale.
        device: Where batches arrive: `None` (or `"cpu"`) leaves them in memory; `"cuda:N"`
            copies each batch to that GPU in a thread, pinned, `non_blocking` on a stream of its
            own that your current stream waits on (no host sync); another accelerator without
            streams. With no accelerator usable, a warning, and batches stay on the CPU.
        max_worker_restarts: How many times per pass a worker that dies (or hangs past
            `timeout`) is replaced by a new process with the same worker id, seed and
            `worker_init_fn`. Its unanswered batches are fetched again, so the epoch completes
            with every index exactly once, in order, and a `RuntimeWarning` names each death.
            Past the limit, `aioload.WorkerDiedError` as without restarts. Needs workers and a
            map-style dataset (an iterable one's replacement would start its stream over).
        seed_per_sample: Seed `random`, torch's CPU generator and numpy before each sample's
            fetch, from `(base seed, epoch, index)`: random augmentations are then bitwise the
            same for any `num_workers`, any `in_order`, and after `load_state_dict`. For async
            datasets each sample keeps its own random state across its awaits.
        shard: `"none"` (the default): every rank gets the whole dataset, as in torch.
            `"auto"`: under `torch.distributed`, with no `sampler` or `batch_sampler`, each rank
            iterates its shard, as a `DistributedSampler` (padded unless `drop_last`, one seed
            for all ranks, reshuffled every pass). `sampler` and `batch_sampler` still describe
            the whole dataset; `len(loader)` counts this rank's batches. Build it after
            `init_process_group`, on every rank: with `shuffle`, the seed is a collective.
        progress: Draw a tqdm progress bar for each pass, with batches/s and the live share
            of time spent waiting for data. `aioload.progress(loader)` does the same for one
            pass.
        worker_concurrency: For an async dataset: how many samples each worker fetches at
            once, on its own event loop (with `num_workers=0`, in the calling process); batches
            still come out complete and in order. Above 1 with a sync dataset: `ValueError`.
            `"auto"`: adjusted while a pass runs (from 4, doubling up to 256, while more fetches
            in flight bring more samples per second); 1 for a sync dataset.
        workers: Where the `num_workers` workers run: `None` for local processes, or
            `aioload.RayWorkers(...)` for Ray actors on a Ray cluster (needs the `ray` extra).
        on_sample_error: What a sample that fails to load does: `"raise"` (the default, as in
            torch) raises its error at its place in the pass; `"skip"` leaves it out of its
            batch (a batch that lost every sample is not yielded); a callable
            `(index, exception) -> "raise" | "skip"` decides per error, in the worker. Every
            skip is listed in `loader.stats().skipped`.
        max_skipped: The most samples a pass may skip: an `int` is a count, a `float` in
            (0, 1) a fraction of the pass's samples; `None` means no limit. Past it the pass
            raises `aioload.TooManySampleErrors`.
        sample_retries: How many times a failing sample is fetched again before it counts as
            an error, after 50 ms, then 100 ms, 200 ms and so on (at most 5 s). A sample that
            succeeds on a retry is not an error.
        snapshot_every_n_steps: Accepted for torchdata's `StatefulDataLoader`, whose users
            then change only the import; `None` or a non-negative integer. It changes nothing
            here: `state_dict()` is exact after every batch.
        max_memory: With `num_workers="auto"` or `prefetch_factor="auto"` (only then): the
            most bytes of batches in flight, `(workers x prefetch_factor + 2) x` a batch's
            bytes, enforced once a batch's size is known by lowering the depth, then the
            workers. An integer, or a float such as `2e9`; `None`: no bound.
        hang_report_after: Seconds of waiting for one batch before aioload logs, once, where
            it is: a WARNING on the `"aioload"` logger naming the batch, the worker holding it,
            its indices, the wait so far and that worker's Python stack (every thread's), also
            in `loader.stats().stalled`. The wait goes on; nothing is stopped (`timeout` ends
            waits). `None` turns it off.

    Raises:
        ValueError: An argument out of range: torch's checks (its messages), then aioload's.
        TypeError: `workers` is neither `None` nor `aioload.RayWorkers(...)`.
        RuntimeError: `device` is an accelerator type or index that is not there.
    """

    # What lies between passes (the epoch, the randomness to replay, the workers kept, what
    # state_dict() reports) has one owner, which plans each pass.
    _passes: PassPlanner

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int | Literal["auto"] = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | Literal["auto"] | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        worker_method: Literal["multiprocessing", "thread", "auto"] = "multiprocessing",
        device: str | torch.device | None = None,
        max_worker_restarts: int = 0,
        seed_per_sample: bool = False,
        shard: Literal["none", "auto"] = "none",
        progress: bool = False,
        worker_concurrency: int | Literal["auto"] = 1,
        workers: RayWorkers | WorkerFactory | None = None,
        on_sample_error: str | Callable[[Any, BaseException], str] = "raise",
        max_skipped: int | float | None = None,
        sample_retries: int = 0,
        snapshot_every_n_steps: int | None = 1,
        max_memory: float | None = None,
        hang_report_after: float | None = 60.0,
    ) -> None:
        resolved = resolve_arguments(
            dataset,
            ShardArguments(shard, shuffle, sampler, batch_sampler, drop_last, generator),
            AutoArguments(num_workers, prefetch_factor, worker_concurrency, max_memory),
        )
        self._rank, self._world_size = resolved.rank, resolved.world_size
        self._tuner = resolved.tuner
        self.max_memory = max_memory
        # torch validates every argument, with its own messages, and builds the samplers.
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=resolved.num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=resolved.prefetch_factor,
            persistent_workers=persistent_workers,
            **torch_only_arguments(pin_memory_device=pin_memory_device, in_order=in_order),
        )
        if shuffle and sampler is None and batch_sampler is None:
            # torch's samplers, with a state a framework can resume from (_engine.samplers).
            use_stateful_shuffle(self, generator)
        # What the installed torch's DataLoader does not take, this one keeps itself.
        if not hasattr(self, "pin_memory_device"):
            self.pin_memory_device = pin_memory_device
        if not hasattr(self, "in_order"):
            self.in_order = in_order
        extras = check_extras(
            self.dataset,
            self._dataset_kind,
            self.num_workers,
            self.prefetch_factor,
            ExtraArguments(
                device=device,
                max_worker_restarts=max_worker_restarts,
                workers=workers,
                worker_concurrency=resolved.worker_concurrency,
                worker_init_fn=worker_init_fn,
                on_sample_error=on_sample_error,
                max_skipped=max_skipped,
                sample_retries=sample_retries,
                snapshot_every_n_steps=snapshot_every_n_steps,
                hang_report_after=hang_report_after,
            ),
        )
        self.device = extras.device
        self.max_worker_restarts = max_worker_restarts
        self._worker_method = check_worker_method(
            worker_method, self.dataset, self.num_workers, workers, seed_per_sample
        )
        self.workers = workers  # None: local workers; RayWorkers: Ray actors
        self.worker_concurrency = extras.worker_concurrency
        # Bad samples (docs/reliability.md): skipped or raised, each skip recorded, capped.
        self.on_sample_error = on_sample_error
        self.max_skipped = max_skipped
        self.sample_retries = sample_retries
        self.seed_per_sample = bool(seed_per_sample)
        # torchdata's: here a checkpoint is exact at every step (docs/resume.md).
        self.snapshot_every_n_steps = extras.snapshot_every_n_steps
        self.hang_report_after = extras.hang_report_after
        # Every argument reads back under its own name (Lightning rebuilds a DataLoader subclass
        # from its __init__ signature and these attributes); torch keeps all but these.
        self.shuffle = shuffle
        self.shard = shard
        self._shard_sampler = resolved.shard_sampler
        # This rank's batches (or indices, without automatic batching), in the shape torch's
        # _index_sampler has.
        self._shard_index_sampler = shard_index_sampler(
            resolved.shard_sampler, self.batch_size, self.drop_last
        )
        # Every pass draws a tqdm bar (batches/s, live data-bound %); see aioload.progress.
        self.progress = progress
        # Which workers a pass runs on (fresh ones, or with persistent_workers those kept),
        # and all else that lies between passes.
        self._passes = PassPlanner(BackendKeeper(self, self.persistent_workers))
        # What the first pass runs here, imported now rather than inside its clock (_aio.lazy_import).
        _lazy.warm(self.num_workers)

    # -- epochs and checkpoints ---------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Number the next pass ``epoch``. Iterating the loader again implies ``epoch + 1``,
        so calling this is only needed to jump. It reseeds what depends on the epoch: the
        shard's shuffle under torch.distributed (``DistributedSampler.set_epoch``, also for a
        sampler you passed that has one) and ``seed_per_sample``.

        Raises:
            ValueError: ``epoch`` is not a non-negative integer."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative integer, but got epoch={epoch!r}")
        self._passes.set_epoch(epoch, self._pass_arguments())

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands, as plain data: ``json.dumps``-able (RNG states are base64
        text) and ``torch.save``-able (loadable with ``torch.load(weights_only=True)``), as far
        as the states of your own Stateful objects are.

        Call it between any two batches, in ``for`` or ``async for``. A fresh loader built with
        the same arguments and given this state by `load_state_dict()` yields exactly the
        batches the interrupted pass had not yet yielded: same contents, same order (with
        ``in_order=False``: the same remaining batches). Batches that were prefetched but not
        yet yielded are fetched again. Between passes, it names the next epoch.

        It holds what torchdata's StatefulDataLoader holds of a dataset, an iterator, a sampler
        or a batch sampler with ``state_dict()`` and ``load_state_dict()``: each one's state
        after the last batch yielded (each worker's copy of the dataset on its own).
        """
        return self._passes.state_dict(self._pass_arguments())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass continue from ``state`` (from `state_dict()` of a loader
        built with the same arguments; ``num_workers`` may differ for a map-style dataset,
        unless the dataset itself is Stateful and its workers' states were saved).

        Raises:
            ValueError: ``state`` is not an aioload state, or was saved by another loader."""
        self._passes.load_state_dict(state, self._pass_arguments())

    def _pass_arguments(self) -> PassArguments:
        """What a pass reads of this loader, as it is now (torch's arguments may be changed
        after construction, and are read at each pass, as torch does)."""
        return PassArguments(
            dataset=self.dataset,
            dataset_kind=self._dataset_kind,
            auto_collation=self._auto_collation,
            collate_fn=self.collate_fn,
            drop_last=self.drop_last,
            worker_init_fn=self.worker_init_fn,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            multiprocessing_context=self.multiprocessing_context,
            generator=self.generator,
            generators=loader_generators(self),
            sampler=self.sampler,
            index_sampler=self._index_sampler,
            timeout=self.timeout,
            in_order=self.in_order,
            iterable_len=self._IterableDataset_len_called,
            rank=self._rank,
            world_size=self._world_size,
            worker_concurrency=self.worker_concurrency,
            on_sample_error=self.on_sample_error,
            sample_retries=self.sample_retries,
            max_skipped=self.max_skipped,
            seed_per_sample=self.seed_per_sample,
            max_worker_restarts=self.max_worker_restarts,
            hang_report_after=self.hang_report_after,
            workers=self.workers,
            worker_method=self.worker_method,
            tuner=self._tuner,
            shard_sampler=self._shard_sampler,
        )

    def _start_pass(self, async_for: bool) -> Orchestrator:
        """A new pass's engine, planned by the loader's ``PassPlanner``."""
        transfer = self._transfer()
        arguments = self._pass_arguments()
        try:
            return self._passes.start_pass(arguments, transfer, async_for)
        finally:
            if arguments.num_workers != self.num_workers:
                # num_workers="auto" with an IterableDataset: the count this pass runs.
                self.num_workers = arguments.num_workers

    @property
    def worker_method(self) -> str:
        """Where the workers run: ``"multiprocessing"``, ``"thread"`` or ``"auto"``."""
        return self._worker_method

    @worker_method.setter
    def worker_method(self, worker_method: str) -> None:
        # Set after construction, checked as the constructor checks it (a misspelt value ran
        # processes): torch checks multiprocessing_context so too. The next pass runs it.
        self._worker_method = check_worker_method(
            worker_method, self.dataset, self.num_workers, self.workers, self.seed_per_sample
        )

    @property
    def _index_sampler(self) -> Any:
        """What a pass draws its indices from: this rank's shard under ``shard="auto"``, else
        torch's choice (``batch_sampler``, or ``sampler`` without automatic batching). So
        ``len(loader)`` counts the batches this rank yields, as with torch's DataLoader over
        a DistributedSampler, while ``len(loader.batch_sampler)`` counts the whole dataset's."""
        # (Read with a default: torch's __init__ runs before this loader's own attributes exist.)
        shard_index_sampler = getattr(self, "_shard_index_sampler", None)
        if shard_index_sampler is not None:
            return shard_index_sampler
        return super()._index_sampler

    # -- the two doors -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """One pass over the data with `for`: each call starts a new pass (new workers, unless
        `persistent_workers`). No event loop; the thread blocks only while it waits for a batch.

        Returns:
            The pass's iterator; `close()` on it stops the workers now, as dropping it does.

        Raises:
            Exception: From `next()`: your code's exception, with its type; a `LoaderError`."""
        iterator = _SyncIterator(self._start_pass(async_for=False), len_fn=self.__len__)
        if self.progress:
            from . import _progress  # only a loader with a progress bar needs it

            return _progress.wrap_sync(iterator, self, {})
        return iterator

    def __aiter__(self) -> AsyncIterator[Any]:
        """One pass over the data with `async for`, on the running event loop (asyncio, uvloop
        or trio): each call starts a new pass. Waiting for a batch never blocks the loop, and
        every `__anext__` yields to it once. A cancellation ends the pass and stops its workers.

        Returns:
            The pass's iterator, an async context manager; `await it.aclose()` stops its workers.

        Raises:
            Exception: As `__iter__`'s; `RuntimeError` for two `__anext__` at once."""
        _lazy.warm_async()
        iterator = _AsyncIterator(self._start_pass(async_for=True))
        if self.progress:
            from . import _progress

            return _progress.wrap_async(iterator, self, {})
        return iterator

    def _transfer(self) -> Transfer | None:
        """The pin / host-to-device stage a pass needs, if any: ``pin_memory`` pins, and warns,
        as the installed torch's iterator does (see ``torch_pin_plan``)."""
        if not self.pin_memory and not self.pin_memory_device:
            return make_transfer(None, self.device)  # (torch_pin_plan's first case)
        from ._engine.pinning import torch_pin_plan

        plan = torch_pin_plan(self.pin_memory, self.pin_memory_device)
        plan.warn(stacklevel=3)  # (__iter__'s frame, as torch's iterator)
        return make_transfer(plan, self.device)

    # -- stats and persistent workers ---------------------------------------------------------

    def stats(self) -> LoaderStats:
        """A snapshot of the current pass, or of the last one if none is running (an empty one
        before the first, with an "auto" loader's starting choice): batches, samples, the
        data-bound share of the consumer's time, each worker's busy fraction, fetch-time
        percentiles and restarts, queue depths, pin time, and the hang report's ``stalled``.

        ``print(loader.stats())`` shows a table; ``loader.stats().as_dict()`` is for loggers.
        """
        pass_stats = self._passes.stats
        if pass_stats is None:
            snapshot = empty_stats(self.num_workers)
            if self._tuner is not None:
                # The controller's starting choice ("no measurement yet"), as the progress bar
                # and a logger would read it once the first pass starts.
                snapshot = dataclasses.replace(snapshot, tuning=self._tuner.report())
            return snapshot
        return pass_stats.snapshot()

    def shutdown(self) -> None:
        """Stop persistent workers now rather than when the loader is collected."""
        self._passes.workers.shutdown()


class _SyncIterator:
    """``for batch in loader``: the orchestrator's steps, waiting in the calling thread; only a
    wait that needs an event loop (an async dataset in this process) runs on a private one."""

    def __init__(self, engine: Orchestrator, len_fn: Callable[[], int]) -> None:
        self._engine = engine
        self._len_fn = len_fn
        # The pass's counters (for aioload.progress).
        self.pass_stats = engine.stats
        # NOTE [threads on one iterator]. Threads that share one iterator take turns: each
        # batch goes to exactly one of them, as with torch's iterator (which the GIL
        # serialises). The engine's steps are not made to interleave: unguarded, two threads
        # lost batches and then hung. A thread waits here while another waits for a batch.
        self._turn = threading.Lock()
        # What ended the pass before its end, if an interrupt did (``_ended_early``).
        self._ended_by: str | None = None

    def __iter__(self) -> _SyncIterator:
        return self

    def __next__(self) -> Any:
        with self._turn:
            if self._ended_by is not None:
                raise _ended_early(self._ended_by)
            engine = self._engine
            stats = engine.stats
            entered = stats.enter()
            try:
                batch = engine.next_blocking()
                if batch is NEEDS_LOOP:
                    from ._aio import sync_loop as _sync  # (the one wait that needs a loop)

                    batch = _sync.run(engine.next())
            except BaseException as error:
                if not isinstance(error, Exception) and not _raised_in_wait(error):
                    # Ctrl-C (or SystemExit) in the wait keeps the pass, as torch's iterator
                    # does: the state is whole there. Anywhere else it ends the pass (an
                    # answer may be half taken in), and the next next() says so: NOTE [an
                    # interrupt in the wait].
                    engine.close()
                    self._ended_by = type(error).__name__
                # Nothing in the error's traceback may keep the pass alive: it then ends when the
                # consumer drops the iterator, not at a garbage collection (release_pass_frames).
                release_pass_frames(error)
                del self, engine
                raise
            finally:
                stats.leave(entered)
            if batch is END:
                engine.close()
                raise StopIteration
            return batch

    def __len__(self) -> int:
        return self._len_fn()

    def close(self) -> None:
        """End the pass and stop its workers now (``del`` or garbage collection does it too).
        Batches already yielded stay valid; the iterator raises ``StopIteration`` from then
        on. Calling it again does nothing."""
        self._engine.close()

    def __del__(self) -> None:
        self._engine.close()


class _AsyncIterator:
    """``async for batch in loader``: the orchestrator runs on the caller's own loop."""

    def __init__(self, engine: Orchestrator) -> None:
        self._engine = engine
        # What ended the pass before its end, if a cancellation did (``_ended_early``).
        self._ended_by: str | None = None
        # The pass's counters (for aioload.progress).
        self.pass_stats = engine.stats

    def __aiter__(self) -> _AsyncIterator:
        return self

    async def __anext__(self) -> Any:
        if self._ended_by is not None:
            raise _ended_early(self._ended_by)
        engine = self._engine
        stats = engine.stats
        entered = stats.enter()
        try:
            # A checkpoint every time (see Orchestrator.next): other tasks run, and a
            # cancellation is honoured, even when the batch is already here.
            batch = await engine.next()
        except BaseException as exc:
            if not isinstance(exc, Exception | GeneratorExit) and not engine.closed:
                # A cancellation (or KeyboardInterrupt, SystemExit) ends the pass wherever it
                # lands: at the checkpoint, while waiting for workers, or in the loop body,
                # from which it reaches us at the next __anext__. ``async for`` does not call
                # aclose() when it is left by an exception, and the iterator may outlive the
                # loop (in a traceback, or a name); so its workers are stopped here, off the
                # loop and shielded. A plain dataset error is not this: the pass goes on, as
                # in torch. (GeneratorExit means this coroutine is being closed, and it may not
                # await; the iterator's __del__ stops the pass then.)
                self._ended_by = type(exc).__name__
                await engine.aclose()
            # As in _SyncIterator.__next__: the pass lives as long as the consumer's own
            # references, not as long as the error (asyncio.run raises it out of a cycle).
            release_pass_frames(exc)
            del self, engine
            raise
        finally:
            stats.leave(entered)
        if batch is END:
            await engine.aclose()
            raise StopAsyncIteration
        return batch

    async def aclose(self) -> None:
        """End the pass and stop its workers without blocking the loop. Batches already
        yielded stay valid; the iterator raises ``StopAsyncIteration`` from then on. Calling
        it again does nothing. A checkpoint, like every ``aclose``: it yields to the loop even
        when there is nothing left to stop."""
        await self._engine.aclose()

    async def __aenter__(self) -> _AsyncIterator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self._engine.close()


def _raised_in_wait(error: BaseException) -> bool:
    from ._aio.waiting import raised_in_wait  # (only where an interrupt lands)

    return raised_in_wait(error)


def _ended_early(cause: str) -> RuntimeError:
    """The error a pass's iterator raises once a cancellation or an interrupt has ended the
    pass before its end: going on quietly (``StopIteration``) would end the epoch short."""
    return RuntimeError(
        f"aioload: this pass was ended by {cause} before its end, so the batches it had not "
        "yielded will not come from this iterator. Start a new pass (a new `for` or `async "
        "for`), or continue where it stopped: loader.load_state_dict(loader.state_dict()), "
        "then iterate again"
    )
