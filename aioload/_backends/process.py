"""The worker process pool: start, pipes, results, death detection and shutdown.

Everything the engine may sleep on goes through one selector (epoll on Linux): each worker's
socket and each worker's process sentinel, which becomes readable when the process exits. The
selector's own descriptor is what the pool offers the engine (``waitable``), so one sleep
covers every worker, under asyncio, uvloop and trio and in the sync front end's thread alike,
and nothing runs detached: between two awaits of the consumer, no aioload code runs at all.
Where the consumer needs one worker's answer next, the pool offers an epoll of its own instead,
which watches that worker's answers alone and everything else the selector watches.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import select
import selectors
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

from .._aio.waiting import Descriptor
from .._wire.channel import ChannelClosed, ParentChannel
from .._wire.messages import (
    Answer,
    Batch,
    Event,
    FreeSlabs,
    PassPlan,
    Raised,
    Reply,
    Reset,
    SetConcurrency,
    SlabBatch,
    Task,
    WorkerLost,
    answer_to,
    failed_in_setup,
)
from .._wire.packed import pack_to_worker, unpack_reply
from .._wire.slabs import EAGER_FREE_BYTES
from ..errors import WorkerDiedError
from .base import (
    OUT_OF_PROCESS,
    BackendTraits,
    Place,
    TunableBackend,
    Waitable,
    WorkerBackend,
    WorkerSpec,
)
from .payload import _TORCH_PICKLE_WARNING as _TORCH_PICKLE_WARNING
from .payload import _torch_warns_on_pickle_error as _torch_warns_on_pickle_error
from .payload import payload
from .staggered import StaggeredStart
from .worker_process import (
    MAIN_GUARD_HINT,
    WorkerHandle,
    describe_exit,
    not_my_child,
    start_process,
    stop_processes,
)
from .worker_process import (
    unforked_ends as _unforked_ends,
)

__all__ = ["WorkerPool"]

# How long shutdown waits for workers to leave by themselves before it kills them. An idle
# worker leaves within a millisecond of seeing its socket close; only one that is busy inside
# a slow __getitem__ can need the kill.
SHUTDOWN_GRACE_S = 0.5
# Upper bound of one sleep on the selector, and the period of the health check in ``poll``, so
# that a failure no descriptor reports (in practice, none is known) is still noticed.
_HEALTH_CHECK_S = 1.0
# A wait for one worker's answer (``waitable``'s ``awaited``) leaves the others' answers in
# their sockets until the parent wakes for it. A worker whose answers outgrow its socket's
# buffer (about 200 KiB) would then block in its send, instead of starting its next batch,
# until then: once one read from a worker brings in more than this, the pool's waits watch
# every worker.
# (A batch in a slab is answered in a few hundred bytes; a pickled one can be any size.)
_AWAIT_ONE_MAX_READ = 64 * 1024

_CLOSED = "aioload: the worker pool has been shut down"

# Parent ends of every pool's sockets, and every pool, in this process.
_parent_fds: weakref.WeakSet[ParentChannel] = weakref.WeakSet()
_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _disown_after_fork() -> None:
    """In a forked child (one of our workers, or any ``os.fork()`` of the user's), the pools and
    sockets copied from the parent belong to the parent.

    The child must not keep the parent's socket ends open: a worker whose socket end is also
    held by a sibling would never see EOF when the parent dies. And it must never run their
    shutdown: a copy of an abandoned pass collected inside the child would close descriptor
    numbers the child may have reused, and kill the parent's workers. So the sockets are closed
    here, once, through their own objects, and every pool is marked closed.
    """
    for channel in list(_parent_fds):
        with contextlib.suppress(OSError):
            channel.close()
    _parent_fds.clear()
    for end in list(_unforked_ends):
        with contextlib.suppress(OSError):
            end.close()
    _unforked_ends.clear()
    for pool in list(_pools):
        pool.closed = True
        pool.retired = True
        # Nor may the child's exit stop them: multiprocessing's exit handler SIGTERMs every
        # daemonic process in its list of children, which a plain os.fork() copies, and then
        # fails to join them ("can only join a child process").
        for worker in pool.workers:
            if worker.process is not None:
                not_my_child(worker.process)
        pool._awaited_epoll.forget_after_fork()
        with contextlib.suppress(Exception):
            pool.selector.close()


os.register_at_fork(after_in_child=_disown_after_fork)


class _Selector(selectors.DefaultSelector):
    """The pool's selector, counting the changes to what it watches: ``_AwaitedEpoll`` keeps
    the epoll it made from the registrations until they change."""

    changes = 0

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        self.changes += 1
        return super().register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        self.changes += 1
        return super().unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        self.changes += 1
        return super().modify(fileobj, events, data)


def _awaited_events(key: selectors.SelectorKey, awaited: WorkerHandle) -> tuple[bool, bool]:
    """What a wait for ``awaited``'s answer watches of a selector registration: (readable,
    writable). Everything the selector watches, less the other workers' answers."""
    worker, what = key.data
    read = bool(key.events & selectors.EVENT_READ) and (what != "sock" or worker is awaited)
    return read, bool(key.events & selectors.EVENT_WRITE)


class _AwaitedEpoll:
    """What the pool offers a wait for one worker's answer (``WorkerPool.waitable``'s
    ``awaited``): an epoll holding what the selector holds, with only the awaited worker's
    socket watched for answers.

    Its descriptor stays while the awaited worker changes, and what it reports moves: the
    engine keeps its watch on a descriptor from wait to wait (under asyncio, a reader on the
    loop, which costs two ``epoll_ctl`` calls and the loop's bookkeeping to move, about 14 us
    a wait, see ``ReadableWait``). When the awaited worker changes, two ``epoll.modify``
    calls, one system call each, take the answers of the one out and put the other's in.

    A change of the selector's registrations (a worker lost or replaced, a write watched or no
    longer) makes a new epoll, offered as a new ``Descriptor``, rather than mirror the change:
    a socket closed while registered, its number then reused, would leave a registration of
    the old file in the old epoll that no call can name any more.
    """

    def __init__(self) -> None:
        self.epoll: select.epoll | None = None
        self.descriptor: Descriptor | None = None
        self.awaited: WorkerHandle | None = None
        self.made_at = -1  # the selector's count of changes the epoll was made at

    def offer(self, selector: _Selector, awaited: WorkerHandle) -> Descriptor:
        """The descriptor that ``awaited``'s answers, and what else the selector watches, make
        readable."""
        if self.epoll is None or self.descriptor is None or self.made_at != selector.changes:
            self._make(selector, awaited)
        elif self.awaited is not awaited:
            self._move(selector, awaited)
        assert self.descriptor is not None
        return self.descriptor

    def _make(self, selector: _Selector, awaited: WorkerHandle) -> None:
        self.close()
        epoll = select.epoll()
        try:
            for key in selector.get_map().values():
                epoll.register(key.fd, _epoll_mask(*_awaited_events(key, awaited)))
        except BaseException:
            epoll.close()
            raise
        self.epoll, self.descriptor = epoll, Descriptor(epoll.fileno())
        self.awaited, self.made_at = awaited, selector.changes

    def _move(self, selector: _Selector, awaited: WorkerHandle) -> None:
        assert self.epoll is not None
        try:
            for worker in (self.awaited, awaited):
                if worker is not None:
                    key = selector.get_key(worker.channel.sock)
                    self.epoll.modify(key.fd, _epoll_mask(*_awaited_events(key, awaited)))
        except (KeyError, ValueError, OSError):
            # Not registered any more (its socket closed): the selector's count has moved too,
            # unless the socket was closed without unregistering; make it anew either way.
            self._make(selector, awaited)
            return
        self.awaited = awaited

    def close(self) -> None:
        # (An engine's wait watches a duplicate of it, which the wait closes itself.)
        epoll = self.epoll
        self.epoll = self.descriptor = self.awaited = None
        if epoll is not None:
            epoll.close()

    def forget_after_fork(self) -> None:
        """In a forked child: let go of the parent's epoll."""
        with contextlib.suppress(OSError):
            self.close()


def _epoll_mask(read: bool, write: bool) -> int:
    # (0 is a valid mask: the descriptor then reports only errors and hang-ups, which a wait
    # wants to hear of anyway.)
    return (select.EPOLLIN if read else 0) | (select.EPOLLOUT if write else 0)


def _fds_exhausted(pid: int | None) -> str:
    """What the consumer reads when a slab's descriptor could not be received: torch's words
    ("Too many open files"), with advice that fits aioload (it has no sharing strategy)."""
    try:
        import resource

        limit = f", at its limit of {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    except (ImportError, OSError, ValueError):
        limit = ""
    return (
        f"Too many open files. This process's descriptor table is full{limit}, so the shared "
        f"memory of a batch from DataLoader worker (pid {pid}) could not be received. This "
        f"batch is lost; the pass goes on with the next one once descriptors are free. Please "
        f"increase the limit using `ulimit -n` in the shell (or "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ...) at the beginning of your code), or "
        f"close the descriptors your code keeps open. (aioload holds no descriptor per batch: "
        f"batches you keep do not count toward the limit.)"
    )


def _map_slab(worker: WorkerHandle, result: SlabBatch) -> BaseException | None:
    """Map the new slab ``result`` announces; the error that says why not, where it could
    not be (its descriptor never came, or the mapping failed)."""
    fd = worker.channel.take_fd()
    if fd is None:
        return RuntimeError(_fds_exhausted(worker.pid))
    try:
        worker.mappings.add(result.slab_id, fd, result.capacity)
    except OSError as error:
        message = (
            f"aioload: the shared memory of a batch from DataLoader worker (pid "
            f"{worker.pid}) could not be mapped in this process: {error}. This batch is "
            f"lost; the pass goes on with the next one. Free memory (or raise the limit "
            f"on this process's address space), or lower batch_size or prefetch_factor."
        )
        mapped = RuntimeError(message)
        mapped.__cause__ = error
        return mapped
    return None


def _rebuilt(worker: WorkerHandle, reply: Reply) -> Answer:
    """The engine's answer for a reply of the current pass. A batch that cannot be rebuilt
    here (a class its pickle names fails to load, a slab missing) is this batch's error, in
    its turn, and not an exception out of ``poll`` that would lose every answer read after it."""
    try:
        return answer_to(worker.worker_id, reply, worker.batch_value)
    except Exception as error:
        outcome = Raised(error)
        return Answer(worker.worker_id, reply.task_id, outcome, reply.stream, reply.busy_s)


def _unmapped(worker: WorkerHandle, reply: Reply, error: BaseException) -> Answer:
    """The answer to a batch whose slab never reached this process: ``error`` in its turn.
    The worker is told to forget the slab (it must never put a batch in it again: this
    side has no mapping of it), and the other answers of this poll go on as usual."""
    assert isinstance(reply.result, SlabBatch)
    worker.channel.queue(FreeSlabs([reply.result.slab_id], forget=True))
    return Answer(worker.worker_id, reply.task_id, Raised(error), reply.stream, reply.busy_s)


class WorkerPool:
    """``num_workers`` processes, each with its own socket, serving index tasks: the process
    implementation of ``_backends.base.WorkerBackend``. Health checks (process sentinels, exit
    codes) stay in here, behind one selector."""

    # Forking takes milliseconds a worker; workers fetch ahead of the consumer.
    TRAITS: ClassVar[BackendTraits] = OUT_OF_PROCESS

    def __init__(self, spec: WorkerSpec, base_seed: int, *, stagger: bool = False) -> None:
        self.spec = spec
        # Fork worker 0 now and the others at the waits (NOTE [staggered start]).
        self.stagger = stagger
        self.num_workers = spec.num_workers
        self._staggered = StaggeredStart(self) if stagger else None
        self.base_seed = base_seed
        self.generation = 0
        self.passes = 0
        self.closed = False
        # Usable for this pass, but not for another: a worker whose init failed, or one stuck
        # in a sample a pass timed out on. A persistent loader starts a fresh pool next pass.
        self.retired = False
        self.workers: list[WorkerHandle] = []
        # Slabs whose batch the consumer has let go of, from any thread (a lease dies wherever
        # its last reference is dropped, often inside the garbage collector). deque.append is
        # atomic, and the queue is drained only on the orchestrator's side.
        self.releases: deque[tuple[WorkerHandle, int]] = deque()
        self.selector = _Selector()
        # What the engine sleeps on: the selector, or for one worker's answer (``waitable``'s
        # ``awaited``) an epoll of its own.
        self._whole = Descriptor(self.selector.fileno())
        self._awaited_epoll = _AwaitedEpoll()
        # The last Waitable offered: a wait offers the same descriptor as the last one nearly
        # always, and the engine waits up to once a batch.
        self._waitable = Waitable(self._whole, _HEALTH_CHECK_S)
        # Held by a staggered start's forks and by close (NOTE [staggered start]). Reentrant:
        # a finalizer run by the collector inside a fork may close this pool.
        self.fork_lock = threading.RLock()
        # This pass's plan for each worker (a replacement gets its slot's plan again).
        self.plans: list[PassPlan] = [PassPlan()] * self.num_workers
        # When poll() next looks for a worker that exited unseen (_check_health).
        self._next_health_check = time.monotonic() + _HEALTH_CHECK_S
        # Whether a wait may watch one worker's answers alone (see _AWAIT_ONE_MAX_READ).
        self._await_one = True
        self._owner_pid = os.getpid()
        # num_workers="auto": the engine dispatches to the first ``active`` workers only, and
        # a staggered start forks the others when they are activated (``activate``).
        self.active = self.num_workers
        # worker_concurrency="auto": what the workers were last told (None: the spec's).
        self.concurrency: int | None = None
        _pools.add(self)
        self._start()

    # -- start -------------------------------------------------------------------------------

    def _start(self) -> None:
        spec = self.spec
        self._ctx = spec.multiprocessing_context or multiprocessing.get_context()
        self._forking = self._ctx.get_start_method() == "fork"
        self._payload = payload(
            (spec.dataset, spec.collate_fn, spec.worker_init_fn), forking=self._forking
        )
        # Worker 0 now, the others at the waits (NOTE [staggered start]: _backends/staggered.py).
        try:
            for worker_id in range(self.num_workers):
                # (Each socket is made after the previous fork: no worker inherits the end of
                # one forked before it. Ends of later ones are closed in it: unforked_ends.)
                worker = self._prepare(worker_id)
                self.workers.append(worker)
                if worker_id == 0 or not self.stagger:
                    self._fork(worker)
        except BaseException:
            self.close(grace=0.0)
            raise

    def _spawn(self, worker_id: int) -> WorkerHandle:
        worker = self._prepare(worker_id)
        try:
            self._fork(worker)
        except BaseException:
            self._unregister(worker)
            raise
        return worker

    def _prepare(self, worker_id: int) -> WorkerHandle:
        """A worker's socket and handle, before its process: what the parent sends it waits
        in the socket until the fork."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        channel = ParentChannel(parent_sock, unpack=unpack_reply, pack=pack_to_worker)
        # Registered before any fork, so that the worker (and any other process forked from
        # here) closes its inherited copy of our end (see _disown_after_fork): holding it, a
        # worker would never see EOF from us.
        _parent_fds.add(channel)
        _unforked_ends.add(child_sock)
        worker = WorkerHandle(worker_id, channel, child_sock)
        worker.release = self._make_release(worker)
        self.selector.register(channel.sock, selectors.EVENT_READ, (worker, "sock"))
        return worker

    def _fork(self, worker: WorkerHandle) -> None:
        # The worker-side code is imported on the first fork, not with the package: the
        # parent never runs it, a fork only needs it in memory, and `import aioload` stays cheap.
        from .._worker.main import worker_main
        from .._worker.parent import parent_watch

        config = self.spec.worker_config(
            worker.worker_id,
            self.base_seed,
            self.generation,
            payload=self._payload,
            shared_memory=True,
        )
        # (Asked here, in the thread that forks: NOTE [staggered start] forks in others.)
        parent = parent_watch(self._ctx.get_start_method())
        start_process(self._ctx, worker, target=worker_main, config=config, parent=parent)
        self.selector.register(worker.process.sentinel, selectors.EVENT_READ, (worker, "exit"))

    def _unregister(self, worker: WorkerHandle) -> None:
        """Close a worker's socket, both ends (one that never got a process)."""
        _parent_fds.discard(worker.channel)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(worker.channel.sock)
        worker.channel.close()
        end, worker.child_end = worker.child_end, None
        if end is not None:
            _unforked_ends.discard(end)
            end.close()

    def _make_release(self, worker: WorkerHandle) -> Callable[[int], None]:
        # Keyed by the worker *incarnation*: a replacement numbers its slabs from 0 again, so a
        # late release of a dead worker's slab must never reach its successor.
        releases = self.releases

        def release(slab_id: int) -> None:
            releases.append((worker, slab_id))

        return release

    # -- tasks -------------------------------------------------------------------------------

    def start_pass(self, plans: list[PassPlan]) -> None:
        """Start a new generation (a new pass over the sampler). Answers to tasks of older
        generations are dropped, and every worker gets the pass's plan, on which it makes
        its fetcher (IterableDataset workers re-create their iterator)."""
        if self.closed:
            raise RuntimeError(_CLOSED)
        self.plans = list(plans)
        if self.passes:
            self.generation += 1
        self.passes += 1
        for worker in self.workers:
            if worker.deferred_frees:
                worker.channel.queue(FreeSlabs(list(worker.take_deferred_frees())))
            worker.channel.queue(Reset(self.generation, self.plans[worker.worker_id]))
        self.flush()

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        # Written at once (what does not fit waits for writability): the orchestrator refills
        # the prefetch window as it hands a batch over, and the task must reach its worker
        # while the consumer works on that batch, not at the consumer's next request.
        # (The calls below are made only where they have something to do: this runs for
        # every batch.)
        worker = self.workers[worker_id]
        if worker.process is None and self._staggered is not None:
            worker.tasked = True  # forked at a wait (NOTE [staggered start])
            self._staggered.done = False
        if self.releases:
            self._queue_frees()
        freed = worker.take_deferred_frees() if worker.deferred_frees else ()
        worker.channel.queue(Task(task_id, self.generation, indices, freed))
        self.flush()

    def _queue_frees(self) -> None:
        """Put the large slabs the consumer has let go of in their workers' outboxes (unsent),
        and set the small ones aside for each worker's next task (EAGER_FREE_BYTES)."""
        if not self.releases:
            return
        freed: dict[WorkerHandle, list[int]] = {}
        while self.releases:
            worker, slab_id = self.releases.popleft()
            if worker.exited or worker.channel.closed:
                continue
            mapping = worker.mappings.maps.get(slab_id)
            if mapping is not None and len(mapping) >= EAGER_FREE_BYTES:
                freed.setdefault(worker, []).append(slab_id)
            else:
                worker.deferred_frees.append(slab_id)
        for worker, slab_ids in freed.items():
            worker.channel.queue(FreeSlabs(slab_ids))

    def flush(self) -> None:
        """Return freed slabs to their workers and write what fits of every outbox (the
        engine's call before it sleeps; ``submit`` and ``start_pass`` make it themselves)."""
        if self.releases:
            self._queue_frees()
        for worker in self.workers:
            if worker.channel.outbox and not worker.channel.closed:
                self._pump_out(worker)

    def _pump_out(self, worker: WorkerHandle) -> None:
        """Write what fits of a worker's outbox, and watch for writability while some is left."""
        # (Not contextlib.suppress: this runs for every batch, and the context manager costs
        # more than the send's bookkeeping.)
        try:  # noqa: SIM105 - its death is reported through its sentinel
            worker.channel.pump_out()
        except ChannelClosed:
            pass
        # Writability is watched only while something is left: epoll would otherwise report a
        # writable socket on every wait. The handle remembers what is registered, so the
        # common case (all sent, nothing watched) costs no selector call.
        watch_write = bool(worker.channel.outbox)
        if watch_write != worker.watching_write:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if watch_write else 0)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.modify(worker.channel.sock, events, (worker, "sock"))
                worker.watching_write = watch_write

    # -- results -----------------------------------------------------------------------------

    def poll(self) -> list[Event]:
        """Everything that has arrived, without waiting.

        Freed slabs are only queued here, not sent. A small one waits for its worker's next
        task (``submit`` sends it on the task) or the next pass's ``start_pass``: a worker
        with no task needs no slab. A large one goes out with the next write to its worker:
        the ``submit`` that refills the window right after this if the refill is for that
        worker, else the flush before the next wait (``flush``), so that the worker
        has it back before it starts its next batch. Only a step that hands a batch over and
        sends nothing leaves a large one queued until then: at the end of the sampler, or for
        a worker whose IterableDataset stream has ended; neither worker has a task that needs
        the slab."""
        if self.closed:
            # (Closed under a pass: by the loader's shutdown(), maybe from another thread.)
            raise RuntimeError(_CLOSED)
        if self.releases:
            self._queue_frees()
        events: list[Event] = []
        if time.monotonic() >= self._next_health_check:
            self._check_health(events)
        dead: list[WorkerHandle] = []
        try:
            ready = self.selector.select(0)
        except (AttributeError, ValueError, OSError):
            if self.closed:  # closed by another thread meanwhile
                raise RuntimeError(_CLOSED) from None
            raise
        for key, mask in ready:
            worker, what = key.data
            if what == "exit":
                dead.append(worker)
                continue
            if mask & selectors.EVENT_WRITE:
                self._pump_out(worker)
            if mask & selectors.EVENT_READ:
                self._read(worker, events)
        for worker in dead:
            # Answers the worker sent before it died are still good: take them first.
            self._read(worker, events)
            self._on_death(worker, events)
        return events

    def _read(self, worker: WorkerHandle, events: list[Event]) -> None:
        if worker.channel.closed:
            return
        try:
            replies = worker.channel.pump_in()
        except ChannelClosed:
            # The worker is exiting; its sentinel reports how.
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(worker.channel.sock)
            return
        if worker.channel.last_read > _AWAIT_ONE_MAX_READ:
            self._await_one = False
        for reply in replies:
            answer = self._decode(worker, reply)
            if answer is not None:
                events.append(answer)

    def _decode(self, worker: WorkerHandle, reply: Reply) -> Answer | None:
        """A reply as the engine sees it; None for a reply of an older pass (dropped)."""
        if reply.dropped_slabs:
            worker.mappings.drop(reply.dropped_slabs)
        result = reply.result
        current = reply.generation == self.generation
        if isinstance(result, SlabBatch):
            if result.capacity:
                lost = _map_slab(worker, result)
                if lost is not None:
                    return _unmapped(worker, reply, lost) if current else None
            if not current and result.slab_id >= 0:
                self.releases.append((worker, result.slab_id))
        if not current:
            return None
        answer = _rebuilt(worker, reply)
        # (A batch, nearly every answer, is no failure: asked without a call.)
        if type(answer.outcome) is not Batch and failed_in_setup(answer):
            self.retired = True
        return answer

    def _on_death(self, worker: WorkerHandle, events: list[Event]) -> None:
        if worker.exited:
            return
        worker.exited = True
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(worker.process.sentinel)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(worker.channel.sock)
        # The sentinel closes while the process exits, a moment before it can be reaped: wait
        # for the exit status rather than reading None (bounded; the process is on its way out).
        worker.process.join(timeout=2.0)
        if self.closed:
            return
        message, code = describe_exit(worker)
        if code == 1 and not self._forking:
            message += MAIN_GUARD_HINT.format(method=self._ctx.get_start_method())
        error = WorkerDiedError(message, worker_id=worker.worker_id, pid=worker.pid, exitcode=code)
        events.append(WorkerLost(worker.worker_id, error))

    def restart(self, worker_id: int, plan: PassPlan | None = None) -> None:
        """Replace a lost worker with a fresh process in the same slot, on this pass's plan
        (or ``plan``). Its predecessor's answers were taken in before its loss was reported."""
        if plan is not None:
            self.plans[worker_id] = plan
        old = self.workers[worker_id]
        self._reap(old)
        replacement = self._spawn(worker_id)
        self.workers[worker_id] = replacement
        replacement.channel.queue(Reset(self.generation, self.plans[worker_id]))
        if self.concurrency is not None:
            replacement.channel.queue(SetConcurrency(self.concurrency))

    def _reap(self, worker: WorkerHandle) -> None:
        # A lost worker being replaced: its socket, and its process once it has exited. Its
        # mappings stay alive as long as batches the consumer holds reference them.
        _parent_fds.discard(worker.channel)
        worker.channel.close()
        with contextlib.suppress(ValueError, AssertionError):
            worker.process.join(timeout=1.0)
            worker.process.close()

    def abandon(self, worker_id: int) -> None:
        """SIGKILL a worker that stopped answering (a hung one); its death is then reported
        by poll() as any other."""
        with contextlib.suppress(ProcessLookupError, OSError, ValueError):
            self.workers[worker_id].process.kill()

    def retire(self) -> None:
        self.retired = True

    def activate(self, count: int) -> None:
        """num_workers="auto": the engine dispatches to the first ``count`` workers. A
        worker of a staggered start is forked at the waits that follow; the others stay as
        they are (an idle process, or a socket waiting for its fork)."""
        self.active = max(1, min(self.num_workers, count))
        if self._staggered is not None:
            self._staggered.done = False

    def set_concurrency(self, concurrency: int) -> None:
        """worker_concurrency="auto": tell every worker (one not forked yet reads it first
        thing; a replacement is told on its start)."""
        self.concurrency = concurrency
        for worker in self.workers:
            if not worker.channel.closed:
                worker.channel.queue(SetConcurrency(concurrency))
        self.flush()

    def place(self, worker_id: int) -> Place:
        # A query: a worker of a staggered start that is not forked yet is named as such (it
        # is forked at a wait, and the engine names it again after each wait until then).
        worker = self.workers[worker_id]
        if worker.pid is None:
            return Place(f"worker {worker_id}, starting", started=False)
        return Place(f"pid {worker.pid}")

    def dump_stack(self, worker_id: int) -> str | None:
        # faulthandler in the worker, on a signal, into a memfd read through /proc
        # (``_worker.stacks``); None for a worker not forked yet, or gone.
        from .._worker.stacks import read_stack  # (only a hang report needs it)

        worker = self.workers[worker_id]
        if worker.pid is None or worker.exited or self.closed:
            return None
        return read_stack(worker.pid)

    def waitable(self, awaited: int | None = None) -> Waitable:
        """What the engine may sleep on: the selector, which an answer, a worker's exit or a
        socket with an outbox left that takes more makes readable; with ``awaited`` (and small
        answers), an epoll that only that worker's answers make readable, besides the rest
        (``_AwaitedEpoll``). At most the health-check period. (What is queued was sent by
        the engine's ``flush`` just before.)

        A staggered start offers the next fork instead, as work to run in place of a sleep
        (NOTE [staggered start]); the engine then looks at what has arrived and comes back
        for the fork after it."""
        if self.closed:
            raise RuntimeError(_CLOSED)
        if self._staggered is not None and (fork := self._staggered.offer(awaited)):
            return fork
        if awaited is not None and self._await_one:
            descriptor = self._awaited_epoll.offer(self.selector, self.workers[awaited])
        else:
            descriptor = self._whole
        if self._waitable.descriptor is not descriptor:
            self._waitable = Waitable(descriptor, _HEALTH_CHECK_S)
        return self._waitable

    def _check_health(self, events: list[Event]) -> None:
        """Catch a worker that exited without its sentinel being seen yet: from ``poll``,
        once a health-check period, so at least once a sleep that nothing ended."""
        self._next_health_check = time.monotonic() + _HEALTH_CHECK_S
        for worker in self.workers:
            if worker.process is None:
                continue
            if not worker.exited and worker.process.exitcode is not None:
                self._read(worker, events)
                self._on_death(worker, events)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self, grace: float | None = None) -> None:
        """Stop every worker and release every resource. Bounded: at most ``grace`` seconds
        (``SHUTDOWN_GRACE_S``) of waiting, then SIGKILL. Safe twice, in a finalizer, a fork."""
        if os.getpid() != self._owner_pid:
            return
        # (After a staggered start's fork in another thread, if one runs: it then forks no
        # more, and this stops the one it forked.)
        with self.fork_lock:
            if self.closed:
                return
            self.closed = True
        self.retired = True
        # 1. Close our ends first. An idle worker sees EOF in its poll() and leaves at once; a
        #    busy one gets EPIPE on its next answer. No "stop" message is needed, and none can
        #    get stuck behind a full socket.
        #    (A worker of a staggered start that was never forked has only its socket.)
        for worker in self.workers:
            _parent_fds.discard(worker.channel)
            worker.channel.close()
            if worker.process is None:
                self._unregister(worker)
        grace = SHUTDOWN_GRACE_S if grace is None else grace
        stop_processes([w for w in self.workers if w.process is not None], grace)
        for worker in self.workers:
            worker.exited = True
            # 4. Unmapping our side happens as leases die: a batch the user holds stays valid.
            worker.mappings.clear()
        # (An engine's wait watches a duplicate of each, which it closes itself.)
        self._awaited_epoll.close()
        with contextlib.suppress(Exception):
            self.selector.close()
        self.releases.clear()


def _conforms(pool: WorkerPool) -> tuple[WorkerBackend, TunableBackend]:
    # Type-checked: the pool honours the seam, and the controller's optional part of it.
    return pool, pool
