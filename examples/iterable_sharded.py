"""An IterableDataset sharded over every worker of every rank, with ``global_id``.

A stream (log lines, records in shard files, a message queue) has no index to sample, so the
dataset shards itself: worker ``global_id`` of ``global_num_workers`` takes every
``global_num_workers``-th record. aioload's ``get_worker_info()`` carries both, counting the
workers of all ranks under ``torch.distributed``, so each record is read by exactly one worker
of one rank.

    torchrun --nproc_per_node=2 examples/iterable_sharded.py    # one process per rank
    python examples/iterable_sharded.py                         # starts 2 ranks itself

Each rank reports what it read; rank 0 checks that together they read every record once.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing

import aioload

SMALL = os.environ.get("AIOLOAD_EXAMPLE_SMALL") == "1"
RECORDS = 2_000 if SMALL else 200_000


class Records(torch.utils.data.IterableDataset[torch.Tensor]):
    """Records 0..n-1, each a small feature vector computed from its number."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = aioload.get_worker_info()
        # In the calling process (num_workers=0) there is no worker info: shard by rank only.
        shard, shards = (
            (info.global_id, info.global_num_workers)
            if info is not None
            else (dist.get_rank(), dist.get_world_size())
        )
        for record in range(shard, self.n, shards):
            features = torch.arange(8, dtype=torch.float32) * (record % 97)
            yield torch.cat([torch.tensor([float(record)]), features])


def run_rank() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = aioload.DataLoader(Records(RECORDS), batch_size=256, num_workers=2)
    seen: list[int] = []
    start = time.perf_counter()
    for batch in loader:
        seen.extend(int(record) for record in batch[:, 0])
    elapsed = time.perf_counter() - start
    print(f"rank {rank}/{world}: {len(seen)} records in {elapsed:.2f} s (worker start included)")

    everyone: list[list[int] | None] = [None] * world
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        every = sorted(record for part in everyone for record in part or [])
        assert every == list(range(RECORDS)), "a record was lost or read twice"
        print(f"all {world} ranks x 2 workers read each of {RECORDS} records exactly once")


def _spawned(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        run_rank()
    finally:
        dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            run_rank()
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as scratch:
        store = os.path.join(scratch, "store")
        torch.multiprocessing.spawn(_spawned, args=(2, store), nprocs=2, join=True)


if __name__ == "__main__":
    main()
