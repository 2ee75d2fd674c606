"""Where the whole machine's time goes on one workload: the floor and the loaders under ``perf``.

    python -m benchmarks.machine_profile [--workload image] [--loaders floor,aioload]
                                            [--rounds 2] [--seconds 2]

Each round runs ``python -m benchmarks._one`` once per loader, one after the other (the
workload's size, batch size and workers; sync ``for``), and while its steady state lasts,
``perf record -e cpu-clock -a`` samples every CPU for ``--seconds``. The samples are put in a
few categories by symbol and library (``categorize``): on ``image`` the two copies every batch
needs, the dataset's ``clone()`` (torch's ``direct_copy_kernel``) and the stack into the
batch's buffer (libc's ``memmove``), then the Python interpreter, the kernel, and the CPUs'
idle time. The shares are of the machine's time (both CPUs), so a loader that leaves a CPU
idle shows it there. The medians over ``--rounds`` are printed as a Markdown table, with each
loader's items/s and the stack / clone ratio: the two copies move about the same bytes, and
the stack costs more when the buffer it writes is cold (docs/benchmark-notes.md, "Why image stays
below its floor").

``perf`` must be installed and allowed to sample the whole system (root, or
``kernel.perf_event_paranoid`` <= 0). A virtual machine without hardware counters still has
the ``cpu-clock`` software event used here.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import git_rev
from benchmarks.workloads import WORKLOADS

IDLE = "idle"
STACK = "stack into the batch (libc memmove/memcpy)"
CLONE = "the dataset's clone (torch direct_copy_kernel)"
PYTHON = "Python interpreter (libpython)"
KERNEL = "kernel"
TORCH = "torch, other"
OTHER = "other"
CATEGORIES = (IDLE, STACK, CLONE, PYTHON, KERNEL, TORCH, OTHER)

_LINE = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s+(\S+)\s+\[(.)\]\s+(.*?)\s*$")


def categorize(comm: str, dso: str, symbol: str) -> str:
    """The category of one ``perf report`` row (the idle task is "swapper")."""
    if comm.startswith("swapper"):
        return IDLE
    if "memmove" in symbol or "memcpy" in symbol:
        return STACK
    if "direct_copy_kernel" in symbol:
        return CLONE
    if dso.startswith("libpython"):
        return PYTHON
    if dso == "[kernel.kallsyms]":
        return KERNEL
    if "torch" in dso or dso.startswith("libc10"):
        return TORCH
    return OTHER


def parse_report(text: str) -> dict[str, float]:
    """Shares per category (percent of all samples), from the text of
    ``perf report --stdio --no-children -g none --sort comm,dso,sym``."""
    shares = dict.fromkeys(CATEGORIES, 0.0)
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is not None:
            percent, comm, dso, _kind, symbol = match.groups()
            shares[categorize(comm, dso, symbol)] += float(percent)
    return shares


def _run_one(
    perf: str, loader: str, workload: str, seconds: float
) -> tuple[dict[str, float], float]:
    known = WORKLOADS[workload]
    cmd = [
        sys.executable,
        "-m",
        "benchmarks._one",
        "--loader",
        loader,
        "--mode",
        "sync",
        "--workload",
        workload,
        "--size",
        str(known.default_size),
        "--batch-size",
        str(known.batch_size),
        "--num-workers",
        str(known.num_workers),
        # Long enough that perf's window lies inside the steady state.
        "--min-seconds",
        str(seconds + 4),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            time.sleep(2.5)  # start-up and the first batches
            recorded = subprocess.run(
                [
                    perf,
                    "record",
                    "-q",
                    "-e",
                    "cpu-clock",
                    "-F",
                    "2000",
                    "-a",
                    "-o",
                    str(data),
                    "--",
                    "sleep",
                    str(seconds),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                timeout=seconds + 60,
            )
            if recorded.returncode != 0:
                # Not allowed to sample the whole system, most often.
                raise SystemExit(f"perf record failed: {recorded.stderr.strip()}")
            out, _ = run.communicate(timeout=300)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        report = subprocess.run(
            [
                perf,
                "report",
                "-i",
                str(data),
                "--stdio",
                "--no-children",
                "-g",
                "none",
                "--sort",
                "comm,dso,sym",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"the {loader} run printed no result")
    return parse_report(report), float(json.loads(lines[-1])["items_per_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.machine_profile")
    p.add_argument("--workload", default="image", choices=sorted(WORKLOADS))
    p.add_argument("--loaders", default="floor,aioload")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=2.0)
    a = p.parse_args(argv)
    perf = shutil.which("perf")
    if perf is None:
        print("perf is not installed", file=sys.stderr)
        return 2
    loaders = a.loaders.split(",")
    shares: dict[str, dict[str, list[float]]] = {name: {} for name in loaders}
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(a.rounds):
        for loader in loaders:  # alternating, as the benchmark does
            share, rate = _run_one(perf, loader, a.workload, a.seconds)
            rates[loader].append(rate)
            for name, value in share.items():
                shares[loader].setdefault(name, []).append(value)
    print(
        f"{a.workload}, {WORKLOADS[a.workload].num_workers} workers, sync; medians of {a.rounds} round(s), {a.seconds:g} s of "
        f"`perf record -a` each; shares of the machine's time (both CPUs); git {git_rev()}\n"
    )
    print("| | " + " | ".join(loaders) + " |")
    print("|---" * (len(loaders) + 1) + "|")
    print(
        "| items/s | " + " | ".join(f"{statistics.median(rates[n]):,.0f}" for n in loaders) + " |"
    )
    for name in CATEGORIES:
        cells = [f"{statistics.median(shares[n].get(name, [0.0])):.1f}%" for n in loaders]
        print(f"| {name} | " + " | ".join(cells) + " |")
    ratios = []
    for n in loaders:
        stack = shares[n].get(STACK, [0.0])
        clone = shares[n].get(CLONE, [0.0])
        per_round = [s / c for s, c in zip(stack, clone, strict=True) if c > 0]
        ratios.append(f"{statistics.median(per_round):.2f}" if per_round else "-")
    print("| stack / clone | " + " | ".join(ratios) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
