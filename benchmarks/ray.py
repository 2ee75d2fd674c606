"""Ray workers against local workers and torch's DataLoader: ``python -m benchmarks.ray``.

The same two workloads as the main benchmark, in one run:

* ``cpu``: about 1 ms of pure Python per sample (calibrated here, once), batches of 32;
* ``image``: uint8 3x224x224 samples, batches of 64 (9.6 MB a batch): transport bandwidth.

For each workload, three loaders with 2 workers each: aioload with 2 Ray actors
(``RayWorkers(num_cpus=1)``), aioload with 2 local worker processes, and torch's DataLoader.
All three use ``persistent_workers=True`` and are made once, so worker (actor) start is not
measured; each round takes a few batches to warm up, then counts items for ``--seconds`` of
steady state. Rounds alternate the three loaders; the figures are medians over the rounds.

**Driver ingest cost.** During the same window the parent's CPU time (``time.process_time``:
every thread of this process, Ray's core-worker threads included) is divided by the batches
received: the CPU seconds the training process spends to take in one batch. Its inverse is the
ceiling this process could ingest at if it did nothing else (batches/s, and GB/s at the
workload's batch size), which bounds how many actors one training process can feed.

Ray binds to the machine's external interface by default and this must stay on loopback: the
benchmark re-runs itself inside a private network namespace (``unshare -n``, then
``ip link set lo up``), as the Ray tests do, with a short Ray temp dir under /tmp (AF_UNIX
socket paths are limited to 107 bytes). Where no namespace can be made it stops and says why.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import IMAGE_SHAPE, CpuDataset, ImageDataset, calibrate_cpu_iters

_INSIDE = "AIOLOAD_RAY_NETNS"
_REPO = Path(__file__).resolve().parents[1]
_SECTION_START = "<!-- ray-bench:start -->"
_SECTION_END = "<!-- ray-bench:end -->"
KINDS = ("ray", "local", "torch")


@dataclass
class Row:
    """One workload and loader: medians over the rounds."""

    workload: str
    loader: str
    batch_size: int
    batch_bytes: int
    items_per_s: float
    driver_cpu_s_per_batch: float
    rounds: list[float]

    @property
    def ceiling_batches_per_s(self) -> float:
        return 1.0 / self.driver_cpu_s_per_batch if self.driver_cpu_s_per_batch > 0 else 0.0

    @property
    def ceiling_gb_per_s(self) -> float:
        return self.ceiling_batches_per_s * self.batch_bytes / 1e9


def _reexec_in_namespace(argv: list[str]) -> int:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        print("bench-ray: needs `unshare` and `ip` to make a loopback-only network namespace")
        return 2
    command = "ip link set lo up && exec " + " ".join(
        [sys.executable, "-m", "benchmarks.ray", *(_quote(a) for a in argv)]
    )
    env = {**os.environ, _INSIDE: "1", "RAY_ADDRESS": ""}
    done = subprocess.run(["unshare", "-n", "sh", "-c", command], env=env, cwd=_REPO)
    if done.returncode != 0:
        print(
            "bench-ray: the run inside `unshare -n` failed (it needs root, or use "
            "`unshare -rn`); Ray must not bind to an external interface, so it does not run "
            "outside a namespace."
        )
    return done.returncode


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _loaders(workload: str, iters: int) -> tuple[dict[str, Any], int, int]:
    import aioload

    if workload == "cpu":
        dataset: Any = CpuDataset(1_000_000, iters)
        batch_size = 32
        batch_bytes = batch_size * 8
    else:
        dataset = ImageDataset(10_000_000)
        batch_size = 64
        batch_bytes = batch_size * IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
    common: dict[str, Any] = {"batch_size": batch_size, "num_workers": 2}
    loaders: dict[str, Any] = {
        "ray": aioload.DataLoader(
            dataset,
            persistent_workers=True,
            workers=aioload.RayWorkers(num_cpus=1),
            **common,
        ),
        "local": aioload.DataLoader(dataset, persistent_workers=True, **common),
        "torch": torch.utils.data.DataLoader(dataset, persistent_workers=True, **common),
    }
    return loaders, batch_size, batch_bytes


def _measure(loader: Any, seconds: float, warmup_batches: int) -> tuple[float, float]:
    """(items/s, driver CPU s per batch) over ``seconds`` of steady state."""
    it = iter(loader)
    for _ in range(warmup_batches):
        next(it)
    items = batches = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    elapsed = 0.0
    while elapsed < seconds:
        batch = next(it)
        # Touch the batch, as the main benchmark does, then let it go.
        _ = int(batch.reshape(-1)[0])
        items += len(batch)
        batches += 1
        del batch
        elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    del it
    return items / elapsed, cpu / batches


def _run_inside(args: argparse.Namespace) -> list[Row]:
    import ray

    temp_dir = tempfile.mkdtemp(prefix="aiorb-", dir="/tmp")
    ray.init(
        num_cpus=2,
        object_store_memory=1 << 30,
        _temp_dir=temp_dir,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    rows: list[Row] = []
    try:
        iters = calibrate_cpu_iters()
        for workload in args.workloads:
            loaders, batch_size, batch_bytes = _loaders(workload, iters)
            # One untimed round first: starts every loader's workers (actors) and warms them.
            for kind in KINDS:
                _measure(loaders[kind], 0.5, 2)
            rates: dict[str, list[float]] = {k: [] for k in KINDS}
            costs: dict[str, list[float]] = {k: [] for k in KINDS}
            for round_ in range(args.rounds):
                order = KINDS if round_ % 2 == 0 else tuple(reversed(KINDS))
                for kind in order:
                    rate, cost = _measure(loaders[kind], args.seconds, 3)
                    rates[kind].append(rate)
                    costs[kind].append(cost)
                    print(
                        f"  {workload:5} {kind:5} round {round_}: {rate:10,.0f} items/s, "
                        f"driver {cost * 1e3:.3f} ms CPU/batch",
                        flush=True,
                    )
            for kind in KINDS:
                rows.append(
                    Row(
                        workload,
                        kind,
                        batch_size,
                        batch_bytes,
                        statistics.median(rates[kind]),
                        statistics.median(costs[kind]),
                        rates[kind],
                    )
                )
            for loader in (loaders["ray"], loaders["local"]):
                loader.shutdown()
            del loaders
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    return rows


def _table(rows: list[Row]) -> str:
    by = {(r.workload, r.loader): r for r in rows}
    lines = [
        "| workload | loader | items/s | vs local | driver CPU per batch | ingest ceiling |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        local = by[(row.workload, "local")].items_per_s
        ceiling = f"{row.ceiling_batches_per_s:,.0f} batches/s"
        if row.workload == "image":
            ceiling += f", {row.ceiling_gb_per_s:.1f} GB/s"
        lines.append(
            f"| {row.workload} (batch {row.batch_size}) | {row.loader} | "
            f"{row.items_per_s:,.0f} | {row.items_per_s / local:.2f}x | "
            f"{row.driver_cpu_s_per_batch * 1e3:.3f} ms | {ceiling} |"
        )
    return "\n".join(lines)


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.workload for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3))
    if len(workloads) == 1:
        axes = [axes]
    for ax, workload in zip(axes, workloads, strict=True):
        mine = [r for r in rows if r.workload == workload]
        ax.bar([r.loader for r in mine], [r.items_per_s for r in mine], color="#4477aa")
        ax.set_title(f"{workload}: items/s, 2 workers")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def _write_docs(rows: list[Row], iters: str, path: Path) -> None:
    from benchmarks import provenance

    cpu_ratio = ""
    by = {(r.workload, r.loader): r for r in rows}
    if ("cpu", "ray") in by:
        ratio = by[("cpu", "ray")].items_per_s / by[("cpu", "local")].items_per_s
        verdict = "PASS" if ratio >= 0.9 else "FAIL"
        cpu_ratio = f"Ray / local on cpu: **{ratio:.2f}x** (target >= 0.9x: {verdict}).\n\n"
    section = (
        f"{_SECTION_START}\n"
        "## Ray workers\n\n"
        "Generated by `make bench-ray` (`python -m benchmarks.ray`), inside a loopback-only "
        "network namespace, on the machine above "
        f"({os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {provenance.commit()}). 2 workers"
        " each: 2 Ray actors "
        "(`RayWorkers(num_cpus=1)`, one-node local Ray), 2 local worker processes, torch's "
        "DataLoader; persistent workers, start-up excluded; medians of alternating rounds, "
        "each >= 3 s of steady state. Compare rows within this table: they ran in one process, "
        "alternating; the shared machine's load was not the main table's.\n\n"
        f"{_table(rows)}\n\n"
        f"{cpu_ratio}"
        "**Driver CPU per batch** is the training process's CPU time (all its threads, Ray's "
        "included) per batch received; the **ingest ceiling** is its inverse: how many "
        "batches/s (and GB/s for `image`, 9.6 MB a batch) this process could take in if it "
        "did nothing else. See [Scaling](scaling.md#beyond-one-machine-workers-as-ray-actors) "
        f"for the throughput model. {iters} On `image`, a Ray actor collates into its own "
        "memory and Ray then copies the batch into the object store (the driver maps it "
        "without a copy); a local worker collates straight into shared memory.\n\n"
        "![Ray workers throughput](benchmarks_ray.png)\n"
        f"{_SECTION_END}\n"
    )
    text = path.read_text()
    if _SECTION_START in text:
        head, rest = text.split(_SECTION_START, 1)
        tail = rest.split(_SECTION_END, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ray", description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0, help="steady state per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["cpu", "image"])
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    if os.environ.get(_INSIDE) != "1":
        return _reexec_in_namespace(argv)
    rows = _run_inside(args)
    print(_table(rows))
    if args.json is not None:
        payload = [
            {
                **asdict(r),
                "ceiling_batches_per_s": r.ceiling_batches_per_s,
                "ceiling_gb_per_s": r.ceiling_gb_per_s,
            }
            for r in rows
        ]
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.docs:
        _plot(rows, _REPO / "docs" / "benchmarks_ray.png")
        _write_docs(
            rows,
            "`cpu` burns the same calibrated ~1 ms pure-Python loop per sample as the main "
            "benchmark.",
            _REPO / "docs" / "benchmarks.md",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
