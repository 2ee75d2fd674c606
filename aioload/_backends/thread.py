"""Workers as threads of the consumer's process (``worker_method="thread"``).

The fourth ``_backends.base.WorkerBackend``, beside processes, the calling process and Ray.
Each worker slot is one daemon thread running a ``_worker.main.WorkerStep`` made for it
(``place="thread"``): the same fetch, collate, ``worker_init_fn``, seeds and error wrapping as
a worker process, on the one dataset object every thread shares.

- **Tasks in, answers out, by reference.** Each thread takes its ``Reset``/``Task`` messages
  from an inbox of its own (``queue.SimpleQueue``) and puts its ``Answer`` on one queue the
  backend drains in ``poll``: a batch is handed over as the object the collate made. No
  pickling, no slabs, nothing in ``/dev/shm``.
- **The wake-up.** After putting an answer, a thread writes a byte to a pipe; that pipe is
  what the backend offers the engine to sleep on (``waitable``), as Ray's waiter thread does,
  so ``for``, asyncio, uvloop and trio all wait alike. ``poll`` empties the pipe before the
  queue, so an answer put after the queue was emptied always leaves a byte behind it.
- **No state shared under the GIL alone.** Whatever a thread and the engine both touch is a
  queue, or is behind ``_Shared.lock`` (the pass's generation, whether the backend is closed,
  which incarnation holds a slot): the backend is correct on a free-threaded build.
- **A stuck thread is abandoned.** A thread cannot be killed. ``abandon`` (a task past
  ``timeout``) marks the thread's incarnation dead, reports it lost, and a replacement takes
  its slot (``restart``); the stuck thread's late answer, if it ever comes, is dropped, so the
  engine's exactly-once holds. Threads are daemons and ``close`` joins them for a bounded
  grace only, so a stuck one never blocks a pass's end or the interpreter's exit.
- **Async datasets.** A thread of an async dataset runs an event loop of its own (uvloop where
  installed), and awaits each task's fetch on it, with ``worker_concurrency`` samples in
  flight within the task.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

from .._aio.waiting import Descriptor
from .._wire.messages import (
    Answer,
    Event,
    PassPlan,
    Produced,
    Reset,
    SetConcurrency,
    Task,
    WorkerLost,
    failed_in_setup,
    outcome_of,
)
from ..errors import WorkerDiedError
from .base import BackendTraits, Place, TunableBackend, Waitable, WorkerBackend, WorkerSpec

if TYPE_CHECKING:
    import asyncio

    from .._worker.main import StepResult, WorkerStep

__all__ = ["THREAD", "ThreadBackend"]

# Threads start in microseconds (made on the pass's first next(), in the caller's thread),
# and fetch ahead of the consumer as processes do.
THREAD = BackendTraits(slow_start=False, runs_ahead=True)
# The longest the engine sleeps without a poll: a thread's end is announced through the pipe
# as an answer is, so this only bounds the sleep.
_HEALTH_CHECK_S = 1.0
# How long close() waits, in all, for the threads to finish the task in hand and leave.
CLOSE_GRACE_S = 0.5
# How often a thread's async batch looks whether its pass is still wanted: a new pass or
# close() cancels it, as a process worker cancels the batches of a pass it has left (else a
# stale fetch that never ends would hold the thread, and the next pass would wait on it).
_STALE_CHECK_S = 0.05
# How long the interpreter's exit waits, in all, for threads still in a sample (see
# NOTE [ Thread workers at the interpreter's exit ]).
_EXIT_GRACE_S = 5.0
# A thread's inbox: this ends the thread.
_STOP: Any = object()
# Names threads across backends, for place() and stack dumps.
_serial = itertools.count()


class _Shared:
    """What the engine and the worker threads both touch, behind one lock (see the module's
    docstring): the answers, the wake-up pipe, the pass's generation."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # (worker incarnation, its task's generation (None: a loss), answer or loss) from the
        # threads, drained by poll.
        self.answers: queue.SimpleQueue[tuple[_ThreadWorker, int | None, Event]] = (
            queue.SimpleQueue()
        )
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.closed = False
        self.generation = 0

    def put(self, worker: _ThreadWorker, event: Event, generation: int | None = None) -> None:
        """From a worker thread: an answer to a task of ``generation`` (or its own end), and a
        byte to wake the engine."""
        self.answers.put((worker, generation, event))
        with self.lock:
            if self.closed:
                return  # (the pipe is closed: its number may be another file's by now)
            with contextlib.suppress(BlockingIOError):  # full: readable anyway
                os.write(self.wake_w, b"\0")

    def current(self, generation: int) -> bool:
        """Whether a task of ``generation`` is still wanted (not a pass left, not closed)."""
        with self.lock:
            return not self.closed and generation >= self.generation

    def drain_wake(self) -> None:
        with self.lock, contextlib.suppress(BlockingIOError, OSError):
            while not self.closed and os.read(self.wake_r, 4096):
                pass

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            os.close(self.wake_r)
            os.close(self.wake_w)


class _ThreadWorker:
    """One incarnation of a worker slot: its thread and its inbox. A replacement is a new
    incarnation in the same slot; the old one's answers are dropped (``poll``)."""

    def __init__(
        self, backend: ThreadBackend, worker_id: int, before_init: dict[str, Any] | None
    ) -> None:
        self.worker_id = worker_id
        # The dataset's attributes before worker_init_fn ran (``_before_init``).
        self.before_init = before_init
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Set by the engine when this incarnation is abandoned or replaced: the tasks left in
        # its inbox went to the slot's new thread, so it must run none of them (a dataset
        # would see those samples fetched twice, at once).
        self.dismissed = threading.Event()
        self.shared = backend.shared
        spec = backend.spec
        # As a local process gets them (payload: the objects themselves, shared), but with
        # torch's default collate stacking privately: no slab in a thread.
        self.config = spec.worker_config(
            worker_id,
            backend.base_seed,
            backend.generation,
            payload=(spec.dataset, spec.collate_fn, spec.worker_init_fn),
            shared_memory=False,
        )._replace(slab_collate=spec.slab_collate)
        self.thread = threading.Thread(
            target=self._run, name=f"aioload-worker-{worker_id}-{next(_serial)}", daemon=True
        )
        self.thread.start()
        _threads.add(self.thread)

    # -- in the worker thread ----------------------------------------------------------------

    def _run(self) -> None:
        from .._worker.info import _set_thread_worker_info, install_thread_hook
        from .._worker.main import WorkerStep

        install_thread_hook()
        _one_intra_op_thread()
        try:
            # Made here: worker_init_fn and get_worker_info() are this thread's.
            step = WorkerStep(self.config, slabs=None, place="thread")
            if step.is_async:
                self._serve_async(step)
            else:
                self._serve(step)
        except BaseException as error:  # (reported as the worker's loss)
            message = f"DataLoader worker (thread {self.thread.name}) ended unexpectedly: {error!r}"
            lost = WorkerDiedError(message, worker_id=self.worker_id)
            self.shared.put(self, WorkerLost(self.worker_id, lost))
        finally:
            _set_thread_worker_info(None)

    def _serve(self, step: WorkerStep) -> None:
        rebound = _rebound(self.before_init, step)  # (worker_init_fn ran in WorkerStep())
        while (message := self.inbox.get()) is not _STOP and not self.dismissed.is_set():
            if isinstance(message, Reset):
                if step.accepts(message):
                    step.generation = message.generation
                    step.new_pass(message.plan)
                    _refuse_shared_state(step, rebound)
            elif isinstance(message, SetConcurrency):
                step.set_concurrency(message.concurrency)
            elif self.shared.current(message.generation):
                started = time.perf_counter()
                self._answer(step, message, step.run(message), started)

    def _serve_async(self, step: WorkerStep) -> None:
        from .._worker.main import _new_event_loop

        loop = _new_event_loop()
        try:
            loop.run_until_complete(step.finish_async_init())
            rebound = _rebound(self.before_init, step)  # (after an async worker_init_fn too)
            entered = loop.run_until_complete(step.enter_async_context())
            try:
                self._serve_on(loop, step, rebound)
            finally:
                if step.fetcher is not None:
                    with contextlib.suppress(Exception):
                        loop.run_until_complete(step.fetcher.aclose())
                if entered:
                    with contextlib.suppress(Exception):
                        loop.run_until_complete(step.dataset.__aexit__(None, None, None))
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _serve_on(
        self, loop: asyncio.AbstractEventLoop, step: WorkerStep, rebound: list[str]
    ) -> None:
        """An async dataset's tasks, one after another, each awaited on this thread's loop
        (its samples ``worker_concurrency`` at a time)."""
        while (message := self.inbox.get()) is not _STOP and not self.dismissed.is_set():
            if isinstance(message, Reset):
                if step.accepts(message):
                    step.generation = message.generation
                    if step.iterable:
                        loop.run_until_complete(step.start_async_stream(message.plan))
                        _refuse_shared_state(step, rebound)
                    else:
                        step.new_async_pass(message.plan)
            elif isinstance(message, SetConcurrency):
                # On the loop, as a process worker resizes: a semaphore made off the loop
                # (fewer slots) binds to none, and more slots then released into it, still
                # off the loop, raised NoEventLoopError and ended the thread.
                loop.run_until_complete(_resize(step, message.concurrency))
            elif self.shared.current(message.generation):
                started = time.perf_counter()
                result = loop.run_until_complete(self._unless_stale(step, message))
                if result is not None:
                    self._answer(step, message, result, started)

    async def _unless_stale(self, step: WorkerStep, task: Task) -> StepResult | None:
        """``step.run_async(task)``, cancelled (None: no answer, the engine drops stale
        ones) once its pass is left, the backend closed or this thread dismissed."""
        import asyncio  # (lazy, as the module's other imports of it)

        job = asyncio.ensure_future(step.run_async(task))
        while not job.done():
            await asyncio.wait({job}, timeout=_STALE_CHECK_S)
            if not job.done() and (
                self.dismissed.is_set() or not self.shared.current(task.generation)
            ):
                job.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await job
                return None
        return job.result()

    def _answer(self, step: WorkerStep, task: Task, result: StepResult, started: float) -> None:
        answer = Answer(
            self.worker_id,
            task.task_id,
            outcome_of(result, _by_reference),
            step.point_of(result),
            time.perf_counter() - started,
        )
        # (The fetcher keeps a batch's samples until it is sent: it is, now.)
        forget = getattr(step.fetcher, "forget", None)
        if forget is not None:
            forget()
        self.shared.put(self, answer, task.generation)


async def _resize(step: WorkerStep, concurrency: int) -> None:
    step.set_concurrency(concurrency)


# NOTE [ Thread workers' intra-op threads ]
#
# A worker process runs torch with one intra-op thread (torch.set_num_threads(1), as torch's
# own workers do): its collate, a torch.stack of the batch, is one copy on one core. A thread
# worker cannot call torch.set_num_threads, which is the whole process's (the training loop's
# too). Left alone, each worker thread's collate runs an OpenMP team as wide as the process's
# setting: two worker threads on two cores ran four copying threads, whose spin-waits after
# each copy took the CPU the other worker was decoding on (the jpeg benchmark). So each
# worker thread sets its own OpenMP limit, a per-thread setting (the "nthreads-var" ICV) that
# torch's parallel_for reads through omp_get_max_threads(): the threads that are not workers,
# the consumer's included, keep the process's setting. torch initialises a thread's limit
# from its process-wide setting the first time the thread asks (at::get_num_threads), which
# would undo ours: torch.get_num_threads() is called first for that. Where the OpenMP runtime
# is not found (a torch built without OpenMP, or no /proc), nothing changes.


def _one_intra_op_thread() -> None:
    """This worker thread's torch ops run on one intra-op thread (see the NOTE above)."""
    import torch

    runtime = _openmp_runtime()
    if runtime is None:
        return
    torch.get_num_threads()  # (this thread's limit initialised first: see the NOTE)
    runtime.omp_set_num_threads(1)


@functools.cache
def _openmp_runtime() -> Any:
    """The OpenMP runtime torch loaded (libgomp, Intel's libiomp5 or LLVM's libomp), from the
    process's memory map; None where there is none (or no /proc)."""
    import ctypes
    import re

    try:
        with open("/proc/self/maps") as maps:
            found = re.search(r"(/\S*/lib(?:gomp|iomp5|omp)[^/\s]*\.so[^/\s]*)$", maps.read(), re.M)
    except OSError:
        return None
    if found is None:
        return None
    try:
        return ctypes.CDLL(found.group(1))
    except OSError:
        return None


def _by_reference(result: Produced) -> Any:
    # The batch as the collate made it: the consumer's process is this one.
    return result.data


def _before_init(spec: WorkerSpec) -> dict[str, Any] | None:
    """An IterableDataset's attributes before thread workers run ``worker_init_fn`` on it,
    taken before any of them starts (each worker's own snapshot would count what a sibling
    added as changed), or None where there is nothing to compare."""
    if spec.worker_init_fn is None or spec.dataset_kind != 1:
        return None
    return dict(getattr(spec.dataset, "__dict__", {}))


def _rebound(before: dict[str, Any] | None, step: WorkerStep) -> list[str]:
    """The dataset's attributes that ``worker_init_fn`` bound to other objects: torch's
    recipe of sharding an IterableDataset by changing ``get_worker_info().dataset``, which
    needs a copy per worker. What it adds (a client of its own) is not counted."""
    if before is None:
        return []
    now = getattr(step.dataset, "__dict__", {})
    return sorted(k for k, v in before.items() if k in now and now[k] is not v)


def _refuse_shared_state(step: WorkerStep, rebound: list[str]) -> None:
    """An IterableDataset that is its own iterator (``__iter__``, or an async one's
    ``__aiter__``, returns ``self``) has one stream, which every thread worker would draw from
    at once: each worker's stream is its own only where ``iter(dataset)`` makes a new
    iterator. And a ``worker_init_fn`` that shards the dataset by changing its attributes
    (torch's docstring recipe: ``get_worker_info().dataset.start = ...``) changes them for
    every thread worker, which then lose and repeat elements. Either way this pass fails with
    a message that says so (a process worker has a copy of the dataset, so it never meets
    this)."""
    fetcher = step.fetcher
    if not (step.iterable and step.config.num_workers > 1 and fetcher is not None):
        return
    own_iterator = getattr(fetcher, "stream", None) is step.dataset
    if not (rebound or own_iterator):
        return
    name, workers = type(step.dataset).__name__, step.config.num_workers
    shared = f"its {workers} thread workers (worker_method='thread') share"
    instead = "or use worker_method='multiprocessing' (each process has its own copy)"
    if rebound:
        message = (
            f"aioload: worker_init_fn changed {', '.join(rebound)} of the "
            f"{name}, which {shared}: sharding an IterableDataset by changing "
            "get_worker_info().dataset needs a copy per worker; shard in __iter__ with "
            f"get_worker_info() instead, {instead}"
        )
    else:
        method = "__aiter__" if step.is_async else "__iter__"
        message = (
            f"aioload: {name}.{method} returns the dataset itself, so {shared} one stream; "
            f"make {method} return a new iterator, {instead}"
        )
    try:
        raise TypeError(message)
    except TypeError:
        step.fetch_error = step.error().error


class ThreadBackend:
    """``num_workers`` worker threads in this process (see the module's docstring)."""

    TRAITS: ClassVar[BackendTraits] = THREAD

    def __init__(self, spec: WorkerSpec, base_seed: int) -> None:
        self.spec = spec
        self.base_seed = base_seed
        self.num_workers = spec.num_workers
        self.retired = False
        self.closed = False
        self.generation = 0
        self.passes = 0
        self.shared = _Shared()
        self._descriptor = Descriptor(self.shared.wake_r)
        self._waitable = Waitable(self._descriptor, _HEALTH_CHECK_S)
        self.plans: list[PassPlan] = [PassPlan()] * self.num_workers
        # Slots whose worker was abandoned, to report lost at the next poll.
        self._abandoned: list[int] = []
        self.concurrency: int | None = None
        self.active = self.num_workers
        before = _before_init(spec)  # (before any thread's worker_init_fn runs)
        self.workers = [_ThreadWorker(self, w, before) for w in range(self.num_workers)]
        _live.add(self)

    # -- the seam ----------------------------------------------------------------------------

    def start_pass(self, plans: list[PassPlan]) -> None:
        if self.closed:
            raise RuntimeError("aioload: the worker threads have been shut down")
        self.plans = list(plans)
        if self.passes:
            self.generation += 1
            with self.shared.lock:
                self.shared.generation = self.generation
        self.passes += 1
        for worker in self.workers:
            worker.inbox.put(Reset(self.generation, self.plans[worker.worker_id]))

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        self.workers[worker_id].inbox.put(Task(task_id, self.generation, indices))

    def poll(self) -> list[Event]:
        shared = self.shared
        shared.drain_wake()  # first: see _Shared
        events: list[Event] = []
        while True:
            try:
                worker, generation, event = shared.answers.get_nowait()
            except queue.Empty:
                break
            if worker is not self.workers[worker.worker_id]:
                continue  # an abandoned incarnation's late answer: its tasks went again
            # NOTE: a task of a pass that was left (a break on kept workers) may have been
            # running when the next pass started; its answer is dropped, as the process
            # backend drops replies of an older generation. Checked here, in the engine's
            # thread, not before the put: the pass may be left between the check and the put.
            if generation is not None and generation < self.generation:
                continue
            if isinstance(event, Answer) and failed_in_setup(event):
                self.retired = True
            events.append(event)
        for worker_id in self._abandoned:
            events.append(WorkerLost(worker_id, self._abandoned_error(worker_id)))
        self._abandoned.clear()
        return events

    def flush(self) -> None:
        pass  # a task is in its worker's queue as it is submitted

    def waitable(self, awaited: int | None = None) -> Waitable:
        """The wake-up pipe, which every answer writes to (whichever worker's: ``awaited`` is
        not needed, an answer costs the engine no read of a socket)."""
        return self._waitable

    def restart(self, worker_id: int, plan: PassPlan | None = None) -> None:
        """A new thread in the slot, on this pass's plan (or ``plan``). The one it replaces
        was abandoned (``abandon``) or ended; its late answers are dropped."""
        if plan is not None:
            self.plans[worker_id] = plan
        old = self.workers[worker_id]
        old.dismissed.set()
        old.inbox.put(_STOP)
        replacement = _ThreadWorker(self, worker_id, _before_init(self.spec))
        self.workers[worker_id] = replacement
        replacement.inbox.put(Reset(self.generation, self.plans[worker_id]))
        if self.concurrency is not None:
            replacement.inbox.put(SetConcurrency(self.concurrency))

    def abandon(self, worker_id: int) -> None:
        """A thread that stopped answering cannot be killed: it is left to finish (or never
        finish) its sample as a daemon, and reported lost at the next poll."""
        worker = self.workers[worker_id]
        worker.dismissed.set()  # it runs nothing more, and leaves if its sample ever ends
        worker.inbox.put(_STOP)
        self._abandoned.append(worker_id)

    def retire(self) -> None:
        self.retired = True

    def place(self, worker_id: int) -> Place:
        return Place(f"thread {self.workers[worker_id].thread.name}")

    def dump_stack(self, worker_id: int) -> str | None:
        """The worker thread's stack (the hang report): a thread of this process, read with
        no help from it, so a stuck one answers too."""
        from .._worker.stacks import format_threads  # (only a hang report needs it)

        ident = self.workers[worker_id].thread.ident
        return format_threads([ident]) if ident is not None else None

    def activate(self, count: int) -> None:
        """num_workers="auto": every thread is already running (an idle one costs nothing but
        its stack); the engine dispatches to the first ``count``."""
        self.active = max(1, min(self.num_workers, count))

    def set_concurrency(self, concurrency: int) -> None:
        self.concurrency = concurrency
        for worker in self.workers:
            worker.inbox.put(SetConcurrency(concurrency))

    def close(self, grace: float | None = None) -> None:
        """Tell every thread to leave after the task in hand, and wait for them a bounded
        while (``grace``, by default ``CLOSE_GRACE_S``); one still in a sample after that is
        abandoned (a daemon: it never holds up the interpreter's exit). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.retired = True
        for worker in self.workers:
            worker.inbox.put(_STOP)
        # Closed first: a thread between two tasks skips what is left in its inbox.
        self.shared.close()
        deadline = time.monotonic() + (CLOSE_GRACE_S if grace is None else grace)
        for worker in self.workers:
            if worker.thread is not threading.current_thread():
                worker.thread.join(max(0.0, deadline - time.monotonic()))
        # Answers nobody will read: let their batches go now.
        with contextlib.suppress(queue.Empty):
            while True:
                self.shared.answers.get_nowait()

    def _abandoned_error(self, worker_id: int) -> WorkerDiedError:
        name = self.workers[worker_id].thread.name
        return WorkerDiedError(
            f"DataLoader worker (thread {name}) stopped answering and was abandoned: a "
            "thread cannot be killed, so it is left to finish its sample in the background, "
            "and its answer will be dropped.",
            worker_id=worker_id,
        )


# NOTE [ Thread workers at the interpreter's exit ]
#
# Worker threads are daemons, so that a stuck one never holds the interpreter's exit. But a
# daemon thread that is still inside native code (a torch op, a decoder) when the interpreter
# finalises keeps running while the process's C++ statics are destroyed under it, and the
# process aborts ("terminate called without an active exception", exit status 134) after the
# user's script ended well. A pass's close() waits only briefly (CLOSE_GRACE_S), and the
# finalizers that close an abandoned pass or kept workers at exit call that close().
#
# So at exit every live backend is closed, and every worker thread still running (of a pass
# closed earlier, or abandoned) is waited for with a longer, bounded grace: threads between
# tasks leave at once, a thread in a sample leaves when the sample ends, and only a thread
# still in a sample after _EXIT_GRACE_S in all is left, as torch leaves a worker process
# after its own bounded join. The hook is an atexit one registered when this module is first
# imported, after weakref's: atexit runs last-registered first, so it runs before the
# finalizers, while the threads can still finish.
_live: weakref.WeakSet[ThreadBackend] = weakref.WeakSet()
_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def _close_at_exit() -> None:
    for backend in list(_live):
        backend.close(grace=0.0)
    deadline = time.monotonic() + _EXIT_GRACE_S
    for thread in list(_threads):
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(_close_at_exit)


def _conforms(backend: ThreadBackend) -> tuple[WorkerBackend, TunableBackend]:
    # Type-checked: the backend honours the seam, and the controller's optional part of it.
    return backend, backend
