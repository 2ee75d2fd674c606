"""Iterates a slow loader forever and prints its worker pids; the test then SIGKILLs this
process and checks that the workers leave by themselves.

Usage: python orphaned.py CONTEXT API [WHERE], with CONTEXT ``default``, ``fork``, ``spawn`` or
``forkserver``, API ``sync`` or ``async``, and WHERE ``between`` (the default: short samples, so
the workers are killed between two) or ``sleep`` or ``gil`` (every sample after each worker's
first is stuck in user code for longer than the test runs: the workers are killed inside it). The dataset lives in an importable module, so the
spawn and forkserver workers can unpickle it.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

# The repository root, so that ``tests.scripts.datasets`` imports here and in spawned workers.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import aioload
from tests.scripts.datasets import Slow, StuckAfter


def main(context: str, api: str, where: str) -> None:
    dataset = Slow(100_000, 0.05) if where == "between" else StuckAfter(100, fast=2, how=where)
    loader = aioload.DataLoader(
        dataset,
        batch_size=1,
        num_workers=2,
        multiprocessing_context=None if context == "default" else context,
    )
    pids: set[int] = set()
    reported = False

    def see(batch: Any) -> None:
        nonlocal reported
        pids.add(int(batch[0, 1]))
        if len(pids) == 2 and not reported:
            reported = True
            print(json.dumps(sorted(pids)), flush=True)

    if api == "sync":
        for batch in loader:
            see(batch)
    else:

        async def consume() -> None:
            async for batch in loader:
                see(batch)

        asyncio.run(consume())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "between")
