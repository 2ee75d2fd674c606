"""aioload.DataLoader: torch's DataLoader, with an asyncio engine behind both iterators."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch
import torch.utils.data
from torch.utils.data import Dataset, IterableDataset, Sampler
from torch.utils.data._utils.collate import default_collate

from . import _progress, _sync
from ._inline import InlineSource
from ._orchestrator import END, PENDING, Orchestrator
from ._pinning import Transfer, make_transfer
from ._workers import WorkerPool, WorkerSpec
from .stats import LoaderStats, PassStats, empty_stats

__all__ = ["DataLoader"]

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co], Generic[T_co]):
    """A drop-in replacement for :class:`torch.utils.data.DataLoader`.

    Same arguments, defaults, validation and results as torch's loader (it is a subclass, so
    ``isinstance(loader, torch.utils.data.DataLoader)`` holds), plus ``async for``::

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
        progress: bool = False,
    ) -> None:
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
        # Every pass draws a tqdm bar (batches/s, live data-bound %); see aioload.progress.
        self.progress = progress
        self._persistent_pool: WorkerPool | None = None
        self._persistent_engine: weakref.ReferenceType[Orchestrator] | None = None
        # The counters of the newest pass (kept after it ends, for stats()).
        self._pass_stats: PassStats | None = None

    # -- the two doors -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        iterator = _SyncIterator(self._engine(offload_inline=False), len_fn=self.__len__)
        if self.progress:
            return _progress.wrap_sync(iterator, self, {})
        return iterator

    def __aiter__(self) -> AsyncIterator[Any]:
        iterator = _AsyncIterator(self._engine(offload_inline=True))
        if self.progress:
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
        # torch's order of RNG use: iter(sampler), then the base seed, then sampling.
        sampler_iter = iter(self._index_sampler)
        first_epoch = True
        spec = self._spec()
        make_source: Callable[[], Any]
        if self.num_workers == 0:
            if self.timeout != 0:
                raise AssertionError("_SingleProcessDataLoaderIter requires timeout == 0")
            self._draw_base_seed()
            owns = True

            def make_source() -> Any:
                return InlineSource(spec, offload=offload_inline)

        elif self.persistent_workers:
            # One pool for the loader's lifetime; a pass that is still open is superseded.
            previous = self._persistent_engine() if self._persistent_engine else None
            if previous is not None:
                previous.close()
            owns = False
            pool = self._persistent_pool
            if pool is not None and not pool.closed and pool.broken is None and not pool.stale:
                first_epoch = False

                def make_source() -> Any:
                    return pool

            else:
                if pool is not None:
                    pool.close()
                    self._persistent_pool = None
                base_seed = self._draw_base_seed()

                def make_source() -> Any:
                    new_pool = WorkerPool(spec, base_seed)
                    self._persistent_pool = new_pool
                    # The workers die with the loader (or at interpreter exit), not with a pass.
                    weakref.finalize(self, new_pool.close)
                    return new_pool

        else:
            base_seed = self._draw_base_seed()
            owns = True

            def make_source() -> Any:
                return WorkerPool(spec, base_seed)

        self._pass_stats = PassStats(
            max(1, self.num_workers),
            in_process=self.num_workers == 0,
            # An IterableDataset's last batches may be short: count what each one holds.
            count_from_batch=isinstance(self.dataset, IterableDataset) and self._auto_collation,
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
