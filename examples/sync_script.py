"""A classic synchronous training script: ``for batch in loader``, nothing async in sight.

aioload is a drop-in replacement here: change the import, keep the loop. This script fits a
linear model to a synthetic regression problem for a few epochs with persistent workers, draws
a progress bar for each epoch and prints ``loader.stats()`` after it, so you can see whether
the loop waited for data.

With ``AIOLOAD_EXAMPLE_SMALL=1`` it runs on a few hundred samples (the examples test does this).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from torch.utils.data import Dataset

import aioload

SMALL = os.environ.get("AIOLOAD_EXAMPLE_SMALL", "") not in ("", "0")
FEATURES = 32


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``y = x . w + noise``; each sample is computed on demand from its index."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.weights = np.random.default_rng(0).normal(size=FEATURES).astype(np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng(index)
        x = rng.normal(size=FEATURES).astype(np.float32)
        y = np.float32(x @ self.weights + 0.01 * rng.normal())
        return torch.from_numpy(x), torch.tensor(y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=512 if SMALL else 50_000)
    parser.add_argument("--epochs", type=int, default=2 if SMALL else 3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    loader = aioload.DataLoader(
        Regression(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,  # the workers are started once, not once per epoch
        progress=True,  # a tqdm bar per epoch: batches/s and the live data-bound %
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    for epoch in range(args.epochs):
        total, batches = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        print(f"epoch {epoch}: mean loss {total / batches:.4f}")
        print(loader.stats())
    loader.shutdown()  # persistent workers: stop them now rather than at exit


if __name__ == "__main__":
    main()
