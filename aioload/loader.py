"""aioload.DataLoader: torch's DataLoader, with an asyncio engine behind both iterators."""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
import torch.distributed
import torch.utils.data
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Sampler
from torch.utils.data._utils.collate import default_collate

from ._aio import lazy_import as _lazy
from ._aio import sync_loop as _sync
from ._backends.base import BackendKeeper, WorkerSpec
from ._backends.choice import BackendChoice, WorkerFactory, choose_backend
from ._backends.ray_config import RayWorkers
from ._engine.orchestrator import END, PENDING, Orchestrator, PassSetup
from ._engine.pinning import Transfer, make_transfer, torch_pin_plan
from ._engine.resume import (
    FORMAT,
    PassProgress,
    SamplerStack,
    StreamPoint,
    YieldedPositions,
    begin_pass,
    check_generator_count,
    generator_states,
    next_points,
    parse_state,
    start_points,
)
from ._engine.tuning import PassTuning, auto_arguments
from ._worker.async_detect import is_async_dataset
from ._worker.datapipes import SharedSeeds, is_datapipe, is_iter_datapipe, reseed, shard_in_process
from ._worker.fetch import SamplePolicy, is_stateful
from .stats import LoaderStats, PassStats, SkipCap, empty_stats

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)


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
            (under `async for`, in a thread, so the loop stays free). `"auto"`: aioload
            chooses the count, and adjusts it while a pass runs from the pass's own
            measurements (whether the consumer waits for data, whether the workers are busy
            while cores are idle), at most one worker per usable core; see `max_memory`.
        collate_fn: Merges a list of samples into a batch; runs in the workers. With torch's
            `default_collate` (the default) tensors are stacked straight into shared memory;
            the tensors and arrays of any other `collate_fn`'s result are copied there. Under
            the `spawn` and `forkserver` start methods it must be picklable: a module-level
            function, not a lambda or a local function.
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
            sample does not hold back the others. No effect with `num_workers=0`.
        device: Where batches arrive: `None` (or `"cpu"`) leaves them in memory; `"cuda"` or
            `"cuda:N"` copies each batch to that GPU in a thread of its own, pinned and with
            `non_blocking=True` on a CUDA stream of its own, and your current stream waits on an
            event (no host sync). Another accelerator's device is copied to in the same thread,
            without streams. Where no accelerator is usable, a warning, and batches stay on the
            CPU (as torch does with `pin_memory`); an accelerator other than the one named, or
            a device index past the last, raises `RuntimeError` here.
        max_worker_restarts: How many times per pass a worker that dies (or hangs past
            `timeout`) is replaced by a new process with the same worker id, seed and
            `worker_init_fn`. Its unanswered batches are fetched again, so the epoch completes
            with every index exactly once, in order, and a `RuntimeWarning` names each death.
            Past the limit, `aioload.WorkerDiedError` is raised as without restarts. Needs
            `num_workers > 0`; refused for an `IterableDataset`, whose replacement would start
            its stream over.
        seed_per_sample: Seed `random`, torch's CPU generator and numpy before each sample's
            fetch, from `(base seed, epoch, index)`: random augmentations are then bitwise the
            same for any `num_workers`, any `in_order`, and after `load_state_dict`. For async
            datasets each sample keeps its own random state across its awaits.
        shard: `"none"` (the default) gives every rank the whole dataset, as torch's
            DataLoader does. `"auto"`: under an initialized `torch.distributed`, with neither
            `sampler` nor `batch_sampler` given, each rank iterates only its shard of the
            dataset, with `DistributedSampler` semantics (padded unless `drop_last`, one
            shuffle seed for all ranks, reshuffled every pass; `set_epoch()` jumps). The public
            `sampler` and `batch_sampler` still describe the whole dataset, and `len(loader)`
            counts this rank's batches. Build such a loader after `init_process_group`, on
            every rank: with `shuffle`, agreeing on the seed is a collective.
        progress: Draw a tqdm progress bar for each pass, with batches/s and the live share
            of time spent waiting for data. `aioload.progress(loader)` does the same for one
            pass.
        worker_concurrency: For an async dataset: how many samples each worker fetches at
            once, on its own event loop (with `num_workers=0`, in the calling process).
            Batches still come out complete and in order. Above 1 with a sync dataset it
            raises `ValueError`. `"auto"`: for an async dataset, adjusted while a pass runs
            (from 4, doubling up to 256, while the extra fetches in flight bring more samples
            per second); for a sync dataset, 1.
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
        max_memory: With `num_workers="auto"` or `prefetch_factor="auto"` (and only with
            one of them): the most bytes of batches the choice may keep in flight, counted as
            `(workers x prefetch_factor + 2) x` the bytes of a batch, enforced once a batch's
            size is known by lowering the prefetch depth first, then the workers. `None`:
            no bound.
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int | str = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | str | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: str | torch.device | None = None,
        max_worker_restarts: int = 0,
        seed_per_sample: bool = False,
        shard: str = "none",
        progress: bool = False,
        worker_concurrency: int | str = 1,
        workers: RayWorkers | WorkerFactory | None = None,
        on_sample_error: str | Callable[[Any, BaseException], str] = "raise",
        max_skipped: int | float | None = None,
        sample_retries: int = 0,
        snapshot_every_n_steps: int | None = 1,
        max_memory: int | None = None,
    ) -> None:
        if shard not in ("auto", "none"):
            raise ValueError(f"shard option should be 'auto' or 'none', but got shard={shard!r}")
        # By default (shard="none") every rank iterates the whole dataset, as with torch's
        # DataLoader, and nothing here talks to the other ranks: a loader built on one rank alone
        # neither blocks nor drops data. With shard="auto", asked for, each rank iterates its own
        # shard of the default sampler under torch.distributed. The shard is private and applies
        # at iteration time only: the public ``sampler`` and ``batch_sampler`` describe the whole
        # dataset, as torch's do, because frameworks read them to shard the data themselves
        # (accelerate's prepare() wraps ``batch_sampler``; Lightning builds a DistributedSampler
        # of ``dataset``). A sampler the user passes (such as a framework's DistributedSampler)
        # is theirs, and left alone: no second shard. The rank is read here (no collective);
        # shard="auto" with shuffle agrees on the shuffle seed here, a collective every rank
        # must join.
        self._rank, self._world_size = _distributed_rank()
        shard_sampler: DistributedSampler[Any] | None = None
        if (
            shard == "auto"
            and self._world_size > 1
            and sampler is None
            and batch_sampler is None
            and not isinstance(dataset, IterableDataset)
        ):
            shard_sampler = DistributedSampler(
                dataset,
                num_replicas=self._world_size,
                rank=self._rank,
                shuffle=bool(shuffle),
                seed=_shared_shuffle_seed(generator) if shuffle else 0,
                drop_last=drop_last,
            )
        # num_workers / prefetch_factor / worker_concurrency "auto" (docs/tuning.md): torch sees
        # the integers the workers are built with, and the controller keeps the rest.
        auto = auto_arguments(
            num_workers,
            prefetch_factor,
            worker_concurrency,
            max_memory,
            iterable=isinstance(dataset, IterableDataset),
            is_async=is_async_dataset(dataset, int(isinstance(dataset, IterableDataset))),
        )
        resolved: tuple[Any, Any, Any] = (num_workers, prefetch_factor, worker_concurrency)
        if auto is not None:
            resolved = (auto.num_workers, auto.prefetch_factor, auto.worker_concurrency)
        elif worker_concurrency == "auto":
            # A sync dataset fetches one sample at a time: "auto" has only 1 to choose from.
            resolved = (num_workers, prefetch_factor, 1)
        # (Typed as torch takes them; torch and _check_worker_concurrency validate them.)
        workers_count: int = resolved[0]
        prefetch: int | None = resolved[1]
        concurrency: int = resolved[2]
        self._tuner = auto.controller if auto is not None else None
        self.max_memory = max_memory
        # torch validates every argument, with its own messages, and builds the samplers.
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=workers_count,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch,
            persistent_workers=persistent_workers,
            **_torch_only_arguments(pin_memory_device=pin_memory_device, in_order=in_order),
        )
        # What the installed torch's DataLoader does not take, this one keeps itself.
        if not hasattr(self, "pin_memory_device"):
            self.pin_memory_device = pin_memory_device
        if not hasattr(self, "in_order"):
            self.in_order = in_order
        if self.prefetch_factor == 0 and self.num_workers > 0:
            # torch accepts 0 here and then fails inside its iterator; fail early and clearly.
            raise ValueError("prefetch_factor option should be positive when num_workers > 0")
        self.device = _check_device(device)
        if not isinstance(max_worker_restarts, int) or max_worker_restarts < 0:
            raise ValueError("max_worker_restarts option should be a non-negative integer")
        if max_worker_restarts and self.num_workers == 0:
            raise ValueError("max_worker_restarts option needs num_workers > 0")
        if max_worker_restarts and isinstance(self.dataset, IterableDataset):
            raise ValueError(
                "max_worker_restarts is not supported with an IterableDataset: a replacement "
                "worker would start its iterator over, so samples would repeat"
            )
        self.max_worker_restarts = max_worker_restarts
        if workers is not None and not isinstance(workers, WorkerFactory):
            raise TypeError(
                f"workers option should be None (local processes) or aioload.RayWorkers, but "
                f"got workers={workers!r}"
            )
        # None: local worker processes; RayWorkers (a WorkerFactory): the num_workers workers
        # as Ray actors.
        self.workers = workers
        self.worker_concurrency = _check_worker_concurrency(
            concurrency, self.dataset, self._dataset_kind, worker_init_fn
        )
        _check_sample_errors(on_sample_error, max_skipped, sample_retries)
        # Bad samples (docs/reliability.md, "Bad samples"): skipped or raised after retries,
        # each skip recorded, within a cap per pass.
        self.on_sample_error = on_sample_error
        self.max_skipped = max_skipped
        self.sample_retries = sample_retries
        self.seed_per_sample = bool(seed_per_sample)
        # torchdata's StatefulDataLoader argument, accepted so that its users change only the
        # import. There it says how often workers send their dataset's state (a checkpoint
        # between two snapshots re-reads the batches since the last one on resume); here the
        # state comes with every batch that needs it, so a checkpoint is exact at every step
        # and the value changes nothing (docs/resume.md).
        self.snapshot_every_n_steps = _check_snapshot_steps(snapshot_every_n_steps)
        # Every argument reads back under its own name (Lightning rebuilds a DataLoader subclass
        # from its __init__ signature and these attributes); torch keeps all but these.
        self.shuffle = shuffle
        self.shard = shard
        self._shard_sampler = shard_sampler
        # This rank's batches (or indices, without automatic batching), in the shape torch's
        # _index_sampler has.
        self._shard_index_sampler: Iterable[Any] | None = None
        if shard_sampler is not None:
            self._shard_index_sampler = (
                shard_sampler
                if self.batch_size is None
                else torch.utils.data.BatchSampler(shard_sampler, self.batch_size, self.drop_last)
            )
        # Every pass draws a tqdm bar (batches/s, live data-bound %); see aioload.progress.
        self.progress = progress
        # Which workers a pass runs on: fresh ones, or (persistent_workers) those kept.
        self._workers = BackendKeeper(self, self.persistent_workers)
        # The counters of the newest pass (kept after it ends, for stats()).
        self._pass_stats: PassStats | None = None
        # Epochs: the number the next pass gets (set_epoch, or one more than the last pass).
        self._next_epoch = 0
        # seed_per_sample's base seed: the first pass's base seed, kept for the loader's life
        # so that every epoch (and a resumed run) seeds sample i the same way.
        self._sample_seed: int | None = None
        # The latest pass, as state_dict() reports it; and a loaded state waiting for the next
        # pass to pick it up.
        self._latest_pass: PassProgress | None = None
        self._pending_resume: PassProgress | None = None
        self._pending_in_progress = False
        # The base seed of the kept workers (persistent_workers), for a state taken between
        # passes: a resumed run starts its workers with it.
        self._pool_seed: int | None = None
        # An IterDataPipe's per-pass shuffle seed, shared by the workers (and the ranks).
        self._shared_seeds = SharedSeeds()
        # What the first pass runs here, imported now rather than inside its clock (_aio.lazy_import).
        _lazy.warm(self.num_workers)

    # -- epochs and checkpoints ---------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Number the next pass ``epoch``. Iterating the loader again implies ``epoch + 1``,
        so calling this is only needed to jump. It reseeds what depends on the epoch: the
        shard's shuffle under torch.distributed (``DistributedSampler.set_epoch``, also for a
        sampler you passed that has one) and ``seed_per_sample``."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch should be a non-negative integer, but got epoch={epoch!r}")
        pending = self._pending_resume
        if pending is not None and pending.epoch != epoch and self._pending_in_progress:
            # Asked for another epoch than the checkpoint's: start that epoch from its first
            # batch, rather than mix the checkpoint's order with another epoch's seeds.
            warnings.warn(
                f"aioload: set_epoch({epoch}) after load_state_dict() of a state in the middle "
                f"of epoch {pending.epoch}: the loaded position is dropped",
                UserWarning,
                stacklevel=2,
            )
            self._pending_resume = None
        self._number_next_pass(epoch)

    def _number_next_pass(self, epoch: int) -> None:
        self._next_epoch = epoch
        # A sampler the user passed with set_epoch (a DistributedSampler of their own) is told
        # too; the shard sampler is set each pass by _engine.
        set_sampler_epoch = getattr(self.sampler, "set_epoch", None)
        if self._shard_sampler is None and callable(set_sampler_epoch):
            set_sampler_epoch(epoch)

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
        pending = self._pending_resume
        if pending is not None:
            progress, in_progress = pending, self._pending_in_progress
        elif self._latest_pass is not None and not self._latest_pass.finished:
            progress, in_progress = self._latest_pass, True
        else:
            progress, in_progress = self._next_pass_progress(), False
        state = progress.as_dict()
        state.update(
            format=FORMAT,
            in_progress=in_progress,
            num_workers=self.num_workers,
            shard_seed=None if self._shard_sampler is None else int(self._shard_sampler.seed),
        )
        # A copy: the Stateful objects' states must not change under a checkpoint kept in
        # memory (or written by another thread) while iteration goes on.
        return copy.deepcopy(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass continue from ``state`` (from `state_dict()` of a loader
        built with the same arguments; ``num_workers`` may differ for a map-style dataset,
        unless the dataset itself is Stateful and its workers' states were saved)."""
        parsed = parse_state(state)
        progress = parsed.progress
        in_progress = parsed.in_progress
        iterable = self._dataset_kind == 1
        if progress.iterable != iterable:
            raise ValueError(
                "aioload: the state was saved for a "
                f"{'n iterable' if progress.iterable else ' map-style'} dataset, this loader has "
                f"a{'n iterable' if iterable else ' map-style'} one"
            )
        streams = max(1, self.num_workers)
        tuner = self._tuner
        if iterable and in_progress and tuner is not None and tuner.per_pass_workers:
            # num_workers="auto": the resumed pass runs a worker per saved stream.
            streams = len(progress.streams) if tuner.workers.auto else streams
        if len(progress.streams) != streams:
            if iterable and in_progress:
                raise ValueError(
                    f"aioload: the state was saved with num_workers={parsed.num_workers}; an "
                    "IterableDataset's streams are per worker, so resume it with the same number"
                )
            if any(point.has_state for point in progress.streams):
                raise ValueError(
                    f"aioload: the state holds the state_dict() of each of the "
                    f"{len(progress.streams)} workers' copies of {type(self.dataset).__name__}"
                    f" (saved with num_workers={parsed.num_workers}); they load only into a "
                    f"loader with as many workers, and this one has num_workers="
                    f"{self.num_workers}"
                )
            progress.streams = [StreamPoint() for _ in range(streams)]
            progress.next_worker = 0
        if any(point.dataset_state is not None for point in progress.streams) and not (
            is_stateful(self.dataset)
        ):
            raise ValueError(
                f"aioload: the state holds a state_dict() of the dataset, but "
                f"{type(self.dataset).__name__} has no load_state_dict(); build the loader "
                "with the same dataset"
            )
        if progress.sampler is not None and progress.sampler.state is not None and not iterable:
            stack = SamplerStack(self._index_sampler)
            if not stack.target_stateful:
                raise ValueError(
                    "aioload: the state holds a state_dict() of the sampler, but "
                    f"{type(stack.target).__name__} has no load_state_dict(); build the loader "
                    "with the same sampler"
                )
        # Checked now: a mismatch found when the next pass starts would drop the state.
        check_generator_count(progress.rng["generators"], self._generators())
        if self._shard_sampler is not None and parsed.shard_seed is not None:
            self._shard_sampler.seed = parsed.shard_seed
        if progress.sample_seed is not None:
            self._sample_seed = progress.sample_seed
        if not in_progress:
            progress.yielded = YieldedPositions()
            progress.next_worker = 0
        skipped = sum(point.samples_seen for point in progress.streams if not point.has_state)
        if skipped and in_progress:
            warnings.warn(
                f"aioload: {type(self.dataset).__name__} has no state_dict()/load_state_dict(), "
                f"so it is resumed by fast-forward: its streams re-read and drop the {skipped} "
                "sample(s) they had yielded. Define both methods to resume without re-reading.",
                UserWarning,
                stacklevel=2,
            )
        self._number_next_pass(progress.epoch)
        self._pending_resume = progress
        self._pending_in_progress = in_progress

    def _next_pass_progress(self) -> PassProgress:
        """The state between passes: the next pass, as it will start."""
        reusable = self._pool_reusable()
        iterable = self._dataset_kind == 1
        return PassProgress(
            epoch=self._next_epoch,
            rng=self._rng_snapshot(),
            sample_seed=self._sample_seed,
            iterable=iterable,
            num_streams=max(1, self.num_workers),
            drew_base_seed=not reusable,
            streams=next_points(self.num_workers, self.dataset, self._latest_pass, reusable),
            worker_seed=self._pool_seed if reusable else None,
            sampler=None if iterable else SamplerStack(self._index_sampler).state_now(),
        )

    def _pool_reusable(self) -> bool:
        """Whether the next pass runs on the live persistent workers (and so draws no seed)."""
        return self.num_workers > 0 and self._workers.reusable()

    def _generators(self) -> list[torch.Generator]:
        """The random generators the sampler order is drawn from (the loader's, and any the
        samplers hold), each once."""
        found: list[torch.Generator] = []
        candidates = [self.generator, self.sampler, self.batch_sampler]
        candidates += [getattr(self.batch_sampler, "sampler", None)]
        for candidate in candidates:
            generator = (
                candidate
                if isinstance(candidate, torch.Generator)
                else getattr(candidate, "generator", None)
            )
            if isinstance(generator, torch.Generator) and all(g is not generator for g in found):
                found.append(generator)
        return found

    def _rng_snapshot(self) -> dict[str, Any]:
        return {
            "torch": torch.get_rng_state(),
            "generators": generator_states(self._generators()),
        }

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
        `persistent_workers`). No event loop is involved; the calling thread blocks only while
        it waits for a batch. `close()` on the iterator stops the pass's workers at once;
        dropping it does the same."""
        iterator = _SyncIterator(self._engine(offload_inline=False), len_fn=self.__len__)
        if self.progress:
            from . import _progress  # only a loader with a progress bar needs it

            return _progress.wrap_sync(iterator, self, {})
        return iterator

    def __aiter__(self) -> AsyncIterator[Any]:
        """One pass over the data with `async for`, on the running event loop (asyncio, uvloop
        or trio): each call starts a new pass. Waiting for a batch never blocks the loop, and
        every `__anext__` yields to it once. A cancellation ends the pass and stops its
        workers. The iterator is an async context manager; `await it.aclose()` stops its
        workers without blocking the loop."""
        _lazy.warm_async()
        iterator = _AsyncIterator(self._engine(offload_inline=True))
        if self.progress:
            from . import _progress

            return _progress.wrap_async(iterator, self, {})
        return iterator

    # -- one engine --------------------------------------------------------------------------

    def _spec(self) -> WorkerSpec:
        return WorkerSpec(
            dataset=self.dataset,
            dataset_kind=self._dataset_kind,
            auto_collation=self._auto_collation,
            collate_fn=self.collate_fn,
            drop_last=self.drop_last,
            worker_init_fn=self.worker_init_fn,
            num_workers=self.num_workers,
            prefetch_factor=self._prefetch_depth(),
            multiprocessing_context=self.multiprocessing_context,
            # Stack straight into the shared-memory slab when the collate is torch's default.
            slab_collate=self.collate_fn is default_collate,
            rank=self._rank,
            world_size=self._world_size,
            worker_concurrency=self.worker_concurrency,
            sample_policy=SamplePolicy(self.on_sample_error, self.sample_retries),
        )

    def _skip_cap(self) -> SkipCap | None:
        """max_skipped for a pass; a fraction is of the sampler's length (an IterableDataset's
        ``len``, where it has one)."""
        if self.max_skipped is None:
            return None
        total: int | None = None
        if isinstance(self.max_skipped, float):
            try:
                total = len(self.dataset if self._dataset_kind == 1 else self.sampler)  # type: ignore[arg-type]
            except TypeError:
                total = None
        return SkipCap(self.max_skipped, total)

    def _draw_shared_seed(self) -> int:
        return self._shared_seeds.draw(self.generator)

    def _prefetch_depth(self) -> int:
        """Batches in flight per worker for the next pass. Read at each pass, as torch does:
        ``num_workers`` may be changed after construction (it is not a locked attribute), and
        then ``prefetch_factor`` is stale. Torch ignores it without workers (one batch at a
        time in the calling process) and uses it as is with them; ``None`` there (a loader
        built with ``num_workers=0``) makes torch's iterator fail with a TypeError, where we
        take 1 rather than fail."""
        if self.num_workers == 0:
            return 1
        return self.prefetch_factor or 1

    def _draw_base_seed(self) -> int:
        # Exactly torch's draw, at the same point (after iter(sampler), before any sampling),
        # so a loader built with the same generator or global seed sees the same sequence.
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())

    def _transfer(self) -> Transfer | None:
        """The pin / host-to-device stage this pass needs, if any: ``pin_memory`` pins, and
        warns, as the installed torch's iterator does (see ``torch_pin_plan``)."""
        plan = torch_pin_plan(self.pin_memory, self.pin_memory_device)
        plan.warn(stacklevel=4)
        return make_transfer(plan, self.device)

    def _engine(self, offload_inline: bool) -> Orchestrator:
        """One pass: its setup, its backend (made on its first next()), and its engine."""
        setup, backend = self._pass_setup(offload_inline)
        self._pass_stats = PassStats(
            max(1, self.num_workers),
            in_process=self.num_workers == 0,
            auto_collation=self._auto_collation,
        )
        # One list, appended to as batches are delivered: stats() and state_dict() read it.
        self._pass_stats.skipped = setup.progress.skipped
        if self._tuner is not None:
            # "auto": the pass feeds its counters to the controller (also stats()["tuning"]).
            setup = setup._replace(tuning=PassTuning(self._tuner, self._pass_stats))
        engine = Orchestrator(
            backend.make, setup, owns_backend=backend.owned, stats=self._pass_stats
        )
        if backend.owned:
            # Also on garbage collection of an abandoned pass (``break``, ``del``) and at exit.
            weakref.finalize(engine, engine.owned.close)
        else:
            self._workers.current_pass = weakref.ref(engine)
        return engine

    def _begin_tuned_pass(self, resume: PassProgress | None, reuse_workers: bool) -> None:
        """num_workers="auto" with an IterableDataset: each worker holds its own stream, so
        the count is chosen for the whole pass, here (from the last pass's measurements), and
        held while persistent workers are kept or a checkpoint's streams are resumed."""
        tuner = self._tuner
        assert tuner is not None
        hold: int | None = None
        if reuse_workers:
            hold = self.num_workers
        elif resume is not None and self._pending_in_progress and tuner.per_pass_workers:
            hold = len(resume.streams)
        tuner.begin_pass(hold)
        if tuner.per_pass_workers and tuner.workers.auto:
            self.num_workers = tuner.pass_workers()

    def _pass_setup(self, offload_inline: bool) -> tuple[PassSetup, BackendChoice]:
        """The one place a pass is described: its number, its randomness (drawn or replayed,
        see ``_engine.resume.begin_pass``), its workers and its settings."""
        transfer = self._transfer()
        epoch = self._next_epoch
        self._next_epoch = epoch + 1
        if self._shard_sampler is not None:
            self._shard_sampler.set_epoch(epoch)
        resume, self._pending_resume = self._pending_resume, None
        reuse_workers = self._pool_reusable()
        if self._tuner is not None:
            self._begin_tuned_pass(resume, reuse_workers)
        points, load_points = start_points(
            self.num_workers, self.dataset, self._latest_pass, resume, reuse_workers
        )
        start = begin_pass(
            epoch=epoch,
            resume=resume,
            in_progress=resume is not None and self._pending_in_progress,
            reuse_workers=reuse_workers,
            index_sampler=self._index_sampler,
            generators=self._generators(),
            draw_base_seed=self._draw_base_seed,
            sample_seed=self._sample_seed,
            seed_per_sample=self.seed_per_sample,
            iterable=self._dataset_kind == 1,
            num_streams=max(1, self.num_workers),
            rank=self._rank,
            draw_shared_seed=(self._draw_shared_seed if is_iter_datapipe(self.dataset) else None),
            starts_workers=self.num_workers > 0,
            points=points,
            load_points=load_points,
            worker_seed=self._pool_seed if reuse_workers else None,
        )
        self._sample_seed = start.sample_seed
        self._latest_pass = start.progress
        if self.num_workers > 0 and not reuse_workers:
            self._pool_seed = start.base_seed  # the workers this pass starts
        if start.shared_seed is not None:
            # The calling process's copy too, as torch seeds it (what num_workers=0 reads).
            reseed(self.dataset, start.shared_seed)
        if self.num_workers == 0 and is_datapipe(self.dataset):
            shard_in_process(self.dataset, self._world_size, self._rank)

        if self.num_workers == 0 and self.timeout != 0:
            refusal = _single_process_timeout_error()
            if refusal is not None:
                raise refusal
        backend = choose_backend(
            self._spec(),
            keeper=self._workers,
            base_seed=start.base_seed,
            workers=self.workers,
            async_front=offload_inline,
        )

        setup = PassSetup(
            batches=start.batches,
            num_workers=max(1, self.num_workers),
            prefetch=self._prefetch_depth(),
            in_order=self.in_order,
            timeout=self.timeout,
            max_worker_restarts=self.max_worker_restarts,
            progress=start.progress,
            plans=start.plans,
            traits=backend.traits,
            transfer=transfer,
            iterable_len=self._IterableDataset_len_called,
            dataset=self.dataset,
            skip_cap=self._skip_cap(),
        )
        return setup, backend

    def stats(self) -> LoaderStats:
        """A snapshot of the current pass, or of the last one if none is running (an empty one
        before the first): batches, samples, the data-bound share of the consumer's time, each
        worker's busy fraction, fetch-time percentiles and restarts, queue depths and pin time.

        ``print(loader.stats())`` shows a table; ``loader.stats().as_dict()`` is for loggers.
        """
        if self._pass_stats is None:
            return empty_stats(self.num_workers)
        return self._pass_stats.snapshot()

    def shutdown(self) -> None:
        """Stop persistent workers now rather than when the loader is collected."""
        self._workers.shutdown()


@functools.cache
def _torch_parameters() -> frozenset[str]:
    """The arguments the installed torch's DataLoader takes."""
    return frozenset(inspect.signature(torch.utils.data.DataLoader.__init__).parameters)


def _torch_only_arguments(**arguments: Any) -> dict[str, Any]:
    """Those of ``arguments`` that the installed torch's DataLoader takes (``in_order`` came
    with torch 2.6; ``pin_memory_device`` is deprecated from 2.9, and may go)."""
    accepted = _torch_parameters()
    return {name: value for name, value in arguments.items() if name in accepted}


def _single_process_timeout_error() -> AssertionError | None:
    """What torch's single-process iterator raises for ``timeout > 0``: a bare ``assert`` up to
    torch 2.9 (no message), an AssertionError that says why from 2.10 on, nothing under
    ``python -O`` where that assert is stripped."""
    arguments = _torch_single_process_timeout_refusal()
    return None if arguments is None else AssertionError(*arguments)


@functools.cache
def _torch_single_process_timeout_refusal() -> tuple[Any, ...] | None:
    """The arguments of torch's refusal, asked of torch on an empty loader (with a generator of
    its own: the iterator draws a seed, which must not come from the global RNG)."""
    nothing: Any = []
    probe: torch.utils.data.DataLoader[Any]
    probe = torch.utils.data.DataLoader(nothing, timeout=1, generator=torch.Generator())
    try:
        iter(probe)
    except AssertionError as error:
        return error.args
    return None


def _distributed_rank() -> tuple[int, int]:
    """(rank, world size) under an initialized torch.distributed, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _shared_shuffle_seed(generator: torch.Generator | None) -> int:
    """One shuffle seed for every rank: each rank draws (so all ranks use their RNGs alike),
    and rank 0's draw is broadcast. A collective: every rank builds its loader, as with
    DistributedSampler."""
    drawn = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    shared: list[Any] = [drawn]
    torch.distributed.broadcast_object_list(shared, src=0)
    return int(shared[0])


def _check_worker_concurrency(
    worker_concurrency: int, dataset: Any, dataset_kind: int, worker_init_fn: Any
) -> int:
    """Validate ``worker_concurrency`` (and an async ``worker_init_fn``) against the dataset:
    concurrency comes from an async dataset's coroutines, which a sync dataset has none of."""
    if (
        not isinstance(worker_concurrency, int)
        or isinstance(worker_concurrency, bool)
        or worker_concurrency < 1
    ):
        raise ValueError(
            "worker_concurrency option should be a positive integer, but got "
            f"worker_concurrency={worker_concurrency!r}"
        )
    is_async = is_async_dataset(dataset, dataset_kind)
    if worker_concurrency > 1 and not is_async:
        raise ValueError(
            f"worker_concurrency={worker_concurrency} needs an async dataset (`async def "
            "__getitem__`, `async def __getitems__` or `__aiter__`); "
            f"{type(dataset).__name__} is synchronous, so each worker fetches one sample at a "
            "time (use more workers, or make the dataset async)"
        )
    if inspect.iscoroutinefunction(worker_init_fn) and not is_async:
        raise ValueError(
            "an async worker_init_fn needs an async dataset: it is awaited on the event loop "
            f"an async dataset's worker runs, and {type(dataset).__name__} is synchronous"
        )
    return worker_concurrency


def _check_snapshot_steps(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(
            "snapshot_every_n_steps option should be None or a non-negative integer, but got "
            f"snapshot_every_n_steps={value!r}"
        )
    return value


def _check_sample_errors(on_sample_error: Any, max_skipped: Any, sample_retries: Any) -> None:
    if not (on_sample_error in ("raise", "skip") or callable(on_sample_error)):
        raise ValueError(
            "on_sample_error option should be 'raise', 'skip' or a callable "
            "(index, exception) -> 'raise' | 'skip', but got "
            f"on_sample_error={on_sample_error!r}"
        )
    if max_skipped is not None:
        if isinstance(max_skipped, bool) or not isinstance(max_skipped, (int, float)):
            valid = False
        elif isinstance(max_skipped, float):
            valid = 0.0 < max_skipped < 1.0
        else:
            valid = max_skipped >= 0
        if not valid:
            raise ValueError(
                "max_skipped option should be None, a non-negative integer (a count) or a "
                f"float in (0, 1) (a fraction of the pass's samples), but got "
                f"max_skipped={max_skipped!r}"
            )
        if on_sample_error == "raise":
            raise ValueError(
                "max_skipped caps skipped samples, but on_sample_error='raise' skips none: "
                "pass on_sample_error='skip' (or a callable) with it"
            )
    if (
        not isinstance(sample_retries, int)
        or isinstance(sample_retries, bool)
        or sample_retries < 0
    ):
        raise ValueError(
            "sample_retries option should be a non-negative integer, but got "
            f"sample_retries={sample_retries!r}"
        )


def _check_device(device: str | torch.device | None) -> torch.device | None:
    """Validate ``device`` now, with a clear error, rather than in the middle of a pass.

    Where no accelerator is usable (a CPU-only build, or a CUDA build on a machine without a
    GPU or driver), an accelerator ``device`` goes the way torch takes ``pin_memory=True``
    there: one warning, and batches stay on the CPU, so one script runs on both machines. An
    accelerator that is there but is not the one named, or a device index past the last, is
    an error."""
    if device is None:
        return None
    resolved = torch.device(device)
    if resolved.type == "cpu":
        return None
    if not torch.accelerator.is_available():
        warnings.warn(
            f"aioload: 'device' argument is set as {str(device)!r} but no accelerator is "
            "found, then batches stay on the CPU.",
            UserWarning,
            stacklevel=3,
        )
        return None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"aioload: device={str(device)!r} needs CUDA, but the accelerator here is "
                f"{torch.accelerator.current_accelerator()}."
            )
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        elif resolved.index >= torch.cuda.device_count():
            raise RuntimeError(
                f"aioload: device={str(device)!r} does not exist: "
                f"{torch.cuda.device_count()} CUDA device(s) are visible."
            )
        return resolved
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != resolved.type:
        raise RuntimeError(
            f"aioload: device={str(device)!r} is not available here "
            f"(current accelerator: {accelerator})."
        )
    return resolved


class _SyncIterator:
    """``for batch in loader``: the orchestrator's steps, waiting in the calling thread; only a
    wait that needs an event loop (an async dataset in this process) runs on a private one."""

    def __init__(self, engine: Orchestrator, len_fn: Callable[[], int]) -> None:
        self._engine = engine
        self._len_fn = len_fn
        # The pass's counters (for aioload.progress).
        self.pass_stats = engine.stats

    def __iter__(self) -> _SyncIterator:
        return self

    def __next__(self) -> Any:
        stats = self._engine.stats
        entered = stats.enter()
        try:
            batch = self._engine.next_blocking()
            if batch is PENDING:
                batch = _sync.run(self._engine.next())
        finally:
            stats.leave(entered)
        if batch is END:
            self._engine.close()
            raise StopIteration
        return batch

    def __len__(self) -> int:
        return self._len_fn()

    def close(self) -> None:
        """Stop this pass's workers now (``del`` or garbage collection does it too)."""
        self._engine.close()

    def __del__(self) -> None:
        self._engine.close()


class _AsyncIterator:
    """``async for batch in loader``: the orchestrator runs on the caller's own loop."""

    def __init__(self, engine: Orchestrator) -> None:
        self._engine = engine
        # The pass's counters (for aioload.progress).
        self.pass_stats = engine.stats

    def __aiter__(self) -> _AsyncIterator:
        return self

    async def __anext__(self) -> Any:
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
                await engine.aclose()
            raise
        finally:
            stats.leave(entered)
        if batch is END:
            await engine.aclose()
            raise StopAsyncIteration
        return batch

    async def aclose(self) -> None:
        """Stop this pass's workers without blocking the loop. A checkpoint, like every
        ``aclose``: it yields to the loop even when there is nothing left to stop."""
        await self._engine.aclose()

    async def __aenter__(self) -> _AsyncIterator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self._engine.close()
