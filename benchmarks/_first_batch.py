"""Start-up of one loader in a fresh process; run as a script (by path), never imported.

Usage (internal)::

    python .../benchmarks/_first_batch.py --loader torch|aioload --workload tiny \
        --batch-size 256 --num-workers 2 [--cpu-iters N] [--repo DIR] [--front async]

Run by path, so that nothing of the ``aioload`` package is imported before the clock starts:
``sys.path[0]`` is this folder, and the workload module is loaded from it as a plain module.
Prints one JSON object on the last line of stdout:

* ``first_batch_s``: from just before ``import aioload`` (torch's loader: before
  ``from torch.utils.data import DataLoader``; torch itself is imported before, for both) to the
  first batch in hand: the package's import, the constructor, the workers' start and the first
  fetch all count.
* ``later_epoch_first_batch_s``: in the same process, after one full (short) epoch, from
  ``iter(loader)`` of the second epoch to its first batch. ``persistent_workers`` is off, so
  both loaders start their workers again.

``--front async`` (aioload only) takes the batches with ``async for`` under ``asyncio.run``,
which starts before the clock: the same two figures, from the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch  # both loaders pay for it before the clock starts


def _load_workloads() -> ModuleType:
    # Loaded as a plain module from this folder, so the aioload package is not imported.
    path = Path(__file__).with_name("workloads.py")
    spec = importlib.util.spec_from_file_location("_bench_workloads", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # picklable by reference for the workers
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(prog="_first_batch.py")
    p.add_argument("--loader", choices=("torch", "aioload"), required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--cpu-iters", type=int, default=0)
    p.add_argument("--batches", type=int, default=16, help="batches in the short epoch")
    p.add_argument("--repo", default="", help="put this folder first on sys.path")
    p.add_argument("--url", default="", help="the HTTP server (http workload)")
    p.add_argument("--max-size", type=int, default=0, help="at most this many samples")
    p.add_argument("--front", choices=("sync", "async"), default="sync")
    a = p.parse_args()
    if a.front == "async" and a.loader != "aioload":
        p.error("--front async is aioload's")
    if a.repo:
        sys.path.insert(0, a.repo)
    workloads = _load_workloads()
    size = a.batch_size * a.batches
    if a.max_size:
        size = min(size, a.max_size)
    workload = workloads.WORKLOADS[a.workload]
    on_aioload = a.loader == "aioload"
    dataset = workloads.make_dataset(
        a.workload, size, a.cpu_iters, asynchronous=on_aioload, url=a.url
    )
    extra = workload.loader_kwargs(on_aioload=on_aioload)
    preloaded = sorted(m for m in sys.modules if m == "aioload" or m.startswith("aioload."))
    if preloaded:
        raise SystemExit(f"aioload was imported before the clock started: {preloaded}")
    torch.set_num_threads(torch.get_num_threads())  # settle torch's lazy thread-pool set-up

    if a.front == "async":
        times = asyncio.run(_timed_async(a.batch_size, a.num_workers, dataset, extra))
    else:
        times = _timed_sync(a.loader, a.batch_size, a.num_workers, dataset, extra)
    import_s, first_s, later_s, n, first_cpu_s = times
    print(
        json.dumps(
            {
                "loader": a.loader,
                "workload": a.workload,
                "front": a.front,
                "import_s": import_s,
                "first_batch_s": first_s,
                "later_epoch_first_batch_s": later_s,
                "first_batch_cpu_s": first_cpu_s,
                "batches": n,
            }
        )
    )
    return 0


def _timed_sync(
    loader_name: str, batch_size: int, num_workers: int, dataset: Any, extra: dict[str, Any]
) -> tuple[float, float, float, int, float]:
    """The import, the first batch (both from before the import), the later epoch's first
    batch, the batches of the first epoch, and this process's CPU time to the first batch
    (less sensitive to a loaded machine than the wall clock), under ``for``."""
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    if loader_name == "aioload":
        import aioload

        cls: Any = aioload.DataLoader
    else:
        from torch.utils.data import DataLoader

        cls = DataLoader
    t_imported = time.perf_counter()
    loader = cls(dataset, batch_size=batch_size, num_workers=num_workers, **extra)
    it = iter(loader)
    first = next(it)
    t_first = time.perf_counter()
    first_cpu = time.process_time() - cpu0
    n = 1
    del first
    for batch in it:
        n += 1
        del batch
    del it
    t1 = time.perf_counter()
    it = iter(loader)
    second = next(it)
    t_second = time.perf_counter()
    del second
    for batch in it:
        del batch
    del it, loader
    return t_imported - t0, t_first - t0, t_second - t1, n, first_cpu


async def _timed_async(
    batch_size: int, num_workers: int, dataset: Any, extra: dict[str, Any]
) -> tuple[float, float, float, int, float]:
    """``_timed_sync`` for aioload under ``async for``."""
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    import aioload

    t_imported = time.perf_counter()
    loader = aioload.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, **extra)
    it = aiter(loader)
    first = await anext(it)
    t_first = time.perf_counter()
    first_cpu = time.process_time() - cpu0
    n = 1
    del first
    async for batch in it:
        n += 1
        del batch
    del it
    t1 = time.perf_counter()
    it = aiter(loader)
    second = await anext(it)
    t_second = time.perf_counter()
    del second
    async for batch in it:
        del batch
    del it, loader
    return t_imported - t0, t_first - t0, t_second - t1, n, first_cpu


if __name__ == "__main__":
    raise SystemExit(main())
