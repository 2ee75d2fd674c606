"""Quickstart: the same synthetic dataset read with ``async for`` and with ``for``.

Run it with ``python examples/quickstart.py``. It prints batches/s for both aioload modes and
for torch.utils.data.DataLoader on the same data, so you can see the difference on your machine.
With ``AIOLOAD_EXAMPLE_SMALL=1`` it runs on 2,000 samples (the examples test does this).
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
    return cls(ds, batch_size=batch_size, num_workers=workers, shuffle=True)


def run_sync(loader: Any) -> tuple[int, float]:
    start = time.perf_counter()
    n = 0
    for batch in loader:
        assert batch["image"].shape[0] > 0
        n += 1
    return n, time.perf_counter() - start


async def run_async(loader: Any) -> tuple[int, float]:
    start = time.perf_counter()
    n = 0
    async for batch in loader:
        assert batch["image"].shape[0] > 0
        n += 1
    return n, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=2_000 if SMALL else 20_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    ds = SyntheticImages(args.samples)
    rows = []
    n, dt = asyncio.run(run_async(_loader(aioload.DataLoader, ds, args.batch_size, args.workers)))
    rows.append(("aioload, async for", n, dt))
    n, dt = run_sync(_loader(aioload.DataLoader, ds, args.batch_size, args.workers))
    rows.append(("aioload, for", n, dt))
    n, dt = run_sync(_loader(torch.utils.data.DataLoader, ds, args.batch_size, args.workers))
    rows.append(("torch DataLoader, for", n, dt))

    print(
        f"{args.samples} samples of {tuple(ds.base.shape)} uint8, batch {args.batch_size}, "
        f"{args.workers} workers"
    )
    for name, n, dt in rows:
        print(f"  {name:<24} {n / dt:9.1f} batches/s  ({n} batches in {dt:.2f} s)")


if __name__ == "__main__":
    main()
