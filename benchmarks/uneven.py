"""Uneven samples: in-order delivery against the floor, when sample times vary.

Each sample sleeps a fixed time drawn per index from a lognormal distribution of mean
``--mean-ms`` (10 ms); ``sigma`` is the lognormal's (0: every sample the same). With
``batch_size=1``, persistent workers, each run's second pass is timed (the first, a few
batches, only starts the workers). Sleeping needs no core, so many workers fit on a small
machine.

The floor is what the workers could deliver if none waited on another: the pass's samples'
total sleep over ``num_workers``. Each figure is the pass's time as a share of the floor's
(100 %: no loss). Runs alternate (every configuration once per round, in a fresh process)
and the medians are reported.

    python -m benchmarks.uneven                 # the full grid, 3 rounds (about 10 minutes)
    python -m benchmarks.uneven --quick         # a smoke run (well under a minute)
    python -m benchmarks.uneven --json docs/benchmarks-uneven.json --docs docs/benchmarks.md

``--aioload-root DIR`` runs the aioload of another checkout (``DIR/aioload``): a before/after
comparison on the same machine, in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from benchmarks import provenance
from benchmarks._one import loader_stats

ROOT = Path(__file__).resolve().parents[1]
SIGMAS = (0.0, 0.5, 1.0)
WORKERS = (2, 8, 14)
# (loader, in_order, seed_per_sample): aioload in order (with torch's round robin, and with
# seed_per_sample, where tasks go to the least busy worker) and not; torch in order and not.
LOADERS = (
    ("aioload", True, False),
    ("aioload", True, True),
    ("aioload", False, False),
    ("torch", True, False),
    ("torch", False, False),
)
BEGIN, END = "<!-- uneven:start (make bench writes this section) -->", "<!-- uneven:end -->"


def sleep_times(n: int, sigma: float, mean_s: float, seed: int = 0) -> list[float]:
    """``n`` lognormal times of spread ``sigma``, scaled so that their mean is ``mean_s``."""
    rng = random.Random(seed)
    raw = [math.exp(rng.gauss(-sigma * sigma / 2, sigma)) if sigma else 1.0 for _ in range(n)]
    scale = mean_s * n / sum(raw)
    return [t * scale for t in raw]


class UnevenDataset(Dataset[torch.Tensor]):
    """Sample ``i`` sleeps ``times[i]`` seconds (a read, a decode, a retry), then is ``i``."""

    def __init__(self, times: list[float]) -> None:
        self.times = times

    def __len__(self) -> int:
        return len(self.times)

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.times[index])
        return torch.tensor(index)


class WarmupSampler(Sampler[int]):
    """The first pass is ``warmup`` indices (it only starts the workers); later ones all."""

    def __init__(self, n: int, warmup: int) -> None:
        self.n, self.warmup, self.passes = n, warmup, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        self.passes += 1
        return iter(range(self.warmup if self.passes == 1 else self.n))


def run_one(config: dict[str, Any], args: Any) -> dict[str, Any]:
    """One configuration, in this process: the second pass's time against the floor's."""
    loader, in_order = config["loader"], config["in_order"]
    workers, sigma = config["workers"], config["sigma"]
    n = args.per_worker * workers
    times = sleep_times(n, sigma, args.mean_ms / 1e3, seed=args.seed)
    dataset = UnevenDataset(times)
    if loader == "aioload":
        from aioload import DataLoader as cls
    else:
        from torch.utils.data import DataLoader as cls  # type: ignore[assignment]
    kwargs: dict[str, Any] = {"in_order": in_order}
    if config.get("seed_per_sample"):
        kwargs["seed_per_sample"] = True
    dl = cls(
        dataset,
        batch_size=1,
        sampler=WarmupSampler(n, 2 * workers),
        num_workers=workers,
        persistent_workers=True,
        **kwargs,
    )
    for _ in dl:
        pass
    seen = 0
    start = time.perf_counter()
    for batch in dl:
        seen += int(batch.numel())
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "samples": seen, "floor_s": sum(times) / workers}
    if loader == "aioload":
        result.update(loader_stats(dl))
        dl.shutdown()
    del dl
    assert seen == n, (seen, n)
    result["share"] = result["floor_s"] / seconds
    return result


def child(config: dict[str, Any], args: Any) -> dict[str, Any]:
    """Run ``config`` in a fresh process (aioload from ``--aioload-root`` if given)."""
    root = str(Path(args.aioload_root).resolve()) if args.aioload_root else str(ROOT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "benchmarks.uneven", "--one", json.dumps(config)]
    cmd += ["--per-worker", str(args.per_worker), "--mean-ms", str(args.mean_ms)]
    cmd += ["--seed", str(args.seed)]
    try:
        # (In ``root``: ``-m`` puts the working directory first on the path.)
        done = subprocess.run(
            cmd,
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    if done.returncode != 0:
        return {"error": " | ".join(done.stderr.strip().splitlines()[-3:])}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def grid(args: Any) -> list[dict[str, Any]]:
    return [
        {"loader": loader, "in_order": in_order, "seed_per_sample": sps, "workers": w, "sigma": s}
        for s in args.sigmas
        for w in args.workers
        for loader, in_order, sps in LOADERS
        if loader in args.loaders
    ]


def _key(config: dict[str, Any]) -> tuple[Any, ...]:
    return (
        config["sigma"],
        config["workers"],
        config["loader"],
        config["in_order"],
        bool(config.get("seed_per_sample")),
    )


def measure(args: Any) -> dict[str, Any]:
    configs = grid(args)
    runs: dict[tuple[Any, ...], list[dict[str, Any]]] = {_key(c): [] for c in configs}
    for round_ in range(args.rounds):
        for config in configs if round_ % 2 == 0 else configs[::-1]:
            result = child(config, args)
            runs[_key(config)].append(result)
            share = result.get("share")
            note = f"{share:6.1%}" if share is not None else result.get("error", "?")
            print(
                f"round {round_ + 1}: sigma={config['sigma']:<4} workers={config['workers']:<3}"
                f" {config['loader']:<8} in_order={config['in_order']!s:<6}"
                f" seed_per_sample={config['seed_per_sample']!s:<6} {note}",
                flush=True,
            )
    rows = []
    for config in configs:
        done = [r for r in runs[_key(config)] if "share" in r]
        row = dict(config, rounds=len(done), runs=runs[_key(config)])
        if done:
            row["share"] = statistics.median(r["share"] for r in done)
            for name in ("busy_share", "waiting_in_order_mean", "run_ahead_peak"):
                values = [r[name] for r in done if r.get(name) is not None]
                row[name] = statistics.median(values) if values else None
        rows.append(row)

    return {
        "command": " ".join(["python -m benchmarks.uneven", *args.argv]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": provenance.commit(),
        "machine": {**provenance.machine(), "load_average": f"{os.getloadavg()[0]:.1f} at the end"},
        "seed": args.seed,
        "per_worker": args.per_worker,
        "mean_ms": args.mean_ms,
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "aioload_root": args.aioload_root,
        "rows": rows,
    }


def round_robin_bound(sigma: float, workers: int, result: dict[str, Any]) -> float:
    """The best share of the floor any loader can reach with torch's round robin: each worker
    fetches every ``workers``-th sample, whatever it costs, so the pass lasts at least as long
    as the slowest worker's share of the drawn times."""
    n = result["per_worker"] * workers
    times = sleep_times(n, sigma, result["mean_ms"] / 1e3, seed=result.get("seed", 0))
    return (sum(times) / workers) / max(sum(times[w::workers]) for w in range(workers))


def _cell(rows: dict[tuple[Any, ...], dict[str, Any]], key: tuple[Any, ...]) -> str:
    row = rows.get(key)
    if row is None or row.get("share") is None:
        return "-"
    return f"{row['share']:.0%}"


def table(result: dict[str, Any]) -> str:
    """The markdown table: one line per (sigma, workers), one column per loader and order."""
    rows = {_key(r): r for r in result["rows"]}
    pairs = sorted({(r["sigma"], r["workers"]) for r in result["rows"]})
    head = "| sigma | workers | bound | aioload | aioload, seeded per sample "
    head += "| aioload, out of order | torch (out of order) | busy, waiting |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for sigma, workers in pairs:
        cells = [f"{round_robin_bound(sigma, workers, result):.0%}"]
        cells += [_cell(rows, (sigma, workers, *loader)) for loader in LOADERS[:3]]
        torch_in, torch_out = (_cell(rows, (sigma, workers, *loader)) for loader in LOADERS[3:])
        cells.append(f"{torch_in} ({torch_out})")
        aio = rows.get((sigma, workers, "aioload", True, False), {})
        busy, wait = aio.get("busy_share"), aio.get("waiting_in_order_mean")
        cells.append("-" if busy is None else f"{busy:.0%}, {wait:.1f}")
        lines.append(f"| {sigma:g} | {workers} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _provenance(result: dict[str, Any]) -> str:
    machine = result.get("machine")
    if not machine:
        return f"{result['cores']} cores."
    return f"{provenance.describe(machine)}; {result['date']}, commit `{result['commit']}`."


def section(result: dict[str, Any]) -> str:
    return "\n".join(
        [
            BEGIN,
            "## Uneven samples, in order (`python -m benchmarks.uneven`)",
            "",
            f"Each sample sleeps a time drawn per index (lognormal, mean {result['mean_ms']:g} ms,"
            f" spread sigma), `batch_size=1`, persistent workers, the second pass timed,"
            f" {result['per_worker']} samples per worker. Each figure is the share of the floor"
            " (the samples' total sleep over `num_workers`: no worker waiting on another),"
            f" the median of {result['rounds']} alternating rounds."
            " In order, aioload's workers run ahead of a late batch within a memory bound"
            " ([Tuning](tuning.md#run-ahead)); torch's wait once the prefetch window is full."
            " With torch's round robin each worker fetches a fixed share of the samples, so no"
            " loader can beat the *round-robin bound*: the floor over the slowest share's time,"
            " computed from the drawn times. With `seed_per_sample` a batch does not depend on"
            " the worker that fetches it, and aioload sends each task to the least busy worker"
            " ([Tuning](tuning.md#run-ahead)), still yielding in order. Columns: *bound*, the"
            " round-robin bound; *aioload* and *torch*, in order (the default); *out of order*"
            " (in parentheses for torch), `in_order=False`; *seeded per sample*, in order with `seed_per_sample=True`; *busy,"
            " waiting*, aioload in order's workers' busy share and the answers waiting in order"
            " at a hand-over (mean).",
            "",
            _provenance(result),
            "",
            table(result),
            "",
            f"Command: `{result['command']}`.",
            END,
        ]
    )


def write_section(path: Path, block: str, begin: str, end: str) -> None:
    """Put ``block`` (which starts with ``begin`` and ends with ``end``) in place of the page's
    section between those markers, or at the page's end where it has none."""
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def write_docs(path: Path, result: dict[str, Any]) -> None:
    write_section(path, section(result), BEGIN, END)


def parse_args(argv: list[str]) -> Any:
    p = argparse.ArgumentParser(prog="python -m benchmarks.uneven", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a smoke run: few samples, one round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-worker", type=int, default=300, help="samples per worker per pass")
    p.add_argument("--mean-ms", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sigmas", default=",".join(map(str, SIGMAS)))
    p.add_argument("--workers", default=",".join(map(str, WORKERS)))
    p.add_argument("--loaders", default="aioload,torch")
    p.add_argument("--aioload-root", default=None, help="the checkout whose aioload runs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--docs", type=Path, default=None, help="write the section into this page")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.rounds, args.per_worker = 1, 40
        if "--sigmas" not in argv:
            args.sigmas = "0,1.0"
        if "--workers" not in argv:
            args.workers = "2,8"
    args.sigmas = [float(s) for s in str(args.sigmas).split(",")]
    args.workers = [int(w) for w in str(args.workers).split(",")]
    args.loaders = str(args.loaders).split(",")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.one is not None:
        config = json.loads(args.one)
        result = run_one(config, args)
        print(json.dumps(result))
        return 0
    result = measure(args)
    print()
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.docs is not None:
        write_docs(args.docs, result)
    failed = [r for r in result["rows"] if r.get("share") is None]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
