"""Many cores, one command (``make bench-cores``): at 2, 4, 8 and 14 workers, the floor,
aioload and torch on ``tiny``, ``image`` and the uneven workload (``benchmarks.uneven``), with
aioload's own view of each run from ``loader.stats()``: the workers' busy share and the
answers waiting in order.

Each run is a fresh process (``benchmarks._one``, as ``make bench`` runs them; the uneven
workload's from ``benchmarks.uneven``), one round, the loaders alternating per worker count.
Made for a 16-core machine, where it takes about 4 minutes (the floor runs first at each worker
count and sizes the loaders' datasets, so that one epoch outlasts the steady state); it writes
``docs/benchmarks-cores.json`` and the "Many cores, measured" section of docs/benchmarks.md.

    python -m benchmarks.cores                      # the full run
    python -m benchmarks.cores --quick --no-write   # a smoke run on any machine (about a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import provenance, startup, uneven
from benchmarks.runner import run_child
from benchmarks.workloads import WORKLOADS

WORKERS = (2, 4, 8, 14)
WORKLOADS_MEASURED = ("tiny", "image")
# "unordered": aioload with in_order=False, which no late batch holds up: where it reaches the
# floor and in order does not, the line (and the slowest worker, whose turn comes round with
# torch's round robin) is what in order waits for, not the parent.
LOADERS = ("floor", "aioload", "unordered", "torch")
# An epoch lasts the steady state and this much more, at the floor's rate (start-up, a slower
# loader's first seconds).
EPOCH_MARGIN_S = 2.0
BEGIN, END = "<!-- cores:start (make bench-cores writes this section) -->", "<!-- cores:end -->"


def _size(workload: str, args: Any, floor_rate: float | None) -> int:
    """The dataset's length: one epoch outlasts the steady state even at the floor's rate, so
    that a run measures one pass, as on 2 cores (without persistent workers, each new epoch
    starts the workers again, which the floor's processes never do)."""
    spec = WORKLOADS[workload]
    size = max(spec.batch_size * 8, int(spec.default_size * args.scale))
    if floor_rate:
        size = max(size, int(floor_rate * (args.min_seconds + EPOCH_MARGIN_S)))
    return size


def _child_loader(loader: str) -> str:
    """The loader a row's child runs: "unordered" is aioload with in_order=False."""
    return "aioload" if loader == "unordered" else loader


def _one(loader: str, workload: str, workers: int, args: Any, size: int) -> dict[str, Any]:
    spec = WORKLOADS[workload]
    child = [
        "--loader",
        _child_loader(loader),
        "--mode",
        "sync",
        "--workload",
        workload,
        "--size",
        str(size),
        "--batch-size",
        str(spec.batch_size),
        "--num-workers",
        str(workers),
        "--min-seconds",
        repr(args.min_seconds),
        *(["--out-of-order"] if loader == "unordered" else []),
    ]
    outcome = run_child(child, timeout_s=args.timeout, env=startup.child_env())
    if not outcome.ok:
        return {"error": outcome.error}
    result = outcome.result
    return {
        "size": size,
        "epochs": result.get("epochs"),
        "items_per_s": result["items_per_s"],
        "parent_cpu_per_batch_s": result.get("parent_cpu_per_batch_s"),
        **(result.get("loader_stats") or {}),
    }


def _uneven(loader: str, workers: int, args: Any) -> dict[str, Any]:
    config = {
        "loader": _child_loader(loader),
        "in_order": loader != "unordered",
        "workers": workers,
        "sigma": args.sigma,
    }
    return uneven.child(config, args)


def measure(args: Any) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    loaders = [name for name in LOADERS[1:] if name in args.loaders]
    for workers in args.workers:
        for workload in args.workloads:
            # The floor first (it sizes the others' dataset); the loaders alternate.
            floor = _one("floor", workload, workers, args, _size(workload, args, None))
            rows.append({"workload": workload, "workers": workers, "loader": "floor", **floor})
            _print(rows[-1])
            size = _size(workload, args, floor.get("items_per_s"))
            for loader in loaders if workers % 4 == 0 else loaders[::-1]:
                result = _one(loader, workload, workers, args, size)
                rows.append({"workload": workload, "workers": workers, "loader": loader, **result})
                _print(rows[-1])
        for loader in loaders:
            result = _uneven(loader, workers, args)
            name = f"uneven (sigma={args.sigma:g})"
            rows.append({"workload": name, "workers": workers, "loader": loader, **result})
            _print(rows[-1])
    return {
        "command": " ".join(["python -m benchmarks.cores", *args.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        # A copy of the tree without .git (a borrowed machine's) is named by --commit.
        "commit": args.commit or provenance.commit(),
        "machine": provenance.machine(),
        "cores": os.cpu_count(),
        "seconds": time.monotonic() - started,
        "quick": args.quick,
        "rows": rows,
    }


def _print(row: dict[str, Any]) -> None:
    what = row.get("error") or (
        f"{row['share']:.0%} of the floor"
        if "share" in row
        else f"{row['items_per_s']:,.0f} items/s"
    )
    busy = row.get("busy_share")
    extra = (
        ""
        if busy is None
        else f", busy {busy:.0%} (least {row['busy_min'] or 0:.0%}), "
        f"waiting {row['waiting_in_order_mean']:.1f}"
    )
    print(f"{row['workers']:>3} workers {row['workload']:<20} {row['loader']:<8} {what}{extra}")
    sys.stdout.flush()


def shares(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per (workload, workers): each loader as a share of the floor."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for row in result["rows"]:
        found.setdefault((row["workload"], row["workers"]), {})[row["loader"]] = row
    lines = []
    for (workload, workers), by in found.items():
        floor = by.get("floor", {}).get("items_per_s")
        line: dict[str, Any] = {"workload": workload, "workers": workers, "floor": floor}
        for loader in LOADERS[1:]:
            row = by.get(loader, {})
            if "share" in row:
                line[loader] = row["share"]
            elif floor and row.get("items_per_s"):
                line[loader] = row["items_per_s"] / floor
        aio = by.get("aioload", {})
        line["busy_share"] = aio.get("busy_share")
        line["busy_min"] = aio.get("busy_min")
        line["waiting_in_order_mean"] = aio.get("waiting_in_order_mean")
        lines.append(line)
    return lines


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def table(result: dict[str, Any]) -> str:
    out = [
        "| workload | workers | floor (items/s) | aioload | aioload, `in_order=False` | torch "
        "| aioload's workers busy (least, mean) | waiting in order (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for line in shares(result):
        floor = (
            "num_workers / mean sample time" if line["floor"] is None else f"{line['floor']:,.0f}"
        )
        wait = line["waiting_in_order_mean"]
        out.append(
            f"| {line['workload']} | {line['workers']} | {floor} | {_pct(line.get('aioload'))} "
            f"| {_pct(line.get('unordered'))} | {_pct(line.get('torch'))} "
            f"| {_pct(line['busy_min'])}, {_pct(line['busy_share'])} "
            f"| {'-' if wait is None else f'{wait:.1f}'} |"
        )
    return "\n".join(out)


def _run_lines(result: dict[str, Any]) -> list[str]:
    return [
        f"On {_machine_words(result)}, with the code of commit {result.get('commit', '?')}, "
        f"{result.get('date', 'date not recorded')}; one round, each run a fresh process, in "
        f"{result['seconds'] / 60:.1f} minutes (`{result['command']}`):",
        "",
        table(result),
        "",
    ]


def section(*results: dict[str, Any]) -> str:
    """The page's section: each run (one, or several that measured different loaders) with
    its machine, date, commit and command."""
    lines = [
        BEGIN,
        "## Many cores, measured (`make bench-cores`)",
        "",
        "Each loader as a share of its workload's floor (for tiny and image, `num_workers` "
        "processes that only make and stack the samples; for the uneven workload, the "
        "samples' total sleep over `num_workers`), with aioload's workers' busy share (the "
        "least busy worker's, and the mean) and the answers waiting in order, from "
        "`loader.stats()` of its in-order run.",
        "",
    ]
    for result in results:
        lines += _run_lines(result)
    return "\n".join([*lines[:-1], END])


def _machine_words(result: dict[str, Any]) -> str:
    machine = result.get("machine")
    if not machine:
        return f"{result['cores']} cores"
    return provenance.describe(machine)


def write_docs(path: Path, *results: dict[str, Any]) -> None:
    uneven.write_section(path, section(*results), BEGIN, END)


def parse_args(argv: list[str]) -> Any:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cores", description=__doc__)
    p.add_argument("--quick", action="store_true", help="2 and 4 workers, short runs")
    p.add_argument("--workers", default=",".join(map(str, WORKERS)))
    p.add_argument("--workloads", default=",".join(WORKLOADS_MEASURED))
    p.add_argument("--loaders", default=",".join(LOADERS), help="of " + ", ".join(LOADERS))
    p.add_argument("--scale", type=float, default=0.25, help="dataset sizes (x each default)")
    p.add_argument("--min-seconds", type=float, default=3.0, help="steady state per run")
    p.add_argument("--sigma", type=float, default=1.0, help="the uneven workload's spread")
    p.add_argument("--per-worker", type=int, default=300, help="uneven samples per worker")
    p.add_argument("--mean-ms", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    p.add_argument("--json", type=Path, default=Path("docs/benchmarks-cores.json"))
    p.add_argument("--docs", type=Path, default=Path("docs/benchmarks.md"))
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--commit", default="", help="the code's commit, where the tree has no .git")
    args = p.parse_args(argv)
    args.argv = argv
    args.aioload_root = None
    if args.quick:
        args.scale, args.min_seconds, args.per_worker = 0.02, 0.3, 20
        if "--workers" not in argv:
            args.workers = "2,4"
    args.workers = [int(w) for w in str(args.workers).split(",")]
    args.workloads = str(args.workloads).split(",")
    args.loaders = str(args.loaders).split(",")
    if "floor" not in args.loaders:
        p.error("--loaders: the floor runs always (it sizes the others)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = measure(args)
    print()
    print(table(result))
    print(f"\n{result['seconds']:.0f} s on {result['cores']} cores")
    if not args.no_write:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        write_docs(args.docs, result)
    return 1 if any("error" in row for row in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
