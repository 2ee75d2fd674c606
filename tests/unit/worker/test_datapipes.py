"""DataPipes are sharded across workers (and ranks) and share one shuffle seed, as in torch.

Before, an ``IterDataPipe`` with ``num_workers=2`` yielded every element twice, silently: no
worker applied ``sharding_filter``'s sharding, and each shuffled with a seed of its own.
Expected results come from torch's loader, run with the same global seed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.utils.data import DataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

import aioload

pytestmark = pytest.mark.timeout(120)

N = 30


def _pipe(shuffle: bool) -> Any:
    pipe = IterableWrapper(range(N))
    if shuffle:
        pipe = pipe.shuffle()
    return pipe.sharding_filter()


def _epochs(cls: Any, shuffle: bool, epochs: int = 3, **kwargs: Any) -> list[list[int]]:
    torch.manual_seed(0)
    loader = cls(_pipe(shuffle), batch_size=4, **kwargs)
    seen = [[int(i) for batch in loader for i in batch] for _ in range(epochs)]
    if isinstance(loader, aioload.DataLoader):
        loader.shutdown()
    return seen


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_each_element_exactly_once(num_workers: int, no_leaks: None) -> None:
    seen = _epochs(aioload.DataLoader, shuffle=False, epochs=1, num_workers=num_workers)
    assert sorted(seen[0]) == list(range(N))
    # In torch's order too: its workers' shards interleave batch by batch.
    assert seen == _epochs(DataLoader, shuffle=False, epochs=1, num_workers=num_workers)


@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True), (3, True)])
def test_shuffle_agrees_across_workers_and_changes_per_epoch(
    num_workers: int, persistent: bool, no_leaks: None
) -> None:
    kwargs: dict[str, Any] = {"num_workers": num_workers, "persistent_workers": persistent}
    pids: list[set[int]] = []
    torch.manual_seed(0)
    loader = aioload.DataLoader(_pipe(shuffle=True), batch_size=4, **kwargs)
    seen = []
    for _ in range(3):
        seen.append([int(i) for batch in loader for i in batch])
        pids.append({p.pid for p in psutil.Process().children()})
    loader.shutdown()
    for epoch in seen:
        # Each worker keeps every num_workers-th element of its own shuffle: only if all the
        # shuffles agree do the shards partition the data.
        assert sorted(epoch) == list(range(N))
    assert seen[0] != seen[1] != seen[2]  # reseeded each epoch
    assert seen[0] != sorted(seen[0])
    if persistent:
        assert pids[0] == pids[1] == pids[2] and len(pids[0]) == num_workers
    # The same shuffles as torch's loader from the same global seed, epoch after epoch.
    assert seen == _epochs(DataLoader, shuffle=True, **kwargs)


def test_async_for_shards_too(no_leaks: None) -> None:
    import asyncio

    async def main() -> list[int]:
        loader = aioload.DataLoader(_pipe(shuffle=True), batch_size=4, num_workers=2)
        return [int(i) async for batch in loader for i in batch]

    assert sorted(asyncio.run(main())) == list(range(N))


# -- across ranks ---------------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(100 + rank)  # the ranks' RNGs differ: the shared seed must not
        report: dict[str, Any] = {}
        for num_workers in (0, 2):
            loader = aioload.DataLoader(_pipe(shuffle=True), batch_size=4, num_workers=num_workers)
            report[str(num_workers)] = [
                [int(i) for batch in loader for i in batch] for _ in range(2)
            ]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def test_ranks_and_workers_partition_one_shuffle(tmp_path: Path, no_leaks: None) -> None:
    """2 ranks (gloo on a file store) with 0 and 2 workers: rank 0's shuffle seed is broadcast,
    and each worker of each rank keeps its own share (workers * ranks instances in all)."""
    subprocess.run(
        [sys.executable, "-m", "tests.unit.worker.test_datapipes", "2", str(tmp_path)],
        check=True,
        timeout=100,
    )
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for num_workers in ("0", "2"):
        for epoch in range(2):
            shards = [report[num_workers][epoch] for report in reports]
            assert shards[0] and shards[1]
            assert sorted(shards[0] + shards[1]) == list(range(N))
        assert reports[0][num_workers][0] != reports[0][num_workers][1]


if __name__ == "__main__":
    ranks, out = int(sys.argv[1]), sys.argv[2]
    # Forked, not spawned: each rank would otherwise import torch again, and start its own
    # workers by spawn too (a spawned process's default), several seconds on a busy machine.
    torch.multiprocessing.start_processes(
        _rank_main,
        args=(ranks, str(Path(out, "store")), out),
        nprocs=ranks,
        join=True,
        start_method="fork",
    )
