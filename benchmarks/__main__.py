"""CLI: ``python -m benchmarks`` -- aioload vs torch DataLoader, side by side.

Runs alternate the floor (no loader), torch, aioload (each mode) and the peer loaders, each in
a fresh subprocess, ``--repeats`` times per workload; then fresh-process start-up probes
(``import aioload``, first batch, a later epoch's first batch). Prints one line per run, a
summary table and the targets as PASS/FAIL, then writes ``<out-dir>/benchmarks.{md,json,png}``
unless ``--no-write`` (and, where ``<out-dir>`` is a repository's ``docs/``, the short table
of ratios in its README.md and docs/index.md).

``--from-json docs/benchmarks.json`` measures nothing: it writes the page, the plot and the
short tables again from that run's JSON (after a change to how they are written).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import report, startup
from benchmarks._one import FAKE_ENV, MODES, PEERS, fake_enabled, peer_available
from benchmarks.httpserver import object_store
from benchmarks.runner import SAMPLE_PERIOD_S, run_child
from benchmarks.workloads import LATENCY_S, WORKLOADS, calibrate_cpu_iters

DEFAULT_MODES = ("sync", "async-uvloop")


def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"invalid {what} {','.join(bad) or value!r}; choose from {','.join(allowed)}"
        )
    return list(dict.fromkeys(items))


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", type=Path, default=Path("docs"))
    p.add_argument("--no-write", action="store_true", help="print only, write no files")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="measure nothing: write the pages again from this run's benchmarks.json, in its "
        "folder",
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
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
        help="steady-state seconds per run: a run stops there, mid-epoch; extra epochs only "
        "if one epoch is shorter (default 3.0 x min(1, scale))",
    )
    p.add_argument(
        "--peers",
        default=",".join(PEERS),
        type=lambda s: [] if s in ("", "none") else _csv(s, PEERS, "peer"),
        help="peer loaders to measure where installed, or 'none' (default %(default)s)",
    )
    p.add_argument(
        "--peer-workloads",
        default="tiny,image,cpu",
        help="workloads the peers run (map-style, synchronous datasets; default %(default)s)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the no-loader floor runs")
    p.add_argument(
        "--startup-repeats",
        type=int,
        default=3,
        help="fresh-process first-batch probes per loader and workload; 0 skips them",
    )
    p.add_argument(
        "--import-repeats", type=int, default=7, help="fresh processes for `import aioload`"
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
    _output_args(p)
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
    f"{'#':>7}  {'workload':<8} {'loader':<9} {'mode':<13} {'items/s':>12} "
    f"{'TTFB':>8} {'CPU/batch':>10} {'peak RSS':>10} {'wall':>6}  note"
)


def _run_line(i: int, n: int, rec: dict[str, Any]) -> str:
    head = f"{i:>3}/{n:<3}  {rec['workload']:<8} {rec['loader']:<9} {rec['mode']:<13}"
    if not rec["ok"]:
        return f"{head} FAILED: {rec['error']}"
    note = []
    if rec["epochs"] > 1:
        note.append(f"{rec['epochs']} epochs")
    if rec["leftover_procs"]:
        note.append(f"{rec['leftover_procs']} leftover proc(s) killed")
    if rec.get("torch_segments_removed"):
        note.append(f"{rec['torch_segments_removed']} /dev/shm segment(s) of torch's removed")
    return (
        f"{head} {report.fmt_ips(rec['items_per_s']):>12} "
        f"{report.fmt_ms(rec['ttfb_s']):>8} "
        f"{report.fmt_us(rec.get('parent_cpu_per_batch_s', math.nan)):>10} "
        f"{report.fmt_mib(rec['peak_tree_rss_bytes']):>10} "
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
        outcome = run_child(child_args, timeout_s=args.timeout, env=startup.child_env())
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
            "torch_segments_removed": outcome.torch_segments_removed,
        }
        rec.update({k: v for k, v in outcome.result.items() if k != "config"})
        runs.append(rec)
        print(_run_line(i, len(schedule), rec), flush=True)


def _startup_probes(
    workloads: list[str],
    args: argparse.Namespace,
    cpu_iters: int,
    url: str,
    sizes: dict[str, int],
) -> list[dict[str, Any]]:
    """Fresh-process first batches, torch and aioload alternating."""
    probes: list[dict[str, Any]] = []
    for rep in range(args.startup_repeats):
        for w in workloads:
            for loader in ("torch", "aioload"):
                rec: dict[str, Any] = {"workload": w, "loader": loader, "repeat": rep}
                try:
                    child = startup.ChildWorkload(
                        w, WORKLOADS[w].batch_size, cpu_iters, url, sizes[w]
                    )
                    rec |= startup.first_batch(
                        loader, child, args.num_workers, timeout_s=args.timeout
                    )
                    rec["ok"] = True
                    print(
                        f"  start-up {w:<8} {loader:<8} first batch "
                        f"{report.fmt_ms(rec['first_batch_s']):>8} (import "
                        f"{report.fmt_ms(rec['import_s'])}), later epoch "
                        f"{report.fmt_ms(rec['later_epoch_first_batch_s']):>8}",
                        flush=True,
                    )
                except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
                    rec |= {"ok": False, "error": str(exc)}
                    print(f"  start-up {w:<8} {loader:<8} FAILED: {exc}", flush=True)
                probes.append(rec)
    return probes


def _write_from_json(path: Path) -> int:
    """Measure nothing: write the pages again from a run's JSON, in its folder."""
    stored_meta, rows, stored_runs = report.load_json(path)
    for written in report.write_all(path.parent, stored_meta, rows, stored_runs, from_json=True):
        print(f"wrote {written}")
    return 0


def _available_peers(wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    """The peer loaders installed here, and why each of the others is not measured."""
    peers_absent: dict[str, str] = {}
    peers: list[str] = []
    for peer in wanted:
        why = peer_available(peer)
        if why is None:
            peers.append(peer)
        else:
            peers_absent[peer] = f"not installed ({why})"
    return peers, peers_absent


def _schedule(args: argparse.Namespace, peers: list[str]) -> list[tuple[str, int, str, str, str]]:
    """workload, repeat, loader, mode, pair; within a repeat the loaders alternate."""
    modes: list[str] = args.modes
    peer_workloads = {w.strip() for w in args.peer_workloads.split(",")}
    schedule: list[tuple[str, int, str, str, str]] = []
    for w in args.workloads:
        for rep in range(args.repeats):
            if not args.no_floor:
                schedule.append((w, rep, "floor", "sync", "sync"))
            # One torch run per repeat, compared with every aioload mode.
            schedule.append((w, rep, "torch", "sync", modes[0]))
            schedule += [(w, rep, "aioload", mode, mode) for mode in modes]
            if w in peer_workloads:
                schedule += [(w, rep, peer, "sync", "sync") for peer in peers]
    return schedule


def _import_overhead(args: argparse.Namespace) -> dict[str, float]:
    import_stats = startup.import_overhead(args.import_repeats)
    print(
        f"import aioload over import torch: {import_stats['import_s'] * 1e3:.1f} ms wall, "
        f"{import_stats['import_cpu_s'] * 1e3:.1f} ms CPU (median of "
        f"{args.import_repeats}); with aioload.DataLoader in hand "
        f"{import_stats['loader_s'] * 1e3:.1f} ms wall",
        flush=True,
    )
    return import_stats


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_json is not None:
        return _write_from_json(args.from_json)
    if problem := _check_aioload():
        print(f"error: {problem}", file=sys.stderr)
        return 2
    fake = fake_enabled()
    if fake:
        print(
            f"WARNING: {FAKE_ENV} is set -- the 'aioload' side is torch's DataLoader; "
            "results are meaningless.",
            file=sys.stderr,
        )
    startup.compile_package()

    workloads: list[str] = args.workloads
    modes: list[str] = args.modes
    min_seconds = args.min_seconds if args.min_seconds is not None else 3.0 * min(1.0, args.scale)
    sizes = {
        w: max(2 * WORKLOADS[w].batch_size, round(WORKLOADS[w].default_size * args.scale))
        for w in workloads
    }
    cpu_iters = (
        args.cpu_iters
        if args.cpu_iters is not None
        else (calibrate_cpu_iters() if "cpu" in workloads else 0)
    )
    peers, peers_absent = _available_peers(args.peers)
    command = ("AIOLOAD_BENCH_FAKE=1 " if fake else "") + shlex.join(
        ["python", "-m", "benchmarks", *argv]
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
            "peers": peers,
        },
        "peers_absent": peers_absent,
    }
    print(f"aioload bench: {command}")
    print(
        f"sizes={sizes} cpu_iters={cpu_iters} min_seconds={min_seconds:g} "
        f"workers={args.num_workers} peers={','.join(peers) or 'none'}"
        + "".join(f" [{k}: {v}]" for k, v in peers_absent.items()),
        flush=True,
    )

    schedule = _schedule(args, peers)

    runs: list[dict[str, Any]] = []
    t_all = time.monotonic()
    with contextlib.ExitStack() as servers:
        # The http workload reads from one server for all its runs, started here, outside
        # the measured processes (and their RSS).
        url = ""
        if "http" in workloads:
            url = servers.enter_context(object_store(sizes["http"], latency=LATENCY_S))
        import_stats = _import_overhead(args) if args.import_repeats > 0 and not fake else None
        probes: list[dict[str, Any]] = []
        if args.startup_repeats > 0 and not fake:
            probes = _startup_probes(workloads, args, cpu_iters, url, sizes)
        print(RUN_HEADER, flush=True)
        _run_schedule(schedule, sizes, args, cpu_iters, min_seconds, url, runs)
    meta["elapsed_s"] = time.monotonic() - t_all

    return _report(args, meta, runs, probes, import_stats)


def _report(
    args: argparse.Namespace,
    meta: dict[str, Any],
    runs: list[dict[str, Any]],
    probes: list[dict[str, Any]],
    import_stats: dict[str, float] | None,
) -> int:
    """Summarize the runs, print the table and the targets, write the pages; the exit status."""
    fake = meta["fake"]
    rows = report.summarize(runs, args.workloads, args.modes, meta["peers_absent"])
    start_summary = report.summarize_startup(probes)
    found = report.targets(rows, start_summary, import_stats)
    meta["import"] = import_stats
    meta["startup"] = start_summary
    meta["startup_probes"] = probes
    meta["targets"] = [asdict(t) for t in found]
    header, body = report.table_rows(rows)
    print()
    print(report.text_table(header, body))
    print(
        "\ntargets (2 workers; medians of alternating runs):"
        + ("   [FAKE: aioload column is torch]" if fake else "")
    )
    for target in found:
        print("  " + target.line())
    if not args.no_write:
        for path in report.write_all(args.out_dir, meta, rows, runs):
            print(f"wrote {path}")
    failed = sum(1 for r in runs if not r["ok"] and r["loader"] in report.OURS)
    peers_failed = sum(1 for r in runs if not r["ok"] and r["loader"] not in report.OURS)
    leaked = sum(int(r["leftover_procs"]) for r in runs)
    if failed or peers_failed or leaked:
        print(
            f"{failed} run(s) failed, {peers_failed} peer run(s) failed (shown in the table; "
            f"not counted against the exit status), {leaked} leftover process(es) killed",
            file=sys.stderr,
        )
    return report.exit_status(runs, rows)


if __name__ == "__main__":
    raise SystemExit(main())
