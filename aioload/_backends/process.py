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
import functools
import inspect
import multiprocessing
import multiprocessing.connection
import os
import pickle
import select
import selectors
import signal
import socket
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

from .._aio.waiting import Descriptor, run_off_loop
from .._wire.channel import ChannelClosed, ParentChannel
from .._wire.messages import (
    Answer,
    Batch,
    Event,
    FreeSlabs,
    PassPlan,
    PickledBatch,
    Raised,
    Reply,
    Reset,
    SetConcurrency,
    SlabBatch,
    Task,
    ValueBatch,
    WorkerLost,
    answer_to,
    failed_in_setup,
)
from .._wire.packed import pack_to_worker, unpack_reply
from .._wire.slabs import EAGER_FREE_BYTES, SlabMappings
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
# The worker ends of sockets whose worker is not forked yet (a staggered start): any other
# process forked meanwhile must not hold one.
_unforked_ends: weakref.WeakSet[socket.socket] = weakref.WeakSet()


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
                _not_my_child(worker.process)
        pool._awaited_epoll.forget_after_fork()
        with contextlib.suppress(Exception):
            pool.selector.close()


os.register_at_fork(after_in_child=_disown_after_fork)


def _not_my_child(process: Any) -> None:
    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.discard(process)


def _payload(objects: tuple[Any, Any, Any], forking: bool) -> tuple[Any, Any, Any] | bytes:
    """How ``(dataset, collate_fn, worker_init_fn)`` travel to each worker (in its
    ``WorkerConfig``, which is part of ``Process(args=...)``).

    - fork: the objects themselves. The workers inherit them; nothing is pickled.
    - spawn and forkserver, fast path: pickled here once, and the same bytes go to every worker
      (and to any replacement), rather than one pickle of the dataset per worker.
    - spawn and forkserver, when that pickle fails: the objects themselves, so that each
      ``Process.start()`` pickles them while it is spawning, as torch's loader does. That is
      the only time multiprocessing lets a Lock, Event, Condition, Value or Queue of the
      loader's context cross to a child ("... should only be shared between processes through
      inheritance" otherwise). ``start()`` still does not wait for a worker to come up, so
      the workers start concurrently either way.
    - anything else that cannot be pickled (a thread lock, an open file) cannot be pickled
      while spawning either: it raises here, before ``Process.start()`` would start
      multiprocessing's resource tracker (or forkserver) only to fail, leaving that helper
      process behind.
    """
    if forking:
        return objects
    try:
        return pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
    except RuntimeError as error:
        # Only the "shared through inheritance" refusal is worth a second try while spawning.
        if "inheritance" not in str(error):
            raise _unpicklable(objects, error) from error
        return objects
    except (TypeError, AttributeError, pickle.PicklingError) as error:
        # The errors torch's loader warns about as it starts a worker, where it does.
        _warn_as_torch_on_pickle_error()
        raise _unpicklable(objects, error) from error
    except Exception as error:
        raise _unpicklable(objects, error) from error


# What torch's loader warns (from torch 2.11) when a worker's arguments cannot be pickled.
_TORCH_PICKLE_WARNING = (
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork')."
)


@functools.cache
def _torch_warns_on_pickle_error() -> bool:
    """Whether the installed torch's loader gives that warning: read from its source, once,
    and only when a pickle has failed (a feature, not a version, is asked about)."""
    from torch.utils.data import dataloader

    try:
        source = inspect.getsource(dataloader._MultiProcessingDataLoaderIter)
    except (OSError, TypeError):
        return False
    return "Got pickle error when attempting to start a worker Process" in source


def _warn_as_torch_on_pickle_error() -> None:
    if _torch_warns_on_pickle_error():
        warnings.warn(_TORCH_PICKLE_WARNING, stacklevel=3)


_PICKLED = ("the dataset", "collate_fn", "worker_init_fn")


def _unpicklable(objects: tuple[Any, Any, Any], error: Exception) -> Exception:
    """``error``, of its own type where it can be made from a message, with a message that
    says which of ``(dataset, collate_fn, worker_init_fn)`` cannot be pickled and what to do."""
    culprit = None
    for name, obj in zip(_PICKLED, objects, strict=True):
        try:
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            culprit = (name, obj)
            break
    if culprit is None:
        return error
    name, obj = culprit
    if name == "the dataset":
        advice = (
            "make what cannot be pickled (an open file, a lock, a client) in the worker "
            "instead: in worker_init_fn, or on first use"
        )
    else:
        advice = (
            f"define it with `def` at the top level of a module, not as a lambda or inside "
            f"another function (a functools.partial of such a function works too); {name} is "
            f"{obj!r}"
        )
    message = (
        f"{name} cannot be pickled, and under the 'spawn' and 'forkserver' start methods "
        f"every worker gets a pickled copy: {advice}. {type(error).__name__}: {error}"
    )
    try:
        return type(error)(message)
    except Exception:
        return pickle.PicklingError(message)


class _WorkerHandle:
    """The parent's handle on one worker process: its process, socket and slab mappings."""

    def __init__(self, worker_id: int, channel: ParentChannel, child_end: socket.socket) -> None:
        self.worker_id = worker_id
        # None until the worker is forked (WorkerPool._fork); its end of the socket is held
        # here until then.
        self.process: Any = None
        self.pid: int | None = None
        self.child_end: socket.socket | None = child_end
        self.channel = channel
        self.mappings = SlabMappings()
        self.exited = False
        self.release: Callable[[int], None] = _no_release
        # Small freed slabs waiting to ride along with this worker's next task (see
        # EAGER_FREE_BYTES).
        self.deferred_frees: list[int] = []
        # Whether the selector watches its socket for writability (see WorkerPool._pump_out).
        self.watching_write = False
        # A worker of a staggered start: whether a task waits in its socket for its fork.
        self.tasked = False

    def batch_value(self, result: SlabBatch | PickledBatch | ValueBatch) -> Any:
        """A batch this worker sent, as the consumer gets it: a slab's tensors as views of it,
        with no copy."""
        if isinstance(result, SlabBatch):
            return self.mappings.decode(
                result.slab_id, result.used, result.payload, result.leaves, self.release
            )
        if isinstance(result, PickledBatch):
            return pickle.loads(result.payload)
        return result.value

    def take_deferred_frees(self) -> tuple[int, ...]:
        freed = tuple(self.deferred_frees)
        self.deferred_frees.clear()
        return freed


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


def _awaited_events(key: selectors.SelectorKey, awaited: _WorkerHandle) -> tuple[bool, bool]:
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
        self.awaited: _WorkerHandle | None = None
        self.made_at = -1  # the selector's count of changes the epoll was made at

    def offer(self, selector: _Selector, awaited: _WorkerHandle) -> Descriptor:
        """The descriptor that ``awaited``'s answers, and what else the selector watches, make
        readable."""
        if self.epoll is None or self.descriptor is None or self.made_at != selector.changes:
            self._make(selector, awaited)
        elif self.awaited is not awaited:
            self._move(selector, awaited)
        assert self.descriptor is not None
        return self.descriptor

    def _make(self, selector: _Selector, awaited: _WorkerHandle) -> None:
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

    def _move(self, selector: _Selector, awaited: _WorkerHandle) -> None:
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


def _no_release(slab_id: int) -> None:
    pass


# A worker that exits with status 1 under spawn or forkserver most often failed while it
# imported the main module, as each such worker does first: a script that makes and iterates
# its DataLoader at the top level starts workers from inside a worker, which Python refuses.
_MAIN_GUARD_HINT = (
    " Under the {method!r} start method each worker first imports your main module: if your "
    "script makes or iterates the DataLoader at its top level, move that code under "
    '`if __name__ == "__main__":`. The worker\'s own error is printed above, on stderr.'
)


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


def _map_slab(worker: _WorkerHandle, result: SlabBatch) -> BaseException | None:
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


def _rebuilt(worker: _WorkerHandle, reply: Reply) -> Answer:
    """The engine's answer for a reply of the current pass. A batch that cannot be rebuilt
    here (a class its pickle names fails to load, a slab missing) is this batch's error, in
    its turn, and not an exception out of ``poll`` that would lose every answer read after it."""
    try:
        return answer_to(worker.worker_id, reply, worker.batch_value)
    except Exception as error:
        outcome = Raised(error)
        return Answer(worker.worker_id, reply.task_id, outcome, reply.stream, reply.busy_s)


def _unmapped(worker: _WorkerHandle, reply: Reply, error: BaseException) -> Answer:
    """The answer to a batch whose slab never reached this process: ``error`` in its turn.
    The worker is told to forget the slab (it must never put a batch in it again: this
    side has no mapping of it), and the other answers of this poll go on as usual."""
    assert isinstance(reply.result, SlabBatch)
    worker.channel.queue(FreeSlabs([reply.result.slab_id], forget=True))
    return Answer(worker.worker_id, reply.task_id, Raised(error), reply.stream, reply.busy_s)


def _describe_exit(worker: _WorkerHandle) -> tuple[str, int | None]:
    code = worker.process.exitcode
    pid = worker.pid
    if code is not None and code < 0:
        signum = -code
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        text = signal.strsignal(signum) or name
        return f"DataLoader worker (pid {pid}) is killed by signal: {text} ({name}).", code
    return f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {code}.", code


def _start_process(
    ctx: Any, worker: _WorkerHandle, *, target: Any, config: Any, parent: Any = None
) -> None:
    """Start ``worker``'s process on its socket's child end, and let go of our copy of that end."""
    child_sock = worker.child_end
    assert child_sock is not None
    process = ctx.Process(
        target=target,
        args=(config, child_sock, parent),
        name=f"aioload-worker-{worker.worker_id}",
        daemon=True,
    )
    # Its own end, the new worker keeps.
    _unforked_ends.discard(child_sock)
    try:
        # start() does not wait for the worker to initialise, so workers come up concurrently.
        process.start()
    finally:
        # Our copy of the child's end must go, or the child's death would not close its socket.
        worker.child_end = None
        child_sock.close()
    worker.process = process
    worker.pid = process.pid


def _stop_processes(forked: list[_WorkerHandle], grace: float) -> None:
    """Steps 2 and 3 of ``WorkerPool.close``: wait up to ``grace`` seconds for the workers to
    leave on their own (their sockets are closed by now), then kill whoever is left and reap
    every one. Bounded: SIGKILL cannot be caught."""
    # 2. Give them ``grace`` seconds to leave on their own, waiting on all sentinels at once.
    pending = [w for w in forked if w.process.exitcode is None]
    deadline = time.monotonic() + grace
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = multiprocessing.connection.wait([w.process.sentinel for w in pending], timeout=left)
        # A ready sentinel means the process is exiting, but it closes a moment before the
        # process can be reaped, and ``exitcode`` reads None until then: waiting on the
        # sentinel again would return at once, a busy loop (hundreds of turns, milliseconds
        # of CPU per pool). join() on a ready sentinel waits for the exit status instead.
        for worker in pending:
            if worker.process.sentinel in ready:
                worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        pending = [w for w in pending if w.process.exitcode is None]
    # 3. Whoever is still there is stuck in user code: kill it. SIGKILL cannot be caught, so
    #    the join below is bounded.
    for worker in pending:
        with contextlib.suppress(ProcessLookupError, OSError, ValueError):
            worker.process.kill()
    for worker in forked:
        with contextlib.suppress(ValueError, AssertionError):
            worker.process.join(timeout=5.0)
            # Process.close() releases the sentinel descriptor now rather than at GC.
            worker.process.close()


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
        self._staggered = _StaggeredStart(self) if stagger else None
        self.base_seed = base_seed
        self.generation = 0
        self.passes = 0
        self.closed = False
        # Usable for this pass, but not for another: a worker whose init failed, or one stuck
        # in a sample a pass timed out on. A persistent loader starts a fresh pool next pass.
        self.retired = False
        self.workers: list[_WorkerHandle] = []
        # Slabs whose batch the consumer has let go of, from any thread (a lease dies wherever
        # its last reference is dropped, often inside the garbage collector). deque.append is
        # atomic, and the queue is drained only on the orchestrator's side.
        self.releases: deque[tuple[_WorkerHandle, int]] = deque()
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
        self._payload = _payload(
            (spec.dataset, spec.collate_fn, spec.worker_init_fn), forking=self._forking
        )
        # Worker 0 now, the others at the waits (NOTE [staggered start]: _StaggeredStart).
        try:
            for worker_id in range(self.num_workers):
                # (Each socket is made after the previous fork: no worker inherits the end of
                # one forked before it. Ends of later ones are closed in it: _unforked_ends.)
                worker = self._prepare(worker_id)
                self.workers.append(worker)
                if worker_id == 0 or not self.stagger:
                    self._fork(worker)
        except BaseException:
            self.close(grace=0.0)
            raise

    def _spawn(self, worker_id: int) -> _WorkerHandle:
        worker = self._prepare(worker_id)
        try:
            self._fork(worker)
        except BaseException:
            self._unregister(worker)
            raise
        return worker

    def _prepare(self, worker_id: int) -> _WorkerHandle:
        """A worker's socket and handle, before its process: what the parent sends it waits
        in the socket until the fork."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        channel = ParentChannel(parent_sock, unpack=unpack_reply, pack=pack_to_worker)
        # Registered before any fork, so that the worker (and any other process forked from
        # here) closes its inherited copy of our end (see _disown_after_fork): holding it, a
        # worker would never see EOF from us.
        _parent_fds.add(channel)
        _unforked_ends.add(child_sock)
        worker = _WorkerHandle(worker_id, channel, child_sock)
        worker.release = self._make_release(worker)
        self.selector.register(channel.sock, selectors.EVENT_READ, (worker, "sock"))
        return worker

    def _fork(self, worker: _WorkerHandle) -> None:
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
        _start_process(self._ctx, worker, target=worker_main, config=config, parent=parent)
        self.selector.register(worker.process.sentinel, selectors.EVENT_READ, (worker, "exit"))

    def _unregister(self, worker: _WorkerHandle) -> None:
        """Close a worker's socket, both ends (one that never got a process)."""
        _parent_fds.discard(worker.channel)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(worker.channel.sock)
        worker.channel.close()
        end, worker.child_end = worker.child_end, None
        if end is not None:
            _unforked_ends.discard(end)
            end.close()

    def _make_release(self, worker: _WorkerHandle) -> Callable[[int], None]:
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
        freed: dict[_WorkerHandle, list[int]] = {}
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

    def _pump_out(self, worker: _WorkerHandle) -> None:
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
        dead: list[_WorkerHandle] = []
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

    def _read(self, worker: _WorkerHandle, events: list[Event]) -> None:
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

    def _decode(self, worker: _WorkerHandle, reply: Reply) -> Answer | None:
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

    def _on_death(self, worker: _WorkerHandle, events: list[Event]) -> None:
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
        message, code = _describe_exit(worker)
        if code == 1 and not self._forking:
            message += _MAIN_GUARD_HINT.format(method=self._ctx.get_start_method())
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

    def _reap(self, worker: _WorkerHandle) -> None:
        """Let go of a lost worker being replaced: its socket, and its process once it has
        exited."""
        # Its mappings stay alive as long as batches the consumer holds reference them.
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

    def close(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Stop every worker and release every resource. Bounded: at most ``grace`` seconds
        of waiting, then SIGKILL. Safe to call twice, from a finalizer, or after a fork."""
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
        _stop_processes([w for w in self.workers if w.process is not None], grace)
        for worker in self.workers:
            worker.exited = True
        # 4. Unmapping our side happens as leases die: a batch the user still holds stays valid.
        for worker in self.workers:
            worker.mappings.clear()
        # (An engine's wait watches a duplicate of each, which it closes itself.)
        self._awaited_epoll.close()
        with contextlib.suppress(Exception):
            self.selector.close()
        self.releases.clear()


class _StaggeredStart:
    """NOTE [staggered start]. A pool forks worker 0 as it starts and each other worker at
    one of the engine's waits, one fork per wait, not as its first task goes out. A fork
    costs the parent milliseconds (most of it copying its page tables), and forking them all
    before the first wait made the first batch wait for every fork: its time grew with
    num_workers. Now worker 0 starts on the first batch while the parent forks the others,
    and the parent takes that batch in between two forks. A task sent to a worker not forked
    yet waits in its socket; the consumer's own worker, when it waits for one, is forked
    first. Every worker is still started, as torch starts them all: those that got no task
    (fewer tasks than workers) are forked together at the first wait that finds no other.

    Each fork is work that the engine runs in place of a sleep (``CallerWork``): under
    ``for`` in the calling thread; under ``async for`` in a thread of its own, as the pool's
    start is. Not on the loop's thread: a child forked there would inherit that thread's
    state (its running event loop, a trio run) and could not run a loop of its own. A fork
    holds the GIL, so the loop stalls for it either way; the thread spares it the rest of a
    process's start.

    A native ``Task.cancel()`` ends the await of such a thread while its fork goes on (see
    ``run_off_loop``): the pool's ``fork_lock`` makes a close wait for that fork (and stop
    the worker it made), and a fork offered before the close forks nothing after it.
    """

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        # Whether no worker that has a task, or is active, waits for its fork: from then on,
        # waits look for none to fork, until a task goes to one not forked yet or more slots
        # are activated (num_workers="auto"). (A replacement is forked as it is made,
        # ``WorkerPool._spawn``.)
        self.done = pool.num_workers == 1
        self._forks: list[_WorkerHandle] = []

    def offer(self, awaited: int | None) -> Waitable | None:
        """This wait's fork, as the engine's work: the awaited worker if it waits for its
        fork, else the first with a task waiting; where none has one, every active worker
        left. None where no worker with a task, and no active one, waits for its fork."""
        if self.done:
            return None
        # (Not one whose socket is already closed: its pool is closing. A slot that
        # num_workers="auto" retired before its fork still answers the tasks it was given;
        # one beyond the active ones is forked when activated.)
        waiting = [
            w
            for w in self.pool.workers
            if w.child_end is not None and (w.tasked or w.worker_id < self.pool.active)
        ]
        if not waiting:
            self.done = True
            return None
        chosen = [w for w in waiting if w.worker_id == awaited] or [w for w in waiting if w.tasked]
        self._forks = chosen[:1] or waiting
        return Waitable(work=self)

    async def work(self) -> None:
        await run_off_loop(functools.partial(self._fork_each, self._forks))

    def work_blocking(self) -> bool:
        self._fork_each(self._forks)
        return True

    def _fork_each(self, workers: list[_WorkerHandle]) -> None:
        pool = self.pool
        with pool.fork_lock:
            if pool.closed:
                return
            for worker in workers:
                if worker.child_end is not None:
                    pool._fork(worker)


def _conforms(pool: WorkerPool) -> tuple[WorkerBackend, TunableBackend]:
    # Type-checked: the pool honours the seam, and the controller's optional part of it.
    return pool, pool
