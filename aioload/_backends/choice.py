"""Which backend runs a pass: the one place where the loader's arguments pick a kind of worker.

The engine never asks which kind it drives; what it must know, it reads from the traits the
choice carries (``BackendTraits``), the same ones the backend's class declares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .base import (
    IN_PROCESS,
    OUT_OF_PROCESS,
    BackendKeeper,
    BackendTraits,
    WorkerBackend,
    WorkerSpec,
)

__all__ = ["BackendChoice", "choose_backend"]


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
    ray_workers: Any,
    async_front: bool,
) -> BackendChoice:
    """``num_workers=0``: the calling process. Otherwise local worker processes, or Ray actors
    where ``workers=RayWorkers(...)`` asks for them; kept between passes by ``keeper`` when
    ``persistent_workers`` is set."""
    if spec.num_workers == 0:

        def make_inline() -> WorkerBackend:
            # Imported here: only num_workers=0 runs datasets in this process.
            from .inline import InlineBackend

            return InlineBackend(spec, offload=async_front)

        return BackendChoice(make_inline, IN_PROCESS, owned=True)

    def make_workers(seed: int) -> WorkerBackend:
        if ray_workers is not None:
            from .ray import RayBackend  # imports Ray: only when a pass needs it

            return RayBackend(spec, seed, ray_workers)
        from .process import WorkerPool

        # Staggered under `for` (see WorkerPool._start); under `async for` the pool starts
        # in a thread, and its forks must not run on the loop later.
        return WorkerPool(spec, seed, stagger=not async_front)

    make, owned = keeper.for_pass(make_workers, base_seed)
    return BackendChoice(make, OUT_OF_PROCESS, owned)
