"""``python -m benchmarks.sweep`` (``make bench-sweep``): how the cost grows.

Three axes, each point run by the floor (no loader), torch and aioload (sync ``for``), in fresh
processes, alternating, ``--repeats`` times (medians):

* sample size from 1 KB to 8 MB (batch of 8, 2 workers);
* batch size from 1 to 512 (1 KB samples, 2 workers);
* ``num_workers`` from 1 to 8 (16 KB samples, batch of 64) on this machine's cores, where
  oversubscription shows.

Samples are uint8 tensors cloned from a small pool (one memcpy each, ``bytes:<n>`` in
:mod:`benchmarks.workloads`). Writes ``benchmarks-sweep.{json,png}`` and the sweep section of
``benchmarks.md`` in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import report, startup
from benchmarks.runner import run_child

LOADERS = ("floor", "torch", "aioload")
_COLOURS = {"floor": "tab:gray", "torch": "tab:orange", "aioload": "tab:blue"}

KB = 1024
SAMPLE_BYTES = (1 * KB, 16 * KB, 128 * KB, 1024 * KB, 8 * 1024 * KB)
BATCH_SIZES = (1, 8, 64, 512)
NUM_WORKERS = (1, 2, 4, 8)


def points(quick: bool) -> list[dict[str, Any]]:
    """(axis, x, sample bytes, batch size, workers) for every point of the sweep."""
    out: list[dict[str, Any]] = []
    for nbytes in SAMPLE_BYTES[::2] if quick else SAMPLE_BYTES:
        out.append({"axis": "sample size", "x": nbytes, "nbytes": nbytes, "batch": 8, "nw": 2})
    for batch in BATCH_SIZES[::2] if quick else BATCH_SIZES:
        out.append({"axis": "batch size", "x": batch, "nbytes": KB, "batch": batch, "nw": 2})
    for nw in NUM_WORKERS[:2] if quick else NUM_WORKERS:
        out.append({"axis": "num_workers", "x": nw, "nbytes": 16 * KB, "batch": 64, "nw": nw})
    return out


def _label(axis: str, x: int) -> str:
    if axis != "sample size":
        return str(x)
    return f"{x // (1024 * KB)} MB" if x >= 1024 * KB else f"{x // KB} KB"


def run_point(point: dict[str, Any], loader: str, min_seconds: float, timeout: float) -> float:
    args = [
        "--loader",
        loader,
        "--mode",
        "sync",
        "--workload",
        f"bytes:{point['nbytes']}",
        "--size",
        str(50_000_000),  # virtual: samples are clones of a small pool; runs stop on time
        "--batch-size",
        str(point["batch"]),
        "--num-workers",
        str(point["nw"]),
        "--min-seconds",
        repr(min_seconds),
    ]
    outcome = run_child(args, timeout_s=timeout, env=startup.child_env())
    if not outcome.ok:
        print(f"    {loader} FAILED: {outcome.error}", flush=True)
        return math.nan
    return float(outcome.result["items_per_s"])


def _load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def render_block(results: list[dict[str, Any]], meta: dict[str, Any], png_name: str) -> str:
    lines = [
        report.SWEEP_BEGIN,
        "## How the cost grows (`make bench-sweep`)",
        "",
        f"`{meta['command']}` on {meta['date_utc']} (git {meta['git_rev']}), "
        f"{meta['cores']} cores; medians of {meta['repeats']} alternating run(s) of "
        f"{meta['min_seconds']:g} s steady state each; load average (1, 5, 15 min) when "
        f"it ended: {_load_average()}, the sweep's own processes included. Single points are "
        "noisy; read the trends.",
        "",
        "| axis | value | batch | workers | floor items/s | torch items/s (% floor) "
        "| aioload items/s (% floor) | aioload / torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        floor = r["floor"]

        def cell(v: float, floor: float = floor) -> str:
            pct = f" ({100 * v / floor:.0f}%)" if floor > 0 and not math.isnan(v) else ""
            return report.fmt_ips(v) + pct

        ratio = r["aioload"] / r["torch"] if r["torch"] > 0 else math.nan
        lines.append(
            f"| {r['axis']} | {_label(r['axis'], r['x'])} | {r['batch']} | {r['nw']} "
            f"| {report.fmt_ips(floor)} | {cell(r['torch'])} | {cell(r['aioload'])} "
            f"| {report.fmt_ratio(ratio)} |"
        )
    lines += [
        "",
        f"![items/s and % of floor along each axis]({png_name})",
        "",
        "Reading it. Where batches are small (batch size 1-8, or small samples), the fixed "
        "cost per batch dominates, and aioload, like torch, sits far below a floor that sends "
        "nothing anywhere: every batch is a round trip (a task written to the worker's socket, "
        "a reply read back, a slab lease decoded). The profiles (py-spy on the `tiny` "
        "workload and at batch size 1; `python -m benchmarks.parent_profile`, see "
        "[Where the parent's time goes](architecture.md#where-the-parents-time-goes)) put the "
        "hot frames in `ParentChannel.pump_out` (the `send` that wakes a sleeping worker), "
        "`ParentChannel._split` (reading the reply, packed with `struct` since this round "
        "where its leaves are contiguous tensors) and `SlabMappings.decode` in the "
        "parent, and in the worker's wait for its next task (`_ProcessWorker._next_message`). "
        "What was ours to fix there is fixed: the sync front end's event-loop step per wait, "
        "a socket-mode switch and an extra poll around every worker read, a pickler per reply, "
        "a failing `recvmsg` per parent read, and (this round) a second `send` and frame per "
        "batch for the slab the consumer had just freed (it rides on the worker's next task "
        "now), a `select` before each wait that found nothing, and the numpy and torch arrays "
        "a batch's leaves were made through. What remains is mostly the price of each "
        "wake-up: the parent sleeps until the next answer and runs its few dozen Python calls "
        "with cold caches, on cores it shares with the workers. With more workers than cores, "
        "every process also waits for a core, and the parent, which must run once per batch, "
        "is one of them. At the large-sample end (128 KB-8 MB) the floor is bound by memory "
        "bandwidth. aioload's workers stack into slabs that rotate (one the consumer holds or "
        "waiting its turn, one being written), which are cache-cold when reused, where the "
        "floor refills one warm buffer: stacking 64 images took 733 us into 4 rotating slabs "
        "against 378 us into one buffer, measured in isolation. Since 2026-11-25 a worker "
        "copies each sample of 128 KiB or more into its row of the slab as the dataset "
        "returns it, and lets go of it before the next is made (`aioload._worker.stacking`), so a "
        "batch's samples no longer pile up beside the slabs and each is made in the bytes "
        "of the one before: the floor still holds a whole batch of samples before it stacks "
        "them. A worker takes the slab freed last (the warmest), takes it only when a batch "
        "first needs it, and waits briefly for a large slab's free rather than make a third "
        "(`WorkerSlabPool.acquire`; one worker in two used to rotate three). Both the workers and the "
        "floor keep a batch's freed samples in the heap (`aioload._worker.heap`): glibc gave them "
        "back to the kernel in some runs, and every batch faulted them in again (the "
        "2026-11-23 sweep had 8 MB samples at 43% of the floor). Each point is one run "
        "against a floor measured at another moment, on a machine whose memory bandwidth "
        "varies from minute to minute: a point can even land above 100%.",
        "",
        report.SWEEP_END,
    ]
    return "\n".join(lines)


def write_png(path: Path, results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_names = list(dict.fromkeys(r["axis"] for r in results))
    fig, axes = plt.subplots(2, len(axes_names), figsize=(4.2 * len(axes_names), 6.4), dpi=110)
    for col, axis in enumerate(axes_names):
        of = [r for r in results if r["axis"] == axis]
        xs = [r["x"] for r in of]
        top, bottom = axes[0][col], axes[1][col]
        for loader in LOADERS:
            top.plot(xs, [r[loader] for r in of], marker="o", label=loader, color=_COLOURS[loader])
        for loader in ("torch", "aioload"):
            bottom.plot(
                xs,
                [100 * r[loader] / r["floor"] if r["floor"] > 0 else math.nan for r in of],
                marker="o",
                label=loader,
                color=_COLOURS[loader],
            )
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [_label(axis, x) for x in xs], fontsize=7)
            ax.set_xlabel(axis)
        top.set_yscale("log")
        top.set_ylabel("items/s")
        bottom.set_ylabel("% of floor")
        bottom.set_ylim(bottom=0)
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
    fig.suptitle("aioload vs torch vs the no-loader floor", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--min-seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="every other point (a smoke run)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out-dir", type=Path, default=Path("docs"))
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    startup.compile_package()
    machine = report.machine_info()
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    for point in points(a.quick):
        measured: dict[str, list[float]] = {loader: [] for loader in LOADERS}
        for _ in range(a.repeats):
            for loader in LOADERS:
                measured[loader].append(run_point(point, loader, a.min_seconds, a.timeout))
        row = dict(point)
        for loader in LOADERS:
            good = [v for v in measured[loader] if not math.isnan(v)]
            row[loader] = statistics.median(good) if good else math.nan
        results.append(row)
        print(
            f"{point['axis']:<12} {_label(point['axis'], point['x']):>6} batch {point['batch']:>3} "
            f"workers {point['nw']}: floor {report.fmt_ips(row['floor']):>10}  torch "
            f"{report.fmt_ips(row['torch']):>10}  aioload {report.fmt_ips(row['aioload']):>10}",
            flush=True,
        )
    meta = {
        "command": "python -m benchmarks.sweep " + " ".join(sys.argv[1:] if argv is None else argv),
        "date_utc": machine["date_utc"],
        "git_rev": machine["git_rev"],
        "cores": machine["usable_cores"],
        "repeats": a.repeats,
        "min_seconds": a.min_seconds,
        "elapsed_s": time.monotonic() - t0,
    }
    if not a.no_write:
        a.out_dir.mkdir(parents=True, exist_ok=True)
        js, png, md = (
            a.out_dir / n
            for n in ("benchmarks-sweep.json", "benchmarks-sweep.png", "benchmarks.md")
        )
        js.write_text(json.dumps({"meta": meta, "points": results}, indent=2) + "\n")
        write_png(png, results)
        text = md.read_text() if md.exists() else "# Benchmarks\n"
        md.write_text(report.replace_block(text, render_block(results, meta, png.name)))
        for path in (md, js, png):
            print(f"wrote {path}")
    failed = sum(1 for r in results for loader in LOADERS if math.isnan(r[loader]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
