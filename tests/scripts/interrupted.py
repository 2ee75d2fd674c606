"""Iterates a slow loader until SIGINT arrives; prints worker pids, then how it ended."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import psutil
import torch

import aioload


class Slow(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> int:
        time.sleep(0.02)
        return i


def main(mode: str) -> None:
    loader = aioload.DataLoader(Slow(), batch_size=2, num_workers=2)
    count = 0

    def report() -> None:
        pids = [p.pid for p in psutil.Process().children()]
        print("workers", *pids, flush=True)

    try:
        if mode == "sync":
            for _ in loader:
                count += 1
                if count == 3:
                    report()
        else:

            async def consume() -> None:
                nonlocal count
                async for _ in loader:
                    count += 1
                    if count == 3:
                        report()

            asyncio.run(consume())
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise


if __name__ == "__main__":
    # A process started in the background by a non-interactive shell (as CI and some test
    # runners do) inherits SIGINT as ignored, and Python then installs no handler. Restore what a
    # terminal user has.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main(sys.argv[1])
