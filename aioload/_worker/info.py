"""``get_worker_info()`` inside an aioload worker, torch's and aioload's alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch.utils.data._utils.worker as torch_worker

__all__ = ["WorkerInfo", "get_worker_info"]


@dataclass(frozen=True, slots=True)
class WorkerInfo(torch_worker.WorkerInfo):
    """Information about the current aioload worker process.

    A subclass of torch's WorkerInfo with the same fields (``id``, ``num_workers``, ``seed``,
    ``dataset``); inside an aioload worker, ``torch.utils.data.get_worker_info()`` returns the
    same object, so datasets that shard themselves by worker work unchanged.

    Under ``torch.distributed`` it also carries ``rank`` and ``world_size``, and the worker's
    place among all workers of all ranks: ``global_id`` (``rank * num_workers + id``) and
    ``global_num_workers`` (``world_size * num_workers``). An IterableDataset that shards by
    ``global_id`` gives every sample to exactly one worker of one rank. Without
    ``torch.distributed`` they equal ``id`` and ``num_workers`` (rank 0 of 1).
    """

    rank: int = 0
    world_size: int = 1

    @property
    def global_id(self) -> int:
        return self.rank * self.num_workers + self.id

    @property
    def global_num_workers(self) -> int:
        return self.world_size * self.num_workers


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """The current worker's WorkerInfo inside an aioload worker process, None elsewhere."""
    return _worker_info


def _set_worker_info(info: WorkerInfo) -> None:
    global _worker_info
    _worker_info = info
    # torch.utils.data.get_worker_info() reads this module global.
    torch_worker._worker_info = info
