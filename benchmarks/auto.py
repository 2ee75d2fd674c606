"""``make bench-auto``: "auto" against a grid of hand-set numbers and torch's defaults.

For each workload (tiny, image, cpu, latency, http) this runs, in one session and alternating
(each round in a rotated order, so no setting always runs first or last):

- aioload with ``num_workers="auto"``, ``prefetch_factor="auto"`` and, for the async datasets
  (latency, http), ``worker_concurrency="auto"``;
- aioload with each (num_workers, prefetch_factor, worker_concurrency) of a small grid;
- torch's DataLoader with torch's defaults (``DataLoader(ds, batch_size=B)``: no workers).

Each run is a fresh process (``benchmarks._one``'s measurement, steady-state items/s from the
first batch on, so the controller's first moves count against it), with its process tree's
peak RSS sampled. The report gives the medians, and checks that auto reaches at least 90 % of
the grid's best and is never below torch's defaults. Writes docs/benchmarks-auto.md and .json.

    python -m benchmarks.auto [--rounds 3] [--min-seconds 3] [--workloads tiny,image]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import _one
from benchmarks import report as report_module
from benchmarks.runner import run_child
from benchmarks.workloads import LATENCY_S, WORKLOADS, calibrate_cpu_iters

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
WORKLOAD_NAMES = ("tiny", "image", "cpu", "latency", "http")
ASYNC_WORKLOADS = ("latency", "http")
# Small enough that every run of every workload fits in about 15 minutes on 2 cores.
SYNC_GRID: tuple[tuple[int, int, int], ...] = ((1, 2, 1), (2, 2, 1), (2, 4, 1), (3, 2, 1))
ASYNC_GRID: tuple[tuple[int, int, int], ...] = ((1, 2, 32), (2, 2, 8), (2, 2, 32), (2, 4, 64))
# Dataset sizes: one epoch outlasts a run (latency and http are slow under torch's defaults,
# which run one sample at a time; their runs stop at min_seconds mid-epoch).
SIZES = {"tiny": 4_000_000, "image": 400_000, "cpu": 20_000, "latency": 16_384, "http": 8_192}
TARGET_OF_BEST = 0.90


def _settings(workload: str) -> list[dict[str, Any]]:
    """Every setting one workload runs: auto first, then the grid, then torch's defaults."""
    is_async = workload in ASYNC_WORKLOADS
    auto: dict[str, Any] = {"num_workers": "auto", "prefetch_factor": "auto"}
    if is_async:
        auto["worker_concurrency"] = "auto"
    settings = [{"name": "auto", "loader": "aioload", "kwargs": auto}]
    for workers, depth, concurrency in ASYNC_GRID if is_async else SYNC_GRID:
        kwargs: dict[str, Any] = {"num_workers": workers, "prefetch_factor": depth}
        if is_async:
            kwargs["worker_concurrency"] = concurrency
        name = f"{workers}w x{depth}" + (f" c{concurrency}" if is_async else "")
        settings.append({"name": name, "loader": "aioload", "kwargs": kwargs})
    settings.append({"name": "torch defaults", "loader": "torch", "kwargs": {}})
    return settings


# -- the child: one run -----------------------------------------------------------------------

_LOADERS: list[Any] = []


def _child(spec: dict[str, Any]) -> int:
    """One measured run (in a fresh process): benchmarks._one's measurement, with this
    setting's DataLoader arguments; prints its JSON, with the controller's final report."""
    extra: dict[str, Any] = spec["kwargs"]

    def make_loader(cfg: _one.RunConfig, dataset: object) -> Any:
        cls = _one.resolve_loader(cfg.loader)
        workload = WORKLOADS[cfg.workload]
        kwargs = workload.loader_kwargs(on_aioload=cfg.loader == "aioload")
        kwargs.update(extra)
        loader = cls(dataset, batch_size=cfg.batch_size, **kwargs)
        _LOADERS.append(loader)
        return loader

    _one._make_loader = make_loader
    cfg = _one.RunConfig(
        loader=spec["loader"],
        mode="sync",
        workload=spec["workload"],
        size=spec["size"],
        batch_size=WORKLOADS[spec["workload"]].batch_size,
        num_workers=0,  # (unused: the setting's own arguments above)
        cpu_iters=spec["cpu_iters"],
        min_seconds=spec["min_seconds"],
        max_epochs=3,
        url=spec.get("url", ""),
    )
    result = _one.measure(cfg)
    tuning = None
    if _LOADERS and hasattr(_LOADERS[-1], "stats"):
        tuning = _LOADERS[-1].stats().as_dict().get("tuning")
    result["tuning"] = tuning
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


# -- the driver -------------------------------------------------------------------------------


def _choice(tuning: dict[str, Any] | None) -> str:
    if not tuning:
        return "-"
    parts = [
        f"{tuning['num_workers']['value']}w",
        f"x{tuning['prefetch_factor']['value']}",
    ]
    if tuning["worker_concurrency"]["auto"]:
        parts.append(f"c{tuning['worker_concurrency']['value']}")
    return " ".join(parts) + f", {len(tuning['changes'])} changes"


def _run(
    workload: str,
    setting: dict[str, Any],
    args: argparse.Namespace,
    cpu_iters: int,
    url: str,
) -> dict[str, Any]:
    spec = {
        "workload": workload,
        "loader": setting["loader"],
        "kwargs": setting["kwargs"],
        "size": SIZES[workload],
        "cpu_iters": cpu_iters,
        "min_seconds": args.min_seconds,
        "url": url,
    }
    outcome = run_child(
        ["--child", json.dumps(spec)], timeout_s=60 + 4 * args.min_seconds, module="benchmarks.auto"
    )
    run = {
        "ok": outcome.ok,
        "error": outcome.error,
        "peak_tree_rss_bytes": outcome.peak_tree_rss_bytes,
        "wall_s": outcome.wall_s,
    }
    if outcome.ok:
        result = outcome.result
        run["items_per_s"] = result["items_per_s"]
        run["ttfb_s"] = result["ttfb_s"]
        run["tuning"] = result.get("tuning")
    return run


def _summarise(workload: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for name, got in runs.items():
        ok = [r for r in got if r["ok"]]
        rows[name] = {
            "items_per_s": statistics.median(r["items_per_s"] for r in ok) if ok else None,
            "peak_rss_mib": (
                statistics.median(r["peak_tree_rss_bytes"] for r in ok) / 2**20 if ok else None
            ),
            "runs": len(ok),
            "failed": [r["error"] for r in got if not r["ok"]],
            "choice": _choice(ok[-1].get("tuning")) if ok and name == "auto" else None,
        }
    grid = {
        n: r
        for n, r in rows.items()
        if n not in ("auto", "torch defaults") and r["items_per_s"] is not None
    }
    best = max(grid, key=lambda n: grid[n]["items_per_s"]) if grid else None
    auto = rows["auto"]["items_per_s"]
    torch_default = rows["torch defaults"]["items_per_s"]
    of_best = auto / grid[best]["items_per_s"] if auto and best else None
    of_torch = auto / torch_default if auto and torch_default else None
    return {
        "workload": workload,
        "rows": rows,
        "best": best,
        "auto_of_best": of_best,
        "auto_of_torch_defaults": of_torch,
        "pass": bool(of_best is not None and of_best >= TARGET_OF_BEST and (of_torch or 0) >= 1),
    }


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def _when(machine: dict[str, Any]) -> str:
    """When and at which commit the run was made, as its JSON recorded them."""
    if "date_utc" not in machine:
        return str(machine.get("provenance", "(date and commit not recorded)"))
    return f"on {machine['date_utc']} at commit {machine['git_rev']}"


def _markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        "# Benchmarks: auto against hand-set numbers",
        "",
        f"`make bench-auto` {_when(machine)}, on {machine['cores']} usable cores "
        f"({machine.get('cpu_model', 'CPU not recorded')}; {machine['platform']}; "
        f"load average {machine.get('load_average', '-')}, the machine's other jobs included), "
        f"{report['rounds']} alternating rounds, {report['min_seconds']} s of steady state "
        "per run, each run a fresh process; medians. items/s counts from the first batch on, "
        "so the controller's first moves count against auto. Peak RSS is the run's process "
        "tree (parent and workers). These runs are shorter than `make bench`'s and count the "
        "controller's start, so compare figures within this page; the benchmarks page has the "
        "steady-state figures of each loader, from its own run.",
        "",
        "The grid (num_workers x prefetch_factor, and worker_concurrency for the async "
        "datasets): "
        + ", ".join(report["grid"]["sync"])
        + "; async: "
        + ", ".join(report["grid"]["async"])
        + ". torch defaults: torch's DataLoader with "
        "`batch_size` only (no workers).",
        "",
        "| workload | auto items/s | auto's choice | best of grid | items/s | auto / best | "
        "auto / torch defaults | on target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    memory = [
        "",
        "Peak memory of the process tree, and torch's defaults' items/s:",
        "",
        "| workload | RSS auto | RSS best of grid | torch defaults items/s |",
        "|---|---|---|---|",
    ]
    for row in report["workloads"]:
        rows = row["rows"]
        best = row["best"]
        auto = rows["auto"]
        best_row = rows[best] if best else {"items_per_s": None, "peak_rss_mib": None}
        lines.append(
            f"| {row['workload']} | {_rate(auto['items_per_s'])} | {auto['choice'] or '-'} | "
            f"{best or '-'} | {_rate(best_row['items_per_s'])} | "
            f"{_pct(row['auto_of_best'])} | {_times(row['auto_of_torch_defaults'])} | "
            f"{'yes' if row['pass'] else 'no'} |"
        )
        memory.append(
            f"| {row['workload']} | {_mib(auto['peak_rss_mib'])} | "
            f"{_mib(best_row['peak_rss_mib'])} | {_rate(rows['torch defaults']['items_per_s'])} |"
        )
    lines += memory
    lines += [
        "",
        f"On target: auto reaches {TARGET_OF_BEST:.0%} of the grid's best and is not below "
        "torch's defaults. The full runs, every grid setting's median and each auto run's changes are "
        "in docs/benchmarks-auto.json.",
        "",
        "Every setting, items/s (median):",
        "",
    ]
    for row in report["workloads"]:
        cells = ", ".join(f"{name} {_rate(r['items_per_s'])}" for name, r in row["rows"].items())
        lines.append(f"- {row['workload']}: {cells}")
    lines += [
        "",
        "Round by round: each round runs every setting once, one after another, so a run of "
        "auto and the same round's run of another setting met nearly the same machine. Auto's "
        "ratio to the best setting's run and to torch's defaults' run in its round, median "
        "over the rounds (lowest to highest):",
        "",
    ]
    for row in report["workloads"]:
        runs = row.get("runs", {})
        paired = [
            f"{_paired(runs, name)} of {name}"
            for name in (row["best"], "torch defaults")
            if name is not None
        ]
        lines.append(f"- {row['workload']}: " + ", ".join(paired))
    lines.append("")
    return "\n".join(lines)


def _paired(runs: dict[str, list[dict[str, Any]]], other: str) -> str:
    """Median (lowest-highest) over the rounds of auto's items/s over ``other``'s, in the same
    round; rounds where either run failed are left out."""
    ratios = [
        a["items_per_s"] / b["items_per_s"]
        for a, b in zip(runs.get("auto", []), runs.get(other, []), strict=False)
        if a["ok"] and b["ok"] and b["items_per_s"]
    ]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MiB"


# -- the floor share at many workers, modelled from a small machine ----------------------------

# The no-loader floor on a 16-core machine (one thread per core), items/s by process count:
# image measured at 2, 4, 8 and 14 processes; tiny at 14 (its per-process cost, 3.5 us a
# sample, scaled linearly below that: tiny's samples are too small to meet memory bandwidth).
FLOOR_16 = {
    "image": {2: 78e3, 4: 166e3, 8: 301e3, 14: 297e3},
    "tiny": {2: 2 / 3.5e-6, 4: 4 / 3.5e-6, 8: 8 / 3.5e-6, 14: 4.0e6},
}


def _one_run(workload: str, loader: str, workers: int, min_seconds: float) -> dict[str, Any]:
    args = [
        "--loader",
        loader,
        "--mode",
        "sync",
        "--workload",
        workload,
        "--size",
        str(SIZES[workload]),
        "--batch-size",
        str(WORKLOADS[workload].batch_size),
        "--num-workers",
        str(workers),
        "--min-seconds",
        str(min_seconds),
    ]
    outcome = run_child(args, timeout_s=60 + 4 * min_seconds)
    if not outcome.ok:
        raise RuntimeError(f"{workload} {loader} {workers}: {outcome.error}")
    return outcome.result


def model_inputs(rounds: int, min_seconds: float) -> dict[str, dict[str, float]]:
    """On this machine, per workload (medians of alternating runs):

    - ``parent_us``: the parent's CPU per batch with 2 workers (``parent_cpu_per_batch_s``);
    - ``worker_cpu_us``: one worker's CPU per sample (aioload with 1 worker), and
      ``floor_cpu_us``: one floor process's;
    - ``over_us``: their difference, what a worker spends per sample beyond the floor's work
      (the task's decode, the slab, the answer). CPU time, not 1 / items/s: on a machine
      whose cores other jobs share, a process's wall time per sample is mostly how long it
      waited for a core, and the difference of two such times is noise;
    - ``worker_wall_us`` and ``floor_wall_us``: 1 / items/s of the same runs, for reference."""
    inputs: dict[str, dict[str, float]] = {}
    for workload in ("tiny", "image"):
        got: dict[str, list[float]] = {
            "parent_us": [],
            "worker_cpu_us": [],
            "floor_cpu_us": [],
            "worker_wall_us": [],
            "floor_wall_us": [],
        }
        for _ in range(rounds):
            floor = _one_run(workload, "floor", 1, min_seconds)
            got["floor_cpu_us"].append(floor["worker_cpu_per_item_s"] * 1e6)
            got["floor_wall_us"].append(1e6 / floor["items_per_s"])
            one = _one_run(workload, "aioload", 1, min_seconds)
            got["worker_cpu_us"].append(one["worker_cpu_per_item_s"] * 1e6)
            got["worker_wall_us"].append(1e6 / one["items_per_s"])
            two = _one_run(workload, "aioload", 2, min_seconds)
            got["parent_us"].append(two["parent_cpu_per_batch_s"] * 1e6)
        row = {k: statistics.median(v) for k, v in got.items()}
        row["over_us"] = row["worker_cpu_us"] - row["floor_cpu_us"]
        row["batch_size"] = WORKLOADS[workload].batch_size
        inputs[workload] = row
    return inputs


def predict(
    inputs: dict[str, dict[str, float]], cores: int = 16, parent_us: float | None = None
) -> list[dict[str, Any]]:
    """The floor share aioload would reach at N workers on ``cores`` cores: the smaller of

    - what N workers make, each paying the floor's cost per sample at N (``N / F(N)``: memory
      bandwidth included) and the worker's cost over it, the same share of that as here
      (``over_us / floor_cpu_us``): ``F(N) / (1 + over / floor)``;
    - what the parent hands over: one batch per ``P`` of its CPU (a single thread), ``P`` being
      ``parent_us`` (this machine's, scaled by how much faster the large machine's floor
      process is than this one's), or the ``parent_us`` given;

    with the workers' cores shared once N workers and the parent's core exceed ``cores``.
    Ratios, not this machine's microseconds: a shared machine's speed changes from hour to
    hour, and the large one is faster; the two runs whose ratio is taken share the hour."""
    rows = []
    for workload, floors in FLOOR_16.items():
        p = inputs[workload]
        batch = p["batch_size"]
        smallest = min(floors)
        speed = (smallest / floors[smallest]) / (p["floor_cpu_us"] * 1e-6)
        parent = parent_us if parent_us is not None else p["parent_us"] * speed
        parent_cap = batch / (parent * 1e-6)
        over = p["over_us"] / p["floor_cpu_us"]
        room = cores - 1  # the parent's core, at most
        for n, floor in floors.items():
            workers_rate = floor / (1.0 + over)
            if n > room:
                workers_rate *= room / n
            rate = min(workers_rate, parent_cap)
            rows.append(
                {
                    "workload": workload,
                    "workers": n,
                    "floor": floor,
                    "predicted": rate,
                    "share": rate / floor,
                    "parent_us": parent,
                    "bound": "parent" if parent_cap < workers_rate else "workers",
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.auto")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=3.0)
    parser.add_argument("--workloads", default=",".join(WORKLOAD_NAMES))
    parser.add_argument("--out", default=str(DOCS / "benchmarks-auto"))
    parser.add_argument("--from-json", help="re-render the page from a run's JSON")
    parser.add_argument(
        "--model",
        action="store_true",
        help="measure the floor model's inputs here and print its predictions for 16 cores",
    )
    parser.add_argument(
        "--model-inputs", help="with --model: the inputs from a file (--model's JSON) instead"
    )
    parser.add_argument(
        "--parent-us",
        type=float,
        help="with --model: the parent's CPU per batch on the large machine, where measured there",
    )
    args = parser.parse_args(argv)
    if args.child:
        return _child(json.loads(args.child))
    if args.from_json:
        # Re-render the page from a run's JSON.
        saved = json.loads(Path(args.from_json).read_text())
        Path(args.out).with_suffix(".md").write_text(_markdown(saved))
        return 0
    if args.model:
        return _print_model(args)
    return _measure_grid(args)


def _print_model(args: argparse.Namespace) -> int:
    """--model: the floor model's inputs (measured here, or from a file) and predictions."""
    if args.model_inputs:
        saved = json.loads(Path(args.model_inputs).read_text())
        inputs = saved.get("inputs", saved)  # docs/benchmarks-model.json wraps them
    else:
        inputs = model_inputs(args.rounds, args.min_seconds)
    print(json.dumps(inputs, indent=1))
    for parent_us in (None, args.parent_us):
        if parent_us is None and args.parent_us is not None:
            continue
        for row in predict(inputs, parent_us=parent_us):
            print(
                f"{row['workload']:6s} {row['workers']:3d} workers: floor "
                f"{_rate(row['floor'])}, predicted {_rate(row['predicted'])} "
                f"({row['share']:.0%}, {row['bound']}-bound, P {row['parent_us']:.0f} us)"
            )
    return 0


def _measure_grid(args: argparse.Namespace) -> int:
    """Every workload's settings, alternating over the rounds; the page and its JSON."""
    workloads = [w for w in args.workloads.split(",") if w]
    cpu_iters = calibrate_cpu_iters() if "cpu" in workloads else 0
    from aioload._engine.measure import usable_cores
    from benchmarks.httpserver import object_store

    started = time.monotonic()
    load_before = os.getloadavg()[0]
    results = []
    with contextlib.ExitStack() as servers:
        url = ""
        if "http" in workloads:
            url = servers.enter_context(object_store(SIZES["http"], latency=LATENCY_S))
        for workload in workloads:
            settings = _settings(workload)
            runs: dict[str, list[dict[str, Any]]] = {s["name"]: [] for s in settings}
            for round_index in range(args.rounds):
                shift = round_index % len(settings)
                for setting in settings[shift:] + settings[:shift]:
                    run = _run(workload, setting, args, cpu_iters, url)
                    runs[setting["name"]].append(run)
                    print(
                        f"{workload:8s} round {round_index + 1} {setting['name']:15s} "
                        f"{_rate(run.get('items_per_s'))} items/s"
                        + ("" if run["ok"] else f"  FAILED: {run['error']}"),
                        flush=True,
                    )
            summary = _summarise(workload, runs)
            summary["runs"] = runs
            results.append(summary)
    report = {
        "machine": {
            "cores": usable_cores(),
            "cpu_model": report_module._cpu_model(),
            "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "git_rev": report_module.git_rev(),
            "platform": platform.platform(),
            "load_average": f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
        },
        "rounds": args.rounds,
        "min_seconds": args.min_seconds,
        "grid": {
            "sync": [f"{w}x{d}" for w, d, _ in SYNC_GRID],
            "async": [f"{w}x{d} c{c}" for w, d, c in ASYNC_GRID],
        },
        "elapsed_s": time.monotonic() - started,
        "workloads": results,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(_markdown(report))
    print(_markdown(report))
    print(f"elapsed {report['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
