"""Benchmark workloads: picklable, module-level datasets plus batch helpers.

The same dataset class (and constructor arguments) is used for both loaders; datasets are
deliberately cheap to produce so that what is measured is the loader's transport and
per-batch overhead, not sample generation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

IMAGE_SHAPE: tuple[int, int, int] = (3, 224, 224)
IMAGE_POOL: int = 4
"""Number of distinct preallocated images the image dataset cycles through."""


class TinyDataset(Dataset[torch.Tensor]):
    """``n`` scalar int64 tensors: measures per-sample / per-batch overhead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class ImageDataset(Dataset[torch.Tensor]):
    """``n`` uint8 ``3x224x224`` tensors: measures transport bandwidth.

    A small pool of images is preallocated once; each ``__getitem__`` returns a fresh
    ``clone()`` of one of them, i.e. exactly one 150 KB memcpy per sample (what a real
    decoder would hand over as freshly allocated memory).
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        gen = torch.Generator().manual_seed(seed)
        self._pool = torch.randint(
            0, 256, (IMAGE_POOL, *IMAGE_SHAPE), dtype=torch.uint8, generator=gen
        )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._pool[index % IMAGE_POOL].clone()


def burn(iters: int, salt: int) -> int:
    """Pure-Python busy loop (holds the GIL); cost is linear in ``iters``."""
    acc = salt
    for j in range(iters):
        acc = (acc * 31 + j) & 0xFFFFFFFF
    return acc


class CpuDataset(Dataset[torch.Tensor]):
    """``n`` samples each costing ``iters`` iterations of :func:`burn` (~1 ms, calibrated)."""

    def __init__(self, n: int, iters: int) -> None:
        self.n = n
        self.iters = iters

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(burn(self.iters, index))


def calibrate_cpu_iters(target_s: float = 1e-3, probe_iters: int = 50_000) -> int:
    """Number of :func:`burn` iterations that take about ``target_s`` on this machine.

    Done once in the parent so that every run (torch and aioload) uses the same count.
    """
    burn(probe_iters, 0)  # warm-up
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        burn(probe_iters, 1)
        best = min(best, time.perf_counter() - t0)
    return max(1, round(probe_iters * target_s / best))


@dataclass(frozen=True)
class Workload:
    name: str
    default_size: int
    batch_size: int
    num_workers: int
    target_ratio: float
    description: str


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("tiny", 1_000_000, 256, 2, 2.0, "scalar tensors, per-batch overhead"),
        Workload("image", 80_000, 64, 2, 4.0, "uint8 3x224x224, transport bandwidth"),
        Workload("cpu", 5_000, 32, 2, 1.0, "~1 ms pure Python per sample, compute scaling"),
    )
}


def make_dataset(name: str, size: int, cpu_iters: int) -> Dataset[torch.Tensor]:
    if name == "tiny":
        return TinyDataset(size)
    if name == "image":
        return ImageDataset(size)
    if name == "cpu":
        return CpuDataset(size, cpu_iters)
    raise ValueError(f"unknown workload {name!r}")


def count_items(batch: object) -> int:
    """Number of samples in a collated batch (leading dimension of the first leaf)."""
    if isinstance(batch, torch.Tensor):
        return 1 if batch.dim() == 0 else int(batch.shape[0])
    if isinstance(batch, Mapping):
        return count_items(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        return count_items(batch[0])
    raise TypeError(f"cannot count items of {type(batch).__name__}")


def touch(batch: object) -> int:
    """Read a few elements of the batch (at most 8) so lazy transports must materialise it.

    Only a tiny view is reduced, never the whole batch, so the consumer stays negligible.
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return int(batch.item())
        row = batch[(0,) * (batch.dim() - 1)]
        return int(row[:8].sum().item())
    if isinstance(batch, Mapping):
        return touch(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        return touch(batch[0])
    raise TypeError(f"cannot touch {type(batch).__name__}")
