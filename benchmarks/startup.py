"""Start-up figures, each from fresh processes: ``import aioload`` over ``import torch``, and the
first batch counted from before ``import aioload`` (:mod:`benchmarks._first_batch`).

    python -m benchmarks.startup [--workers 2 4 8 14] [--rounds 5] [--workload tiny]

prints the first batch at each worker count, aioload's (under ``for`` and ``async for``) and
torch's, alternating, as medians, and then a verdict per worker count and front: aioload's first
batch over torch's, as the median of each round's ratio (the two ran side by side, under the
same load). The command exits 1 when one of them is over ``--max-ratio`` (0.8 by default), so
that a slower start is seen where it is made; ``--max-ratio 0`` prints the ratios but judges
nothing.

Every child runs with bytecode caching on (``PYTHONDONTWRITEBYTECODE`` removed) after
:func:`compile_package` has written aioload's ``.pyc`` files: torch's own modules are always
imported from their caches, so without this aioload alone would pay for compiling its sources
(about 30 ms, seen where that variable is set) and the comparison would measure the compiler.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

_REPO_DIR = Path(__file__).resolve().parents[1]
_PKG_DIR = _REPO_DIR / "aioload"
_REPO = str(_REPO_DIR)
_FIRST_BATCH = str(Path(__file__).with_name("_first_batch.py"))

# aioload's first batch must take at most this share of torch's (fresh process, same run).
MAX_RATIO = 0.8

_IMPORT_PROBE = """
import sys, time
sys.path.insert(0, {repo!r})
import torch
wall, cpu = time.perf_counter(), time.process_time()
import aioload
wall1, cpu1 = time.perf_counter(), time.process_time()
aioload.DataLoader
wall2, cpu2 = time.perf_counter(), time.process_time()
import json
print(json.dumps({{"import_s": wall1 - wall, "import_cpu_s": cpu1 - cpu,
                  "loader_s": wall2 - wall, "loader_cpu_s": cpu2 - cpu}}))
"""


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH", "")) if p)
    return env


def compile_package() -> None:
    """Write aioload's bytecode caches, as an installed package has them."""
    compileall.compile_dir(str(_PKG_DIR), quiet=1)


def _json_child(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env(), check=False
    )
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        tail = " | ".join(res.stderr.strip().splitlines()[-4:])
        raise RuntimeError(f"{cmd[1:3]} exit code {res.returncode}: {tail}")
    parsed: dict[str, Any] = json.loads(lines[-1])
    return parsed


def import_overhead(repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` fresh processes: ``import aioload`` after ``import torch``
    (wall and CPU), and the same up to ``aioload.DataLoader`` in hand."""
    runs = [
        _json_child([sys.executable, "-c", _IMPORT_PROBE.format(repo=_REPO)], 120)
        for _ in range(repeats)
    ]
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {
        "repeats": float(repeats)
    }


class ChildWorkload(NamedTuple):
    """What a start-up child loads: the workload and its settings."""

    name: str
    batch_size: int
    cpu_iters: int = 0
    url: str = ""
    max_size: int = 0


def first_batch(
    loader: str,
    workload: ChildWorkload,
    num_workers: int,
    timeout_s: float = 300.0,
    front: str = "sync",
) -> dict[str, Any]:
    """One fresh process: first batch from before the import, and a later epoch's first."""
    cmd = [
        sys.executable,
        _FIRST_BATCH,
        "--loader",
        loader,
        "--workload",
        workload.name,
        "--batch-size",
        str(workload.batch_size),
        "--num-workers",
        str(num_workers),
        "--cpu-iters",
        str(workload.cpu_iters),
        "--repo",
        _REPO,
        "--url",
        workload.url,
        "--max-size",
        str(workload.max_size),
        "--front",
        front,
    ]
    return _json_child(cmd, timeout_s)


Runs = dict[tuple[str, str, int], list[dict[str, Any]]]


def verdicts(runs: Runs, max_ratio: float) -> tuple[list[str], bool]:
    """One line per worker count and front: aioload's fresh-process first batch over
    torch's, the median of the rounds' ratios (round i of each ran side by side), PASS or
    FAIL against ``max_ratio`` (0: not judged); and whether every one passed."""
    lines: list[str] = []
    ok = True
    for (loader, front, n), records in sorted(runs.items()):
        if loader != "aioload":
            continue
        torch_records = runs[("torch", "sync", n)]
        ratios = [
            float(mine["first_batch_s"]) / float(theirs["first_batch_s"])
            for mine, theirs in zip(records, torch_records, strict=True)
        ]
        ratio = statistics.median(ratios)
        passed = not max_ratio or ratio <= max_ratio
        ok = ok and passed
        verdict = "----" if not max_ratio else "PASS" if passed else "FAIL"
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        lines.append(
            f"{verdict} first batch, {n} workers, aioload ({'async for' if front == 'async' else 'for'})"
            f" / torch: {ratio:.2f}x (rounds {spread}), target <= {max_ratio:.2f}x"
        )
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    """The first batch at each worker count: a fresh process's, and a later epoch's (the
    workers start again), for aioload and torch in alternation; medians as a Markdown table,
    then the verdicts (:func:`verdicts`). 1 when aioload's first batch is over ``--max-ratio``
    of torch's."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.startup")
    p.add_argument("--workload", default="tiny")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 14])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--max-ratio",
        type=float,
        default=MAX_RATIO,
        help="fail when aioload's first batch is over this share of torch's (0: judge nothing)",
    )
    a = p.parse_args(argv)
    compile_package()
    # (loader, front): torch's under ``for``, aioload's under ``for`` and ``async for``.
    kinds = (("torch", "sync"), ("aioload", "sync"), ("aioload", "async"))
    runs: Runs = {(loader, front, n): [] for n in a.workers for loader, front in kinds}
    for _ in range(a.rounds):
        for n in a.workers:
            for loader, front in kinds:
                record = first_batch(
                    loader, ChildWorkload(a.workload, a.batch_size), n, front=front
                )
                runs[loader, front, n].append(record)

    def ms(kind: tuple[str, str], n: int, key: str) -> str:
        return f"{1e3 * statistics.median(float(r[key]) for r in runs[(*kind, n)]):.0f} ms"

    print(f"{a.workload} (batch {a.batch_size}), medians of {a.rounds} fresh processes each")
    print("| workers | fresh process: aioload for / async for / torch | later epoch: the same |")
    print("|---|---|---|")
    for n in a.workers:
        cells = [
            " / ".join(ms(kind, n, key) for kind in (kinds[1], kinds[2], kinds[0]))
            for key in ("first_batch_s", "later_epoch_first_batch_s")
        ]
        print(f"| {n} | {cells[0]} | {cells[1]} |")
    lines, ok = verdicts(runs, a.max_ratio)
    print("\n".join(lines))
    if not ok:
        print(
            f"FAIL: aioload's first batch is over {a.max_ratio:.2f}x torch's "
            "(python -m benchmarks.startup; docs/benchmarks.md, start-up)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
