"""What the Ray tests share: one local Ray instance for every inner test of the run (each
``ray.init`` starts Ray's GCS, raylet and a pool of worker processes: seconds on the 2-core
machine), the per-test ``RayWorkers`` with its check that no actor is left, and the outer run
in a loopback-only network namespace.

Ray binds to the machine's external interface by default, and tests may talk only to
127.0.0.1. So one outer test (in test_ray_workers.py) re-runs the inner tests of every Ray test
file in a child inside a private network namespace (``unshare -n``, then ``ip link set lo
up``), where loopback is the only interface; the inner tests run only there
(``AIOLOAD_RAY_NETNS=1``). Where no namespace can be made (not root, no unshare), the outer
test skips and says so.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aioload
from tests.helpers import ray_namespace_problem, within

INSIDE = os.environ.get("AIOLOAD_RAY_NETNS") == "1"
REPO = Path(__file__).resolve().parents[2]
inner = pytest.mark.skipif(not INSIDE, reason="runs inside the private network namespace")


def run_inside_a_namespace(test_files: list[Path], timeout_s: float) -> None:
    """Run the inner tests of ``test_files`` in one pytest, in a private network namespace
    whose only interface is loopback (Ray binds to the machine's address otherwise); skip
    where none can be made."""
    problem = ray_namespace_problem()
    if problem is not None:
        pytest.skip(problem)
    env = {**os.environ, "AIOLOAD_RAY_NETNS": "1", "RAY_ADDRESS": ""}
    paths = " ".join(str(path.relative_to(REPO)) for path in test_files)
    command = (
        "ip link set lo up && exec "
        f"{sys.executable} -m pytest {paths} -q -p no:cacheprovider -o addopts=-ra"
    )
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", command],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    print(done.stdout[-6000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stdout[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


class LocalRay:
    """The run's one-node Ray instance. A test that needs another (the two-node cluster) shuts
    it down; ``ensure`` starts it again for the tests after that one."""

    def __init__(self) -> None:
        import ray

        self.ray = ray
        # A short temp dir: Ray's AF_UNIX socket paths must stay under 107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="aioray-", dir="/tmp")

    def ensure(self) -> None:
        if not self.ray.is_initialized():
            self.ray.init(
                num_cpus=4,
                _temp_dir=self.temp_dir,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )

    def close(self) -> None:
        self.ray.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[LocalRay]:
    local = LocalRay()
    try:
        local.ensure()
        yield local
    finally:
        local.close()


class _Actor:
    def __init__(self, info: dict[str, Any]) -> None:
        self.actor_id = info["ActorID"]
        self.pid = int(info["Pid"])
        self.node_id = info["Address"]["NodeID"]


def alive_actors() -> list[_Actor]:
    """Ray's own record (the GCS's actor table; the state API needs the dashboard)."""
    import ray

    table = ray._private.state.actors()
    return [_Actor(info) for info in table.values() if info["State"] == "ALIVE"]


def assert_no_actors_left() -> None:
    gc.collect()
    deadline = time.monotonic() + within(10)
    while alive_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_actors() == [], "actors left behind"


@pytest.fixture
def ray_workers(ray_session: LocalRay) -> Iterator[aioload.RayWorkers]:
    """RayWorkers for one test, on the run's local Ray; afterwards, no actor of ours is left
    alive."""
    ray_session.ensure()
    yield aioload.RayWorkers(num_cpus=1)
    assert_no_actors_left()
