"""Sharding across ranks with real ``torch.distributed`` (gloo on localhost): 2 ranks, started
with ``torch.multiprocessing.spawn``, each running its own aioload loader with workers, sharded
by ``shard="auto"``; without it, every rank reads the whole dataset, as with torch's loader.

Each rank writes what it saw to a JSON file; the assertions run here, in the test process.
The ranks are started from a child process (``python -m tests.features.test_distributed``), not from
pytest itself: ``spawn`` leaves a multiprocessing resource tracker running in the process that
used it, which is not ours to stop.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.utils.data import Dataset, IterableDataset

import aioload
from tests.helpers import flat

pytestmark = [
    pytest.mark.no_local_workers("the ranks and their loaders run in processes of their own"),
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.timeout(180),
]

N = 51  # not a multiple of the 2 ranks: DistributedSampler pads, and the padding shows
BATCH = 4
# A rank started by torch.multiprocessing.spawn makes spawn its default start method, and a
# spawned worker imports torch afresh (seconds each on a loaded machine): the ranks' workers
# are forked, as a training script's usually are. What is under test is the sharding.
FORK: dict[str, Any] = {"multiprocessing_context": "fork"}


class Indexed(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index


class GlobalShards(IterableDataset[int]):
    """The documented pattern: shard by the worker's place among all ranks' workers."""

    def __iter__(self) -> Any:
        info = aioload.get_worker_info()
        assert info is not None
        return iter(range(info.global_id, N, info.global_num_workers))


def _rank_main(rank: int, world_size: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(100 + rank)  # ranks' RNGs differ: the shuffle seed must not
        report: dict[str, Any] = {}

        def make() -> aioload.DataLoader[Any]:
            return aioload.DataLoader(
                Indexed(), batch_size=BATCH, shuffle=True, num_workers=2, shard="auto", **FORK
            )

        loader = make()
        report["epochs"] = [flat(loader), flat(loader)]
        loader.set_epoch(0)
        report["epoch0_again"] = flat(loader)

        unsharded = aioload.DataLoader(Indexed(), batch_size=BATCH)  # torch's default: no shard
        report["unsharded"] = flat(unsharded)

        # Resume per rank: stop mid-epoch 1, checkpoint, continue in a fresh loader. (Reseeded
        # first so that it draws the same shuffle seed as the loader above.)
        torch.manual_seed(100 + rank)
        interrupted = make()
        flat(interrupted)
        iterator = iter(interrupted)
        head = [int(i) for _ in range(3) for i in next(iterator)]
        buffer = io.BytesIO()
        torch.save(interrupted.state_dict(), buffer)
        del iterator
        buffer.seek(0)
        torch.manual_seed(7)
        resumed = make()
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        report["resumed_epoch1"] = head + flat(resumed)

        iterable = aioload.DataLoader(GlobalShards(), batch_size=BATCH, num_workers=2, **FORK)
        report["iterable"] = flat(iterable)

        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


# Two ranks only: a third took 42 s of the suite (three spawned ranks of two workers each on
# two cores) and covers no path two ranks do not, now that N makes two ranks pad.
@pytest.mark.parametrize("world_size", [2])
def test_ranks_draw_disjoint_shards_and_resume(tmp_path: Path, world_size: int) -> None:
    subprocess.run(
        [sys.executable, "-m", "tests.features.test_distributed", str(world_size), str(tmp_path)],
        check=True,
        timeout=150,
    )
    reports = [
        json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)
    ]
    per_rank = -(-N // world_size)  # DistributedSampler pads to equal shares
    for epoch in range(2):
        shards = [report["epochs"][epoch] for report in reports]
        assert all(len(shard) == per_rank for shard in shards)
        everything = [i for shard in shards for i in shard]
        assert set(everything) == set(range(N))  # the union is the whole dataset
        padding = len(everything) - N
        assert padding == per_rank * world_size - N
        # Disjoint but for the padding, which repeats the first indices of the permutation.
        assert len(everything) - len(set(everything)) == padding
    for report in reports:
        assert report["epochs"][0] != report["epochs"][1]  # set_epoch implied by iterating
        assert report["epoch0_again"] == report["epochs"][0]  # and explicit set_epoch
        assert report["unsharded"] == list(range(N))  # by default: the whole dataset
        assert report["resumed_epoch1"] == report["epochs"][1]
    iterable = [i for report in reports for i in report["iterable"]]
    assert sorted(iterable) == list(range(N))  # each sample on exactly one worker of one rank


def test_not_distributed_means_rank_zero_of_one() -> None:
    assert not dist.is_initialized()
    loader = aioload.DataLoader(Indexed(), batch_size=BATCH, num_workers=1)
    assert flat(loader) == list(range(N))


if __name__ == "__main__":
    ranks, out = int(sys.argv[1]), sys.argv[2]
    torch.multiprocessing.spawn(
        _rank_main, args=(ranks, str(Path(out, "store")), out), nprocs=ranks, join=True
    )
