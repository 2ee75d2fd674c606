"""Where the parent's time goes per batch: the tiny workload under py-spy, in per-batch steps.

    python -m benchmarks.parent_profile [--repo DIR] [--rounds 3]

Runs ``python -m benchmarks._one --loader aioload --mode sync --workload tiny`` (2 workers,
batch 256, >= 4 s of steady state) under ``py-spy record`` from ``--repo`` (default: this
checkout; point it at another checkout to profile an older version of the code), main thread
only. Each sample is put in one step by the innermost frame that names one (``_STEPS``, then
``_REST``); samples whose innermost frame is a blocking ``select`` (or the pool's
``_aio.waiting._poll_blocking``: py-spy shows no C frames, so the blocking call needs a Python
frame of its own) are the parent asleep, not CPU, and are left out.
Each step's share of the remaining samples is scaled to the run's measured parent CPU per batch
(``time.process_time()`` from the first to the last batch), and the medians over ``--rounds``
fresh runs are printed as a Markdown table (docs/benchmark-notes.md, "Where the parent's time
goes"). Shares are the reading to trust: sampling puts +-10% on each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

# (step, frame-name fragments). A sample belongs to the first step whose fragment occurs in one
# of its frames, innermost frame first; order matters where one step calls another (the
# dispatch inside ``_deliver`` is dispatch, not the rest of the step).
_STEPS: list[tuple[str, tuple[str, ...]]] = [
    ("read and unpickle answer frames", ("pump_in", "_split")),
    ("decode the batch (slab lease, tensor views)", ("SlabMappings.decode", "WorkerPool._decode")),
    ("slab release (the lease's finalizer)", ("finalize", "WorkerPool.release", "_queue_frees")),
    (
        "dispatch the next task (sampler, pickle, socket write)",
        ("_dispatch", "submit", "pump_out", "encode_frame", "_flush", "BatchSampler"),
    ),
    (
        "wait for a worker (everything around the blocking select)",
        ("wait_blocking", "Waiter.", "waitable", "sync_loop.py", "run_until_complete"),
    ),
]
# Samples no step above claims, by their innermost frame that names one of these. The bench's
# own frames are under aioload/ too, so they come first.
_REST: list[tuple[str, tuple[str, ...]]] = [
    ("the consumer (the bench's touch and clocks; torch pays it too)", ("bench/",)),
    ("the rest of the engine's step (reorder, resume, stats)", ("aioload/",)),
]
_ASLEEP = ("EpollSelector.select", "select.select", "_poll_blocking")


def _classify(frames: list[str]) -> str | None:
    """The step a sample belongs to; None when the thread was asleep."""
    if any(fragment in frames[-1] for fragment in _ASLEEP):
        return None
    for rules in (_STEPS, _REST):
        for frame in reversed(frames):
            for step, fragments in rules:
                if any(fragment in frame for fragment in fragments):
                    return step
    return "other"


def profile_once(repo: Path, py_spy: str, size: int) -> tuple[dict[str, float], float]:
    """One fresh run: (share of the awake samples per step, parent CPU per batch in s)."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "profile.txt"
        cmd = [
            py_spy,
            "record",
            # Blocking sampling (the process is paused per sample): slower, but every stack
            # is consistent, which --nonblocking's are not.
            "-r",
            "500",
            "-f",
            "raw",
            "-o",
            str(raw),
            "--",
            sys.executable,
            "-m",
            "benchmarks._one",
            "--loader",
            "aioload",
            "--mode",
            "sync",
            "--workload",
            "tiny",
            "--size",
            str(size),
            "--batch-size",
            "256",
            "--num-workers",
            "2",
            "--min-seconds",
            "4",
        ]
        env = dict(os.environ, PYTHONPATH=str(repo))
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise SystemExit(f"the profiled run failed:\n{done.stdout}\n{done.stderr}")
        cpu_per_batch = float(json.loads(lines[-1])["parent_cpu_per_batch_s"])
        counts: Counter[str] = Counter()
        for line in raw.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            # The steady state only: the loop over batches, not start-up.
            if not any("run_sync" in frame for frame in frames):
                continue
            step = _classify(frames)
            if step is not None:
                counts[step] += int(count)
    total = sum(counts.values()) or 1
    return {step: n / total for step, n in counts.items()}, cpu_per_batch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.parent_profile")
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", type=int, default=3_000_000)
    a = p.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed (it is in the bench extra)")
    shares: dict[str, list[float]] = {}
    cpus: list[float] = []
    for _ in range(a.rounds):
        share, cpu = profile_once(a.repo.resolve(), py_spy, a.size)
        cpus.append(cpu)
        for step, _fragments in [*_STEPS, *_REST, ("other", ())]:
            shares.setdefault(step, []).append(share.get(step, 0.0))
    cpu = statistics.median(cpus)
    print(
        f"repo {a.repo}: parent CPU per batch {cpu * 1e6:.0f} us (rounds: "
        + ", ".join(f"{c * 1e6:.0f}" for c in cpus)
        + ")"
    )
    print("| per-batch step | us (share) |\n|---|---|")
    for step, values in shares.items():
        median = statistics.median(values)
        print(f"| {step} | {median * cpu * 1e6:.0f} us ({median:.0%}) |")
    print(f"| **parent CPU per batch, measured** | **{cpu * 1e6:.0f} us** |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
