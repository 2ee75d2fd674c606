"""The fetch step for async datasets: ``async def __getitem__``, ``async def __getitems__``
(or ``getitems``), or ``__aiter__``, fetched on an event loop with many samples in flight.

It has the same responsibilities as ``_worker.fetch.Fetcher`` (torch's fetchers, then ``collate_fn``,
``seed_per_sample``, and resume of an IterableDataset from a ``PassPlan``), split in two so
that the caller can put the synchronous collate where it wants it (a worker collates into a
shared-memory slab): ``await gather(indices)`` returns the samples, ``collate(samples)`` the
batch.

It runs on whatever loop awaits it: a worker's own asyncio/uvloop loop, the consumer's loop
under ``async for`` with ``num_workers=0`` (asyncio, uvloop or trio), or the sync front end's
private loop. So everything here uses anyio, never asyncio directly.

Two things differ from the sync fetcher:

- a failing sample cancels its batch's sibling fetches (they share a task group), and the
  batch fails with the original exception, not an ExceptionGroup;
- ``seed_per_sample`` cannot seed the global RNGs once before a sample, because concurrent
  samples interleave at every ``await``. Each sample's coroutine instead runs inside
  ``_OwnRng``, which installs that sample's RNG states before every step of the coroutine and
  saves them after, so each sample draws from its own stream whatever the interleaving, and
  whoever runs between two steps (a sibling, or the consumer's own tasks) sees its own.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

import anyio
from torch.utils.data import IterableDataset

from .._wire.messages import IndexRange, PassPlan
from .._wire.slabs import LazyArena

# Detection lives in its own small module: the loader and every worker need it, and neither
# should import anyio (this module's) to ask whether a dataset is async at all.
from .async_detect import batched_hook as _batched_hook
from .async_detect import has_async_context, is_async_dataset
from .fetch import (
    BaseFetcher,
    FetchSpec,
    Gathered,
    RngStates,
    _Failed,
    _record,
    _seed_all,
    gathered_batch,
    retry_delay,
)

__all__ = [
    "AsyncFetcher",
    "AsyncIterableDataset",
    "StreamEnd",
    "has_async_context",
    "is_async_dataset",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class AsyncIterableDataset(IterableDataset[T_co]):
    """Base class for an IterableDataset that yields its samples from ``__aiter__``.

    torch's IterableDataset makes ``__iter__`` abstract; this base class fills it in with a
    clear error, so a subclass needs only ``__aiter__``. (Any IterableDataset that defines
    ``__aiter__`` is read asynchronously by aioload; subclassing this one is a convenience.)
    """

    def __iter__(self) -> Any:
        raise TypeError(
            f"{type(self).__name__} is an async dataset: read it with aioload.DataLoader, "
            "which iterates it with `async for` on an event loop"
        )

    def __aiter__(self) -> Any:
        raise NotImplementedError


class StreamEnd(Exception):
    """An async IterableDataset's stream is done (``StopIteration`` cannot cross an await)."""


# -- one RNG stream per sample ---------------------------------------------------------------


def _seeded_states(seed: int) -> RngStates:
    """The RNG states that seeding with ``seed`` gives, without changing the current ones."""
    current = RngStates()
    _seed_all(seed)
    seeded = RngStates()
    current.install()
    return seeded


class _OwnRng(Awaitable[T]):
    """Awaits ``awaitable`` step by step, each step under its own RNG states.

    A coroutine runs in steps: from one suspension to the next. Before each step the sample's
    states are installed, after it they are saved and whatever was there before is put back.
    The sample thus sees one uninterrupted seeded stream, and everyone else (sibling samples,
    the consumer's tasks on a shared loop, the caller's training RNG) sees theirs. Works on any
    loop: it only relays what the coroutine yields to the loop, and what the loop sends or
    throws back (including cancellation).
    """

    __slots__ = ("_awaitable", "_states")

    def __init__(self, awaitable: Awaitable[T], states: RngStates) -> None:
        self._awaitable = awaitable
        self._states = states

    def __await__(self) -> Generator[Any, Any, T]:
        steps: Any = self._awaitable.__await__()
        to_send: Any = None
        to_throw: BaseException | None = None
        while True:
            theirs = RngStates()
            self._states.install()
            try:
                if to_throw is not None:
                    # Dropped before the step: a kept reference would tie the exception's
                    # traceback (and this frame) into a cycle.
                    exc, to_throw = to_throw, None
                    signal = steps.throw(exc)
                    del exc
                else:
                    signal = steps.send(to_send)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            finally:
                self._states = RngStates()
                theirs.install()
            try:
                to_send = yield signal
            except GeneratorExit:
                # This wrapper is being closed (its task was abandoned): close the sample too.
                steps.close()
                raise
            except BaseException as exc:
                # Cancellation, or anything else the loop throws in: the sample must see it.
                to_send, to_throw = None, exc


async def _fetch_into(
    fetch_one: Callable[[Any], Awaitable[Any]],
    samples: list[Any],
    position: int,
    key: Any,
    failures: list[Exception],
    batch: anyio.abc.TaskGroup,
) -> None:
    """One sample of a batch gathered in a task group (``AsyncFetcher._gather_each``)."""
    try:
        samples[position] = await fetch_one(key)
    except Exception as exc:
        # Cancellation is a BaseException and passes through. A real failure cancels the
        # siblings: the batch is lost anyway, and their requests need not finish.
        failures.append(exc)
        batch.cancel_scope.cancel()


# -- the fetcher -----------------------------------------------------------------------------


class AsyncFetcher(BaseFetcher):
    """``Fetcher``'s counterpart for async datasets. At most ``concurrency`` per-index fetches
    of this fetcher are in flight at once, across every batch it is gathering."""

    def __init__(self, spec: FetchSpec, plan: PassPlan, concurrency: int = 1) -> None:
        super().__init__(spec, plan)
        self.concurrency = concurrency
        self.batched = None if self.iterable else _batched_hook(spec.dataset)
        self.started = False
        # Made on first use: an anyio semaphore belongs to the loop (and backend) it is used on.
        self._slots: anyio.Semaphore | None = None

    def set_concurrency(self, concurrency: int) -> None:
        """worker_concurrency="auto": from now on at most ``concurrency`` fetches at once. More
        slots are released into the semaphore; fewer take a new one (fetches holding a slot
        of the old one finish on it, so for a moment both counts run)."""
        old, self.concurrency = self.concurrency, concurrency
        slots = self._slots
        if slots is None or concurrency == old:
            return
        if concurrency > old:
            for _ in range(concurrency - old):
                slots.release()
        else:
            self._slots = anyio.Semaphore(concurrency)

    async def fetch(self, indices: Any) -> Any:
        return self.collate(await self.gather(indices))

    def collate(self, samples: Any, arena: LazyArena | None = None) -> Any:
        """The batch of ``samples``. (Its collate finds ``arena`` where torch's collate looks
        it up: NOTE [the arena of a collate] in ``_wire.slabs``.)"""
        if type(samples) is Gathered:
            return self.collate_gathered(samples)
        return self.collate_fn(samples)

    async def gather(self, indices: Any) -> Any:
        """The samples of one batch (a list; one sample without auto-collation; a
        ``Gathered`` under an active sample-error policy), for ``collate``. Raises StreamEnd
        when an IterableDataset's stream is done."""
        if type(indices) is IndexRange:
            indices = indices.as_list()
        if self.iterable:
            if self.policy.active:
                return await self._gather_iterable_policy(indices)
            samples = await self._gather_iterable(indices)
            if not self.keep_last:
                return samples
            count = len(samples) if self.auto_collation else 1
            keys = list(range(self.samples_seen - count, self.samples_seen))
        else:
            if self.policy.active:
                return await self._gather_map_policy(indices)
            samples = await self._gather_map(indices)
            if not self.keep_last:
                return samples
            keys = list(indices) if self.auto_collation else [indices]
        # In a worker, the keys go with the samples to the collate, which keeps both until
        # the batch is sent: a sample that cannot be sent is then named.
        return Gathered(keys, samples, opaque=True)

    async def aclose(self) -> None:
        """Close an IterableDataset's async generator on the loop it ran on (its ``finally``
        blocks may await)."""
        stream, self.stream = self.stream, None
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()

    def _own_rng(self, awaitable: Awaitable[T], key: Any) -> Awaitable[T]:
        if not self.seeded:
            return awaitable
        return _OwnRng(awaitable, _seeded_states(self.seed_of(key)))

    # -- map-style ---------------------------------------------------------------------------

    async def _gather_map(self, indices: Any) -> Any:
        if not self.auto_collation:
            return await self._own_rng(self.dataset[indices], indices)
        if self.batched is not None:
            # One call for the whole batch, seeded from its first index as the sync fetcher
            # does; the dataset decides its own concurrency.
            return await self._own_rng(self.batched(indices), indices[0] if len(indices) else 0)
        return await self._gather_each(indices, self._fetch_one)

    async def _fetch_one(self, index: Any) -> Any:
        assert self._slots is not None
        async with self._slots:
            return await self._own_rng(self.dataset[index], index)

    async def _gather_each(
        self, keys: Any, fetch_one: Callable[[Any], Awaitable[Any]]
    ) -> list[Any]:
        """``await fetch_one(key)`` for each of ``keys`` (``fetch_one`` takes a slot: at most
        ``concurrency`` are in flight across every batch this fetcher is gathering), the
        samples in the keys' order."""
        if self._slots is None:
            self._slots = anyio.Semaphore(self.concurrency)
        samples: list[Any] = [None] * len(keys)
        if self.concurrency == 1 or len(keys) == 1:
            # Nothing to overlap within the batch: no task group. The slot still counts, as
            # a worker may be gathering several batches at once.
            for position, key in enumerate(keys):
                samples[position] = await fetch_one(key)
            return samples
        failures: list[Exception] = []
        async with anyio.create_task_group() as batch:
            for position, key in enumerate(keys):
                batch.start_soon(_fetch_into, fetch_one, samples, position, key, failures, batch)
        if failures:
            # The first failure, as itself (not an ExceptionGroup): the consumer sees the
            # dataset's own exception type, as with a sync dataset.
            failure = failures.pop(0)
            failures.clear()
            try:
                raise failure
            finally:
                del failure
        return samples

    # -- map-style, under the sample-error policy ---------------------------------------------

    async def _gather_map_policy(self, indices: Any) -> Gathered:
        """As ``_gather_map``, but each sample on its own: retried, then raised or skipped.
        A failing batched fetch falls back to fetching its samples one by one."""
        keys = list(indices) if self.auto_collation else [indices]
        if self.auto_collation and self.batched is not None:
            try:
                data = await self._own_rng(self.batched(indices), keys[0] if keys else 0)
            except Exception:
                pass  # one by one, below: only the bad samples are lost
            else:
                return gathered_batch(keys, data)
        # A sample the policy raises loses the batch, as without a policy.
        return Gathered(keys, await self._gather_each(keys, self._get))

    async def _get(self, key: Any) -> Any:
        """One sample, retried ``policy.retries`` times with a growing pause, then raised or
        skipped. The pause holds no concurrency slot, and only this sample's task sleeps: the
        other fetches in flight go on."""
        assert self._slots is not None
        tries = 0
        while True:
            tries += 1
            try:
                async with self._slots:
                    item = self.dataset[key]
                    if inspect.isawaitable(item):
                        # (A sync __getitem__ beside an async __getitems__ returns the sample.)
                        item = await self._own_rng(item, key)
                    return item
            except Exception as exc:
                if tries <= self.policy.retries:
                    await anyio.sleep(retry_delay(tries - 1))
                    continue
                if self.policy.skips(key, exc):
                    return _Failed(_record(key, exc, tries))
                raise

    # -- iterable ----------------------------------------------------------------------------

    async def _draw(self) -> Any:
        """The stream's next sample under the policy (``_Failed`` when skipped); as the sync
        fetcher's ``_draw``, without retries."""
        try:
            return await self._next_sample()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            if not self.policy.skips(self.samples_seen, exc):
                raise
            return self.lost_draw(exc)

    async def _gather_iterable_policy(self, indices: Any) -> Gathered:
        if not self.started:
            await self.start()
        if self.ended:
            raise StreamEnd
        wanted = len(indices) if self.auto_collation else 1
        samples: list[Any] = []
        with contextlib.suppress(StopAsyncIteration):
            while len(samples) < wanted:
                samples.append(await self._draw())
        return self.drawn_batch(samples, wanted, StreamEnd)

    async def start(self) -> None:
        """Open the stream: load the checkpointed state, or fast-forward past what was yielded
        before. (``gather`` does it on first use when nobody called it.)"""
        self.started = True
        if self.ended:
            return
        plan = self.plan
        self.load_dataset_state()
        if self.opened(self.dataset.__aiter__()):
            self.samples_seen = plan.samples_seen
            return
        try:
            for _ in range(plan.samples_seen):
                try:
                    await self._next_sample()
                except StopAsyncIteration:
                    raise
                except Exception:
                    # Failed when first drawn too, and skipped (or raised) then.
                    if not self.policy.may_skip:
                        raise
                    self.samples_seen += 1
        except StopAsyncIteration:
            self.ended = True  # shorter than it was: nothing is left to yield

    async def _next_sample(self) -> Any:
        # Named by stream and position, as in the sync fetcher.
        sample = await self._own_rng(
            self.stream.__anext__(), (self.plan.stream_id, self.samples_seen)
        )
        self.samples_seen += 1
        return sample

    async def _gather_iterable(self, indices: Any) -> Any:
        if not self.started:
            await self.start()
        if self.ended:
            raise StreamEnd
        if not self.auto_collation:
            try:
                return await self._next_sample()
            except StopAsyncIteration:
                self.ended = True
                raise StreamEnd from None
        samples: list[Any] = []
        for _ in indices:
            try:
                samples.append(await self._next_sample())
            except StopAsyncIteration:
                self.ended = True
                break
        if not samples or (self.drop_last and len(samples) < len(indices)):
            self.ended = True
            raise StreamEnd
        return samples
