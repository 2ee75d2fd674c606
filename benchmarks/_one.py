"""One measured loader run; executed in a fresh subprocess by the benchmark driver.

Usage (internal)::

    python -m benchmarks._one --loader torch|aioload|torchdata|spdl|floor \
        --mode sync|async-uvloop|async-asyncio \
        --workload tiny --size 500000 --batch-size 256 --num-workers 2 --cpu-iters N \
        --min-seconds 2.0

Prints a single JSON object on the last line of stdout.  Timing definitions:

* ``ttfb_s``: from just before ``DataLoader(...)`` is constructed to receipt of the first
  batch (so start-up work done eagerly in the constructor, iterator creation and worker
  start-up all count).  ``construct_s`` is the constructor alone.
* ``items_per_s``: items received *after* the first batch divided by the time between the
  first and the last batch arrival (steady state).
* A run stops once its steady state has lasted ``--min-seconds`` (mid-epoch: the datasets are
  sized so that one epoch lasts longer); only if an epoch ends sooner is another one run (same
  loader object), and ``epochs`` reports how many.
* ``worker_cpu_per_item_s``: CPU time of the workers (this process's children, user and
  system) between the first batch and the end of the steady state, per item received.
* ``parent_cpu_per_batch_s``: CPU time of this process (all its threads, not the workers)
  between the first and the last batch, per batch: what the loader costs the training process.
* Loaders: ``torch`` and ``aioload``; the peers ``torchdata`` (``torchdata.nodes``, a
  process ``ParallelMapper``) and ``spdl`` (``spdl.dataloader.get_pytorch_dataloader``) where
  installed (the ``bench`` extra); and ``floor``, no loader at all: ``num_workers`` processes
  that only make the samples and ``torch.stack`` them into a reused shared-memory buffer
  (:mod:`benchmarks.floor`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import resource
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from benchmarks.workloads import WORKLOADS, count_items, make_dataset, touch

FAKE_ENV = "AIOLOAD_BENCH_FAKE"
LOADERS = ("torch", "aioload", "torchdata", "spdl", "floor")
PEERS = ("torchdata", "spdl")
MODES = ("sync", "async-uvloop", "async-asyncio")


def fake_enabled() -> bool:
    return os.environ.get(FAKE_ENV, "") not in ("", "0")


def resolve_loader(which: str) -> Callable[..., Any]:
    """The DataLoader class for ``which`` ("torch" or "aioload")."""
    if which == "torch" or (which == "aioload" and fake_enabled()):
        from torch.utils.data import DataLoader

        return DataLoader
    if which == "aioload":
        mod = importlib.import_module("aioload")
        cls: Callable[..., Any] = mod.DataLoader
        return cls
    if which == "torchdata":
        return _torchdata_loader
    if which == "spdl":
        from spdl.dataloader import get_pytorch_dataloader

        spdl_factory: Callable[..., Any] = get_pytorch_dataloader
        return spdl_factory
    raise ValueError(f"unknown loader {which!r}")


def peer_available(which: str) -> str | None:
    """None when the peer loader can be imported here, else why not."""
    module = {"torchdata": "torchdata.nodes", "spdl": "spdl.dataloader"}[which]
    try:
        importlib.import_module(module)
    except Exception as exc:  # any import failure means "absent", with its reason
        return f"{type(exc).__name__}: {exc}"
    return None


class _FetchBatch:
    """torchdata.nodes map function: indices -> collated batch (picklable, module level)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self, indices: list[int]) -> Any:
        from torch.utils.data import default_collate

        return default_collate([self.dataset[i] for i in indices])


def _torchdata_loader(dataset: Any, *, batch_size: int, num_workers: int) -> Any:
    """torchdata.nodes' equivalent of DataLoader(dataset, batch_size, num_workers): sampler ->
    batches of indices -> a process ParallelMapper that fetches and collates -> Loader."""
    from torch.utils.data import SequentialSampler
    from torchdata.nodes import Batcher, Loader, ParallelMapper, SamplerWrapper

    node: Any = Batcher(SamplerWrapper(SequentialSampler(dataset)), batch_size=batch_size)
    node = ParallelMapper(
        node, map_fn=_FetchBatch(dataset), num_workers=num_workers, method="process"
    )
    return Loader(node)


@dataclass
class Meter:
    t_start: float = 0.0
    t_constructed: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    t_done: float = 0.0
    items: int = 0
    first_items: int = 0
    batches: int = 0
    epochs: int = 0
    checksum: int = 0
    cpu_first: float = 0.0
    cpu_last: float = 0.0
    # The CPU time of this process's children (the workers) at the first batch and when the
    # steady state ended; -1 until taken.
    workers_cpu_first: float = -1.0
    workers_cpu_last: float = -1.0
    lags: list[float] = field(default_factory=list)
    # aioload's own view of the run (loader.stats()), read before the loader goes.
    loader_stats: dict[str, Any] = field(default_factory=dict)

    def on_batch(self, batch: object) -> None:
        now = time.perf_counter()
        cpu = time.process_time()
        n = count_items(batch)
        self.checksum += touch(batch)
        if self.batches == 0:
            self.t_first = now
            self.cpu_first = cpu
            self.first_items = n
            self.workers_cpu_first = _children_cpu()
        self.t_last = now
        self.cpu_last = cpu
        self.items += n
        self.batches += 1

    def need_more(self, min_seconds: float) -> bool:
        return self.batches > 0 and self.t_last - self.t_first < min_seconds

    def enough(self, min_seconds: float) -> bool:
        return self.batches > 0 and self.t_last - self.t_first >= min_seconds

    def steady_state_over(self) -> None:
        """Takes the workers' CPU time at the end of the steady state (once: the first end)."""
        if self.workers_cpu_last < 0:
            self.workers_cpu_last = _children_cpu()

    def workers_cpu_per_item(self) -> float:
        """The workers' CPU time per item received in the steady state (all workers together,
        user and system; nan where there are no workers)."""
        steady = self.items - self.first_items
        spent = self.workers_cpu_last - self.workers_cpu_first
        if steady <= 0 or self.workers_cpu_first < 0 or spent <= 0:
            return float("nan")
        return spent / steady


def _children_cpu() -> float:
    """User and system CPU time of this process's live descendants (a loader's workers)."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue  # gone since it was listed
        total += times.user + times.system
    return total


@dataclass
class RunConfig:
    loader: str
    mode: str
    workload: str
    size: int
    batch_size: int
    num_workers: int
    cpu_iters: int
    min_seconds: float
    max_epochs: int
    url: str = ""
    # aioload's seed_per_sample=True (with it, in order, tasks go to the least busy worker).
    seed_per_sample: bool = False
    # in_order=False (aioload and torch alike).
    out_of_order: bool = False


def _real_aioload(cfg: RunConfig) -> bool:
    return cfg.loader == "aioload" and not fake_enabled()


def _make_loader(cfg: RunConfig, dataset: object) -> Any:
    cls = resolve_loader(cfg.loader)
    if cfg.loader in PEERS:
        return cls(dataset, batch_size=cfg.batch_size, num_workers=cfg.num_workers)
    workload = WORKLOADS.get(cfg.workload)
    extra = workload.loader_kwargs(on_aioload=_real_aioload(cfg)) if workload else {}
    if cfg.seed_per_sample:
        extra["seed_per_sample"] = True
    if cfg.out_of_order:
        extra["in_order"] = False
    return cls(dataset, batch_size=cfg.batch_size, num_workers=cfg.num_workers, **extra)


def run_sync(cfg: RunConfig, dataset: object) -> Meter:
    m = Meter()
    m.t_start = time.perf_counter()
    loader = _make_loader(cfg, dataset)
    m.t_constructed = time.perf_counter()
    while True:
        m.epochs += 1
        for batch in loader:
            m.on_batch(batch)
            del batch  # drop our reference before asking for the next batch
            if m.enough(cfg.min_seconds):
                m.steady_state_over()
                break
        if m.epochs >= cfg.max_epochs or not m.need_more(cfg.min_seconds):
            break
    m.steady_state_over()
    m.loader_stats = loader_stats(loader)
    del loader
    m.t_done = time.perf_counter()
    return m


async def _fake_aiter(loader: Iterable[object]) -> AsyncIterator[object]:
    """Debug-only async adapter for torch's loader (blocks the loop; see FAKE_ENV)."""
    for batch in loader:
        yield batch
        await asyncio.sleep(0)


async def _heartbeat(stop: asyncio.Event, lags: list[float], period: float = 0.01) -> None:
    """Record event-loop lag (oversleep) while the loader is iterated."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - t0 - period)


async def run_async(cfg: RunConfig, dataset: object) -> Meter:
    m = Meter()
    stop = asyncio.Event()
    hb = asyncio.create_task(_heartbeat(stop, m.lags))
    m.t_start = time.perf_counter()
    loader = _make_loader(cfg, dataset)
    m.t_constructed = time.perf_counter()
    while True:
        m.epochs += 1
        source: Any = loader if hasattr(loader, "__aiter__") else None
        if source is None:
            if not fake_enabled():
                raise TypeError(f"{type(loader).__name__} does not support `async for`")
            source = _fake_aiter(loader)
        async for batch in source:
            m.on_batch(batch)
            del batch
            if m.enough(cfg.min_seconds):
                m.steady_state_over()
                break
        if m.epochs >= cfg.max_epochs or not m.need_more(cfg.min_seconds):
            break
    m.steady_state_over()
    m.loader_stats = loader_stats(loader)
    del loader, source
    m.t_done = time.perf_counter()
    stop.set()
    await hb
    return m


def loader_stats(loader: Any) -> dict[str, Any]:
    """What aioload's ``loader.stats()`` says of the pass (empty for other loaders): the
    workers' mean busy share and the answers waiting in order (mean, peak), and the run-ahead."""
    stats_of = getattr(loader, "stats", None)
    if not callable(stats_of):
        return {}
    stats = stats_of()
    busy = [w.busy_fraction for w in stats.workers]
    found: dict[str, Any] = {
        "busy_share": sum(busy) / len(busy) if busy else None,
        # The least and most busy worker: in order, with torch's round robin, the slowest
        # worker sets the pace once the others have run ahead as far as they may.
        "busy_min": min(busy, default=None),
        "busy_max": max(busy, default=None),
        "waiting_in_order_mean": stats.waiting_in_order_mean,
        "data_bound_pct": stats.data_bound_pct,
    }
    for name in ("waiting_in_order_peak", "run_ahead_peak", "run_ahead_limit"):
        found[name] = getattr(stats, name, None)
    return found


def _new_uvloop() -> asyncio.AbstractEventLoop:
    import uvloop

    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def measure(cfg: RunConfig) -> dict[str, Any]:
    if cfg.loader == "floor":
        from benchmarks.floor import measure_floor

        return {"config": asdict(cfg), **measure_floor(cfg)}
    dataset = make_dataset(
        cfg.workload, cfg.size, cfg.cpu_iters, asynchronous=_real_aioload(cfg), url=cfg.url
    )
    rss_baseline = psutil.Process().memory_info().rss
    if cfg.mode == "sync":
        m = run_sync(cfg, dataset)
    elif cfg.mode == "async-uvloop":
        with asyncio.Runner(loop_factory=_new_uvloop) as runner:
            m = runner.run(run_async(cfg, dataset))
    elif cfg.mode == "async-asyncio":
        m = asyncio.run(run_async(cfg, dataset))
    else:
        raise ValueError(f"unknown mode {cfg.mode!r}")
    if m.batches == 0:
        raise RuntimeError("loader produced no batches")
    steady_s = m.t_last - m.t_first
    steady_items = m.items - m.first_items
    ru_self = resource.getrusage(resource.RUSAGE_SELF)
    ru_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    lags = sorted(m.lags)
    return {
        "config": asdict(cfg),
        "fake": cfg.loader == "aioload" and fake_enabled(),
        "items": m.items,
        "batches": m.batches,
        "epochs": m.epochs,
        "steady_items": steady_items,
        "steady_s": steady_s,
        "items_per_s": steady_items / steady_s if steady_s > 0 else float("nan"),
        "parent_cpu_per_batch_s": (
            (m.cpu_last - m.cpu_first) / (m.batches - 1) if m.batches > 1 else float("nan")
        ),
        "worker_cpu_per_item_s": m.workers_cpu_per_item(),
        "ttfb_s": m.t_first - m.t_start,
        "construct_s": m.t_constructed - m.t_start,
        "teardown_s": m.t_done - m.t_last,
        "total_s": m.t_done - m.t_start,
        "checksum": m.checksum,
        "rss_baseline_bytes": rss_baseline,
        # Linux reports ru_maxrss in KiB.
        "ru_maxrss_self_bytes": ru_self.ru_maxrss * 1024,
        "ru_maxrss_children_bytes": ru_children.ru_maxrss * 1024,
        "cpu_user_s": ru_self.ru_utime + ru_children.ru_utime,
        "cpu_sys_s": ru_self.ru_stime + ru_children.ru_stime,
        "loop_lag_max_ms": lags[-1] * 1e3 if lags else None,
        "loop_lag_p99_ms": lags[int(0.99 * (len(lags) - 1))] * 1e3 if lags else None,
        "loader_stats": m.loader_stats,
    }


def parse_args(argv: list[str] | None) -> RunConfig:
    p = argparse.ArgumentParser(prog="python -m benchmarks._one")
    p.add_argument("--loader", choices=LOADERS, required=True)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--cpu-iters", type=int, default=0)
    p.add_argument("--min-seconds", type=float, default=2.0)
    p.add_argument("--max-epochs", type=int, default=100)
    p.add_argument("--url", default="", help="the HTTP server (http workload)")
    p.add_argument("--seed-per-sample", action="store_true", help="aioload's seed_per_sample")
    p.add_argument("--out-of-order", action="store_true", help="in_order=False")
    a = p.parse_args(argv)
    return RunConfig(
        loader=a.loader,
        mode=a.mode,
        workload=a.workload,
        size=a.size,
        batch_size=a.batch_size,
        num_workers=a.num_workers,
        cpu_iters=a.cpu_iters,
        min_seconds=a.min_seconds,
        max_epochs=a.max_epochs,
        url=a.url,
        seed_per_sample=a.seed_per_sample,
        out_of_order=a.out_of_order,
    )


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    result = measure(cfg)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
