"""Which backend runs a pass: the one place where the loader's arguments pick a kind of worker.

The engine never asks which kind it drives; what it must know, it reads from the traits the
choice carries (``BackendTraits``), the same ones the backend's class declares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .._named_tuple import NamedTuple
from .base import (
    IN_PROCESS,
    OUT_OF_PROCESS,
    BackendKeeper,
    BackendTraits,
    WorkerBackend,
    WorkerSpec,
)

__all__ = ["BackendChoice", "WorkerFactory", "choose_backend"]


@runtime_checkable
class WorkerFactory(Protocol):
    """What ``DataLoader(workers=...)`` takes: something that makes the backend a pass's
    ``num_workers`` workers run on (``aioload.RayWorkers``: Ray actors; ``_backends.fake``'s
    ``FakeWorkers``: scripted slots in the calling process, for tests). ``None`` there means
    local worker processes."""

    def make_backend(self, spec: WorkerSpec, base_seed: int) -> WorkerBackend:
        """The backend for a pass (or, with ``persistent_workers``, for the passes that keep
        it), its workers seeded from ``base_seed``. Called on the pass's first ``next()``,
        in a thread under ``async for``."""
        ...


class BackendChoice(NamedTuple):
    # Makes the pass's backend, on the pass's first next() (in a thread where it is slow).
    make: Callable[[], WorkerBackend]
    traits: BackendTraits
    # Whether the pass closes the backend when it ends (not a kept, persistent one).
    owned: bool


def choose_backend(
    spec: WorkerSpec,
    *,
    keeper: BackendKeeper,
    base_seed: int | None,
    workers: WorkerFactory | None,
    async_for: bool,
    choose_method: Callable[[WorkerSpec], str] | None = None,
) -> BackendChoice:
    """``num_workers=0``: the calling process. Otherwise local worker processes (threads with
    ``worker_method="thread"``), or what ``workers`` makes (``RayWorkers(...)``: Ray actors); kept between passes by ``keeper`` when
    ``persistent_workers`` is set. ``choose_method``: ``worker_method="auto"`` not decided yet,
    decided by it when the workers are made (until then, the traits of a slow start)."""
    if spec.num_workers == 0:

        def make_inline() -> WorkerBackend:
            # Imported here: only num_workers=0 runs datasets in this process.
            from .inline import InlineBackend

            return InlineBackend(spec, async_for=async_for)

        return BackendChoice(make_inline, IN_PROCESS, owned=True)

    def make_workers(seed: int) -> WorkerBackend:
        chosen = spec
        if choose_method is not None:
            chosen = spec._replace(worker_method=choose_method(spec))
        if workers is not None:
            return workers.make_backend(chosen, seed)
        if chosen.worker_method == "thread":
            from .thread import ThreadBackend

            return ThreadBackend(chosen, seed)
        from .process import WorkerPool

        # Worker 0 forked now, the others at the engine's waits (see WorkerPool._start).
        return WorkerPool(chosen, seed, stagger=True)

    make, owned = keeper.for_pass(make_workers, base_seed, spec.num_workers)
    traits = OUT_OF_PROCESS
    if workers is None and spec.worker_method == "thread":
        from .thread import THREAD

        traits = THREAD
    return BackendChoice(make, traits, owned)
