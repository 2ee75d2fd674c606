"""Real ranks for the framework tests: 2 processes, gloo over 127.0.0.1, started the way
``torchrun`` starts them (environment variables), each running one flow and writing what it saw
to ``rank{N}.json``. The assertions run in the test process.

The ranks are plain subprocesses (``python -m tests.frameworks._ranks FLOW OUT``), not
``torch.multiprocessing.spawn`` from pytest: spawn leaves a resource tracker running in the
process that used it, which is not the test's to stop.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

N = 512  # a multiple of ranks x batch size: no padding, so exactly-once means exactly N
BATCH = 8
WORLD_SIZE = 2
# The training step's own time, so that a data-wait figure has something to compare with.
STEP_SECONDS = 0.002


class Indexed(Dataset[dict[str, Any]]):
    """Sample i carries its own index, so every rank can say which samples it trained on."""

    def __init__(self, size: int = N) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        features = torch.full((4,), float(index) / self.size)
        return {"index": index, "x": features, "labels": features.sum()}


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launch(flow: str, out_dir: Path, timeout: float) -> list[dict[str, Any]]:
    """Run ``flow`` on WORLD_SIZE ranks and return each rank's report, rank 0 first."""
    port = free_loopback_port()
    ranks = []
    for rank in range(WORLD_SIZE):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            WORLD_SIZE=str(WORLD_SIZE),
            LOCAL_WORLD_SIZE=str(WORLD_SIZE),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
        )
        log = open(out_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed below)
        ranks.append(
            (
                subprocess.Popen(
                    [sys.executable, "-m", "tests.frameworks._ranks", flow, str(out_dir)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        for process, _ in ranks:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        # A rank that hangs in a collective would wait for its peer forever: stop both.
        for process, log in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    reports = []
    for rank, (process, _) in enumerate(ranks):
        if process.returncode != 0:
            tail = (out_dir / f"rank{rank}.log").read_text(errors="replace")[-4000:]
            raise AssertionError(f"rank {rank} of {flow} exited with {process.returncode}:\n{tail}")
        reports.append(json.loads((out_dir / f"rank{rank}.json").read_text()))
    return reports


def type_name(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def assert_exactly_once(per_rank: list[list[int]]) -> None:
    """Every index of the dataset, once, across the ranks; and an even split between them."""
    assert [len(indices) for indices in per_rank] == [N // WORLD_SIZE] * WORLD_SIZE
    everything = sorted(i for indices in per_rank for i in indices)
    assert everything == list(range(N))


if __name__ == "__main__":
    flow_name, out = sys.argv[1], Path(sys.argv[2])
    from . import flows

    run: Callable[[], dict[str, Any]] = getattr(flows, flow_name)
    report = run()
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
    # The frameworks start the process group and leave it running. Exiting with it still up
    # once aborted rank 0 after its report ("terminate called without an active exception",
    # signal 6, 2026-11-25 22:19 UTC, the transformers flow): torch asks for
    # destroy_process_group before exit, which stops its gloo threads in order.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
