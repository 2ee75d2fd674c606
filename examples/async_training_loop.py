"""An async training loop on uvloop: ``async for`` next to other async work, on one event loop.

A service that trains while it also answers requests, streams metrics or writes checkpoints
cannot block its event loop on data loading. Here three tasks share one loop:

* the trainer: ``async for batch in loader``, one SGD step per batch;
* a metrics reporter: every 0.2 s it reads ``loader.stats()`` (the live data-bound %);
* a heartbeat: ticks every 10 ms and records how late it wakes up. Waiting for batches never
  blocks the loop, so its lag stays small; a loader that blocked would show up here at once.

At the end of each epoch a checkpoint is written in a thread (``asyncio.to_thread``), so the loop
stays responsive while the disk works.

With ``AIOLOAD_EXAMPLE_SMALL=1`` it runs on a few hundred samples (the examples test does this).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import time
from typing import Any

import torch
import uvloop
from torch.utils.data import Dataset

import aioload

SMALL = os.environ.get("AIOLOAD_EXAMPLE_SMALL", "") not in ("", "0")


class NoisyDigits(Dataset[tuple[torch.Tensor, int]]):
    """16x16 "images": label ``k`` lights up row ``k``, plus noise, so a model can learn it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        label = index % 10
        image = torch.randn(1, 16, 16, generator=generator) * 0.5
        image[0, label] += 2.0
        return image, label


async def heartbeat(stop: asyncio.Event, lags: list[float], period: float = 0.01) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - started - period)


async def report_metrics(loader: aioload.DataLoader[Any], stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.2)
        stats = loader.stats()
        if stats.running and stats.data_bound_pct is not None:
            print(
                f"  [metrics] {stats.batches} batches, data-bound {stats.data_bound_pct:.0f} %, "
                f"{stats.in_flight} tasks in flight",
                flush=True,
            )


def save_checkpoint(model: torch.nn.Module) -> int:
    buffer = io.BytesIO()  # a real service would write a file or an object store
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


async def train(args: argparse.Namespace) -> None:
    loader = aioload.DataLoader(
        NoisyDigits(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stop = asyncio.Event()
    lags: list[float] = []
    beat = asyncio.create_task(heartbeat(stop, lags))
    metrics = asyncio.create_task(report_metrics(loader, stop))
    try:
        for epoch in range(args.epochs):
            correct = seen = 0
            async for images, labels in loader:
                optimizer.zero_grad()
                logits = model(images)
                torch.nn.functional.cross_entropy(logits, labels).backward()
                optimizer.step()
                correct += int((logits.argmax(1) == labels).sum())
                seen += len(labels)
                # Let the other tasks run between steps, as real async services do.
                await asyncio.sleep(0)
            size = await asyncio.to_thread(save_checkpoint, model)
            stats = loader.stats()
            pct = stats.data_bound_pct or 0.0
            print(
                f"epoch {epoch}: accuracy {correct / seen:.1%}, {stats.batches} batches, "
                f"data-bound {pct:.0f} %, checkpoint {size} bytes"
            )
    finally:
        stop.set()
        await asyncio.gather(beat, metrics)
        loader.shutdown()
    lags.sort()
    worst = lags[-1] * 1e3 if lags else 0.0
    print(f"event loop: {len(lags)} heartbeats, worst lag {worst:.1f} ms")
    print(loader.stats())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=640 if SMALL else 40_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    uvloop.run(train(parser.parse_args()))


if __name__ == "__main__":
    main()
