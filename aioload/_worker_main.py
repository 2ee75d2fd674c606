"""Code that runs inside a worker process.

A worker is a loop over its socket: it reads index tasks, fetches and collates them with torch's
own fetchers, puts the batch in a shared-memory slab and answers with a small frame. Every task
gets exactly one answer ("ok", "pickled", "err" or "end"), which keeps the parent's bookkeeping
simple: a task is in flight until its answer arrives or its worker dies.

The worker never outlives its parent. It waits for work in ``poll`` with a one-second bound; a
closed socket (the parent exited, was killed, or shut us down) ends it at once, and a changed
parent pid ends it within a second even if something else still holds the parent's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
import pickle
import random
import select
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import numpy as np
import torch
import torch.utils.data._utils.worker as torch_worker
from torch._utils import ExceptionWrapper, KeyErrorMessage
from torch.utils.data._utils.worker import _generate_state

from . import _transport
from ._async_fetch import AsyncFetcher, StreamEnd, has_async_context, is_async_dataset
from ._channel import ChannelClosed, WorkerChannel
from ._fetch import Fetcher, PassPlan, SamplePolicy
from .errors import WorkerError

__all__ = ["RemoteError", "WorkerConfig", "WorkerInfo", "get_worker_info", "worker_main"]

_PARENT_CHECK_S = 1.0


@dataclass(frozen=True, slots=True)
class WorkerInfo(torch_worker.WorkerInfo):
    """Information about the current aioload worker process.

    A subclass of torch's WorkerInfo with the same fields (``id``, ``num_workers``, ``seed``,
    ``dataset``); inside an aioload worker, ``torch.utils.data.get_worker_info()`` returns the
    same object, so datasets that shard themselves by worker work unchanged.

    Under ``torch.distributed`` it also carries ``rank`` and ``world_size``, and the worker's
    place among all workers of all ranks: ``global_id`` (``rank * num_workers + id``) and
    ``global_num_workers`` (``world_size * num_workers``). An IterableDataset that shards by
    ``global_id`` gives every sample to exactly one worker of one rank. Without
    ``torch.distributed`` they equal ``id`` and ``num_workers`` (rank 0 of 1).
    """

    rank: int = 0
    world_size: int = 1

    @property
    def global_id(self) -> int:
        return self.rank * self.num_workers + self.id

    @property
    def global_num_workers(self) -> int:
        return self.world_size * self.num_workers


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """The current worker's WorkerInfo inside an aioload worker process, None elsewhere."""
    return _worker_info


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


@dataclass
class WorkerConfig:
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


def _set_worker_info(info: WorkerInfo) -> None:
    global _worker_info
    _worker_info = info
    # torch.utils.data.get_worker_info() reads this module global.
    torch_worker._worker_info = info


def _seed(base_seed: int, worker_id: int) -> int:
    # The same seeds torch's own workers use, so random augmentations match torch's loader.
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_generate_state(base_seed, worker_id))  # type: ignore[no-untyped-call]
    return seed


def worker_main(config: WorkerConfig, sock: Any) -> None:
    # (Under fork, the parent's ends of every worker's socket that we inherited were closed by
    # _workers._disown_after_fork before this runs.)
    # Ctrl-C goes to the whole process group; the parent decides what it means and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    channel = WorkerChannel(sock)
    # ChannelClosed and friends: the parent is gone or shut us down.
    with contextlib.suppress(ChannelClosed, BrokenPipeError, ConnectionResetError):
        _Worker(config, channel).run()


class _Worker:
    # An IterableDataset's __iter__ failed this epoch (init_error: the worker's setup failed).
    fetch_error: RemoteError | None = None

    def __init__(self, config: WorkerConfig, channel: WorkerChannel) -> None:
        self.config = config
        self.channel = channel
        self.pool = _transport.WorkerSlabPool(config.max_idle_slabs)
        self.generation = config.generation
        self.pending: deque[Any] = deque()
        self.fetcher: Any = None
        self.init_error: RemoteError | None = None
        # An async worker_init_fn's coroutine, awaited on the worker's loop before any task.
        self.async_init: Any = None
        # Async map-style batches being gathered, by generation: cancelled when a newer pass
        # starts (persistent workers after a break), so stale fetches free their slots.
        self.gathering: dict[int, set[anyio.CancelScope]] = {}
        self.parent_gone = False
        self.iteration_end = False
        self.parent_pid = os.getppid()
        # When the task being answered started: every answer carries its seconds, for stats.
        self.task_started = 0.0
        self.poller = select.poll()
        self.poller.register(channel.sock.fileno(), select.POLLIN)

        wid = config.worker_id
        seed = _seed(config.base_seed, wid)
        try:
            payload = config.payload
            objects = pickle.loads(payload) if isinstance(payload, bytes) else payload
            self.dataset, collate_fn, init_fn = objects
            if config.slab_collate:
                collate_fn = _transport.slab_collate
            self.collate_fn = collate_fn
            _set_worker_info(
                WorkerInfo(
                    id=wid,
                    num_workers=config.num_workers,
                    seed=seed,
                    dataset=self.dataset,
                    rank=config.rank,
                    world_size=config.world_size,
                )
            )
            if init_fn is not None:
                self.async_init = init_fn(wid)
                if not inspect.isawaitable(self.async_init):
                    self.async_init = None
        except Exception:
            # Reported as the answer to every task this worker gets, so it reaches the consumer.
            self.init_error = RemoteError(wid)
            self.init_error.from_init = True
        # The fetcher is made when the pass's plan arrives (the first message, always): an
        # IterableDataset being resumed must load its state before __iter__ runs.
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
                self.init_error = RemoteError(wid)
                self.init_error.from_init = True

    def _try_new_fetcher(self, plan: PassPlan) -> None:
        # An IterableDataset's __iter__ runs here, once per epoch: its failure is this
        # epoch's, and the next epoch (a "reset") tries again.
        self.fetch_error = None
        self.fetcher = None
        try:
            self.fetcher = Fetcher(
                self.config.dataset_kind,
                self.dataset,
                self.config.auto_collation,
                self.collate_fn,
                self.config.drop_last,
                plan,
                policy=self.config.sample_policy,
            )
        except Exception:
            self.fetch_error = RemoteError(self.config.worker_id)

    # -- reading -----------------------------------------------------------------------------

    def _next_message(self) -> Any:
        while not self.pending:
            while not self.channel.has_frame():
                if not self.poller.poll(int(_PARENT_CHECK_S * 1000)):
                    if os.getppid() != self.parent_pid:
                        raise ChannelClosed
                    continue
                self.channel.fill(wait=False)
            self._absorb(self.channel.pop())
        return self.pending.popleft()

    def _drain(self) -> None:
        """Take in what the parent has already sent, without waiting: slabs it freed since the
        current task was sent are then reused instead of growing the pool, and a newer epoch
        already announced lets us skip tasks that nobody waits for any more."""
        self.channel.fill(wait=False)
        while self.channel.has_frame():
            self._absorb(self.channel.pop())

    def _absorb(self, message: Any) -> None:
        kind = message[0]
        if kind == "free":
            for slab_id in message[1]:
                self.pool.release(slab_id)
        else:
            if kind == "reset":
                self.generation = max(self.generation, message[1])
            self.pending.append(message)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        if self.is_async:
            self._run_async()
            return
        while True:
            message = self._next_message()
            kind = message[0]
            if kind == "task":
                _, task_id, generation, indices = message
                self._drain()
                if generation < self.generation:
                    continue  # a task of an epoch the parent has already left
                self._run_task(task_id, generation, indices)
            elif kind == "reset":
                if message[1] >= self.generation and self.init_error is None:
                    self.iteration_end = False
                    self._try_new_fetcher(message[2])
            elif kind == "stop":
                return

    def _answered_without_fetch(self, task_id: int, generation: int) -> bool:
        """Answer a task that needs no fetch: this worker's setup or this epoch's stream
        failed ("err"), or its IterableDataset stream has run dry ("end")."""
        error = self.init_error or self.fetch_error
        if error is not None:
            self._send(("err", task_id, generation, error))
            return True
        if self.iteration_end:
            self._send(("end", task_id, generation))
            return True
        return False

    def _run_task(self, task_id: int, generation: int, indices: Any) -> None:
        self.task_started = time.perf_counter()
        if self._answered_without_fetch(task_id, generation):
            return
        fetcher = self.fetcher
        self._produce(task_id, generation, lambda: fetcher.fetch(indices))

    def _produce(self, task_id: int, generation: int, make_batch: Callable[[], Any]) -> None:
        """Run ``make_batch`` (a fetch, or an async fetch's collate) with a slab to collate
        into, and answer the task."""
        wid = self.config.worker_id
        arena = None
        try:
            if self.config.slab_collate:
                try:
                    arena = self.pool.arena()
                except OSError:
                    arena = None  # no shared memory now: collate as usual, send by value
            _transport._current_arena = arena
            try:
                data = make_batch()
            finally:
                _transport._current_arena = None
        except StopIteration:
            if arena is not None:
                self.pool.release(arena.slab.id)
            if self.config.dataset_kind != 1:  # only an IterableDataset may run dry
                self._send(("err", task_id, generation, RemoteError(wid)))
                return
            self.iteration_end = True
            self._send(("end", task_id, generation))
            return
        except Exception:
            if arena is not None:
                self.pool.release(arena.slab.id)
            self._send(("err", task_id, generation, RemoteError(wid)))
            return
        if self.config.dataset_kind == 1:
            # Where this stream stands after the batch, sent ahead of it: a checkpoint taken
            # after the batch is yielded resumes from exactly here.
            try:
                state = self.fetcher.state()
            except Exception:
                if arena is not None:
                    self.pool.release(arena.slab.id)
                self._send(("err", task_id, generation, RemoteError(wid)))
                return
            self._send(
                ("state", task_id, generation, self.fetcher.samples_seen, state, self.fetcher.ended)
            )
        self._send_batch(task_id, generation, data, arena)

    # -- async datasets ----------------------------------------------------------------------
    #
    # The worker runs one event loop for its whole life (uvloop when installed). One coroutine
    # reads the socket; each map-style task runs as its own task, so the batches the parent
    # has sent ahead (up to prefetch_factor) are gathered at once, sharing the fetcher's
    # worker_concurrency slots. An IterableDataset's tasks run one after another, in order,
    # since they pull from one stream. Answers go out as batches complete; the parent
    # reorders them.

    def _run_async(self) -> None:
        loop = _new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        finally:
            # Async generators the dataset left suspended get their finally blocks run here,
            # on the loop they belong to, before it closes.
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        wid = self.config.worker_id
        if self.async_init is not None:
            init, self.async_init = self.async_init, None
            try:
                await init
            except Exception:
                self.init_error = RemoteError(wid)
                self.init_error.from_init = True
        async with contextlib.AsyncExitStack() as resources:
            # The dataset's per-worker setup (say, an HTTP client session) is entered once,
            # here, on this loop, and exited when the loop below ends: after the parent closed
            # our socket (a graceful shutdown: every in-flight fetch has been cancelled by
            # then, so nothing uses the resources while they close) or the parent died.
            # Shutdown gives a worker 0.5 s before SIGKILL, which is ample to close a client.
            if self.init_error is None and has_async_context(self.dataset):
                try:
                    await resources.enter_async_context(self.dataset)
                except Exception:
                    self.init_error = RemoteError(wid)
                    self.init_error.from_init = True
            try:
                await self._serve_tasks()
            finally:
                if self.fetcher is not None:
                    with contextlib.suppress(Exception):
                        await self.fetcher.aclose()

    async def _serve_tasks(self) -> None:
        iterable = self.config.dataset_kind == 1
        # Tasks and resets of an IterableDataset, in arrival order, for the one runner.
        ordered_in, ordered_out = anyio.create_memory_object_stream[Any](math.inf)
        async with anyio.create_task_group() as tasks:
            if iterable:
                tasks.start_soon(self._guarded, tasks, self._run_in_order, ordered_out)
            try:
                while True:
                    message = await self._next_message_async()
                    kind = message[0]
                    if kind == "task":
                        _, task_id, generation, indices = message
                        self._drain()
                        if generation < self.generation:
                            continue  # a task of an epoch the parent has already left
                        if iterable:
                            ordered_in.send_nowait(message)
                        else:
                            tasks.start_soon(
                                self._guarded,
                                tasks,
                                self._run_map_task,
                                self.fetcher,
                                task_id,
                                generation,
                                indices,
                            )
                    elif kind == "reset":
                        self._cancel_older(message[1])
                        if message[1] >= self.generation and self.init_error is None:
                            if iterable:
                                ordered_in.send_nowait(message)
                            else:
                                self._new_async_fetcher(message[2])
                    elif kind == "stop":
                        break
            except (ChannelClosed, BrokenPipeError, ConnectionResetError):
                # Caught here rather than let through: leaving a task group with an exception
                # wraps it in an ExceptionGroup. Either way every fetch in flight is cancelled
                # before the task group exits, and only then are the resources closed.
                self.parent_gone = True
            tasks.cancel_scope.cancel()
        ordered_in.close()
        ordered_out.close()
        if self.parent_gone:
            raise ChannelClosed

    async def _guarded(self, tasks: anyio.abc.TaskGroup, run: Any, *args: Any) -> None:
        """Run a batch task (or the in-order runner). An answer that cannot be sent means the
        parent closed our socket or died: handled as EOF is, by leaving the task group (which
        cancels the other fetches), rather than as an error of the task group."""
        try:
            await run(*args)
        except (ChannelClosed, BrokenPipeError, ConnectionResetError):
            self.parent_gone = True
            tasks.cancel_scope.cancel()

    def _cancel_older(self, generation: int) -> None:
        for stale in [g for g in self.gathering if g < generation]:
            for scope in self.gathering.pop(stale):
                scope.cancel()

    async def _next_message_async(self) -> Any:
        """``_next_message`` without blocking the loop: the same one-second bound, after which
        a changed parent pid ends the worker."""
        fd = self.channel.sock.fileno()
        while not self.pending:
            while not self.channel.has_frame():
                with anyio.move_on_after(_PARENT_CHECK_S) as wait:
                    await anyio.wait_readable(fd)
                if wait.cancelled_caught:
                    if os.getppid() != self.parent_pid:
                        raise ChannelClosed
                    continue
                self.channel.fill(wait=False)
            self._absorb(self.channel.pop())
        return self.pending.popleft()

    def _new_async_fetcher(self, plan: PassPlan) -> AsyncFetcher:
        self.fetch_error = None
        self.iteration_end = False
        fetcher = AsyncFetcher(
            self.config.dataset_kind,
            self.dataset,
            self.config.auto_collation,
            self.collate_fn,
            self.config.drop_last,
            plan,
            self.config.worker_concurrency,
            policy=self.config.sample_policy,
        )
        self.fetcher = fetcher
        return fetcher

    async def _run_map_task(
        self, fetcher: AsyncFetcher, task_id: int, generation: int, indices: Any
    ) -> None:
        # Batches are gathered concurrently: each keeps its own start, and sets the worker's
        # task_started just before it answers (with no await between, nothing interleaves).
        started = time.perf_counter()
        error = self.init_error or self.fetch_error
        if error is not None:
            self.task_started = started
            self._send(("err", task_id, generation, error))
            return
        # A stale batch is cancelled without an answer: the parent drops stale answers, and
        # it does not wait for tasks of a pass it has left.
        with anyio.CancelScope() as scope:
            running = self.gathering.setdefault(generation, set())
            running.add(scope)
            try:
                samples = await fetcher.gather(indices)
            except Exception:
                self.task_started = started
                self._send(("err", task_id, generation, RemoteError(self.config.worker_id)))
                return
            finally:
                running.discard(scope)
                if not running and self.gathering.get(generation) is running:
                    del self.gathering[generation]
            # No await from here on: the collate and the answer are not interrupted.
            self.task_started = started
            self._produce(task_id, generation, lambda: fetcher.collate(samples))

    async def _run_in_order(self, messages: Any) -> None:
        async for message in messages:
            if message[0] == "reset":
                # A new epoch: the previous stream is closed and a new one opened (its
                # __aiter__ runs now, after a resumed pass's state is loaded).
                previous = self.fetcher
                if previous is not None:
                    with contextlib.suppress(Exception):
                        await previous.aclose()
                fetcher = self._new_async_fetcher(message[2])
                try:
                    await fetcher.start()
                except Exception:
                    self.fetch_error = RemoteError(self.config.worker_id)
                continue
            _, task_id, generation, indices = message
            if generation < self.generation:
                continue
            await self._run_iterable_task(task_id, generation, indices)

    async def _run_iterable_task(self, task_id: int, generation: int, indices: Any) -> None:
        # One task at a time here (one stream), so the worker's task_started is this task's.
        self.task_started = time.perf_counter()
        if self._answered_without_fetch(task_id, generation):
            return
        fetcher: AsyncFetcher = self.fetcher
        try:
            samples = await fetcher.gather(indices)
        except StreamEnd:
            self.iteration_end = True
            self._send(("end", task_id, generation))
            return
        except Exception:
            self._send(("err", task_id, generation, RemoteError(self.config.worker_id)))
            return
        # _produce sends where the stream stands after this batch ahead of it, for state_dict().
        self._produce(task_id, generation, lambda: fetcher.collate(samples))

    def _send_batch(self, task_id: int, generation: int, data: Any, arena: Any) -> None:
        try:
            encoded = _transport.encode_batch(data, self.pool, arena)
        except OSError:
            # No shared memory to be had (e.g. /dev/shm or the memory cgroup is full): send the
            # batch by value instead. Slower, never wrong.
            if arena is not None:
                self.pool.release(arena.slab.id)
            try:
                payload = _transport.dumps_by_value(data)
            except Exception:
                self._send(("err", task_id, generation, RemoteError(self.config.worker_id)))
                return
            self._send(("pickled", task_id, generation, payload))
            return
        except Exception as error:
            # Typically an unpicklable sample. The fetcher blames the samples that cannot be
            # sent: it raises an error naming them, or (skip) gives the batch without them.
            if arena is not None:
                self.pool.release(arena.slab.id)
            drop_unsendable = getattr(self.fetcher, "drop_unsendable", None)
            try:
                if drop_unsendable is None:
                    raise error
                data = drop_unsendable(error)  # (raises error when no sample is to blame)
            except Exception:
                self._send(("err", task_id, generation, RemoteError(self.config.worker_id)))
                return
            # Each round drops at least one sample, so this ends.
            self._send_batch(task_id, generation, data, None)
            return
        finally:
            # The fetcher kept the batch's samples for the blame above: let them go.
            forget = getattr(self.fetcher, "forget", None)
            if forget is not None:
                forget()
        slab = encoded.slab
        fds: list[int] = []
        capacity = 0
        if slab is not None and encoded.new_slab:
            fd = slab.take_fd()
            assert fd is not None
            fds.append(fd)
            capacity = slab.capacity
        try:
            self._send(
                (
                    "ok",
                    task_id,
                    generation,
                    -1 if slab is None else slab.id,
                    capacity,
                    encoded.used,
                    encoded.payload,
                    encoded.leaves,
                ),
                fds,
            )
        finally:
            for fd in fds:
                os.close(fd)

    def _send(self, message: tuple[Any, ...], fds: list[int] | None = None) -> None:
        # Slabs this worker retired ride along, so the parent can unmap them too; before them,
        # the seconds spent on this task (fetch, collate, copy into the slab), for the stats.
        busy_s = time.perf_counter() - self.task_started
        self.channel.send((*message, busy_s, self.pool.take_dropped()), fds)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """A worker's event loop: uvloop when installed, else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
