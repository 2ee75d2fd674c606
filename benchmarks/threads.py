"""Thread workers against worker processes and torch's DataLoader, at 2 workers.

For the ``jpeg`` (real JPEGs decoded and augmented with Pillow and numpy), ``tiny`` and
``image`` workloads, each loader runs in a fresh process: aioload with
``worker_method="thread"``, with ``"multiprocessing"`` under Python's default start method
(fork on Linux before Python 3.14) and under ``"forkserver"`` (the default from 3.14, and what a
process that uses CUDA must use), with ``"auto"``, and torch's DataLoader. Under fork the
workers share the parent's pages (torch's among them) until they write to them; a forkserver's
workers each import torch and the dataset's modules themselves. Each run reports items/s over its steady state (from the first batch on, at least
``--min-seconds``), the time to its first batch (from the loader's construction, its imports
done beforehand; the workers' start and ``"auto"``'s trial included) and its peak memory: the sum of PSS
(``/proc/<pid>/smaps_rollup``) over the run's process and its workers, sampled while it runs
(RSS would count the pages parent and workers share once per process). Runs alternate (every
loader once per round, the order rotated each round) and the medians are reported. Two more
"loaders", ``bare-threads`` and ``bare-processes``, make the same batches with no loader
(:mod:`benchmarks.bare_workers`): threads against processes before any loader's costs.

    python -m benchmarks.threads                # 3 rounds (about 4 minutes)
    python -m benchmarks.threads --quick        # a smoke run
    python -m benchmarks.threads --json docs/benchmarks-threads.json --docs docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import bare_workers, provenance

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"jpeg": (100_000, 32), "tiny": (4_000_000, 256), "image": (400_000, 64)}
LOADERS = ("thread", "multiprocessing", "forkserver", "auto", "torch", *bare_workers.KINDS)
# Loaders that are aioload's worker processes, each under its start method (None: Python's
# default, named in the results as the one it was).
PROCESS_START = {"multiprocessing": None, "forkserver": "forkserver"}
BEGIN, END = "<!-- threads:start (make bench writes this section) -->", "<!-- threads:end -->"
# How often the runs' PSS is read. Reading /proc/<pid>/smaps_rollup walks every page the
# process maps: 10-27 ms for one run's tree of processes here, done every 50 ms it took a
# quarter of a core from the run it measured (jpeg's items/s 5-10 % lower, threads and
# processes alike). A run's memory is flat once it is under way: twice a second finds its peak.
SAMPLE_PERIOD_S = 0.5


# -- one run, in its own process ------------------------------------------------------------------


def run_one(loader_name: str, workload: str, workers: int, min_seconds: float) -> dict[str, Any]:
    """Items/s from the first batch on, the first batch's time, and what "auto" chose."""
    import multiprocessing

    import torch

    import aioload
    from benchmarks.workloads import count_items, make_dataset, touch

    size, batch_size = WORKLOADS[workload]
    dataset = make_dataset(workload, size, 0)
    dataset[0]  # (the files are drawn, and the modules imported, before the clock starts)
    if loader_name in bare_workers.KINDS:
        return bare_workers.run_bare(loader_name, dataset, workers, batch_size, min_seconds)
    kwargs: dict[str, Any] = {"batch_size": batch_size, "num_workers": workers}
    make: Any = torch.utils.data.DataLoader
    if loader_name in PROCESS_START:
        make, kwargs["worker_method"] = aioload.DataLoader, "multiprocessing"
        start_method = PROCESS_START[loader_name] or multiprocessing.get_start_method()
        kwargs["multiprocessing_context"] = start_method
    elif loader_name != "torch":
        make, kwargs["worker_method"] = aioload.DataLoader, loader_name
    # A first loader, never iterated, imports what constructing one needs (a few hundred ms,
    # the same for every worker method): the clock times the pass, not the imports.
    make(dataset, **kwargs)
    started = time.perf_counter()
    loader = make(dataset, **kwargs)
    first_s, items, steady_from = 0.0, 0, 0.0
    for batch in loader:
        touch(batch)
        now = time.perf_counter()
        if not steady_from:
            first_s, steady_from = now - started, now
            continue
        items += count_items(batch)
        if now - steady_from >= min_seconds:
            break
    rate = items / (time.perf_counter() - steady_from)
    result: dict[str, Any] = {"items_per_s": rate, "first_batch_s": first_s}
    if loader_name == "auto":
        result["choice"] = loader.stats().as_dict()["tuning"]["worker_method"]
    if loader_name in PROCESS_START:
        result["start_method"] = start_method
    del batch, loader
    _let_worker_threads_finish()
    return result


def _let_worker_threads_finish(bound_s: float = 30.0) -> None:
    """Wait (bounded) until the loader's worker threads have left. A thread that is inside a
    C++ call (a torch op) when the interpreter finalizes can abort the process ("terminate
    called without an active exception"), and the run would count as failed."""
    import gc
    import threading

    gc.collect()
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline and any(
        t.name.startswith("aioload-worker-") for t in threading.enumerate()
    ):
        time.sleep(0.05)


# -- the parent: alternating runs, PSS sampled --------------------------------------------------


def pss_bytes(pid: int) -> int:
    """The process's proportional set size, from ``/proc/<pid>/smaps_rollup`` (0 if gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def tree_pids(root: int) -> list[int]:
    """``root`` and every process below it: its workers, and under forkserver the fork server
    (a child of ``root``) and the workers it forked (its children, ``root``'s grandchildren),
    and multiprocessing's resource tracker."""
    import psutil

    try:
        return [root, *(p.pid for p in psutil.Process(root).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def tree_pss(root: int) -> int:
    """The PSS of ``root`` and every process below it, summed (PSS divides each shared page
    among the processes that map it, so the sum counts it once)."""
    return sum(pss_bytes(pid) for pid in tree_pids(root))


def measure(loader_name: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run in a fresh process; its result with the peak PSS of its process tree."""
    cmd = [sys.executable, "-m", "benchmarks.threads", "--one", loader_name, workload]
    cmd += ["--workers", str(args.workers), "--min-seconds", str(args.min_seconds)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, start_new_session=True)
    peak, deadline = 0, time.monotonic() + args.timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            peak = max(peak, tree_pss(proc.pid))
            time.sleep(SAMPLE_PERIOD_S)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
        out, _ = proc.communicate(timeout=60)
    if proc.returncode != 0:
        return {"error": f"exit code {proc.returncode}"}
    return {**json.loads(out.decode().strip().splitlines()[-1]), "peak_pss_bytes": peak}


def run_rounds(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (workload, loader) once per round, the loaders' order rotated each round."""
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for workload in args.workloads:
            order = args.loaders[r % len(args.loaders) :] + args.loaders[: r % len(args.loaders)]
            for name in order:
                run = {"round": r, "workload": workload, "loader": name}
                run.update(measure(name, workload, args))
                runs.append(run)
                print(_run_line(run), flush=True)
    return runs


def _run_line(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"  {run['workload']:<6} {run['loader']:<16} {run['error']}"
    chose = f"  chose {run['choice']['value']}" if "choice" in run else ""
    return (
        f"  {run['workload']:<6} {run['loader']:<16} {run['items_per_s']:>10.0f} items/s"
        f"  first {run['first_batch_s']:.3f} s  peak PSS {run['peak_pss_bytes'] / 2**20:.0f} MiB"
        + chose
    )


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, loader): the medians of its runs."""
    rows = []
    keys = sorted({(r["workload"], r["loader"]) for r in runs if "error" not in r})
    for workload, name in keys:
        mine = [r for r in runs if (r["workload"], r["loader"]) == (workload, name)]
        mine = [r for r in mine if "error" not in r]
        row: dict[str, Any] = {"workload": workload, "loader": name, "runs": len(mine)}
        for key in ("items_per_s", "first_batch_s", "peak_pss_bytes"):
            row[key] = statistics.median(r[key] for r in mine)
        if name == "auto":
            row["chose"] = sorted({r["choice"]["value"] for r in mine})
        if name in PROCESS_START:
            row["start_method"] = mine[0]["start_method"]
        rows.append(row)
    return rows


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets: jpeg threads vs processes (items/s >= 0.95x, memory <= 0.6x, first batch
    <= 0.5x), against processes under the default start method and, as ``*_forkserver``,
    under forkserver; tiny "auto" >= 0.9x the better of threads and processes."""
    by = {(r["workload"], r["loader"]): r for r in rows}
    out: dict[str, Any] = {}
    t = by.get(("jpeg", "thread"))
    for loader, suffix in (("multiprocessing", ""), ("forkserver", "_forkserver")):
        p = by.get(("jpeg", loader))
        if not (t and p):
            continue
        out[f"jpeg_items_per_s{suffix}"] = _ratio(t["items_per_s"], p["items_per_s"], ">=", 0.95)
        out[f"jpeg_memory{suffix}"] = _ratio(t["peak_pss_bytes"], p["peak_pss_bytes"], "<=", 0.6)
        out[f"jpeg_first_batch{suffix}"] = _ratio(t["first_batch_s"], p["first_batch_s"], "<=", 0.5)
    a = by.get(("tiny", "auto"))
    best = max(
        (
            by[("tiny", m)]["items_per_s"]
            for m in ("thread", "multiprocessing")
            if ("tiny", m) in by
        ),
        default=None,
    )
    if a and best:
        out["tiny_auto_items_per_s"] = _ratio(a["items_per_s"], best, ">=", 0.9)
    return out


def ceilings(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per workload, plain threads over plain processes (no loader), items/s and peak memory:
    how threads compare with processes here before any loader's costs."""
    by = {(r["workload"], r["loader"]): r for r in rows}
    out = {}
    for (workload, loader), p in by.items():
        t = by.get((workload, "bare-threads"))
        if loader == "bare-processes" and t:
            out[workload] = {
                key: round(t[key] / p[key], 3) for key in ("items_per_s", "peak_pss_bytes")
            }
    return out


def _ratio(value: float, against: float, sense: str, bound: float) -> dict[str, Any]:
    ratio = value / against if against else float("inf")
    met = ratio >= bound if sense == ">=" else ratio <= bound
    return {"ratio": round(ratio, 3), "target": f"{sense} {bound}", "met": met}


# -- the page -------------------------------------------------------------------------------------

_NAMES = {
    "thread": 'aioload, `worker_method="thread"`',
    "multiprocessing": 'aioload, `"multiprocessing"`',
    "forkserver": 'aioload, `"multiprocessing"`',
    "auto": 'aioload, `"auto"`',
    "torch": "torch",
    "bare-threads": "no loader: plain threads",
    "bare-processes": "no loader: forked processes",
}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | loader | items/s | first batch | peak memory (PSS) | chose |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        chose = ", ".join(row.get("chose", [])) or "-"
        name = _NAMES[row["loader"]]
        if row["loader"] in PROCESS_START:
            default = " (the default)" if PROCESS_START[row["loader"]] is None else ""
            name += f", {row.get('start_method', 'default start method')}{default}"
        lines.append(
            f"| {row['workload']} | {name} | {row['items_per_s']:,.0f} "
            f"| {row['first_batch_s'] * 1e3:,.0f} ms | {row['peak_pss_bytes'] / 2**20:,.0f} MiB "
            f"| {chose} |"
        )
    return "\n".join(lines)


def _target_lines(result: dict[str, Any]) -> list[str]:
    words = {
        "jpeg_items_per_s": "jpeg, threads' items/s over processes' (default start method)",
        "jpeg_memory": "jpeg, threads' peak memory over processes' (default start method)",
        "jpeg_first_batch": "jpeg, threads' first batch over processes' (default start method)",
        "jpeg_items_per_s_forkserver": "jpeg, threads' items/s over processes' (forkserver)",
        "jpeg_memory_forkserver": "jpeg, threads' peak memory over processes' (forkserver)",
        "jpeg_first_batch_forkserver": "jpeg, threads' first batch over processes' (forkserver)",
        "tiny_auto_items_per_s": 'tiny, `"auto"`\'s items/s over the better of the two',
    }
    return [
        f"- {words[k]}: {v['ratio']:.2f} (target {v['target']}: {'met' if v['met'] else 'missed'})"
        for k, v in result["targets"].items()
    ] + [
        f"- {w}, with no loader: plain threads over forked processes, items/s"
        f" {r['items_per_s']:.2f}, peak memory {r['peak_pss_bytes']:.2f}"
        for w, r in result.get("ceilings", {}).items()
    ]


def section(result: dict[str, Any]) -> str:
    machine = result["machine"]
    return "\n".join(
        [
            BEGIN,
            "## Thread workers against processes (`python -m benchmarks.threads`)",
            "",
            f"{result['workers']} workers, the medians of {result['rounds']} alternating rounds"
            f" on {provenance.describe(machine)}; {result['date']}, commit `{result['commit']}`."
            " aioload's processes run under the default start method here (fork, which"
            " shares the parent's pages with the workers) and under forkserver (Python"
            " 3.14's default on Linux, and what a process that uses CUDA must use: each"
            " worker imports torch itself)."
            " jpeg: real 224x224 JPEGs decoded with Pillow and augmented with numpy into"
            " float32 tensors, batch 32; tiny: scalar tensors, batch 256; image: uint8"
            " 3x224x224, batch 64. Items/s from the first batch on; the first batch timed from"
            " the loader's construction, imports done (workers' start and `\"auto\"`'s trial"
            " included); memory"
            " is the peak of the summed PSS of the run's process and its workers. The"
            " no-loader rows make the same batches in plain threads, or in forked processes,"
            " and hand none over (`benchmarks/bare_workers.py`): their ratio is how threads"
            " compare with processes on this interpreter and machine before any loader's"
            " costs.",
            "",
            table(result["rows"]),
            "",
            *_target_lines(result),
            "",
            f"Command: `{result['command']}`. Raw runs: `docs/benchmarks-threads.json`.",
            END,
        ]
    )


def write_docs(path: Path, result: dict[str, Any]) -> None:
    from benchmarks.uneven import write_section

    write_section(path, section(result), BEGIN, END)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.threads", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a smoke run: one round, 0.5 s runs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=3.0, help="steady state per run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--loaders", default=",".join(LOADERS))
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--docs", type=Path, default=None, help="write the section into this page")
    p.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.min_seconds = 1, 0.5
    args.workloads = [w for w in str(args.workloads).split(",") if w in WORKLOADS]
    args.loaders = [n for n in str(args.loaders).split(",") if n in LOADERS]
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args.one[0], args.one[1], args.workers, args.min_seconds)))
        return 0
    from benchmarks.workloads import ensure_jpegs

    ensure_jpegs()  # (drawn once, before any run is timed)
    load_before = os.getloadavg()[0]
    runs = run_rounds(args)
    rows = medians(runs)
    result: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.threads", *argv]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": provenance.commit(),
        "machine": {
            **provenance.machine(),
            "load_average": f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end",
        },
        "workers": args.workers,
        "rounds": args.rounds,
        "min_seconds": args.min_seconds,
        "rows": rows,
        "runs": runs,
    }
    result["targets"] = targets(rows)
    result["ceilings"] = ceilings(rows)
    print(table(rows))
    print("\n".join(_target_lines(result)))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.docs is not None:
        write_docs(args.docs, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
