"""``python -m benchmarks.sweep`` (``make bench-sweep``): how the cost grows.

Three axes, each point run by the floor (no loader), torch and aioload (sync ``for``), in fresh
processes, alternating, ``--repeats`` times (medians):

* sample size from 1 KB to 8 MB (batch of 8, 2 workers);
* batch size from 1 to 512 (1 KB samples, 2 workers);
* ``num_workers`` from 1 to 8 (16 KB samples, batch of 64) on this machine's cores, where
  oversubscription shows.

Samples are uint8 tensors cloned from a small pool (one memcpy each, ``bytes:<n>`` in
:mod:`benchmarks.workloads`). Writes ``benchmarks-sweep.{json,png}`` and the sweep section of
``benchmarks.md`` in ``--out-dir``; ``--from-json docs/benchmarks-sweep.json`` writes the
section and plot again from a sweep's JSON, measuring nothing.
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
    load = meta.get("load_average")
    lines = [
        report.SWEEP_BEGIN,
        "## How the cost grows (`make bench-sweep`)",
        "",
        f"`{report._command(meta['command']).strip()}` on {meta['date_utc']} (git {meta['git_rev']}), "
        f"{meta['cores']} cores; medians of {meta['repeats']} alternating run(s) of "
        f"{meta['min_seconds']:g} s steady state each"
        + (
            f"; load average (1, 5, 15 min) when it ended: {load}, the sweep's own processes "
            "included"
            if load
            else ""
        )
        + ". Single points are noisy; read the trends.",
        "",
        "| axis | value | batch | workers | aioload items/s (% floor) "
        "| torch items/s (% floor) | aioload / torch | floor items/s |",
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
            f"| {cell(r['aioload'])} | {cell(r['torch'])} | {report.fmt_ratio(ratio)} "
            f"| {report.fmt_ips(floor)} |"
        )
    lines += [
        "",
        f"![items/s and % of floor along each axis]({png_name})",
        "",
        "Reading it:",
        "",
        "- **Small batches** (batch size 1-8, or small samples): the fixed cost of each batch "
        "dominates. Every batch is a round trip between the training process and a worker (a "
        "task written to the worker's socket, an answer read back, a slab's lease decoded), so "
        "aioload, like torch, stays far below a floor that sends nothing anywhere. Larger "
        "batches amortize it: where the cost goes is in "
        "[Benchmark notes](benchmark-notes.md#where-the-parents-time-goes).",
        "- **Large samples** (128 KB and more): the floor is bound by memory bandwidth, and so "
        "is aioload, whose workers copy each large sample into its place in the batch's shared "
        "memory as the dataset returns it. The floor is measured at another moment than the "
        "loaders, on a machine whose memory bandwidth varies from minute to minute, so a point "
        "can land above 100%.",
        "- **More workers than cores**: every process also waits for a core, the training "
        "process among them, which has to run once per batch.",
        "",
        report.SWEEP_END,
    ]
    return "\n".join(lines)


def write_png(path: Path, results: list[dict[str, Any]]) -> None:
    """Items/s (top) and % of the floor (bottom) along each axis, sized to be shown at its own
    width in the docs' text column (about 870 px)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_names = list(dict.fromkeys(r["axis"] for r in results))
    fig, axes = plt.subplots(2, len(axes_names), figsize=(8.6, 6.4), dpi=100, squeeze=False)
    for col, axis in enumerate(axes_names):
        of = [r for r in results if r["axis"] == axis]
        xs = [r["x"] for r in of]
        top, bottom = axes[0][col], axes[1][col]
        for loader in LOADERS:
            top.plot(xs, [r[loader] for r in of], marker="o", label=loader, color=_COLOURS[loader])
        for loader in ("aioload", "torch"):
            bottom.plot(
                xs,
                [100 * r[loader] / r["floor"] if r["floor"] > 0 else math.nan for r in of],
                marker="o",
                label=loader,
                color=_COLOURS[loader],
            )
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [_label(axis, x) for x in xs], fontsize=9, rotation=30)
            ax.minorticks_off()
            ax.tick_params(axis="y", labelsize=9)
            ax.set_xlabel(axis, fontsize=10)
        top.set_yscale("log")
        top.minorticks_off()
        bottom.set_ylim(bottom=0)
        if col == 0:
            top.set_ylabel("items/s", fontsize=10)
            bottom.set_ylabel("% of floor", fontsize=10)
            top.legend(fontsize=9)
    fig.suptitle("aioload vs torch vs the no-loader floor", fontsize=12)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _write(out_dir: Path, meta: dict[str, Any], results: list[dict[str, Any]]) -> list[Path]:
    png, md = out_dir / "benchmarks-sweep.png", out_dir / "benchmarks.md"
    write_png(png, results)
    text = md.read_text() if md.exists() else "# Benchmarks\n"
    md.write_text(report.replace_block(text, render_block(results, meta, png.name)))
    return [md, png]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--min-seconds", type=float, default=3.0)
    p.add_argument("--quick", action="store_true", help="every other point (a smoke run)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out-dir", type=Path, default=Path("docs"))
    p.add_argument("--no-write", action="store_true")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="measure nothing: write the section and plot again from this sweep's JSON",
    )
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.from_json is not None:
        payload = json.loads(a.from_json.read_text())
        for path in _write(a.from_json.parent, payload["meta"], payload["points"]):
            print(f"wrote {path}")
        return 0
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
        "load_average": _load_average(),
    }
    if not a.no_write:
        a.out_dir.mkdir(parents=True, exist_ok=True)
        js = a.out_dir / "benchmarks-sweep.json"
        js.write_text(json.dumps({"meta": meta, "points": results}, indent=2) + "\n")
        for path in [*_write(a.out_dir, meta, results), js]:
            print(f"wrote {path}")
    failed = sum(1 for r in results for loader in LOADERS if math.isnan(r[loader]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
