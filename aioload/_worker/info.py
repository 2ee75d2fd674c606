"""``get_worker_info()`` inside an aioload worker, torch's and aioload's alike."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

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
    """The current worker's WorkerInfo inside an aioload worker process, None elsewhere."""
    return _worker_info


def _set_worker_info(info: WorkerInfo | None) -> None:
    """Set (or, with None, clear) what both ``get_worker_info()`` return in this process."""
    global _worker_info
    _worker_info = info
    # torch.utils.data.get_worker_info() reads this module global.
    torch_worker._worker_info = info
