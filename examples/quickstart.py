"""Quickstart: the same synthetic dataset read with ``async for`` and with ``for``.

Run it with ``python examples/quickstart.py``. It reads the same data with aioload under
``async for``, with aioload under ``for``, and with torch.utils.data.DataLoader, each with
persistent workers. Each loader first runs one untimed warm-up pass (it starts the workers and
fills the caches); then each of ``--passes`` timed passes is counted from its first batch, and
the report gives, per loader, the median batches/s over those passes and the median and p99 of
the time between two batches. With ``AIOLOAD_EXAMPLE_SMALL=1`` it runs on 2,000 samples (the
examples test does this).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import time
from typing import Any

import torch
from torch.utils.data import Dataset

import aioload

SMALL = os.environ.get("AIOLOAD_EXAMPLE_SMALL", "") not in ("", "0")


class SyntheticImages(Dataset[dict[str, Any]]):
    """Small uint8 "images" with labels; cheap to make, so the loader is what's measured."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 64, 64)) -> None:
        self.n = n
        self.base = torch.randint(0, 255, shape, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": self.base + (i % 7), "label": i % 10}


def _loader(cls: Any, ds: Dataset[Any], batch_size: int, workers: int) -> Any:
    return cls(
        ds, batch_size=batch_size, num_workers=workers, shuffle=True, persistent_workers=True
    )


class Timing:
    """Arrival times of the batches of each pass; the first batch of a pass starts its clock."""

    def __init__(self) -> None:
        self.rates: list[float] = []  # batches/s of each timed pass, after its first batch
        self.gaps: list[float] = []  # seconds between two consecutive batches

    def add_pass(self, arrivals: list[float]) -> None:
        if len(arrivals) < 2:
            return
        self.rates.append((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]))
        self.gaps += [b - a for a, b in itertools.pairwise(arrivals)]

    def line(self, name: str) -> str:
        gaps = sorted(self.gaps)
        p99 = gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))]
        return (
            f"  {name:<24} {statistics.median(self.rates):9.1f} batches/s   time between "
            f"batches: median {statistics.median(gaps) * 1e3:6.2f} ms, p99 {p99 * 1e3:6.2f} ms"
        )


def run_sync(loader: Any, passes: int) -> Timing:
    timing = Timing()
    for timed in range(passes + 1):  # pass 0 is the warm-up
        arrivals = []
        for batch in loader:
            assert batch["image"].shape[0] > 0
            arrivals.append(time.perf_counter())
        if timed:
            timing.add_pass(arrivals)
    return timing


async def run_async(loader: Any, passes: int) -> Timing:
    timing = Timing()
    for timed in range(passes + 1):  # pass 0 is the warm-up
        arrivals = []
        async for batch in loader:
            assert batch["image"].shape[0] > 0
            arrivals.append(time.perf_counter())
        if timed:
            timing.add_pass(arrivals)
    return timing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=2_000 if SMALL else 20_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--passes", type=int, default=3, help="timed passes per loader")
    args = parser.parse_args()

    ds = SyntheticImages(args.samples)
    loaders = {
        "aioload, async for": _loader(aioload.DataLoader, ds, args.batch_size, args.workers),
        "aioload, for": _loader(aioload.DataLoader, ds, args.batch_size, args.workers),
        "torch DataLoader, for": _loader(
            torch.utils.data.DataLoader, ds, args.batch_size, args.workers
        ),
    }
    timings = {
        "aioload, async for": asyncio.run(run_async(loaders["aioload, async for"], args.passes)),
        "aioload, for": run_sync(loaders["aioload, for"], args.passes),
        "torch DataLoader, for": run_sync(loaders["torch DataLoader, for"], args.passes),
    }
    for loader in loaders.values():
        if isinstance(loader, aioload.DataLoader):
            loader.shutdown()

    print(
        f"{args.samples} samples of {tuple(ds.base.shape)} uint8, batch {args.batch_size}, "
        f"{args.workers} workers; one warm-up pass, then medians of {args.passes} passes"
    )
    for name, timing in timings.items():
        print(timing.line(name))


if __name__ == "__main__":
    main()
