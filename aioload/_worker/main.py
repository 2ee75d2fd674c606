"""Code that runs inside a worker: the fetch step every backend shares, and the process loop.

:class:`WorkerStep` is what a worker does with a task, wherever it runs: its setup (seeds,
``get_worker_info()``, ``worker_init_fn``), the pass's fetcher, one fetch and collate (sync or
async), and one way to answer an error. A Ray actor runs the same step.

:class:`_ProcessWorker` is the loop of a local worker process around that step: it reads
``_wire.messages.Task``/``Reset``/``FreeSlabs`` from its socket, puts each batch in a shared-memory
slab and answers with one ``_wire.messages.Reply`` per task, which keeps the parent's bookkeeping
simple: a task is in flight until its answer arrives or its worker dies.

The worker never outlives its parent. It waits for work in ``poll`` with a one-second bound; a
closed socket (the parent exited, was killed, or shut us down) ends it at once, and a changed
parent pid ends it within a second even if something else still holds the parent's end. Inside
a slow sample, ``_worker.parent``'s watch ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import importlib.util
import inspect
import math
import os
import pickle
import random
import select
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
from torch._utils import ExceptionWrapper, KeyErrorMessage
from torch.utils.data._utils.worker import _generate_state

from .._wire import slabs as _transport
from .._wire.channel import ChannelClosed, WorkerChannel
from .._wire.messages import (
    Failure,
    FreeSlabs,
    PassPlan,
    PickledBatch,
    Produced,
    Reply,
    Reset,
    SetConcurrency,
    SlabBatch,
    StreamEnded,
    StreamState,
    Task,
    ToWorker,
)
from .._wire.packed import pack_reply, unpack_to_worker
from ..errors import WorkerError
from . import stacks as _stacks
from .async_detect import has_async_context, is_async_dataset
from .datapipes import is_datapipe, reseed, shard_in_worker
from .fetch import Fetcher, FetchSpec, SamplePolicy, is_stateful
from .heap import HeapPolicy
from .info import (
    WorkerInfo,
    _set_thread_worker_info,
    _set_worker_info,
    make_rng,
    thread_worker_info,
)
from .parent import ParentWatch, watch_parent

if TYPE_CHECKING:
    import anyio.abc

    from .async_fetch import AsyncFetcher

# A worker of a sync dataset (the common case) never runs an event loop: anyio and the async
# fetch machinery are imported by the functions of the async worker loop below, on their first
# call, so neither the parent (which imports this module before it forks) nor a sync worker
# pays for them.

__all__ = [
    "RemoteError",
    "WorkerConfig",
    "WorkerStep",
    "worker_main",
]

_PARENT_CHECK_S = 1.0


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_NO_INDEX: Any = object()


def _failed_index(tb: TracebackType | None) -> Any:
    """The index a failed fetch was for, where the dataset's own ``__getitem__`` raised (or
    something it called): the argument of the first frame outside aioload that aioload's
    fetch code called, when that frame is a ``__getitem__``. ``_NO_INDEX`` for any other
    failure (a batched ``__getitems__``, a ``collate_fn``, ``worker_init_fn``)."""
    called_from_aioload = False
    while tb is not None:
        code = tb.tb_frame.f_code
        ours = code.co_filename.startswith(_PACKAGE_DIR)
        if called_from_aioload and not ours:
            if code.co_name == "__getitem__" and code.co_argcount >= 2:
                return tb.tb_frame.f_locals.get(code.co_varnames[1], _NO_INDEX)
            return _NO_INDEX
        called_from_aioload = ours
        tb = tb.tb_next
    return _NO_INDEX


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
        # The sample whose fetch raised, named beside torch's message (its first lines are
        # torch's, word for word, and its last is the exception's own).
        index = _failed_index(sys.exc_info()[2])
        if index is not _NO_INDEX:
            head, _, frames = self.exc_msg.partition("\n")
            self.exc_msg = f"{head}\n  (fetching the sample at index {index!r})\n{frames}"

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


class WorkerConfig(NamedTuple):
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


def _seed(base_seed: int, worker_id: int) -> int:
    # The same seeds torch's own workers use, so random augmentations match torch's loader.
    seed = base_seed + worker_id
    random.seed(seed)
    if _accelerators_to_seed():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
    _seed_numpy(_generate_state(base_seed, worker_id))  # type: ignore[no-untyped-call]
    return seed


def _accelerators_to_seed() -> bool:
    """Whether this torch could ever run on an accelerator in this process, so that
    ``torch.manual_seed`` must seed it too.

    torch's workers call ``torch.manual_seed``, which also seeds every accelerator backend. An
    uninitialized one (CUDA, XPU, MTIA) defers its seeding: it keeps the seed and a formatted
    stack trace of the call for when it starts. That costs a worker about 2 ms and 500
    copy-on-write page faults of its start, on the path to the first batch, and in a torch
    built without any accelerator it is for a backend that can never start: there, seeding
    the CPU generator (all that call then does that can be observed) is enough. Anything
    unsure, a custom device backend included, takes the full call."""
    try:
        return bool(
            torch.cuda._is_compiled()
            or torch.xpu._is_compiled()
            or torch.mtia._is_compiled()
            or torch.backends.mps.is_built()
            or torch._C._get_privateuse1_backend_name() != "privateuseone"
        )
    except Exception:  # a torch without one of these: do as torch's workers do
        return True


def _seed_numpy(state: list[int]) -> None:
    """Seed numpy's global RNG with ``state``, as torch's workers do, without importing
    ``numpy.random`` only for that.

    torch's workers import ``numpy.random`` to seed it: about 10 ms of a worker's start (before
    its first batch) and 2-3 MiB of its memory, whether or not the dataset ever draws from it.
    Where nothing in this process has imported it yet, nothing can have drawn from it either,
    so the seed is applied the moment it is imported (by the dataset, ``worker_init_fn`` or a
    library, through the import system in every case), before anyone can draw: every draw sees
    the state torch's worker gives it.
    """
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed(state)
        return

    def seed(module: ModuleType) -> None:
        module.seed(state)

    # A seeding not applied yet (numpy.random still not imported) is replaced, not stacked:
    # two hooks for one import would each wrap the same loader's ``exec_module``.
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImport) and finder.name == "numpy.random":
            finder.then = seed
            return
    sys.meta_path.insert(0, _AfterImport("numpy.random", seed))


class _AfterImport:
    """A meta path finder that runs ``then(module)`` right after the module ``name`` has been
    executed, before the import that loads it returns, and then leaves ``sys.meta_path``.

    It finds nothing itself: the module is found by the finders behind it, and loaded by its own
    loader, whose ``exec_module`` is wrapped on that one loader object for that one call (so the
    module's ``__loader__`` and ``__spec__`` are what they would have been)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        # Out first: the search below, and any later import of the name, skip this finder.
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader: Any = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        then = self.then

        def exec_then(module: ModuleType) -> None:
            try:
                exec_module(module)
            finally:
                del loader.exec_module
            then(module)

        loader.exec_module = exec_then
        return spec


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


StepResult = Produced | Failure | StreamEnded

# Where a WorkerStep runs (see WorkerStep):
# - "worker": a worker's own process (a local worker process, a Ray actor);
# - "beside": a worker's step in the consumer's process, set up as that worker would be (its
#   seeds, ``get_worker_info()``, ``worker_init_fn``), its globals swapped in around each step
#   by whoever drives it (the fake backend, ``_backends.fake``);
# - "caller": the calling process itself, as torch's ``num_workers=0`` (``InlineBackend``);
# - "thread": a worker thread in the consumer's process (``_backends.thread``): set up as a
#   worker (its seed, ``worker_init_fn``), but its ``get_worker_info()`` is its thread's own,
#   with per-worker generators (``rng``), and the process-wide generators, which every thread
#   shares, are not reseeded.
Place = Literal["worker", "beside", "caller", "thread"]


class WorkerStep:
    """What one worker does with one task, whatever carries tasks to it (a process's socket,
    or a Ray actor's method calls): the worker's setup (seeds, ``get_worker_info()``,
    ``worker_init_fn``), the pass's fetcher, and the fetch and collate of one task, sync or
    async. It knows nothing of transports: it returns a :class:`Produced`, a
    :class:`Failure` or :class:`StreamEnded`, and its caller encodes and sends the answer.

    With ``slabs`` (a process worker), a batch is collated straight into a shared-memory slab
    when the collate is torch's default.

    ``place="caller"`` is torch's ``num_workers=0``: the calling process fetches, with no
    worker setup at all (no seeds, no ``get_worker_info()``, no ``worker_init_fn``, no
    DataPipe sharding, which the loader does for that process), from ``config.payload``'s
    objects themselves; a failure is answered with the exception itself, with its own
    traceback, not wrapped; and a seeded fetch puts the caller's RNG states back.
    Wherever the step shares the consumer's process (``"caller"``, ``"beside"``), the stream
    points it answers with are deep copies: the dataset's state object may be the live one,
    which later batches would change under the checkpoint (a worker's reply pickles it).
    """

    def __init__(
        self,
        config: WorkerConfig,
        slabs: _transport.WorkerSlabPool | None,
        *,
        place: Place = "worker",
    ) -> None:
        self.config = config
        self.slabs = slabs
        self.in_caller = place == "caller"
        self.in_thread = place == "thread"
        self.copies_points = place != "worker"
        self.iterable = config.dataset_kind == 1
        # The newest pass announced to this worker; tasks of older ones are skipped.
        self.generation = config.generation
        self.fetcher: Any = None
        # The worker's setup failed: the answer to every task it gets, so it reaches the
        # consumer (and the pool is not reused).
        self.init_error: Any = None
        # An IterableDataset's __iter__ failed this pass (as ``error`` answers it).
        self.fetch_error: Any = None
        # This pass's IterableDataset stream has run dry.
        self.iteration_end = False
        # Where the dataset stood after the last task run (see ``point_of``).
        self.point: StreamState | None = None
        # A Stateful dataset's state when this worker began its first pass: where a kept
        # worker that is rewound to an untouched dataset goes back to (``rewind``).
        self.pristine: Any = None
        self.began = False
        # An async worker_init_fn's coroutine, awaited on the worker's loop before any task.
        self.async_init: Any = None
        self.dataset: Any = None
        self.collate_fn: Any = None
        # An async dataset's fetches at once (worker_concurrency; "auto" changes it).
        self.concurrency = config.worker_concurrency

        wid = config.worker_id
        seed: int | None = None
        if self.in_thread:
            seed = config.base_seed + wid  # torch's worker seed; no process-wide seeding
        elif not self.in_caller:
            seed = _seed(config.base_seed, wid)
        try:
            payload = config.payload
            objects = pickle.loads(payload) if isinstance(payload, bytes) else payload
            self.dataset, collate_fn, init_fn = objects
            if config.slab_collate:
                collate_fn = _transport.slab_collate
            self.collate_fn = collate_fn
            if seed is not None:
                self._set_up_worker(wid, seed, init_fn)
        except Exception:
            self.setup_failed()
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
                self.setup_failed()

    def _set_up_worker(self, wid: int, seed: int, init_fn: Any) -> None:
        """What a worker does before its first task (not the calling process)."""
        config = self.config
        fields: dict[str, Any] = {
            "id": wid,
            "num_workers": config.num_workers,
            "seed": seed,
            "dataset": self.dataset,
            "rank": config.rank,
            "world_size": config.world_size,
        }
        if self.in_thread:
            # This thread's own info, with generators of its own (seeded as torch seeds a
            # process worker's globals); nothing process-wide changes.
            rng = make_rng(seed, _generate_state(config.base_seed, wid))  # type: ignore[no-untyped-call]
            _set_thread_worker_info(thread_worker_info(rng=rng, **fields))
        else:
            _set_worker_info(WorkerInfo(**fields))
        if is_datapipe(self.dataset):
            # As torch's workers do, before the user's worker_init_fn.
            shard_in_worker(self.dataset, config.num_workers, wid, config.world_size, config.rank)
        if init_fn is not None:
            self.async_init = init_fn(wid)
            if not inspect.isawaitable(self.async_init):
                self.async_init = None

    # -- errors: the one way a task's failure is answered --------------------------------------

    def error(self) -> Failure:
        """The exception being handled, as this worker's answer (type and traceback kept)."""
        return Failure(self._caught())

    def _caught(self) -> Any:
        """The exception being handled, as this step's answers carry it: wrapped with the
        worker's traceback for the consumer (a ``RemoteError``), or in the calling process the
        exception itself, raised as it is (torch's ``num_workers=0``)."""
        if self.in_caller:
            return sys.exc_info()[1]
        return RemoteError(self.config.worker_id)

    def set_concurrency(self, concurrency: int) -> None:
        """worker_concurrency="auto" (``SetConcurrency``): this pass's fetcher and the next."""
        self.concurrency = concurrency
        resize = getattr(self.fetcher, "set_concurrency", None)
        if resize is not None:
            resize(concurrency)

    def setup_failed(self) -> None:
        """The exception being handled broke the worker's setup: every task gets it."""
        self.init_error = self._caught()
        if not self.in_caller:
            self.init_error.from_init = True

    async def finish_async_init(self) -> None:
        """Await an async ``worker_init_fn``'s coroutine, once, on the loop that will fetch;
        its failure is the setup's (``setup_failed``). A process worker and a Ray actor both
        run it before their first task."""
        if self.async_init is None:
            return
        init, self.async_init = self.async_init, None
        try:
            await init
        except Exception:
            self.setup_failed()

    async def enter_async_context(self) -> bool:
        """Enter an async dataset's context (its per-worker setup, say an HTTP session) on
        the loop that fetches, where the setup went well and the dataset has one; its failure
        is the setup's. Returns whether it was entered: the caller exits it when it is done."""
        if self.init_error is not None or not has_async_context(self.dataset):
            return False
        try:
            await self.dataset.__aenter__()
        except Exception:
            self.setup_failed()
            return False
        return True

    def preamble(self) -> Failure | StreamEnded | None:
        """The answer to a task that needs no fetch: the worker's setup or this pass's stream
        failed, or its IterableDataset stream has run dry. None: fetch it."""
        if self.init_error is not None or self.fetch_error is not None:
            self.point = None
        error = self.init_error or self.fetch_error
        if error is not None:
            return Failure(error)
        if self.iteration_end:
            return StreamEnded()
        return None

    # -- a pass --------------------------------------------------------------------------------

    def accepts(self, reset: Reset) -> bool:
        """Whether a Reset still concerns this worker (not superseded, setup fine)."""
        return reset.generation >= self.generation and self.init_error is None

    def fetch_spec(self) -> FetchSpec:
        """What this worker's fetchers are made from (its dataset and collate, as set up)."""
        config = self.config
        return FetchSpec(
            config.dataset_kind,
            self.dataset,
            config.auto_collation,
            self.collate_fn,
            config.drop_last,
            config.sample_policy,
        )

    def new_pass(self, plan: PassPlan) -> None:
        # An IterableDataset's __iter__ runs here, once per pass: its failure is this pass's,
        # and the next pass tries again.
        self.fetch_error = None
        self.iteration_end = False
        self.fetcher = None
        try:
            if not self.in_caller:  # (the loader reseeds the calling process's dataset)
                self.rewind(plan)
                if plan.shared_seed is not None:
                    # Every worker's shuffle seeded alike, anew each pass (an IterDataPipe).
                    reseed(self.dataset, plan.shared_seed)
            self.fetcher = Fetcher(self.fetch_spec(), plan, in_calling_process=self.in_caller)
        except Exception:
            self.fetch_error = self._caught()

    def rewind(self, plan: PassPlan) -> None:
        """Before a pass: note a Stateful dataset's state at this worker's first pass; a kept
        worker told to rewind (``plan.rewind``) with no state to load had an untouched dataset
        at the last batch the consumer received from it, and goes back to that state."""
        if not self.began:
            self.began = True
            if is_stateful(self.dataset):
                try:
                    self.pristine = copy.deepcopy(self.dataset.state_dict())
                except Exception:
                    # (A dataset that is its own iterator may know its state only once
                    # iterated: nothing to go back to.)
                    self.pristine = None
        if plan.rewind and plan.dataset_state is None and self.pristine is not None:
            self.dataset.load_state_dict(copy.deepcopy(self.pristine))

    def new_async_pass(self, plan: PassPlan) -> AsyncFetcher | None:
        from .async_fetch import AsyncFetcher

        self.fetch_error = None
        self.iteration_end = False
        self.fetcher = None
        try:
            if not self.in_caller:
                self.rewind(plan)
            # (A map-style dataset's checkpointed state is loaded here: it may fail.)
            fetcher = AsyncFetcher(self.fetch_spec(), plan, self.concurrency)
        except Exception:
            self.fetch_error = self._caught()
            return None
        self.fetcher = fetcher
        return fetcher

    async def start_async_stream(self, plan: PassPlan) -> None:
        """An async IterableDataset's new pass: close the previous stream, open the next (its
        __aiter__ runs now, after a resumed pass's state is loaded)."""
        previous = self.fetcher
        if previous is not None:
            with contextlib.suppress(Exception):
                await previous.aclose()
        fetcher = self.new_async_pass(plan)
        if fetcher is None:
            return
        try:
            await fetcher.start()
        except Exception:
            self.fetch_error = self._caught()

    # -- a task --------------------------------------------------------------------------------

    def run(self, task: Task) -> StepResult:
        early = self.preamble()
        if early is not None:
            return early
        return self.finish(self.fetcher.fetch, task.indices)

    async def run_async(self, task: Task, fetcher: AsyncFetcher | None = None) -> StepResult:
        """An async dataset's task: gather its samples (with up to worker_concurrency in
        flight), then collate. ``fetcher`` is the pass's, for map-style batches gathered
        concurrently across a pass change."""
        early = self.preamble()
        if early is not None:
            return early
        from .async_fetch import StreamEnd

        active: AsyncFetcher = fetcher if fetcher is not None else self.fetcher
        try:
            samples = await active.gather(task.indices)
        except StreamEnd:
            if not self.iterable:
                return self.error()
            self.iteration_end = True
            self.point = self._point_or_none()
            return StreamEnded()
        except Exception:
            failure = self.error()
            self.point = self._point_or_none()
            return failure
        # No await from here on: the collate is not interrupted by a cancellation.
        return self.finish(active.collate, samples)

    def finish(self, make_batch: Callable[[Any], Any], argument: Any) -> StepResult:
        """Run ``make_batch(argument)`` (a fetch of a task's indices, or an async fetch's
        collate of its samples), with a slab to collate into when this worker has shared
        memory, and note where the stream stands after it."""
        arena = self._arena()
        started = time.perf_counter()
        waited = 0.0 if self.slabs is None else self.slabs.waited_s
        try:
            _transport._current_arena = arena
            try:
                data = make_batch(argument)
            finally:
                _transport._current_arena = None
                # The arena has a slab only if the collate stacked into it.
                arena = None if arena is None else arena.arena
                if self.slabs is not None:
                    # How long a batch takes to make, a wait for a free left out: the pool
                    # waits at most this long for the next one.
                    took = time.perf_counter() - started
                    self.slabs.batch_s = took - (self.slabs.waited_s - waited)
            # Where the dataset stands now (its state_dict() is the user's code: a failure
            # there is this task's).
            stream = self.point = self._point()
        except StopIteration:
            self.release(arena)
            if not self.iterable:  # only an IterableDataset may run dry
                return self.error()
            self.iteration_end = True
            # The state after the stream ran dry is what the next pass starts from.
            self.point = self._point_or_none()
            return StreamEnded()
        except Exception:
            self.release(arena)
            failure = self.error()
            # A failed task may have moved the dataset on too (a random draw).
            self.point = self._point_or_none()
            return failure
        return Produced(data, stream, arena)

    def _point(self) -> StreamState | None:
        point: StreamState | None = self.fetcher.point()
        if point is not None and self.copies_points:
            # In this process the dataset's state object may be the live one.
            point = copy.deepcopy(point)
        return point

    def _point_or_none(self) -> StreamState | None:
        try:
            return None if self.fetcher is None else self._point()
        except Exception:
            return None

    def point_of(self, result: StepResult) -> StreamState | None:
        """Where the dataset stood after the task that gave ``result`` (for its reply)."""
        if isinstance(result, Produced):
            return result.stream
        return self.point

    def _arena(self) -> Any:
        # Every collate gets one, the user's own too: the default_collate it may call stacks
        # tensors straight into it (_wire.slabs.stack_tensors_privately), so they are copied
        # once, not stacked privately and copied again. A collate_fn that keeps such a tensor
        # after the batch is sent keeps its slab too: a slab still viewed here is never
        # reused (_Slab.referenced).
        if self.slabs is None:
            return None
        try:
            return self.slabs.arena()
        except OSError:
            return None  # no shared memory now: collate as usual, send by value

    def release(self, arena: Any) -> None:
        if arena is not None and self.slabs is not None:
            self.slabs.release(arena.slab.id)


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
            encoded = _transport.encode_batch(produced.data, self.slabs, arena)
        except OSError:
            # No shared memory to be had (e.g. /dev/shm or the memory cgroup is full): send the
            # batch by value instead. Slower, never wrong.
            self.step.release(arena)
            try:
                return PickledBatch(_transport.dumps_by_value(produced.data))
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
