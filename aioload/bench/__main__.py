"""CLI: ``python -m aioload.bench`` -- aioload vs torch DataLoader, side by side.

Runs alternate torch / aioload (each in a fresh subprocess), ``--repeats`` times per
workload and aioload mode; prints one line per run and a summary table, then writes
``<out-dir>/benchmarks.{md,json,png}`` unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from aioload.bench import report
from aioload.bench._one import FAKE_ENV, MODES, fake_enabled
from aioload.bench.httpserver import object_store
from aioload.bench.runner import SAMPLE_PERIOD_S, run_child
from aioload.bench.workloads import LATENCY_S, WORKLOADS, calibrate_cpu_iters

DEFAULT_MODES = ("sync", "async-uvloop")


def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"invalid {what} {','.join(bad) or value!r}; choose from {','.join(allowed)}"
        )
    return list(dict.fromkeys(items))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m aioload.bench",
        description="Benchmark aioload.DataLoader against torch.utils.data.DataLoader.",
        epilog=f"Debug only: {FAKE_ENV}=1 maps the aioload side to torch's DataLoader.",
    )
    names = tuple(WORKLOADS)
    p.add_argument(
        "--workloads",
        default=",".join(names),
        type=lambda s: _csv(s, names, "workload"),
        help="comma-separated subset of %(default)s",
    )
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        type=lambda s: _csv(s, MODES, "mode"),
        help=f"aioload modes, subset of {','.join(MODES)} (default %(default)s); "
        "torch always runs sync",
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats per pair (default 3)")
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply dataset sizes (and --min-seconds) by this, e.g. 0.02 for a smoke run",
    )
    p.add_argument(
        "--min-seconds",
        type=float,
        default=None,
        help="minimum steady-state seconds per run; extra epochs only if one "
        "epoch is shorter (default 2.0 x min(1, scale))",
    )
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument(
        "--cpu-iters",
        type=int,
        default=None,
        help="busy-loop iterations per cpu sample (default: calibrated to ~1 ms)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="kill a run (and its workers) after this many seconds",
    )
    p.add_argument("--out-dir", type=Path, default=Path("docs"))
    p.add_argument("--no-write", action="store_true", help="print only, write no files")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.scale <= 0:
        p.error("--repeats must be >= 1 and --scale > 0")
    return a


def _check_aioload() -> str | None:
    if fake_enabled():
        return None
    try:
        mod = importlib.import_module("aioload")
        getattr(mod, "DataLoader")  # noqa: B009 - may be missing while aioload is written
    except Exception as exc:  # report any import-time failure of the package under test
        return (
            f"aioload.DataLoader is not importable ({type(exc).__name__}: {exc}). "
            f"To exercise the harness alone, set {FAKE_ENV}=1."
        )
    return None


RUN_HEADER = (
    f"{'#':>7}  {'workload':<8} {'loader':<8} {'mode':<13} {'items/s':>12} "
    f"{'TTFB':>8} {'peak RSS':>10} {'wall':>6}  note"
)


def _run_line(i: int, n: int, rec: dict[str, Any]) -> str:
    head = f"{i:>3}/{n:<3}  {rec['workload']:<8} {rec['loader']:<8} {rec['mode']:<13}"
    if not rec["ok"]:
        return f"{head} FAILED: {rec['error']}"
    note = []
    if rec["epochs"] > 1:
        note.append(f"{rec['epochs']} epochs")
    if rec["leftover_procs"]:
        note.append(f"{rec['leftover_procs']} leftover proc(s) killed")
    return (
        f"{head} {report.fmt_ips(rec['items_per_s']):>12} "
        f"{report.fmt_ms(rec['ttfb_s']):>8} {report.fmt_mib(rec['peak_tree_rss_bytes']):>10} "
        f"{rec['child_wall_s']:>5.1f}s  {', '.join(note)}"
    )


def _run_schedule(
    schedule: list[tuple[str, int, str, str, str]],
    sizes: dict[str, int],
    args: argparse.Namespace,
    cpu_iters: int,
    min_seconds: float,
    url: str,
    runs: list[dict[str, Any]],
) -> None:
    for i, (w, rep, loader, mode, pair) in enumerate(schedule, 1):
        child_args = [
            "--loader",
            loader,
            "--mode",
            mode,
            "--workload",
            w,
            "--size",
            str(sizes[w]),
            "--batch-size",
            str(WORKLOADS[w].batch_size),
            "--num-workers",
            str(args.num_workers),
            "--cpu-iters",
            str(cpu_iters),
            "--min-seconds",
            repr(min_seconds),
            "--url",
            url,
        ]
        outcome = run_child(child_args, timeout_s=args.timeout)
        rec: dict[str, Any] = {
            "seq": i,
            "workload": w,
            "repeat": rep,
            "loader": loader,
            "mode": mode,
            "pair_mode": pair,
            "ok": outcome.ok,
            "error": outcome.error,
            "returncode": outcome.returncode,
            "child_wall_s": outcome.wall_s,
            "peak_tree_rss_bytes": outcome.peak_tree_rss_bytes,
            "peak_main_rss_bytes": outcome.peak_main_rss_bytes,
            "max_tree_procs": outcome.max_tree_procs,
            "rss_samples": outcome.samples,
            "leftover_procs": outcome.leftover_procs,
        }
        rec.update({k: v for k, v in outcome.result.items() if k != "config"})
        runs.append(rec)
        print(_run_line(i, len(schedule), rec), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    problem = _check_aioload()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    fake = fake_enabled()
    if fake:
        print(
            f"WARNING: {FAKE_ENV} is set -- the 'aioload' side is torch's DataLoader; "
            "results are meaningless.",
            file=sys.stderr,
        )

    workloads: list[str] = args.workloads
    modes: list[str] = args.modes
    min_seconds = args.min_seconds if args.min_seconds is not None else 2.0 * min(1.0, args.scale)
    sizes = {
        w: max(2 * WORKLOADS[w].batch_size, round(WORKLOADS[w].default_size * args.scale))
        for w in workloads
    }
    cpu_iters = (
        args.cpu_iters
        if args.cpu_iters is not None
        else (calibrate_cpu_iters() if "cpu" in workloads else 0)
    )
    command = ("AIOLOAD_BENCH_FAKE=1 " if fake else "") + shlex.join(
        ["python", "-m", "aioload.bench", *argv]
    )
    meta: dict[str, Any] = {
        "command": command,
        "fake": fake,
        "machine": report.machine_info(),
        "config": {
            "workloads": workloads,
            "modes": modes,
            "repeats": args.repeats,
            "scale": args.scale,
            "sizes": sizes,
            "cpu_iters": cpu_iters,
            "num_workers": args.num_workers,
            "min_seconds": min_seconds,
            "sample_ms": SAMPLE_PERIOD_S * 1e3,
            "timeout_s": args.timeout,
            "batch_sizes": {w: WORKLOADS[w].batch_size for w in workloads},
        },
    }
    print(f"aioload bench: {command}")
    print(
        f"sizes={sizes} cpu_iters={cpu_iters} min_seconds={min_seconds:g} "
        f"workers={args.num_workers}",
        flush=True,
    )

    schedule: list[tuple[str, int, str, str, str]] = []  # workload, repeat, loader, mode, pair
    for w in workloads:
        for rep in range(args.repeats):
            for mode in modes:
                schedule.append((w, rep, "torch", "sync", mode))
                schedule.append((w, rep, "aioload", mode, mode))

    runs: list[dict[str, Any]] = []
    print(RUN_HEADER, flush=True)
    t_all = time.monotonic()
    with contextlib.ExitStack() as servers:
        # The http workload reads from one server for all its runs, started here, outside
        # the measured processes (and their RSS).
        url = ""
        if "http" in workloads:
            url = servers.enter_context(object_store(sizes["http"], latency=LATENCY_S))
        _run_schedule(schedule, sizes, args, cpu_iters, min_seconds, url, runs)

    rows = report.summarize(runs, workloads, modes)
    meta["elapsed_s"] = time.monotonic() - t_all
    header, body = report.table_rows(rows)
    print()
    print(report.text_table(header, body))
    print(
        "targets: ratio "
        + " ".join(f"{w}>={WORKLOADS[w].target_ratio:g}x" for w in workloads)
        + "; TTFB <= torch; peak RSS <= 1.2x torch"
        + ("   [FAKE: aioload column is torch]" if fake else "")
    )
    if not args.no_write:
        for path in report.write_all(args.out_dir, meta, rows, runs):
            print(f"wrote {path}")
    failed = sum(1 for r in runs if not r["ok"])
    leaked = sum(int(r["leftover_procs"]) for r in runs)
    if failed or leaked:
        print(f"{failed} run(s) failed, {leaked} leftover process(es) killed", file=sys.stderr)
    return 1 if failed or any(math.isnan(r.ratio) for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
