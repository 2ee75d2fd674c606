"""A loader built on one rank alone, under an initialized ``torch.distributed``: with torch's
defaults it reads the whole dataset and talks to no other rank, as torch's DataLoader does.

Two gloo ranks on 127.0.0.1, each its own process (``python -m tests.features.test_one_rank``).
Rank 0 builds and reads four loaders (shuffle off and on, no workers and two) while rank 1
builds none and waits in the closing barrier. Rank 0 records every collective call its loaders
make; were one made, rank 1 would never join it, and the process group's timeout (bounded
here) would end the run with an error rather than a hang.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.utils.data import Dataset

import aioload

pytestmark = [
    pytest.mark.no_local_workers("the ranks and their loaders run in processes of their own"),
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.timeout(240),
]

N = 100
BATCH = 10
CASES = [(shuffle, workers) for shuffle in (False, True) for workers in (0, 2)]
# What a loader could use to talk to the other ranks.
COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "scatter",
    "scatter_object_list",
    "send",
)
GROUP_TIMEOUT_S = 30  # bounds a collective that one rank would never join
ROOT = Path(__file__).resolve().parents[2]


class Range(Dataset[int]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return index


def _rank_main(rank: int, port: int, out: Path) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's connections stay on the loopback
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        if rank == 0:
            out.write_text(json.dumps(_read_alone()))
        dist.barrier()  # rank 1 waits here from the start
    finally:
        dist.destroy_process_group()


def _read_alone() -> dict[str, Any]:
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def recording(name: str, original: Any) -> Any:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, recording(name, original))
    report: dict[str, Any] = {}
    try:
        for shuffle, workers in CASES:
            before = len(calls)
            loader = aioload.DataLoader(
                Range(), batch_size=BATCH, shuffle=shuffle, num_workers=workers
            )
            seen = [int(index) for batch in loader for index in batch]
            report[f"shuffle={shuffle} num_workers={workers}"] = {
                "len": len(loader),
                "seen": len(seen),
                "distinct": len(set(seen)),
                "collectives": calls[before:],
            }
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return report


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_loader_on_one_rank_reads_everything_and_waits_for_no_one(tmp_path: Path) -> None:
    port = _free_port()
    out = tmp_path / "rank0.json"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.features.test_one_rank", str(rank), str(port), str(out)],
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs: list[str] = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=180)[0])
    finally:
        for process in ranks:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert [process.returncode for process in ranks] == [0, 0], "\n".join(outputs)
    report = json.loads(out.read_text())
    for shuffle, workers in CASES:
        case = report[f"shuffle={shuffle} num_workers={workers}"]
        # The whole dataset, each sample once, and no call to another rank.
        assert case == {"len": N // BATCH, "seen": N, "distinct": N, "collectives": []}, (
            shuffle,
            workers,
        )


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
