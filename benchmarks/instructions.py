"""The many-core model's inputs as instruction counts, which a shared 2-core machine does not
disturb: its CPU times move with the hour, and with three processes on two cores each one's
CPU time includes what sharing a core costs it (cold caches after every switch).

    python -m benchmarks.instructions [--workload tiny] [--batches 100 600]

Runs under valgrind's cachegrind (``--cache-sim=no``: it counts the instructions each process
executes in user space) and reports, per batch:

- the parent: aioload, ``for``, 2 workers, the consumer doing nothing;
- each worker: the same run's worker processes;
- the floor: the same samples made and stacked in one process (``benchmarks.floor``'s stacker);
- the bare parent: only the calls into C that a parent written in Python makes for each batch
  of tiny whatever its design (a poll, the answer's read, the batch's lease and tensor view, the
  next task's write), in a loop that does nothing else: what the parent's count has to beat.

Each figure is the difference between a run of ``N1`` and one of ``N2`` batches, over
``N2 - N1``, so imports and start-up cancel. What this leaves out: the kernel's instructions
(system calls, page faults, wake-ups) and the time memory stalls take, which are real costs
that only a CPU-time measurement on the large machine shows. The parent's figure is also
taken with the workers slowed down by valgrind, so it waits for every batch, as it does on a
many-core machine, and what the parent does by the clock (a health check every second) comes
about once a batch at valgrind's pace, against once in hundreds in a real run: the count moves
by some 20 % from run to run. The counted processes run with one BLAS thread (OpenBLAS's idle
threads spin for as long as the scheduler lets them, and counted as the parent's).

On the 16-core machine the floor's instructions take ``benchmarks.auto.FLOOR_16``'s time per
sample; the parent's instructions, at the same rate, give its user-space CPU per batch there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.auto import FLOOR_16
from benchmarks.startup import child_env

BATCH_SIZE = {"tiny": 256, "image": 64}
SIZE = {"tiny": 10_000_000, "image": 2_000_000}
# The bare loop runs this many times the batches: its 35K a batch over a few hundred batches
# would be lost in how much two runs' start-ups differ (tens of millions of instructions).
BARE_REPEAT = 10


def _bare_parent(batches: int) -> None:
    """The calls a parent written in Python cannot do without for a batch of tiny, and nothing
    else: a poll of its descriptors, the answer's read and header, the batch's lease over its
    slab, the weak reference that frees it, the tensor view, and the next task's write. The
    "worker" is the other end of a socket pair in this same process (its send and read of a
    few bytes count too)."""
    import ctypes
    import mmap
    import selectors
    import socket
    import struct
    import weakref

    import torch

    parent, worker = socket.socketpair()
    parent.setblocking(False)
    worker.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(parent, selectors.EVENT_READ)
    chunk = memoryview(bytearray(1 << 20))
    anc_space = socket.CMSG_SPACE(64 * 4)
    slab_map = mmap.mmap(-1, 1 << 20)
    slab = (ctypes.c_ubyte * (1 << 20)).from_buffer(slab_map)
    reply, task = struct.Struct("<IqqqqqdII"), struct.Struct("<Bqqqq")
    answer = reply.pack(0, 1, 2, 3, 4, 2048, 0.1, 1, 0)
    freed: list[int] = []
    size = BATCH_SIZE["tiny"]
    for k in range(batches):
        worker.send(answer)
        selector.select(0)
        parent.recvmsg_into([chunk], anc_space)
        reply.unpack_from(chunk)
        lease = (ctypes.c_ubyte * (8 * size)).from_buffer(slab)
        ref = weakref.ref(lease, lambda _ref: freed.append(1))
        batch = torch.frombuffer(lease, dtype=torch.int64, count=size, offset=0)
        del lease
        parent.send(task.pack(1, k, 0, k * size, (k + 1) * size))
        worker.recv_into(chunk)
        del batch, ref
    selector.close()
    del slab
    slab_map.close()
    parent.close()
    worker.close()


def _child(role: str, batches: int, workload: str) -> None:
    """One counted run, in the process valgrind started (its pid is printed for the parent)."""
    from benchmarks.workloads import make_dataset

    print(json.dumps({"pid": os.getpid()}), flush=True)
    if role == "bare":
        _bare_parent(batches)
        return
    dataset: Any = make_dataset(workload, SIZE[workload], 0)
    batch_size = BATCH_SIZE[workload]
    if role == "parent":
        import aioload

        loader = aioload.DataLoader(dataset, batch_size=batch_size, num_workers=2)
        it = iter(loader)
        for _ in range(batches):
            batch = next(it)
            del batch
        del it, loader
    else:
        from benchmarks.floor import _Stacker

        stacker = _Stacker()
        for k in range(batches):
            start = k * batch_size
            stacker.stack([dataset[i] for i in range(start, start + batch_size)])


def _summary_instructions(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise ValueError(f"no summary line in {path}")


def count(role: str, batches: int, workload: str) -> dict[str, Any]:
    """Instructions of one run: {"main": the process valgrind started, "children": the others'}."""
    with tempfile.TemporaryDirectory(prefix="aioload-cg-") as out:
        cmd = [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            f"--cachegrind-out-file={out}/cg.%p",
            sys.executable,
            "-m",
            "benchmarks.instructions",
            "--child",
            role,
            "--batches",
            str(batches),
            str(batches),
            "--workload",
            workload,
        ]
        # One BLAS thread: OpenBLAS's idle threads spin in the counted process for as long as
        # the scheduler lets them, which moved a run's count by 30K instructions per batch.
        env = child_env() | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=1800, env=env, check=False
        )
        if res.returncode != 0:
            raise RuntimeError(f"{role} {batches}: exit {res.returncode}: {res.stderr[-2000:]}")
        pid = json.loads(res.stdout.strip().splitlines()[0])["pid"]
        counts = {
            int(p.name.split(".")[-1]): _summary_instructions(p) for p in Path(out).glob("cg.*")
        }
    main = counts.pop(pid)
    return {"main": main, "children": sorted(counts.values())}


def per_batch(
    short: dict[str, Any], long: dict[str, Any], n_short: int, n_long: int
) -> dict[str, Any]:
    """Instructions per batch from two runs' counts: the main process's, and the children's
    (paired by size: the workers of a run started alike)."""
    span = n_long - n_short
    result: dict[str, Any] = {"main": (long["main"] - short["main"]) / span}
    if short["children"] and len(short["children"]) == len(long["children"]):
        # Each worker did about half of the batches: its count over half the span.
        each = len(long["children"])
        result["worker"] = [
            (b - a) / (span / each)
            for a, b in zip(short["children"], long["children"], strict=True)
        ]
    return result


def model_figures(
    parent: float, workers: list[float], floor: float, workload: str
) -> dict[str, float]:
    """What the counts say for the model (docs/benchmarks.md, "Many cores"): the worker's
    instructions over the floor's, the parent's as a share of a batch's floor work, and the
    parent's user-space CPU per batch on the 16-core machine at the floor's rate there."""
    floors = FLOOR_16[workload]
    smallest = min(floors)
    sample_s = smallest / floors[smallest]  # one floor process's time per sample there
    batch = BATCH_SIZE[workload]
    instructions_per_s = (floor / batch) / sample_s
    worker = sum(workers) / len(workers) if workers else float("nan")
    return {
        "parent_per_batch": parent,
        "worker_per_batch": worker,
        "floor_per_batch": floor,
        "o_instructions": worker / floor - 1.0,
        "parent_share_of_floor_batch": parent / floor,
        "parent_us_16": parent / instructions_per_s * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.instructions")
    p.add_argument("--workload", choices=sorted(BATCH_SIZE), default="tiny")
    p.add_argument("--batches", type=int, nargs=2, default=[100, 600], metavar=("N1", "N2"))
    p.add_argument("--child", choices=("parent", "floor", "bare"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a.child, a.batches[0], a.workload)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing to count", file=sys.stderr)
        return 2
    n1, n2 = a.batches
    runs = {
        (role, n): count(role, n * (BARE_REPEAT if role == "bare" else 1), a.workload)
        for role in ("floor", "parent", "bare")
        for n in (n1, n2)
    }
    parent = per_batch(runs["parent", n1], runs["parent", n2], n1, n2)
    floor = per_batch(runs["floor", n1], runs["floor", n2], n1, n2)
    bare = per_batch(runs["bare", n1], runs["bare", n2], BARE_REPEAT * n1, BARE_REPEAT * n2)["main"]
    figures = model_figures(parent["main"], parent.get("worker", []), floor["main"], a.workload)
    print(
        json.dumps(
            {"workload": a.workload, "batches": [n1, n2], "bare_parent_per_batch": bare} | figures,
            indent=1,
        )
    )
    print(
        f"{a.workload}: parent {figures['parent_per_batch'] / 1e3:.0f}K instructions a batch "
        f"({figures['parent_share_of_floor_batch']:.1%} of the floor's batch), "
        f"worker {figures['o_instructions']:+.1%} over the floor's "
        f"{figures['floor_per_batch'] / 1e6:.2f}M; the parent on the 16-core machine: "
        f"{figures['parent_us_16']:.0f} us a batch in user space; the calls a Python parent "
        f"cannot do without (tiny's): {bare / 1e3:.0f}K a batch"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
