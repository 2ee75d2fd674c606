"""The worker process pool: start, pipes, results, death detection and shutdown.

Everything the orchestrator waits on goes through one selector (epoll on Linux): each worker's
socket and each worker's process sentinel, which becomes readable when the process exits. The
selector's own descriptor is what the event loop waits on, through ``anyio.wait_readable``, so
one await covers every worker under asyncio, uvloop and trio alike, and nothing runs detached:
between two awaits of the consumer, no aioload code runs at all.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import selectors
import signal
import socket
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from ._channel import ChannelClosed, ParentChannel
from ._fetch import PassPlan
from ._transport import SlabMappings
from .errors import WorkerDiedError
from .stats import PassStats

__all__ = ["Outcome", "WorkerPool"]

# How long shutdown waits for workers to leave by themselves before it kills them. An idle
# worker leaves within a millisecond of seeing its socket close; only one that is busy inside
# a slow __getitem__ can need the kill.
SHUTDOWN_GRACE_S = 0.5
# Upper bound of one wait on the selector, so that a failure no descriptor reports (in practice,
# none is known) is still noticed.
_HEALTH_CHECK_S = 1.0

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
    for pool in list(_pools):
        pool.closed = True
        with contextlib.suppress(Exception):
            pool.selector.close()


os.register_at_fork(after_in_child=_disown_after_fork)

# What a task produced: ("ok", batch), ("err", RemoteError) or ("end", None) when an
# IterableDataset worker has run dry.
Outcome = tuple[str, Any]


@dataclass
class WorkerSpec:
    dataset: Any
    dataset_kind: int
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    worker_init_fn: Any
    num_workers: int
    prefetch_factor: int
    multiprocessing_context: Any
    slab_collate: bool
    max_worker_restarts: int = 0
    rank: int = 0
    world_size: int = 1
    worker_concurrency: int = 1


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, worker_id: int, process: Any, channel: ParentChannel) -> None:
        self.worker_id = worker_id
        self.process = process
        self.pid: int | None = process.pid
        self.channel = channel
        self.mappings = SlabMappings()
        self.exited = False
        self.release: Callable[[int], None] = _no_release


def _no_release(slab_id: int) -> None:
    pass


def _describe_exit(worker: _Worker) -> tuple[str, int | None]:
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


class WorkerPool:
    """``num_workers`` processes, each with its own socket, serving index tasks."""

    def __init__(self, spec: WorkerSpec, base_seed: int) -> None:
        self.spec = spec
        self.num_workers = spec.num_workers
        self.base_seed = base_seed
        self.generation = 0
        self.closed = False
        self.broken: BaseException | None = None
        # Usable for this pass, but not for another: a worker whose init failed, or one stuck
        # in a sample a pass timed out on. A persistent loader starts a fresh pool next pass.
        self.stale = False
        self.workers: list[_Worker] = []
        # Slabs whose batch the consumer has let go of, from any thread (a lease dies wherever
        # its last reference is dropped, often inside the garbage collector). deque.append is
        # atomic, and the queue is drained only on the orchestrator's side.
        self.releases: deque[tuple[_Worker, int]] = deque()
        self.selector = selectors.DefaultSelector()
        self._watched: list[int] = []
        # Healing: how many more dead workers this pass may replace, and the ids replaced since
        # the orchestrator last looked (it re-sends their in-flight tasks).
        self.max_restarts = spec.max_worker_restarts
        self.restarts_left = spec.max_worker_restarts
        self.restarted: list[int] = []
        # This pass's plan for each worker (a replacement gets its slot's plan again).
        self.plans: list[PassPlan] = [PassPlan()] * self.num_workers
        # IterableDataset streams: where each stood after a task's batch, task id ->
        # (samples seen, dataset state, whether it had run dry). The orchestrator takes an entry when it yields the
        # batch.
        self.stream_states: dict[int, tuple[int, Any, bool]] = {}
        # The current pass's counters (set by its orchestrator).
        self.stats: PassStats | None = None
        self._owner_pid = os.getpid()
        _pools.add(self)
        self._start()

    # -- start -------------------------------------------------------------------------------

    def _start(self) -> None:
        spec = self.spec
        self._ctx = spec.multiprocessing_context or multiprocessing.get_context()
        self._forking = self._ctx.get_start_method() == "fork"
        objects = (spec.dataset, spec.collate_fn, spec.worker_init_fn)
        # Under spawn and forkserver the dataset is pickled here once and the same bytes go to
        # every worker (and to any replacement); under fork the workers inherit it and nothing
        # is pickled at all.
        self._payload: tuple[Any, Any, Any] | bytes = (
            objects if self._forking else pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
        )
        try:
            for worker_id in range(self.num_workers):
                self.workers.append(self._spawn(worker_id))
        except BaseException:
            self.close(grace=0.0)
            raise

    def _spawn(self, worker_id: int) -> _Worker:
        # The worker-side code is imported on the first spawn, not with the package: the
        # parent never runs it, a fork only needs it in memory, and `import aioload` stays cheap.
        from ._worker_main import WorkerConfig, worker_main

        spec = self.spec
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        channel = ParentChannel(parent_sock)
        # Registered before the fork, so that the new worker closes its inherited copy of our
        # end too (see _disown_after_fork): holding it, it would never see EOF from us.
        _parent_fds.add(channel)
        config = WorkerConfig(
            worker_id=worker_id,
            num_workers=self.num_workers,
            base_seed=self.base_seed,
            generation=self.generation,
            dataset_kind=spec.dataset_kind,
            auto_collation=spec.auto_collation,
            drop_last=spec.drop_last,
            payload=self._payload,
            slab_collate=spec.slab_collate,
            max_idle_slabs=spec.prefetch_factor + 1,
            rank=spec.rank,
            world_size=spec.world_size,
            worker_concurrency=spec.worker_concurrency,
        )
        process = self._ctx.Process(
            target=worker_main,
            args=(config, child_sock),
            name=f"aioload-worker-{worker_id}",
            daemon=True,
        )
        try:
            # start() does not wait for the worker to initialise, so workers come up
            # concurrently.
            process.start()
        except BaseException:
            _parent_fds.discard(channel)
            channel.close()
            raise
        finally:
            # Our copy of the child's end must go, or the child's death would not close its
            # socket.
            child_sock.close()
        worker = _Worker(worker_id, process, channel)
        worker.release = self._make_release(worker)
        self.selector.register(channel.sock, selectors.EVENT_READ, (worker, "sock"))
        self.selector.register(process.sentinel, selectors.EVENT_READ, (worker, "exit"))
        return worker

    def _make_release(self, worker: _Worker) -> Callable[[int], None]:
        # Keyed by the worker *incarnation*: a replacement numbers its slabs from 0 again, so a
        # late release of a dead worker's slab must never reach its successor.
        releases = self.releases

        def release(slab_id: int) -> None:
            releases.append((worker, slab_id))

        return release

    # -- tasks -------------------------------------------------------------------------------

    def begin_epoch(self, first: bool, plans: list[PassPlan]) -> int:
        """Start a new generation (a new pass over the sampler). Answers to tasks of older
        generations are dropped, and every worker gets the pass's plan, on which it makes
        its fetcher (IterableDataset workers re-create their iterator)."""
        self.check_usable()
        self.restarts_left = self.max_restarts
        self.restarted.clear()
        self.stream_states.clear()
        self.plans = list(plans)
        # A previous pass's pin stage pipe, if any, is closed by now: forget it.
        for fd in self._watched:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.selector.unregister(fd)
        self._watched.clear()
        if not first:
            self.generation += 1
        for worker in self.workers:
            self._queue(worker, ("reset", self.generation, self.plans[worker.worker_id]))
        self.flush()
        return self.generation

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        self._queue(self.workers[worker_id], ("task", task_id, self.generation, indices))

    def _queue(self, worker: _Worker, message: Any) -> None:
        worker.channel.queue(message)

    def flush(self) -> None:
        """Return freed slabs to their workers and write what fits of every outbox."""
        if self.releases:
            freed: dict[_Worker, list[int]] = {}
            while self.releases:
                worker, slab_id = self.releases.popleft()
                freed.setdefault(worker, []).append(slab_id)
            for worker, slab_ids in freed.items():
                if not worker.exited and not worker.channel.closed:
                    worker.channel.queue(("free", slab_ids))
        for worker in self.workers:
            if worker.channel.outbox and not worker.channel.closed:
                self._pump_out(worker)

    def _pump_out(self, worker: _Worker) -> None:
        """Write what fits of a worker's outbox, and watch for writability while some is left."""
        # A closed channel's death is reported through its sentinel.
        with contextlib.suppress(ChannelClosed):
            worker.channel.pump_out()
        self._watch_writable(worker)

    def _watch_writable(self, worker: _Worker) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if worker.channel.outbox else 0)
        with contextlib.suppress(KeyError, ValueError):
            key = self.selector.get_key(worker.channel.sock)
            if key.events != events:
                self.selector.modify(worker.channel.sock, events, key.data)

    # -- results -----------------------------------------------------------------------------

    def poll(self) -> list[tuple[int, int, Outcome]]:
        """Everything that has arrived, without waiting: (worker_id, task_id, outcome)."""
        results: list[tuple[int, int, Outcome]] = []
        dead: list[_Worker] = []
        for key, mask in self.selector.select(0):
            worker, what = key.data
            if what == "wake":
                continue  # its owner drains it
            if what == "exit":
                dead.append(worker)
                continue
            if mask & selectors.EVENT_WRITE:
                self._pump_out(worker)
            if mask & selectors.EVENT_READ:
                self._read(worker, results)
        for worker in dead:
            # Answers the worker sent before it died are still good: take them first.
            self._read(worker, results)
            self._on_death(worker)
        return results

    def _read(self, worker: _Worker, results: list[tuple[int, int, Outcome]]) -> None:
        if worker.channel.closed:
            return
        try:
            frames = worker.channel.pump_in()
        except ChannelClosed:
            # The worker is exiting; its sentinel reports how.
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(worker.channel.sock)
            return
        for frame in frames:
            outcome = self._decode(worker, frame)
            if outcome is not None:
                results.append((worker.worker_id, frame[1], outcome))

    def _decode(self, worker: _Worker, frame: tuple[Any, ...]) -> Outcome | None:
        kind, _task_id, generation = frame[0], frame[1], frame[2]
        worker.mappings.drop(frame[-1])
        if kind != "state" and generation == self.generation and self.stats is not None:
            # Every answer carries the seconds its worker spent on the task, before the
            # dropped-slabs list (see _worker_main._Worker._send). (A "state" frame precedes
            # its task's answer and is not one.)
            self.stats.fetched(worker.worker_id, frame[-2])
        if kind == "ok":
            slab_id, capacity, used, payload, leaves = frame[3:8]
            if capacity:
                worker.mappings.add(slab_id, worker.channel.take_fd(), capacity)
            if generation != self.generation:
                if slab_id >= 0:
                    self.releases.append((worker, slab_id))
                return None
            batch = worker.mappings.decode(slab_id, used, payload, leaves, worker.release)
            return ("ok", batch)
        if generation != self.generation:
            return None
        if kind == "pickled":
            return ("ok", pickle.loads(frame[3]))
        if kind == "err":
            if getattr(frame[3], "from_init", False):
                self.stale = True
            return ("err", frame[3])
        if kind == "end":
            return ("end", None)
        if kind == "state":
            self.stream_states[frame[1]] = (frame[3], frame[4], frame[5])
            return None
        raise AssertionError(f"unknown frame from worker: {kind!r}")

    def _on_death(self, worker: _Worker) -> None:
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
        if self.restarts_left > 0:
            self.restarts_left -= 1
            used = self.max_restarts - self.restarts_left
            warnings.warn(
                f"{message} aioload replaced it with a new worker {worker.worker_id} "
                f"(restart {used} of max_worker_restarts={self.max_restarts}) and is sending "
                "its unfinished tasks again.",
                RuntimeWarning,
                stacklevel=2,
            )
            self._retire(worker)
            replacement = self._spawn(worker.worker_id)
            self.workers[worker.worker_id] = replacement
            self._queue(replacement, ("reset", self.generation, self.plans[worker.worker_id]))
            self.restarted.append(worker.worker_id)
            return
        self.broken = WorkerDiedError(
            message, worker_id=worker.worker_id, pid=worker.pid, exitcode=code
        )

    def _retire(self, worker: _Worker) -> None:
        # Its mappings stay alive as long as batches the consumer holds reference them.
        _parent_fds.discard(worker.channel)
        worker.channel.close()
        with contextlib.suppress(ValueError, AssertionError):
            worker.process.join(timeout=1.0)
            worker.process.close()

    def kill(self, worker_id: int) -> None:
        """SIGKILL a worker (a hung one); its death is then handled as any other."""
        with contextlib.suppress(ProcessLookupError, OSError, ValueError):
            self.workers[worker_id].process.kill()

    def take_restarted(self) -> list[int]:
        restarted, self.restarted = self.restarted, []
        return restarted

    def check_usable(self) -> None:
        if self.broken is not None:
            raise self.broken
        if self.closed:
            raise RuntimeError("aioload: the worker pool has been shut down")

    async def wait(self, deadline: float) -> bool:
        """Wait until something may have arrived, a worker exited, or ``deadline`` (in
        ``time.monotonic()`` seconds; ``math.inf`` for none) passes. False when nothing woke
        us: only then is a health check worth its syscalls, since every worker's death already
        wakes us through its sentinel."""
        budget = min(deadline - time.monotonic(), _HEALTH_CHECK_S)
        if budget <= 0:
            return False
        with anyio.move_on_after(budget):
            await anyio.wait_readable(self.selector.fileno())
            return True
        return False

    def check_health(self) -> None:
        """Catch a worker that exited without its sentinel being seen yet."""
        for worker in self.workers:
            if not worker.exited and worker.process.exitcode is not None:
                results: list[tuple[int, int, Outcome]] = []
                self._read(worker, results)
                self._on_death(worker)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Stop every worker and release every resource. Bounded: at most ``grace`` seconds
        of waiting, then SIGKILL. Safe to call twice, from a finalizer, or after a fork."""
        if self.closed or os.getpid() != self._owner_pid:
            return
        self.closed = True
        # 1. Close our ends first. An idle worker sees EOF in its poll() and leaves at once; a
        #    busy one gets EPIPE on its next answer. No "stop" message is needed, and none can
        #    get stuck behind a full socket.
        for worker in self.workers:
            _parent_fds.discard(worker.channel)
            worker.channel.close()
        # 2. Give them ``grace`` seconds to leave on their own, waiting on all sentinels at once.
        pending = [w for w in self.workers if w.process.exitcode is None]
        deadline = time.monotonic() + grace
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            multiprocessing.connection.wait([w.process.sentinel for w in pending], timeout=left)
            pending = [w for w in pending if w.process.exitcode is None]
        # 3. Whoever is still there is stuck in user code: kill it. SIGKILL cannot be caught, so
        #    the join below is bounded.
        for worker in pending:
            with contextlib.suppress(ProcessLookupError, OSError, ValueError):
                worker.process.kill()
        for worker in self.workers:
            with contextlib.suppress(ValueError, AssertionError):
                worker.process.join(timeout=5.0)
                # Process.close() releases the sentinel descriptor now rather than at GC.
                worker.process.close()
            worker.exited = True
        # 4. Unmapping our side happens as leases die: a batch the user still holds stays valid.
        for worker in self.workers:
            worker.mappings.clear()
        with contextlib.suppress(Exception):
            self.selector.close()
        self.releases.clear()

    def watch(self, fd: int) -> None:
        """Also wake the orchestrator when ``fd`` becomes readable (the pin stage's pipe)."""
        self.selector.register(fd, selectors.EVENT_READ, (None, "wake"))
        self._watched.append(fd)

    def pid(self, worker_id: int) -> int | None:
        return self.workers[worker_id].pid
