"""Every ``examples/*.py`` runs to completion on tiny sizes.

Convention for example authors (a new example is picked up here automatically):

* ``AIOLOAD_EXAMPLE_SMALL=1`` in the environment means "tiny sizes": the example must then
  finish in a few seconds (a few hundred samples, one or two epochs).
* ``AIOLOAD_EXAMPLE_DATA=<dir>`` is where an example may write data it generates (the default
  is the repository's git-ignored ``data/``); the test points it at a temporary folder.
* It runs as ``python examples/NAME.py`` with no arguments, exits 0, and prints what it did
  on stdout. Add the lines it must print to ``EXPECTED`` below.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ray_namespace_problem

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# Lines each known example must print (regular substrings); others must print something.
EXPECTED: dict[str, list[str]] = {
    "quickstart.py": ["aioload, async for", "aioload, for", "torch DataLoader, for"],
    "train_images.py": [
        "drew 64 JPEGs",
        "(2 corrupt on purpose)",
        "aioload stats (finished)",
        "skipped samples: 2",
        "skipped 00005_square.jpg: OSError",
        "data-bound",
        "load only",
    ],
    "sync_script.py": ["epoch 0: mean loss", "epoch 1: mean loss", "aioload stats (finished)"],
    "async_training_loop.py": ["epoch 1: accuracy", "event loop:", "checkpoint"],
    "trio_loop.py": ["8 batches, 512 signals", "cancelled pass: cleaned up"],
    "iterable_sharded.py": ["read each of 2000 records exactly once"],
    "http_dataset.py": ["aioload, async dataset, 2 workers x 32 in flight", "files/s"],
    "distributed_training.py": ["epoch 0: 2 rank(s) x 1 worker(s)", "one loader state per rank"],
    "ray_cluster.py": ["local Ray cluster: 2 nodes", "one epoch: 128 samples", "on 2 node(s)"],
}

# Ray binds to the machine's external interface: these run only inside a private network
# namespace that has nothing but loopback (as tests/ray does), and skip where none can be made.
IN_LOOPBACK_NAMESPACE = {"ray_cluster.py"}


def _example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.py"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", _example_files(), ids=lambda p: p.name)
def test_example_runs(path: Path, tmp_path: Path) -> None:
    env = dict(os.environ, AIOLOAD_EXAMPLE_SMALL="1", AIOLOAD_EXAMPLE_DATA=str(tmp_path))
    command = [sys.executable, str(path)]
    if path.name in IN_LOOPBACK_NAMESPACE:
        problem = ray_namespace_problem()
        if problem is not None:
            pytest.skip(problem)
        env["RAY_ADDRESS"] = ""
        command = [
            "unshare",
            "-n",
            "sh",
            "-c",
            "ip link set lo up && exec " + shlex.join([sys.executable, str(path)]),
        ]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), f"{path.name} printed nothing"
    assert "Traceback" not in done.stderr, done.stderr
    for expected in EXPECTED.get(path.name, []):
        assert expected in done.stdout, f"{path.name} did not print {expected!r}:\n{done.stdout}"
