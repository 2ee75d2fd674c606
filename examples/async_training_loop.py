"""An async training loop on uvloop: ``async for`` next to other async work, on one event loop.

A service that trains while it also answers requests, streams metrics or writes checkpoints
cannot block its event loop on data loading. Here three tasks share one loop:

* the trainer: ``async for batch in loader``, one SGD step per batch;
* a metrics reporter: every 0.2 s it reads ``loader.stats()`` (the live data-bound %);
* a heartbeat: ticks every 10 ms and records how late it wakes up. Waiting for batches never
  blocks the loop, so its lag stays small; a loader that blocked would show up here at once.

At the end it prints the median, p99 and worst heartbeat lag from the first batch on (the
workers' start before it is left out), next to the longest training step: the step runs
synchronously between two awaits, so a heartbeat can be late by up to one step, plus whatever a
busy machine takes from the process.

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


async def heartbeat(
    stop: asyncio.Event, lags: list[tuple[float, float]], period: float = 0.01
) -> None:
    """Record (when, how late) for every tick."""
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(period)
        woke = time.perf_counter()
        lags.append((woke, woke - started - period))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


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
    # Training threads that compete with the workers for the same cores slow every step down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - args.workers))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stop = asyncio.Event()
    lags: list[tuple[float, float]] = []
    steps: list[float] = []
    first_batch_at: float | None = None
    beat = asyncio.create_task(heartbeat(stop, lags))
    metrics = asyncio.create_task(report_metrics(loader, stop))
    try:
        for epoch in range(args.epochs):
            correct = seen = 0
            async for images, labels in loader:
                if first_batch_at is None:
                    first_batch_at = time.perf_counter()
                step_started = time.perf_counter()
                optimizer.zero_grad()
                logits = model(images)
                torch.nn.functional.cross_entropy(logits, labels).backward()
                optimizer.step()
                correct += int((logits.argmax(1) == labels).sum())
                seen += len(labels)
                steps.append(time.perf_counter() - step_started)
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
    after_start = [lag for when, lag in lags if first_batch_at and when >= first_batch_at]
    print(
        f"event loop: {len(after_start)} heartbeats once batches flowed, lag median "
        f"{percentile(after_start, 0.5) * 1e3:.2f} ms, p99 {percentile(after_start, 0.99) * 1e3:.2f}"
        f" ms, worst {max(after_start, default=0.0) * 1e3:.1f} ms"
    )
    print(
        f"  training steps: median {percentile(steps, 0.5) * 1e3:.2f} ms, longest "
        f"{max(steps, default=0.0) * 1e3:.1f} ms (a heartbeat waits for the step in progress)"
    )
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
