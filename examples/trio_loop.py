"""The same loader under trio: ``async for`` inside a nursery, next to other trio tasks.

aioload waits through anyio, so it runs unchanged under trio. Here a consumer sums a running
statistic over the batches while a second task ticks; ``loader.stats()`` and
``aioload.progress`` work as under asyncio. Cancellation is trio's: the nursery's cancel scope
stops the pass, and the loader's workers are stopped with it.

With ``AIOLOAD_EXAMPLE_SMALL=1`` it runs on a few hundred samples (the examples test does this).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import torch
import trio
from torch.utils.data import Dataset

import aioload

SMALL = os.environ.get("AIOLOAD_EXAMPLE_SMALL", "") not in ("", "0")


class Signals(Dataset[torch.Tensor]):
    """Short noisy sine waves, one per index."""

    def __init__(self, n: int, length: int = 256) -> None:
        self.n = n
        self.t = torch.linspace(0, 6.283, length)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(index)
        frequency = 1 + index % 5
        return torch.sin(frequency * self.t) + 0.1 * torch.randn(len(self.t), generator=generator)


async def ticker(ticks: list[float]) -> None:
    while True:
        ticks.append(time.perf_counter())
        await trio.sleep(0.01)


async def main(args: argparse.Namespace) -> None:
    loader = aioload.DataLoader(
        Signals(args.samples), batch_size=args.batch_size, num_workers=args.workers
    )
    ticks: list[float] = []
    energy = 0.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker, ticks)
        async for batch in aioload.progress(loader, desc="trio"):
            energy += float(batch.pow(2).mean())
            await trio.sleep(0)
        nursery.cancel_scope.cancel()  # stop the ticker: the pass is over
    stats = loader.stats()
    print(
        f"{stats.batches} batches, {stats.samples} signals, mean energy {energy / stats.batches:.3f}"
    )
    print(f"the ticker ran {len(ticks)} times meanwhile")
    print(stats)

    # A pass cancelled from outside stops its workers too (here after 0.1 s): by the time the
    # cancel scope is left, no worker process of it is running.
    with trio.move_on_after(0.1) as deadline:
        async for _batch in aioload.DataLoader(Signals(10**6), batch_size=64, num_workers=2):
            await trio.sleep(0.01)
    left = multiprocessing.active_children()
    if not deadline.cancelled_caught:
        raise SystemExit("cancelled pass: the pass ended before its deadline; nothing to check")
    if left:
        raise SystemExit(f"cancelled pass: {len(left)} worker process(es) still running: {left}")
    print("cancelled pass: cleaned up, no worker process left")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=512 if SMALL else 20_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    trio.run(main, parser.parse_args())
