"""DataPipes (``torch.utils.data.datapipes``), sharded and seeded as torch's loader does.

torch's loader treats a DataPipe specially in three places, and so do we:

- **Sharding.** Each worker applies ``graph_settings.apply_sharding`` to its copy, so that a
  ``sharding_filter()`` keeps every ``num_workers * world_size``-th element: worker ``k`` of
  rank ``r`` is instance ``k * world_size + r`` (ranks first, then workers, as torch orders
  them). In the calling process (``num_workers=0``) the rank alone shards it.
- **One shuffle seed for all workers.** Every shuffling or otherwise random pipe of an
  ``IterDataPipe`` is seeded from one seed per pass, drawn from the loader's generator (and
  under ``torch.distributed`` broadcast from rank 0), so that the workers' shuffles agree and
  their shards partition one permutation. It is drawn again every pass, persistent workers
  included, and reaches the workers in their pass plan.
- **Where the draws fall.** Like torch, a pass draws the shared seed before the sampler and
  the base seed; a pass that starts workers draws one more after the base seed (torch's
  iterator resets itself once when it starts them), and a pass that reuses persistent workers
  draws one after the sampler. A loader seeded like torch's therefore draws the same base
  seeds and shuffles as torch's, epoch after epoch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.graph_settings import apply_random_seed, apply_sharding

__all__ = [
    "SharedSeeds",
    "is_datapipe",
    "is_iter_datapipe",
    "reseed",
    "shard_in_process",
    "shard_in_worker",
]


def is_datapipe(dataset: Any) -> bool:
    return isinstance(dataset, IterDataPipe | MapDataPipe)


def is_iter_datapipe(dataset: Any) -> bool:
    return isinstance(dataset, IterDataPipe)


def shard_in_worker(
    dataset: Any, num_workers: int, worker_id: int, world_size: int, rank: int
) -> None:
    """Worker ``worker_id`` of rank ``rank`` keeps its share of the elements."""
    apply_sharding(dataset, num_workers * world_size, worker_id * world_size + rank)


def shard_in_process(dataset: Any, world_size: int, rank: int) -> None:
    """``num_workers=0``: the calling process is its rank's only reader."""
    apply_sharding(dataset, world_size, rank)


def reseed(dataset: Any, shared_seed: int) -> None:
    """Seed every random pipe of ``dataset`` from ``shared_seed`` (the same in every worker)."""
    rng = torch.Generator()
    rng.manual_seed(shared_seed)
    apply_random_seed(dataset, rng)


class SharedSeeds:
    """Draws a loader's per-pass shared seeds; under ``torch.distributed``, rank 0's draw is
    broadcast over a gloo group of the loader's own (the default group may be NCCL, which
    cannot broadcast a CPU tensor). The group is made on the first draw, a collective that
    every rank reaches as it starts its first pass."""

    def __init__(self) -> None:
        self._group: Any = None

    def draw(self, generator: torch.Generator | None) -> int:
        seed = torch.empty((), dtype=torch.int64).random_(generator=generator)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if self._group is None:
                self._group = torch.distributed.new_group(backend="gloo")
            torch.distributed.broadcast(seed, src=0, group=self._group)
        return int(seed.item())
