"""``make soak``: 1,000 loaders created, partly iterated and dropped, with random breaks and
worker kills, in sync and async mode. Counts processes, descriptors, threads and /dev/shm
entries at the start and at the end; all must be flat. Not part of ``make test`` (it takes a
minute or two).

    python tests/soak.py [--loaders 1000] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import signal
import threading
import time
import warnings
from typing import Any

import psutil
import torch
from torch.utils.data import Dataset

import aioload


class Samples(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((16, 16), i, dtype=torch.float32), "i": i}


def counts() -> dict[str, int]:
    me = psutil.Process()
    try:
        shm = len(os.listdir("/dev/shm"))
    except FileNotFoundError:
        shm = 0
    return {
        "processes": len(me.children(recursive=True)),
        "fds": me.num_fds(),
        "threads": threading.active_count(),
        "dev_shm_entries": shm,
    }


def kill_a_worker(rng: random.Random) -> None:
    workers = []
    for proc in psutil.Process().children():
        # A worker that exits between the listing and the look is not there to kill.
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() != psutil.STATUS_ZOMBIE:
                workers.append(proc)
    if workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rng.choice(workers).pid, signal.SIGKILL)


def after_batch(n: int, stop_after: int, kill_at: int | None, rng: random.Random) -> bool:
    """After batch ``n``: kill a worker if it is time to; whether the pass stops here."""
    if n == kill_at:
        kill_a_worker(rng)
    return n >= stop_after


def one_sync(loader: Any, stop_after: int, kill_at: int | None, rng: random.Random) -> int:
    n = 0
    try:
        for n, _ in enumerate(loader, 1):
            if after_batch(n, stop_after, kill_at, rng):
                break
    except aioload.WorkerDiedError:
        pass
    return n


async def one_async(loader: Any, stop_after: int, kill_at: int | None, rng: random.Random) -> int:
    n = 0
    try:
        async for _ in loader:
            n += 1
            if after_batch(n, stop_after, kill_at, rng):
                break
    except aioload.WorkerDiedError:
        pass
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loaders", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rng = random.Random(args.seed)

    # One warm-up loader of each kind, so the once-per-process things (the private event loop,
    # anyio's worker thread) exist before the counts are taken.
    list(aioload.DataLoader(Samples(8), batch_size=4, num_workers=1))
    asyncio.run(
        one_async(aioload.DataLoader(Samples(8), batch_size=4, num_workers=1), 99, None, rng)
    )
    gc.collect()
    start = counts()
    started = time.monotonic()
    stats = {"sync": 0, "async": 0, "killed": 0, "healed": 0, "persistent": 0, "batches": 0}
    kept: list[Any] = []
    for i in range(args.loaders):
        persistent = rng.random() < 0.2
        heal = rng.random() < 0.3
        loader = aioload.DataLoader(
            Samples(rng.randint(10, 200)),
            batch_size=rng.choice([1, 4, 16]),
            num_workers=rng.choice([1, 2]),
            shuffle=rng.random() < 0.5,
            persistent_workers=persistent,
            max_worker_restarts=3 if heal else 0,
            in_order=rng.random() < 0.8,
        )
        stop_after = rng.randint(0, 12)
        kill_at = rng.randint(1, 6) if rng.random() < 0.15 else None
        stats["killed"] += kill_at is not None and kill_at <= stop_after
        stats["healed"] += heal and kill_at is not None
        stats["persistent"] += persistent
        for _epoch in range(2 if persistent else 1):
            if rng.random() < 0.5:
                stats["sync"] += 1
                stats["batches"] += one_sync(loader, stop_after, kill_at, rng)
            else:
                stats["async"] += 1
                stats["batches"] += asyncio.run(one_async(loader, stop_after, kill_at, rng))
        if rng.random() < 0.05:
            # Sometimes keep a batch past its loader's life.
            kept.append(next(iter(aioload.DataLoader(Samples(4), batch_size=2, num_workers=1))))
        del loader
        if i % 100 == 99:
            gc.collect()
            print(f"{i + 1:5d} loaders  {counts()}  {time.monotonic() - started:.0f}s", flush=True)
    for n, batch in enumerate(kept):
        assert batch["i"].tolist() == [0, 1], f"kept batch {n} changed"
    kept.clear()
    gc.collect()
    deadline = time.monotonic() + 10
    while counts()["processes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    end = counts()
    report = {
        "loaders": args.loaders,
        "seconds": round(time.monotonic() - started, 1),
        "start": start,
        "end": end,
        "activity": stats,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    flat = all(end[k] <= start[k] for k in start)
    print("FLAT" if flat else "NOT FLAT")
    raise SystemExit(0 if flat else 1)


if __name__ == "__main__":
    main()
