"""From one machine to many: each rank runs its own aioload loader, and the loader shards.

    torchrun --nproc_per_node=3 examples/distributed_training.py           # 3 ranks here
    torchrun --nnodes=2 --node_rank=R --master_addr=HOST --nproc_per_node=8 \\
        examples/distributed_training.py                                   # 2 machines
    python examples/distributed_training.py                                # starts 2 ranks

Nothing in the loop knows about ranks except the model wrapper (DistributedDataParallel):
under an initialized ``torch.distributed``, ``aioload.DataLoader(..., shard="auto")`` gives
each rank its shard of the default sampler (``DistributedSampler`` semantics, one shuffle seed
for all ranks),
moves to the next epoch's shuffle by itself, and checkpoints per rank with ``state_dict()``.

Options: ``--epochs N``, ``--workers N`` (per rank), ``--loader-only`` (no model: measures
loading alone), ``--samples N``.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing
import torch.nn.functional as F
from torch import nn

import aioload

SMALL = os.environ.get("AIOLOAD_EXAMPLE_SMALL") == "1"


class Augmented(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Synthetic 3x40x40 images, randomly cropped to 32x32 and flipped, with a label."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = index % 10
        image = torch.full((3, 40, 40), float(label) / 10) + 0.05 * torch.randn(3, 40, 40)
        top, left = np.random.randint(0, 9, size=2)
        crop = image[:, top : top + 32, left : left + 32]
        if torch.rand(()) < 0.5:
            crop = crop.flip(-1)
        return crop.contiguous(), label


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def run_rank(args: argparse.Namespace, checkpoint_dir: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    loader = aioload.DataLoader(
        Augmented(args.samples),
        batch_size=64,
        shuffle=True,
        num_workers=args.workers,
        shard="auto",  # each rank iterates its own shard of the dataset
        seed_per_sample=True,  # augmentations independent of workers and ranks' timing
    )
    model = None if args.loader_only else nn.parallel.DistributedDataParallel(_model())
    optimizer = None if model is None else torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        samples, start = 0, time.perf_counter()
        for step, (images, labels) in enumerate(loader):
            if model is not None and optimizer is not None:
                loss = F.cross_entropy(model(images), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            samples += len(labels)
            if step == len(loader) // 2:
                # A mid-epoch checkpoint, per rank: what a preempted job would resume from.
                path = os.path.join(checkpoint_dir, f"loader-rank{rank}.pt")
                torch.save(loader.state_dict(), path)
        elapsed = time.perf_counter() - start
        totals: list[Any] = [None] * world
        dist.all_gather_object(totals, (samples, elapsed))
        if rank == 0:
            all_samples = sum(s for s, _ in totals)
            slowest = max(t for _, t in totals)
            print(
                f"epoch {epoch}: {world} rank(s) x {args.workers} worker(s): "
                f"{all_samples} samples in {slowest:.2f} s = {all_samples / slowest:,.0f} "
                f"samples/s ({all_samples / slowest / world:,.0f} per rank)"
            )
    if rank == 0:
        print(f"checkpoints: one loader state per rank in {checkpoint_dir}")
    # DDP's reducer holds threads of the process group: let it go (it sits in reference
    # cycles) before the group is destroyed, or the process aborts on its way out.
    del model, optimizer
    gc.collect()


def _spawned(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        run_rank(args, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1 if SMALL else 2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--samples", type=int, default=512 if SMALL else 20_000)
    parser.add_argument("--loader-only", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        if "RANK" in os.environ:  # started by torchrun
            dist.init_process_group("gloo")
            try:
                run_rank(args, scratch)
            finally:
                dist.destroy_process_group()
            return
        store = os.path.join(scratch, "store")
        torch.multiprocessing.spawn(_spawned, args=(2, store, args, scratch), nprocs=2)


if __name__ == "__main__":
    main()
