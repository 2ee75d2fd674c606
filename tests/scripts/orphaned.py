"""Iterates a slow loader forever and prints its worker pids; the test then SIGKILLs this
process and checks that the workers leave by themselves.

Usage: python orphaned.py CONTEXT API, with CONTEXT ``default``, ``fork``, ``spawn`` or
``forkserver`` and API ``sync`` or ``async``. The dataset lives in an importable module, so the
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
from tests.scripts.datasets import Slow


def main(context: str, api: str) -> None:
    loader = aioload.DataLoader(
        Slow(100_000, 0.05),
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
    main(sys.argv[1], sys.argv[2])
