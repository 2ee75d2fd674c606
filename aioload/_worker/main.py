"""A local worker process: the loop over its socket around one ``WorkerStep``.

:class:`_ProcessWorker` reads ``_wire.messages.Task``/``Reset``/``FreeSlabs`` from its socket,
runs each task through the :class:`~aioload._worker.step.WorkerStep` every backend's workers
share, puts each batch in a shared-memory slab (``_wire.encoding``) and answers with one
``_wire.messages.Reply`` per task, which keeps the parent's bookkeeping simple: a task is in
flight until its answer arrives or its worker dies.

The worker never outlives its parent. It waits for work in ``poll`` with a one-second bound; a
closed socket (the parent exited, was killed, or shut us down) ends it at once, and a changed
parent pid ends it within a second even if something else still holds the parent's end. Inside
a slow sample, ``_worker.parent``'s watch ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import select
import signal
import sys
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from .._wire import slabs as _transport
from .._wire.channel import ChannelClosed, WorkerChannel
from .._wire.encoding import encode_batch
from .._wire.leaves import dumps_by_value
from .._wire.messages import (
    Failure,
    FreeSlabs,
    PickledBatch,
    Produced,
    Reply,
    Reset,
    SetConcurrency,
    SlabBatch,
    StreamEnded,
    Task,
    ToWorker,
)
from .._wire.packed import pack_reply, unpack_to_worker
from . import stacks as _stacks
from .heap import HeapPolicy
from .parent import ParentWatch, watch_parent

# (The step's names are imported from here by the backends: this module is the one a process
# backend loads before it forks, and with it everything a worker runs.)
from .seeding import _AfterImport as _AfterImport
from .seeding import _seed_numpy as _seed_numpy
from .step import RemoteError as RemoteError
from .step import StepResult as StepResult
from .step import WorkerConfig as WorkerConfig
from .step import WorkerStep as WorkerStep

if TYPE_CHECKING:
    import anyio.abc

    from .async_fetch import AsyncFetcher

# A worker of a sync dataset (the common case) never runs an event loop: anyio and the async
# fetch machinery are imported by the functions of the async worker loop below, on their first
# call, so neither the parent (which imports this module before it forks) nor a sync worker
# pays for them.

__all__ = [
    "RemoteError",
    "StepResult",
    "WorkerConfig",
    "WorkerStep",
    "worker_main",
]

_PARENT_CHECK_S = 1.0


def worker_main(config: WorkerConfig, sock: Any, parent: ParentWatch | None = None) -> None:
    # (Under fork, the parent's ends of every worker's socket that we inherited were closed by
    # _backends.process._disown_after_fork before this runs.)
    # Never outlive the parent, even inside a slow sample (``_worker.parent``).
    if parent is not None:
        watch_parent(parent, sock)
    # Everything inherited from the parent is set aside from the cyclic garbage collector: a
    # full collection here would write to every object the parent made (torch's included) and
    # so copy every shared page, hundreds of milliseconds at a worker's start. It also keeps
    # the child from ever collecting (and finalizing) the parent's abandoned objects.
    gc.freeze()
    # Ctrl-C goes to the whole process group; the parent decides what it means and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent may ask for our stack (the hang report): faulthandler answers it.
    _stacks.install()
    torch.set_num_threads(1)
    _transport.stack_tensors_privately()
    channel = WorkerChannel(sock, pack=pack_reply, unpack=unpack_to_worker)
    worker_pid = os.getpid()
    # A process the dataset forks (its own os.fork()) is a copy of this one, socket included:
    # it must never take a task or answer one.
    os.register_at_fork(after_in_child=sock.close)
    try:
        # ChannelClosed and friends: the parent is gone or shut us down.
        with contextlib.suppress(ChannelClosed, BrokenPipeError, ConnectionResetError):
            _ProcessWorker(config, channel).run()
    except Exception as error:
        if os.getpid() == worker_pid:
            raise
        # Such a copy came back from the dataset's code into this loop (it did not end with
        # os._exit()), and found the socket closed: it leaves, and says why.
        print(_FORKED_INSIDE.format(config.worker_id, error), file=sys.stderr, flush=True)
        os._exit(1)


_FORKED_INSIDE = (
    "aioload: a process forked inside DataLoader worker {} returned into the worker's loop "
    "and exits here ({!r}); end a process you fork in a dataset with os._exit()."
)


class _ProcessWorker:
    """A worker process: the loop over its socket around one :class:`WorkerStep`.

    Sync datasets are served one task after another. An async dataset's worker runs one event
    loop for its whole life (uvloop; asyncio's own if it cannot be imported): one coroutine reads the socket, and each
    map-style task runs as its own task, so the batches the parent has sent ahead (up to
    prefetch_factor) are gathered at once, sharing the fetcher's worker_concurrency slots. An
    IterableDataset's tasks run one after another, in order, since they pull from one stream.
    Answers go out as batches complete; the parent reorders them.
    """

    # How this process's malloc treats the samples freed after each batch (see _worker.heap).
    heap: HeapPolicy | None = None

    def __init__(self, config: WorkerConfig, channel: WorkerChannel) -> None:
        self.channel = channel
        self.heap = HeapPolicy()
        self.slabs = _transport.WorkerSlabPool(config.max_idle_slabs)
        self.step = WorkerStep(config, self.slabs)
        self.pending: deque[Reset | Task] = deque()
        # Async map-style batches being gathered, by generation: cancelled when a newer pass
        # starts (persistent workers after a break), so stale fetches free their slots.
        self.gathering: dict[int, set[anyio.CancelScope]] = {}
        self.parent_gone = False
        # The socket was read while the current message was being waited for (see _current).
        self.drained = False
        self.parent_pid = os.getppid()
        self.poller = select.poll()
        self.poller.register(channel.sock.fileno(), select.POLLIN)
        if not self.step.is_async:
            # A sync worker reads its socket only between tasks, so a slab the parent freed
            # while this task's samples were being made would go unseen until the next one.
            # Not for an async worker: its reader is a coroutine waiting on the socket, and a
            # task read here, in the middle of another task's collate, would sit in `pending`
            # unseen by it.
            self.slabs.take_in_frees = self._take_in_frees

    # -- reading -------------------------------------------------------------------------------

    def _next_message(self) -> Reset | Task:
        self.drained = False
        while not self.pending:
            while not self.channel.has_frame():
                # Read first and poll only when nothing is there: while the parent keeps this
                # worker busy, the next task is usually waiting already, and one read then
                # replaces a poll plus a read.
                if self.channel.fill(wait=False):
                    self.drained = True
                    continue
                # Nothing there: wait for it, checking on the parent once a second.
                ready = self.poller.poll(int(_PARENT_CHECK_S * 1000))
                if not ready and os.getppid() != self.parent_pid:
                    raise ChannelClosed
            self._absorb(self.channel.pop())
        return self.pending.popleft()

    async def _next_message_async(self) -> Reset | Task:
        """``_next_message`` without blocking the loop: the same one-second bound, after which
        a changed parent pid ends the worker."""
        import anyio

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

    def _drain(self) -> None:
        """Take in what the parent has already sent, without waiting: slabs it freed since the
        current task was sent are then reused instead of growing the pool, and a newer pass
        already announced lets us skip tasks that nobody waits for any more."""
        self.channel.fill(wait=False)
        self._absorb_buffered()

    def _take_in_frees(self, wait_s: float) -> None:
        """``_drain``, for the slab pool in the middle of a task, waiting up to ``wait_s`` for
        a free to arrive (see WorkerSlabPool._take_in_frees). A parent found gone here is found
        again by the next read, between tasks, where the worker ends."""
        with contextlib.suppress(ChannelClosed, OSError):
            free = len(self.slabs.free)
            self._drain()
            deadline = time.perf_counter() + wait_s
            while len(self.slabs.free) == free:
                left = deadline - time.perf_counter()
                if left <= 0 or not self.poller.poll(math.ceil(left * 1000)):
                    return
                self._drain()

    def _absorb_buffered(self) -> None:
        """Take in every whole frame already read."""
        while self.channel.has_frame():
            self._absorb(self.channel.pop())

    def _absorb(self, message: ToWorker) -> None:
        if isinstance(message, FreeSlabs):
            for slab_id in message.slab_ids:
                if message.forget:
                    self.slabs.discard(slab_id)
                else:
                    self.slabs.release(slab_id)
            return
        if isinstance(message, SetConcurrency):
            self.step.set_concurrency(message.concurrency)
            return
        if isinstance(message, Reset):
            self.step.generation = max(self.step.generation, message.generation)
        else:
            for slab_id in message.freed_slabs:
                self.slabs.release(slab_id)
        self.pending.append(message)

    def _current(self, task: Task) -> bool:
        """Take in what has arrived; False for a task of a pass the parent has already left."""
        if self.drained:
            # ``_next_message`` has just read the socket for this task, so what the parent
            # sent before it is already in: another read would find nothing. But that read
            # may have brought more than this task: ``_next_message`` stops at the first task,
            # and the frames behind it (typically the FreeSlabs the parent sent a moment after
            # this task, when the consumer dropped a batch) are absorbed here, before this task
            # takes a slab. Left in the buffer, the freed slab went unseen and the worker made
            # another: every worker grew a third slab in the first batches of every pass (9 MiB
            # more resident memory per worker on the image workload).
            self.drained = False
            self._absorb_buffered()
        else:
            self._drain()
        return task.generation >= self.step.generation

    # -- answering -----------------------------------------------------------------------------

    def _answer(self, task: Task, result: StepResult, started: float) -> None:
        """Encode and send the one reply ``task`` gets."""
        fds: list[int] = []
        stream = None
        wire: SlabBatch | PickledBatch | Failure | StreamEnded
        try:
            # Sent even if the encoding fails: the stream did move past these samples.
            stream = self.step.point_of(result)
            wire = self._encode(result, fds) if isinstance(result, Produced) else result
            # Slabs this worker retired ride along, so the parent can unmap them too.
            reply = Reply(
                task.task_id,
                task.generation,
                wire,
                stream,
                time.perf_counter() - started,
                self.slabs.take_dropped(),
            )
            self.channel.send(reply, fds)
        finally:
            for fd in fds:
                os.close(fd)
            # The fetcher kept the batch's samples in case the batch could not be sent (see
            # _encode): let them go now. After the send, so that freeing them (a few hundred
            # tensors for a batch of scalars) does not delay the reply the parent waits for.
            forget = getattr(self.step.fetcher, "forget", None)
            if forget is not None:
                forget()
            if self.heap is not None:
                # After the samples are freed: the thresholds follow the largest batch.
                self.heap.batch_made(self.slabs.expected)

    def _encode(self, produced: Produced, fds: list[int]) -> SlabBatch | PickledBatch | Failure:
        arena = produced.arena
        try:
            encoded = encode_batch(produced.data, self.slabs, arena)
        except OSError:
            # No shared memory to be had (e.g. /dev/shm or the memory cgroup is full): send the
            # batch by value instead. Slower, never wrong.
            self.step.release(arena)
            try:
                return PickledBatch(dumps_by_value(produced.data))
            except Exception:
                return self.step.error()
        except Exception as error:
            # Typically an unpicklable sample. The fetcher blames the samples that cannot be
            # sent: it raises an error naming them, or (skip) gives the batch without them.
            self.step.release(arena)
            drop_unsendable = getattr(self.step.fetcher, "drop_unsendable", None)
            try:
                if drop_unsendable is None:
                    raise error
                data = drop_unsendable(error)  # (raises error when no sample is to blame)
            except Exception:
                return self.step.error()
            # Each round drops at least one sample, so this ends.
            return self._encode(produced._replace(data=data, arena=None), fds)
        slab = encoded.slab
        capacity = 0
        if slab is not None and encoded.new_slab:
            fd = slab.take_fd()
            assert fd is not None
            fds.append(fd)
            capacity = slab.capacity
        return SlabBatch(
            -1 if slab is None else slab.id,
            capacity,
            encoded.used,
            encoded.payload,
            encoded.leaves,
        )

    # -- the sync loop -------------------------------------------------------------------------

    def run(self) -> None:
        if self.step.is_async:
            self._run_async()
            return
        while True:
            message = self._next_message()
            if isinstance(message, Reset):
                if self.step.accepts(message):
                    self.step.new_pass(message.plan)
            elif self._current(message):
                self._run(message)

    def _run(self, task: Task) -> None:
        started = time.perf_counter()
        self._answer(task, self.step.run(task), started)

    # -- the async loop ------------------------------------------------------------------------

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
        step = self.step
        await step.finish_async_init()
        async with contextlib.AsyncExitStack() as resources:
            # The dataset's per-worker setup (say, an HTTP client session) is entered once,
            # here, on this loop, and exited when the loop below ends: after the parent closed
            # our socket (a graceful shutdown: every in-flight fetch has been cancelled by
            # then, so nothing uses the resources while they close) or the parent died.
            # Shutdown gives a worker 0.5 s before SIGKILL, which is ample to close a client.
            if await step.enter_async_context():
                resources.push_async_exit(step.dataset)
            try:
                await self._serve_tasks()
            finally:
                if step.fetcher is not None:
                    with contextlib.suppress(Exception):
                        await step.fetcher.aclose()

    async def _serve_tasks(self) -> None:
        import anyio

        step = self.step
        # Tasks and resets of an IterableDataset, in arrival order, for the one runner.
        ordered_in, ordered_out = anyio.create_memory_object_stream[Reset | Task](math.inf)
        async with anyio.create_task_group() as tasks:
            if step.iterable:
                tasks.start_soon(self._guarded, tasks, self._run_in_order, ordered_out)
            try:
                while True:
                    message = await self._next_message_async()
                    if isinstance(message, Reset):
                        self._cancel_older(message.generation)
                        if step.accepts(message):
                            if step.iterable:
                                ordered_in.send_nowait(message)
                            else:
                                step.new_async_pass(message.plan)
                    elif self._current(message):
                        if step.iterable:
                            ordered_in.send_nowait(message)
                        else:
                            tasks.start_soon(
                                self._guarded, tasks, self._run_map_task, step.fetcher, message
                            )
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

    async def _run_map_task(self, fetcher: AsyncFetcher, task: Task) -> None:
        # Batches are gathered concurrently, each timed from its own start.
        started = time.perf_counter()
        # A stale batch is cancelled without an answer: the parent drops stale answers, and
        # it does not wait for tasks of a pass it has left.
        import anyio

        with anyio.CancelScope() as scope:
            running = self.gathering.setdefault(task.generation, set())
            running.add(scope)
            try:
                result = await self.step.run_async(task, fetcher)
            finally:
                running.discard(scope)
                if not running and self.gathering.get(task.generation) is running:
                    del self.gathering[task.generation]
            self._answer(task, result, started)

    async def _run_in_order(self, messages: Any) -> None:
        async for message in messages:
            if isinstance(message, Reset):
                await self.step.start_async_stream(message.plan)
            elif message.generation >= self.step.generation:
                started = time.perf_counter()
                self._answer(message, await self.step.run_async(message), started)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """A worker's event loop: uvloop (a dependency), or asyncio's own if it cannot be
    imported (a trimmed environment)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop
