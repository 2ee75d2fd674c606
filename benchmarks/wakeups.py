"""How often the parent wakes per batch, and how many of those wake-ups bring nothing.

    python -m benchmarks.wakeups [--rounds 3] [--batches 1500] [--workers 2]

Runs the ``tiny`` workload (scalar samples, batch 256) for ``--batches`` batches under ``for``,
``async for`` on asyncio and ``async for`` on uvloop, each round in a fresh process, the fronts
alternating. Each engine step that follows a wait is counted as a wake-up, and as an empty one
when it took no batch (``Orchestrator.step`` returned ``PENDING``): a wait that something other
than the awaited batch ended. Prints, per front, the medians over the rounds of wake-ups per
batch, empty wake-ups per batch, and the parent's CPU per batch (docs/benchmark-notes.md,
"Where the parent's time goes").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = str(Path(__file__).resolve().parents[1])
FRONTS = ("for", "asyncio", "uvloop")


def _child(front: str, batches: int, workers: int) -> dict[str, Any]:
    """One run in this process: counts of wake-ups, and the parent's CPU per batch."""
    import aioload
    from aioload._engine import orchestrator
    from benchmarks.workloads import make_dataset

    counts = {"wakeups": 0, "empty": 0}
    step = orchestrator.Orchestrator.step

    def counting(self: orchestrator.Orchestrator, intake: bool = True) -> Any:
        result = step(self, intake)
        if intake:  # (the step after a wait; a step that only dispatches takes no answer)
            counts["wakeups"] += 1
            counts["empty"] += result is orchestrator.PENDING
        return result

    orchestrator.Orchestrator.step = counting  # type: ignore[method-assign]
    loader = aioload.DataLoader(
        make_dataset("tiny", batches * 256, 0), batch_size=256, num_workers=workers
    )
    got = 0
    cpu = 0.0
    if front == "for":
        began = time.process_time()
        for _ in loader:
            got += 1
        cpu = time.process_time() - began
    else:

        async def drain() -> float:
            nonlocal got
            began = time.process_time()
            async for _ in loader:
                got += 1
            return time.process_time() - began

        if front == "uvloop":
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                cpu = runner.run(drain())
        else:
            cpu = asyncio.run(drain())
    return {
        "front": front,
        "batches": got,
        "wakeups_per_batch": counts["wakeups"] / got,
        "empty_per_batch": counts["empty"] / got,
        "parent_cpu_per_batch_us": cpu / got * 1e6,
    }


def _run(front: str, batches: int, workers: int) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.wakeups",
        "--child",
        front,
        "--batches",
        str(batches),
        "--workers",
        str(workers),
    ]
    done = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True, timeout=600, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wakeups")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=1500)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--child", choices=FRONTS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.batches, a.workers)))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {front: [] for front in FRONTS}
    for _ in range(a.rounds):
        for front in FRONTS:
            runs[front].append(_run(front, a.batches, a.workers))
    print(f"tiny, batch 256, {a.workers} workers, {a.batches} batches, medians of {a.rounds} runs")
    print("| front | wake-ups per batch | empty wake-ups per batch | parent CPU per batch |")
    print("|---|---|---|---|")
    for front, results in runs.items():
        keys = ("wakeups_per_batch", "empty_per_batch", "parent_cpu_per_batch_us")
        wakeups, empty, cpu = (statistics.median(r[key] for r in results) for key in keys)
        name = "for" if front == "for" else f"async for, {front}"
        print(f"| {name} | {wakeups:.2f} | {empty:.2f} | {cpu:.0f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
