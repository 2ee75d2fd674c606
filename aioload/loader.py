"""aioload.DataLoader: torch's DataLoader, with an asyncio engine behind both iterators."""

from __future__ import annotations

import inspect
import itertools
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch
import torch.distributed
import torch.utils.data
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Sampler
from torch.utils.data._utils.collate import default_collate

from . import _lazy, _sync
from ._async_fetch import is_async_dataset
from ._fetch import PassPlan
from ._orchestrator import END, PENDING, Orchestrator
from ._pinning import Transfer, make_transfer
from ._resume import (
    FORMAT,
    PassProgress,
    StreamPoint,
    YieldedPositions,
    check_generator_count,
    generator_states,
    set_generator_states,
)
from ._workers import WorkerPool, WorkerSpec
from .stats import LoaderStats, PassStats, empty_stats

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co], Generic[T_co]):
    """A drop-in replacement for ``torch.utils.data.DataLoader``.

    Same arguments, defaults, validation and results as torch's loader (it is a subclass, so
    ``isinstance(loader, torch.utils.data.DataLoader)`` holds), plus ``async for``:

        loader = aioload.DataLoader(ds, batch_size=64, num_workers=8)
        for batch in loader: ...          # classic scripts
        async for batch in loader: ...    # asyncio, uvloop or trio

    Workers are processes fed over one socket each; batches come back through reused
    shared-memory slabs and reach the consumer without a copy.
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: str | torch.device | None = None,
        max_worker_restarts: int = 0,
        seed_per_sample: bool = False,
        shard: str = "auto",
        progress: bool = False,
        worker_concurrency: int = 1,
    ) -> None:
        if shard not in ("auto", "none"):
            raise ValueError(f"shard option should be 'auto' or 'none', but got shard={shard!r}")
        # Under torch.distributed, the default sampler becomes this rank's shard. It has to be
        # decided before torch's __init__, which builds the sampler and then forbids changing
        # it. A sampler the user passes is theirs, and left alone.
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
            sampler, shuffle = shard_sampler, None
        # torch validates every argument, with its own messages, and builds the samplers.
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
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
        self.worker_concurrency = _check_worker_concurrency(
            worker_concurrency, self.dataset, self._dataset_kind, worker_init_fn
        )
        self.seed_per_sample = bool(seed_per_sample)
        self.shard = shard
        self._shard_sampler = shard_sampler
        # Every pass draws a tqdm bar (batches/s, live data-bound %); see aioload.progress.
        self.progress = progress
        self._persistent_pool: WorkerPool | None = None
        self._persistent_engine: weakref.ReferenceType[Orchestrator] | None = None
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
        # What the first pass runs here, imported now rather than inside its clock (_lazy).
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
        """Where iteration stands, as plain data (``torch.save``-able, and loadable with
        ``torch.load(weights_only=True)``).

        Call it between any two batches, in ``for`` or ``async for``. A fresh loader built with
        the same arguments and given this state by :meth:`load_state_dict` yields exactly the
        batches the interrupted pass had not yet yielded: same contents, same order (with
        ``in_order=False``: the same remaining batches). Batches that were prefetched but not
        yet yielded are fetched again. Between passes, it names the next epoch.
        """
        pending = self._pending_resume
        if pending is not None:
            progress, in_progress = pending, self._pending_in_progress
        elif self._latest_pass is not None and not self._latest_pass.finished:
            progress, in_progress = self._latest_pass, True
        else:
            progress = PassProgress(
                epoch=self._next_epoch,
                rng=self._rng_snapshot(),
                sample_seed=self._sample_seed,
                iterable=self._dataset_kind == 1,
                num_streams=max(1, self.num_workers),
                drew_base_seed=not self._pool_reusable(),
            )
            in_progress = False
        state = progress.as_dict()
        state.update(
            format=FORMAT,
            in_progress=in_progress,
            num_workers=self.num_workers,
            shard_seed=None if self._shard_sampler is None else int(self._shard_sampler.seed),
        )
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass continue from ``state`` (from :meth:`state_dict` of a loader
        built with the same arguments; ``num_workers`` may differ for a map-style dataset)."""
        if not isinstance(state, Mapping) or state.get("format") != FORMAT:
            raise ValueError(
                "aioload: load_state_dict expects a state from aioload.DataLoader.state_dict()"
            )
        progress = PassProgress.from_dict(dict(state))
        iterable = self._dataset_kind == 1
        if progress.iterable != iterable:
            raise ValueError(
                "aioload: the state was saved for a "
                f"{'n iterable' if progress.iterable else ' map-style'} dataset, this loader has "
                f"a{'n iterable' if iterable else ' map-style'} one"
            )
        if (
            iterable
            and bool(state["in_progress"])
            and len(progress.streams) != max(1, self.num_workers)
        ):
            raise ValueError(
                f"aioload: the state was saved with num_workers={state['num_workers']}; an "
                "IterableDataset's streams are per worker, so resume it with the same number"
            )
        # Checked now: a mismatch found when the next pass starts would drop the state.
        check_generator_count(progress.rng["generators"], self._generators())
        if self._shard_sampler is not None and state.get("shard_seed") is not None:
            self._shard_sampler.seed = int(state["shard_seed"])
        if progress.sample_seed is not None:
            self._sample_seed = progress.sample_seed
        if not bool(state["in_progress"]):
            progress.yielded = YieldedPositions()
            progress.streams = [StreamPoint() for _ in range(max(1, self.num_workers))]
            progress.next_worker = 0
        skipped = sum(point.samples_seen for point in progress.streams if not point.has_state)
        if skipped:
            warnings.warn(
                f"aioload: {type(self.dataset).__name__} has no state_dict()/load_state_dict(), "
                f"so it is resumed by fast-forward: its streams re-read and drop the {skipped} "
                "sample(s) they had yielded. Define both methods to resume without re-reading.",
                UserWarning,
                stacklevel=2,
            )
        self._number_next_pass(progress.epoch)
        self._pending_resume = progress
        self._pending_in_progress = bool(state["in_progress"])

    def _pool_reusable(self) -> bool:
        """Whether the next pass runs on the live persistent pool (and so draws no seed)."""
        pool = self._persistent_pool if self.persistent_workers else None
        return (
            self.num_workers > 0
            and pool is not None
            and not pool.closed
            and pool.broken is None
            and not pool.stale
        )

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

    # -- the two doors -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        iterator = _SyncIterator(self._engine(offload_inline=False), len_fn=self.__len__)
        if self.progress:
            from . import _progress  # only a loader with a progress bar needs it

            return _progress.wrap_sync(iterator, self, {})
        return iterator

    def __aiter__(self) -> AsyncIterator[Any]:
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
            prefetch_factor=self.prefetch_factor or 1,
            multiprocessing_context=self.multiprocessing_context,
            # Stack straight into the shared-memory slab when the collate is torch's default.
            slab_collate=self.collate_fn is default_collate,
            max_worker_restarts=self.max_worker_restarts,
            rank=self._rank,
            world_size=self._world_size,
            worker_concurrency=self.worker_concurrency,
        )

    def _draw_base_seed(self) -> int:
        # Exactly torch's draw, at the same point (after iter(sampler), before any sampling),
        # so a loader built with the same generator or global seed sees the same sequence.
        return int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())

    def _transfer(self) -> Transfer | None:
        """The pin / host-to-device stage this pass needs, if any (torch's warnings kept)."""
        if self.pin_memory and self.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{self.pin_memory_device}'.",
                stacklevel=4,
            )
        if self.pin_memory and not torch.accelerator.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=4,
            )
        return make_transfer(self.pin_memory, self.device)

    def _engine(self, offload_inline: bool) -> Orchestrator:
        transfer = self._transfer()
        epoch = self._next_epoch
        self._next_epoch = epoch + 1
        if self._shard_sampler is not None:
            self._shard_sampler.set_epoch(epoch)
        resume, self._pending_resume = self._pending_resume, None
        in_progress = resume is not None and self._pending_in_progress
        persistent_pool = self._persistent_pool if self.persistent_workers else None
        reuse_pool = self._pool_reusable()
        # A pass draws a base seed unless it reuses a persistent pool; a replayed pass draws
        # from the recorded RNGs exactly as the original did (a pool it must start anyway gets
        # its seed from the caller's RNG afterwards).
        replay_draw = resume.drew_base_seed if resume is not None else not reuse_pool
        # The pass's randomness is drawn here, at its start, and nowhere else: the sampler's
        # order (torch's samplers draw on their first next(), hence the priming) and the base
        # seed. Recording the RNG states just before makes the pass replayable; a resumed pass
        # replays them, and then gives the caller back their own global RNG untouched.
        snapshot = resume.rng if resume is not None else self._rng_snapshot()
        callers_rng = torch.get_rng_state() if resume is not None else None
        try:
            if resume is not None:
                torch.set_rng_state(snapshot["torch"])
                set_generator_states(self._generators(), snapshot["generators"])
            # torch's order of RNG use: iter(sampler), then the base seed, then sampling.
            sampler_iter = iter(self._index_sampler)
            base_seed = self._draw_base_seed() if replay_draw else None
            sampler_iter = _primed(sampler_iter)
            if base_seed is None and not reuse_pool:
                # A pool must start, but the replayed pass drew no seed (it had reused its
                # pool): draw one without moving the generators the next passes' order comes
                # from. (A draw from the global RNG is undone with the caller's RNG below.)
                generators = self._generators()
                saved = generator_states(generators)
                base_seed = self._draw_base_seed()
                set_generator_states(generators, saved)
        finally:
            if callers_rng is not None:
                torch.set_rng_state(callers_rng)
        if reuse_pool:
            base_seed = None
        if self._sample_seed is None and base_seed is not None:
            self._sample_seed = base_seed

        iterable = self._dataset_kind == 1
        streams = max(1, self.num_workers)
        progress = PassProgress(
            epoch=epoch,
            rng=snapshot,
            sample_seed=self._sample_seed if self.seed_per_sample else None,
            iterable=iterable,
            num_streams=streams,
            drew_base_seed=replay_draw,
        )
        skip: YieldedPositions | None = None
        if resume is not None and in_progress:
            if iterable:
                progress.streams = [StreamPoint(**vars(point)) for point in resume.streams]
                progress.next_worker = resume.next_worker
                # Positions mean nothing to an IterableDataset; only the count goes on.
                progress.yielded = YieldedPositions(len(resume.yielded))
            else:
                progress.yielded = resume.yielded.copy()
                skip = resume.yielded
        self._latest_pass = progress
        plans = [
            PassPlan(
                epoch=epoch,
                sample_seed=progress.sample_seed,
                samples_seen=point.samples_seen,
                has_state=point.has_state,
                dataset_state=point.state,
                ended=point.ended,
                stream_id=self._rank * streams + worker_id,
            )
            for worker_id, point in enumerate(progress.streams)
        ]

        first_epoch = True
        spec = self._spec()
        make_source: Callable[[], Any]
        if self.num_workers == 0:
            if self.timeout != 0:
                raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
            owns = True

            def make_source() -> Any:
                # Imported here: only num_workers=0 runs datasets in this process.
                from ._inline import InlineSource

                return InlineSource(spec, offload=offload_inline)

        elif self.persistent_workers:
            # One pool for the loader's lifetime; a pass that is still open is superseded.
            previous = self._persistent_engine() if self._persistent_engine else None
            if previous is not None:
                previous.close()
            owns = False
            pool = persistent_pool
            if reuse_pool:
                first_epoch = False

                def make_source() -> Any:
                    return pool

            else:
                if pool is not None:
                    pool.close()
                    self._persistent_pool = None
                assert base_seed is not None
                new_pool_seed = base_seed

                def make_source() -> Any:
                    new_pool = WorkerPool(spec, new_pool_seed)
                    self._persistent_pool = new_pool
                    # The workers die with the loader (or at interpreter exit), not with a pass.
                    weakref.finalize(self, new_pool.close)
                    return new_pool

        else:
            owns = True
            assert base_seed is not None
            pass_seed = base_seed

            def make_source() -> Any:
                return WorkerPool(spec, pass_seed)

        self._pass_stats = PassStats(
            max(1, self.num_workers),
            in_process=self.num_workers == 0,
            auto_collation=self._auto_collation,
        )
        engine = Orchestrator(
            make_source,
            sampler_iter=sampler_iter,
            prefetch=self.prefetch_factor or 1,
            in_order=self.in_order,
            timeout=self.timeout,
            owns_source=owns,
            first_epoch=first_epoch,
            iterable_len=self._IterableDataset_len_called,
            dataset=self.dataset,
            num_workers=max(1, self.num_workers),
            offload_start=offload_inline and self.num_workers > 0,
            plans=plans,
            progress=progress,
            skip=skip,
            start=len(progress.yielded) if iterable else 0,
            transfer=transfer,
            stats=self._pass_stats,
        )
        if owns:
            # Also on garbage collection of an abandoned pass (``break``, ``del``) and at exit.
            weakref.finalize(engine, engine.owned.close)
        else:
            self._persistent_engine = weakref.ref(engine)
        return engine

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
        if self._persistent_pool is not None:
            self._persistent_pool.close()
            self._persistent_pool = None


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


_NOTHING: Any = object()


def _primed(sampler_iter: Iterator[Any]) -> Iterator[Any]:
    """Take the sampler's first batch now, so that the random draws a sampler makes when it
    starts (torch's make them on the first next()) happen at the pass's start."""
    first = next(sampler_iter, _NOTHING)
    if first is _NOTHING:
        return iter(())
    return itertools.chain((first,), sampler_iter)


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


def _check_device(device: str | torch.device | None) -> torch.device | None:
    """Validate ``device`` now, with a clear error, rather than in the middle of a pass."""
    if device is None:
        return None
    resolved = torch.device(device)
    if resolved.type == "cpu":
        return None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"aioload: device={str(device)!r} needs CUDA, but torch.cuda.is_available() is "
                "False (no GPU, or a CPU-only build of torch). Use device=None for CPU batches."
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
    """``for batch in loader``: each step runs the orchestrator on a private event loop."""

    def __init__(self, engine: Orchestrator, len_fn: Callable[[], int]) -> None:
        self._engine = engine
        self._len_fn = len_fn

    def __iter__(self) -> _SyncIterator:
        return self

    def __next__(self) -> Any:
        stats = self._engine.stats
        entered = stats.enter()
        try:
            batch = self._engine.step()
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

    def __aiter__(self) -> _AsyncIterator:
        return self

    async def __anext__(self) -> Any:
        stats = self._engine.stats
        entered = stats.enter()
        try:
            batch = await self._engine.next()
        finally:
            stats.leave(entered)
        if batch is END:
            await self._engine.aclose()
            raise StopAsyncIteration
        return batch

    async def aclose(self) -> None:
        """Stop this pass's workers without blocking the loop."""
        await self._engine.aclose()

    async def __aenter__(self) -> _AsyncIterator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self._engine.close()
