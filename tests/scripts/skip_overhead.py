"""What ``on_sample_error="skip"`` costs when no sample fails (docs/reliability.md).

Runs the benchmark's ``tiny`` workload (scalar tensors: the per-sample overhead is all there
is) with ``on_sample_error="raise"`` and ``"skip"``, alternating run by run so that a change in
the machine's load hits both alike, and prints each mode's median samples/s and the overhead.
It also times the fetch step alone (``Fetcher.fetch`` of one batch, in this process), which
isolates the change from the pipes and the workers.

    .venv/bin/python tests/scripts/skip_overhead.py --rounds 10 --samples 200000
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import aioload
from aioload._wire.messages import PassPlan
from aioload._worker.fetch import Fetcher, FetchSpec, SamplePolicy
from benchmarks.workloads import TinyDataset

MODES = ("raise", "skip")


def _cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the pass's workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def loader_run(mode: str, samples: int, batch_size: int, workers: int) -> tuple[float, float]:
    """One pass: steady-state samples/s (first batch to last), and CPU microseconds per sample
    of the whole pass, the workers' included (less sensitive to the machine's load than
    wall time)."""
    cpu_before = _cpu_s()
    loader = aioload.DataLoader(
        TinyDataset(samples), batch_size=batch_size, num_workers=workers, on_sample_error=mode
    )
    count = 0
    first = 0.0
    for i, batch in enumerate(loader):
        if i == 0:
            first = time.perf_counter()
            continue
        count += len(batch)
    rate = count / (time.perf_counter() - first)
    # The pass's workers have been joined at its end, so their CPU time is counted now.
    return rate, 1e6 * (_cpu_s() - cpu_before) / samples


def fetch_seconds(mode: str, batch_size: int, batches: int) -> float:
    """Seconds per batch of the fetch step alone (fetch + default_collate)."""
    spec = FetchSpec(
        dataset_kind=0,
        dataset=TinyDataset(batch_size * batches),
        auto_collation=True,
        collate_fn=torch.utils.data.default_collate,
        drop_last=False,
        policy=SamplePolicy(mode),
    )
    fetcher = Fetcher(spec, PassPlan())
    indices = [list(range(b * batch_size, (b + 1) * batch_size)) for b in range(batches)]
    started = time.perf_counter()
    for batch in indices:
        fetcher.fetch(batch)
    return (time.perf_counter() - started) / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    fetch: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        # Alternate which mode goes first, too.
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            rate, cpu_us = loader_run(mode, args.samples, args.batch_size, args.workers)
            rates[mode].append(rate)
            cpu[mode].append(cpu_us)
            for _ in range(5):
                fetch[mode].append(fetch_seconds(mode, args.batch_size, 50))
    print(
        f"tiny workload: {args.samples} samples, batch {args.batch_size}, "
        f"{args.workers} workers, {args.rounds} alternating rounds"
    )
    raise_rate = statistics.median(rates["raise"])
    skip_rate = statistics.median(rates["skip"])
    paired = [1 - s / r for r, s in zip(rates["raise"], rates["skip"], strict=True)]
    print(f"  loader, raise: median {raise_rate:,.0f} samples/s")
    print(f"  loader, skip:  median {skip_rate:,.0f} samples/s")
    print(
        f"  loader overhead of skip: {100 * (1 - skip_rate / raise_rate):+.2f} % of medians, "
        f"paired median {100 * statistics.median(paired):+.2f} %"
    )
    raise_cpu = statistics.median(cpu["raise"])
    skip_cpu = statistics.median(cpu["skip"])
    print(
        f"  loader CPU per sample (all processes): raise {raise_cpu:.2f} us, "
        f"skip {skip_cpu:.2f} us ({100 * (skip_cpu / raise_cpu - 1):+.2f} %)"
    )
    for label, pick in (("median", statistics.median), ("best", min)):
        raise_fetch = pick(fetch["raise"])
        skip_fetch = pick(fetch["skip"])
        print(
            f"  fetch step alone, {label} per batch: raise {raise_fetch * 1e6:.1f} us, "
            f"skip {skip_fetch * 1e6:.1f} us ({100 * (skip_fetch / raise_fetch - 1):+.2f} %)"
        )


if __name__ == "__main__":
    main()
