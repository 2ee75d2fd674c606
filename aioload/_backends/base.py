"""The seam between the engine and its workers, and the policy that keeps workers between passes.

The orchestrator (``_engine/orchestrator.py``) schedules ``(task_id, indices)`` tasks; a
``WorkerBackend`` runs them somewhere and reports back. Four implementations:

- ``_backends.process.WorkerPool``: local worker processes (shared-memory batches, sockets, sentinels);
- ``_backends.inline.InlineBackend``: ``num_workers=0``, the calling process as the one worker;
- ``_backends.ray.RayBackend``: Ray actors (optional, ``aioload[ray]``);
- ``_backends.thread.ThreadBackend``: threads of the calling process (``worker_method="thread"``).

Everything a backend says to the engine is a ``_wire.messages.Event``: an ``Answer`` to a task, or a
``WorkerLost``. Health checks, descriptors and transports stay inside each backend; restart
policy (how many, which tasks go again) is the engine's, the same for every backend.

Waiting is the engine's too: a backend offers what can end a sleep (``Waitable``: a descriptor,
a budget, or work to run in the caller) and the engine sleeps on it together with its own
wake-up pipe, so no backend needs to know of the engine's descriptors.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from .._named_tuple import NamedTuple
from .._wire.messages import Event, PassPlan

if TYPE_CHECKING:
    from .._aio.waiting import Descriptor
    from .._worker.fetch import SamplePolicy
    from .._worker.main import WorkerConfig

__all__ = [
    "IN_PROCESS",
    "OUT_OF_PROCESS",
    "BackendKeeper",
    "BackendTraits",
    "CallerWork",
    "Place",
    "TunableBackend",
    "Waitable",
    "WorkerBackend",
    "WorkerSpec",
]


class BackendTraits(NamedTuple):
    """What the engine must know of a backend, declared by the backend's class (``TRAITS``),
    so that the engine never asks which kind of backend it drives. Known before the backend
    is made: the first is needed to decide how to make it."""

    # Making one blocks for milliseconds (forks, actors): under ``async for`` the engine makes
    # it in a thread, so that the caller's loop never stalls.
    slow_start: bool
    # Its workers fetch apart from the consumer (processes, actors), so tasks run ahead: the
    # engine keeps the prefetch window full from the start and refills it as each batch is
    # handed over, as torch's multiprocess iterator does. A backend that fetches in the
    # calling process fetches a batch when it is asked for, as torch's single-process one.
    runs_ahead: bool


# The calling process: nothing to start, a batch fetched when it is asked for.
IN_PROCESS = BackendTraits(slow_start=False, runs_ahead=False)
# Processes or actors: milliseconds to start each, fetching ahead of the consumer.
OUT_OF_PROCESS = BackendTraits(slow_start=True, runs_ahead=True)


class CallerWork(Protocol):
    """Work that a backend must run in the caller before its ``poll`` can have an answer: the
    fetch itself, where the calling process is the worker (``num_workers=0``), or the fork of
    a worker that has a task waiting (a staggered start). The engine runs it in place of a
    sleep, since no other thread or process would: a sleep would never end.
    The backend hands it over in its ``Waitable``, wait by wait, so the engine never asks
    which kind of backend it drives, and one backend may need it for some waits only (the
    calling process with no task left sleeps until its pin stage hands a batch back)."""

    async def work(self) -> None:
        """Under ``async for``: run it without blocking the loop (in a thread, or awaited)."""

    def work_blocking(self) -> bool:
        """Under ``for``: run it in the calling thread. False, having run nothing, where it
        needs an event loop (an async dataset); the front end then runs ``work`` on its own."""


class Waitable(NamedTuple):
    """What a backend offers the engine to sleep on (``WorkerBackend.waitable``)."""

    # Readable when ``poll`` may have something (an answer, a lost worker); None: nothing the
    # engine can watch (it sleeps out the budget, or until its own wake-up).
    descriptor: Descriptor | None = None
    # How long the engine may sleep before it must ``poll`` anyway, whatever the descriptor
    # says (seconds): a backend's health checks run in ``poll`` and need it to come round,
    # and a backend may know when its next answer is due. 0: ``poll`` has something now.
    budget: float = math.inf
    # Where the answer comes from work done in the caller, that work, run instead of a sleep.
    work: CallerWork | None = None


class Place(NamedTuple):
    """Where a worker runs (``WorkerBackend.place``): how error messages and ``stats()`` name
    it, and whether it has started. A worker not started yet (a staggered start's worker not
    forked yet, an actor whose node is not known yet) has only a provisional name: the
    engine asks again after each wait until it has started."""

    name: str
    started: bool = True


class WorkerBackend(Protocol):
    """What the engine needs from whatever runs its workers."""

    TRAITS: ClassVar[BackendTraits]

    # Worker slots, numbered 0..num_workers-1 (a replacement keeps its slot).
    num_workers: int
    # No longer fit for another pass (a worker's setup failed, or one hung): a persistent
    # loader starts a fresh backend next pass. Closed backends are retired too.
    retired: bool

    def start_pass(self, plans: list[PassPlan]) -> None:
        """A pass begins: answers to older passes' tasks are dropped from now on, and worker
        ``i`` makes its fetcher from ``plans[i]``."""

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        """Ask worker ``worker_id`` for one batch. May be held back until ``flush``."""

    def poll(self) -> list[Event]:
        """Return every answer and loss that has arrived, without waiting. A lost worker's
        answers sent before it died come first. Runs at least once per ``Waitable.budget``,
        so a backend's health checks live here."""

    def flush(self) -> None:
        """Send what is still held back (what ``submit`` could not write at once, freed slabs
        for their workers): the engine calls it just before it sleeps, since the workers must
        have it while the engine sleeps. Nothing else: it starts no worker."""

    def waitable(self, awaited: int | None) -> Waitable:
        """What the engine may sleep on before its next ``poll``, asked just before it sleeps
        (after ``flush``). A question: it sends nothing and starts nothing; where a worker
        must be started for the answer to come, it offers that as work (``CallerWork``) for
        the engine to run.

        The engine does the waiting, not the backend: it also waits on descriptors of its own
        (the pin stage's), and one sleep must cover both, under asyncio, uvloop and trio and in
        the sync front end's thread alike. A backend only says what can end the sleep.

        ``awaited`` is the worker whose answer the consumer needs next, where the engine knows
        it (in-order delivery): a backend may then offer a descriptor that only that worker's
        answers (and any worker's loss) make readable, rather than any answer. The others'
        answers are taken in by the ``poll`` after the sleep."""

    def restart(self, worker_id: int, plan: PassPlan | None = None) -> None:
        """Replace a lost worker in its slot, on this pass's plan (or ``plan``: where the lost
        worker's dataset stood, for a Stateful dataset)."""

    def abandon(self, worker_id: int) -> None:
        """Stop a worker that stopped answering; ``poll`` then reports it lost."""

    def retire(self) -> None:
        """Serve out this pass, but no other (a worker is stuck): sets ``retired``."""

    def place(self, worker_id: int) -> Place:
        """Where this worker runs, as error messages name it ("pid 1234", "actor ... on node
        ..."), and whether it has started. A query: it never waits."""

    def dump_stack(self, worker_id: int) -> str | None:
        """This worker's current Python stack, every thread's, as text, for the hang report
        (``_engine/hang.py``); None where it cannot be read. Bounded in time (a fraction of a
        second at most): the engine asks it from the consumer's wait, and a worker that cannot
        answer must not hold that up. It must not disturb the worker."""

    def close(self) -> None:
        """Stop every worker and release everything, bounded in time. Idempotent."""


@runtime_checkable
class TunableBackend(Protocol):
    """What a backend may offer the controller (``num_workers``/``worker_concurrency`` set to
    "auto") beyond the seam. A backend without it runs every slot at the concurrency it
    started with; the controller's other choices (tasks in flight) are the engine's own."""

    def activate(self, count: int) -> None:
        """Slots ``0..count-1`` take tasks from now on: start any of them not yet started."""

    def set_concurrency(self, concurrency: int) -> None:
        """An async dataset's fetches in flight per worker, from now on."""


SHUT_DOWN_MESSAGE = (
    "aioload: this pass's workers were stopped by DataLoader.shutdown(), so the pass cannot go "
    "on; start a new pass (iter(loader) or `async for`), which starts fresh workers"
)

SUPERSEDED_MESSAGE = (
    "aioload: a newer pass over this loader (iter(loader) or `async for`) took over its "
    "persistent workers, so this pass cannot go on; with persistent_workers, iterate one "
    "pass at a time"
)


class BackendKeeper:
    """Which backend a pass runs on: a fresh one per pass, or (``persistent_workers``) one kept
    for the loader's life and replaced only when it is closed or retired."""

    def __init__(self, owner: object, persistent: bool) -> None:
        self._owner = weakref.ref(owner)
        self.persistent = persistent
        self.kept: WorkerBackend | None = None
        # How many workers the kept backend runs: a pass that asks for another count (the
        # user set `loader.num_workers` between passes) starts fresh workers, as many as it
        # asks for, and the kept ones stop.
        self.kept_workers = 0
        # The pass that runs on the kept backend: superseded (closed) when the next begins.
        self.current_pass: Callable[[], Any] | None = None

    def reusable(self, num_workers: int) -> bool:
        """Whether the next pass, on ``num_workers`` workers, runs on the kept backend (and so
        draws no base seed)."""
        kept = self.kept if self.persistent else None
        return kept is not None and not kept.retired and self.kept_workers == num_workers

    def for_pass(
        self, make: Callable[[int], WorkerBackend], base_seed: int | None, num_workers: int
    ) -> tuple[Callable[[], WorkerBackend], bool]:
        """A factory for this pass's backend on ``num_workers`` workers (called on the pass's
        first ``next()``), and whether the pass owns it (closes it when it ends)."""
        if not self.persistent:
            assert base_seed is not None
            seed = base_seed
            return (lambda: make(seed)), True
        previous = self.current_pass() if self.current_pass is not None else None
        if previous is not None:
            # One pass at a time on a kept backend: the one before ends, and says why if it
            # is asked for another batch (quietly, it would pass for a whole epoch).
            previous.close(RuntimeError(SUPERSEDED_MESSAGE))
        if self.reusable(num_workers):
            kept = self.kept
            assert kept is not None
            return (lambda: kept), False
        self.shutdown()
        assert base_seed is not None
        seed = base_seed

        def start() -> WorkerBackend:
            backend = make(seed)
            self.kept, self.kept_workers = backend, num_workers
            owner = self._owner()
            if owner is not None:
                # The workers die with the loader (or at interpreter exit), not with a pass.
                weakref.finalize(owner, backend.close)
            return backend

        return start, False

    def shutdown(self) -> None:
        """Stop the kept workers (``DataLoader.shutdown()``). A pass that runs on them ends
        with an error that says so: its batches cannot come any more, and ending it quietly
        would pass for a whole epoch. The next pass starts fresh workers."""
        if self.kept is not None and self.current_pass is not None:
            running = self.current_pass()
            if running is not None:
                running.close(RuntimeError(SHUT_DOWN_MESSAGE))
        kept, self.kept = self.kept, None
        if kept is not None:
            kept.close()


class WorkerSpec(NamedTuple):
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
    rank: int = 0
    world_size: int = 1
    worker_concurrency: int = 1
    sample_policy: SamplePolicy | None = None
    # Where the workers run: "multiprocessing" (processes) or "thread" (threads of this
    # process, ``_backends.thread``), as torch's WorkerInfo names them.
    worker_method: str = "multiprocessing"

    def worker_config(
        self,
        worker_id: int,
        base_seed: int,
        generation: int,
        *,
        payload: tuple[Any, Any, Any] | bytes,
        shared_memory: bool,
    ) -> WorkerConfig:
        """What worker ``worker_id`` starts with, whichever backend runs it. ``payload``: how
        ``(dataset, collate_fn, worker_init_fn)`` reach it (``_backends.payload``; a Ray actor gets
        them from the object store instead). ``shared_memory``: whether it answers through
        shared-memory slabs (a local process), or returns its batches as values (a Ray actor:
        no slab collate, no idle slabs kept)."""
        # Imported here, as in WorkerPool._spawn: the worker-side code is not loaded with the
        # package.
        from .._worker.main import WorkerConfig

        return WorkerConfig(
            worker_id=worker_id,
            num_workers=self.num_workers,
            base_seed=base_seed,
            generation=generation,
            dataset_kind=self.dataset_kind,
            auto_collation=self.auto_collation,
            drop_last=self.drop_last,
            payload=payload,
            slab_collate=self.slab_collate and shared_memory,
            max_idle_slabs=self.prefetch_factor + 1 if shared_memory else 0,
            rank=self.rank,
            world_size=self.world_size,
            worker_concurrency=self.worker_concurrency,
            sample_policy=self.sample_policy,
        )
