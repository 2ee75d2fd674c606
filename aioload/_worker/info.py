"""``get_worker_info()`` inside an aioload worker, torch's and aioload's alike.

A worker process sets the process-wide value, as torch's workers do. A worker *thread*
(``worker_method="thread"``) cannot: the consumer and every other thread share the process.
Its ``WorkerInfo`` is thread-local (``_set_thread_worker_info``), and torch's
``get_worker_info`` is taught to look there first (``install_thread_hook``).
"""

from __future__ import annotations

import dataclasses
import random
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.data._utils.worker as torch_worker

__all__ = ["WorkerInfo", "get_worker_info"]


class _GlobalPlace:
    """A worker's place among all workers of all ranks (for either shape of ``WorkerInfo``)."""

    __slots__ = ()
    id: int
    num_workers: int
    rank: int
    world_size: int

    @property
    def global_id(self) -> int:
        return self.rank * self.num_workers + self.id

    @property
    def global_num_workers(self) -> int:
        return self.world_size * self.num_workers


# torch's WorkerInfo is a frozen dataclass from torch 2.12 on (with ``rng`` and
# ``worker_method`` beside the four fields), and a plain class whose ``__init__(**kwargs)`` sets
# the attributes and then locks them before that. The subclass takes the same shape as its base.
# (The dataclass comes last: it is the one type checkers and the API docs read.)
if not (TYPE_CHECKING or dataclasses.is_dataclass(torch_worker.WorkerInfo)):

    class WorkerInfo(_GlobalPlace, torch_worker.WorkerInfo):
        """Information about the current aioload worker process, for a torch whose WorkerInfo
        is a plain class (up to 2.11): the same fields and properties as the dataclass."""

        def __init__(
            self,
            *,
            id: int,
            num_workers: int,
            seed: int,
            dataset: Any,
            rank: int = 0,
            world_size: int = 1,
            **more: Any,
        ) -> None:
            super().__init__(
                id=id,
                num_workers=num_workers,
                seed=seed,
                dataset=dataset,
                rank=rank,
                world_size=world_size,
                **more,
            )

        rank: int
        world_size: int

else:

    @dataclasses.dataclass(frozen=True, slots=True)
    class WorkerInfo(_GlobalPlace, torch_worker.WorkerInfo):
        """Information about the current aioload worker process.

        A subclass of torch's WorkerInfo with the same fields (``id``, ``num_workers``,
        ``seed``, ``dataset``, and whatever else the installed torch gives it); inside an
        aioload worker, ``torch.utils.data.get_worker_info()`` returns the same object, so
        datasets that shard themselves by worker work unchanged.

        Under ``torch.distributed`` it also carries ``rank`` and ``world_size``, and the
        worker's place among all workers of all ranks: ``global_id``
        (``rank * num_workers + id``) and ``global_num_workers`` (``world_size * num_workers``).
        An IterableDataset that shards by ``global_id`` gives every sample to exactly one worker
        of one rank. Without ``torch.distributed`` they equal ``id`` and ``num_workers`` (rank 0
        of 1).
        """

        rank: int = 0
        world_size: int = 1


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """The current worker's WorkerInfo inside an aioload worker (process or thread), None
    elsewhere."""
    info: WorkerInfo | None = getattr(_thread_local, "info", None)
    return info if info is not None else _worker_info


def _set_worker_info(info: WorkerInfo | None) -> None:
    """Set (or, with None, clear) what both ``get_worker_info()`` return in this process."""
    global _worker_info
    _worker_info = info
    # torch.utils.data.get_worker_info() reads this module global.
    torch_worker._worker_info = info


# -- thread workers ----------------------------------------------------------------------------

# The WorkerInfo of the worker thread that reads it (unset in every other thread). A
# threading.local is correct without the GIL too: each thread sees only its own attribute.
_thread_local = threading.local()
_hook_lock = threading.Lock()


def _set_thread_worker_info(info: WorkerInfo | None) -> None:
    """Set (or clear) the calling thread's own WorkerInfo: what both ``get_worker_info()``
    return in this thread alone."""
    _thread_local.info = info


def thread_worker_rng() -> Any:
    """The calling worker thread's ``WorkerInfo.rng`` (per-worker generators); None in a
    process worker, the main thread, or any thread that is not a worker."""
    info = getattr(_thread_local, "info", None)
    return None if info is None else getattr(info, "rng", None)


class _Generators:
    """``WorkerInfo.rng`` for a torch older than 2.12, which has no ``_RNG``: the same fields."""

    __slots__ = ("numpy_generator", "random_generator", "torch_generator")

    def __init__(self, python: random.Random, torch_gen: torch.Generator, numpy: Any) -> None:
        self.random_generator = python
        self.torch_generator = torch_gen
        self.numpy_generator = numpy


def make_rng(seed: int, numpy_seed: list[int]) -> Any:
    """A worker thread's own generators, seeded as torch seeds a worker process's globals:
    ``random.Random(seed)``, a ``torch.Generator`` with ``manual_seed(seed)``, and a numpy
    ``RandomState`` seeded with the state torch's workers give numpy's global one
    (``numpy_seed``). A thread worker that draws from them gets, draw for draw, what a process
    worker of torch's draws from the globals. torch's ``_RNG`` where it has one (2.12+)."""
    import numpy as np

    python = random.Random(seed)
    torch_gen = torch.Generator()
    torch_gen.manual_seed(seed)
    # (RandomState, numpy's legacy generator, since that is what its global one is: the same
    # methods and the same draws as np.random's functions.)
    numpy_gen = np.random.RandomState(numpy_seed)
    rng_class = getattr(torch_worker, "_RNG", None)
    if rng_class is not None:
        return rng_class(python, torch_gen, numpy_gen)
    return _Generators(python, torch_gen, numpy_gen)


def reseed_rng(rng: Any, seed: int) -> None:
    """Seed a worker thread's generators in place (seed_per_sample under threads), as a
    process worker's globals are seeded for the sample (``_worker.fetch._seed_all``): the same
    objects, so a dataset that kept a reference to one sees the new state."""
    rng.random_generator.seed(seed)
    rng.torch_generator.manual_seed(seed)
    numpy_gen = rng.numpy_generator
    if numpy_gen is not None:
        numpy_gen.seed((seed ^ (seed >> 32)) & 0xFFFF_FFFF)


def set_thread_worker_info(
    base_seed: int, wid: int, wrap_rng: Callable[[Any], Any] | None = None, **fields: Any
) -> None:
    """Make the calling thread thread worker ``wid``: its own WorkerInfo, with
    ``worker_method="thread"``, torch's worker seed (``base_seed + wid``) and generators of its
    own, seeded as torch seeds a process worker's globals (``rng``, wrapped by ``wrap_rng``
    where given); nothing process-wide changes. ``fields``: WorkerInfo's others. ``rng`` and
    ``worker_method`` are fields where torch's WorkerInfo has them (2.12+), attributes of the
    plain class before."""
    from torch.utils.data._utils.worker import _generate_state

    seed = base_seed + wid
    rng = make_rng(seed, _generate_state(base_seed, wid))  # type: ignore[no-untyped-call]
    if wrap_rng is not None:
        rng = wrap_rng(rng)
    _set_thread_worker_info(
        WorkerInfo(worker_method="thread", id=wid, seed=seed, rng=rng, **fields)
    )


def _torch_collate_code() -> Any:
    from torch.utils.data._utils.collate import collate_tensor_fn

    return collate_tensor_fn.__code__


def _thread_or_process_info(process_info: Any) -> Any:
    """What torch's patched ``get_worker_info`` returns: the calling thread's own WorkerInfo
    in a worker thread, else the process-wide value (a worker process's, or None).

    One caller inside a worker thread is told None: torch's ``collate_tensor_fn``, which
    otherwise stacks every batch into a fresh shared-memory segment for a process worker's
    queue. A thread hands its batch over by reference, so that segment would be a copy and a
    /dev/shm allocation for nothing (NOTE: frame 2 is get_worker_info's caller)."""
    info = getattr(_thread_local, "info", None)
    if info is None:
        return process_info
    if sys._getframe(2).f_code is _COLLATE_CODE:
        return None
    return info


_COLLATE_CODE: Any = None


def _patched_get_worker_info() -> Any:  # runs with torch's module globals (see below)
    return _aioload_thread_or_process_info(_worker_info)  # type: ignore[name-defined]  # noqa: F821


def install_thread_hook() -> None:
    """Make torch's ``get_worker_info`` thread-aware, once, when thread workers first start.

    torch's function returns its module's ``_worker_info`` global, which is one per process;
    no value of that global can be one thing in one thread and None in another (whatever
    object it holds is returned as it is). So the function's code is replaced, in place: the
    same function object, which every ``from torch.utils.data import get_worker_info`` taken
    before ``import aioload`` also holds, now asks ``_thread_or_process_info`` (put in torch's
    module namespace, where the new code looks up its globals). A process worker and the main
    thread still get the module global, unchanged."""
    global _COLLATE_CODE
    with _hook_lock:
        function = torch_worker.get_worker_info
        if function.__code__ is _patched_get_worker_info.__code__:
            return
        _COLLATE_CODE = _torch_collate_code()
        torch_worker.__dict__["_aioload_thread_or_process_info"] = _thread_or_process_info
        function.__code__ = _patched_get_worker_info.__code__
