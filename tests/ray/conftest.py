"""What the Ray tests share: one local Ray instance for every inner test of the run (each
``ray.init`` starts Ray's GCS, raylet and a pool of worker processes: seconds on the 2-core
machine), the per-test ``RayWorkers`` with its check that no actor is left, and the outer run
in a loopback-only network namespace.

Ray binds to the machine's external interface by default, and tests may talk only to
127.0.0.1. So one outer test (in test_ray_workers.py) re-runs the inner tests of every Ray test
file, and the Ray cases of the backend contract (tests/contract), in one child inside a private
network namespace (``unshare -n``, then ``ip link set lo up``), where loopback is the only
interface; the inner tests run only there (``AIOLOAD_RAY_NETNS=1``). One child, not one per
file: each would import torch and start a Ray of its own (seconds each on the 2-core machine).
Where no namespace can be made (not root, no unshare), the outer test skips and says so.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import aioload
from tests.helpers import ray_namespace_problem, within

INSIDE = os.environ.get("AIOLOAD_RAY_NETNS") == "1"
REPO = Path(__file__).resolve().parents[2]
inner = pytest.mark.skipif(not INSIDE, reason="runs inside the private network namespace")


def run_inside_a_namespace(test_paths: list[Path], timeout_s: float) -> None:
    """Run the inner tests of ``test_paths`` in one pytest, in a private network namespace
    whose only interface is loopback (Ray binds to the machine's address otherwise); skip
    where none can be made. The child runs in a session of its own: Ray's processes (GCS,
    raylet, agents, actors) are in its process group, and whatever of it is left when the run
    ends or times out is killed, so that no Ray process outlives the test."""
    problem = ray_namespace_problem()
    if problem is not None:
        pytest.skip(problem)
    env = {**os.environ, "AIOLOAD_RAY_NETNS": "1", "RAY_ADDRESS": ""}
    paths = " ".join(str(path.relative_to(REPO)) for path in test_paths)
    # NOTE: -p no:randomly: the inner tests run in the order given (the two-node test, which
    # ends the one-node Ray, last); a shuffle would start that Ray again, for seconds.
    command = (
        "ip link set lo up && exec "
        f"{sys.executable} -m pytest {paths} -q -p no:cacheprovider -p no:randomly "
        "-o addopts='-ra --durations=15'"
    )
    done = run_in_own_group(["unshare", "-n", "sh", "-c", command], env, timeout_s)
    print(done.stdout[-6000:], done.stderr[-3000:])
    if done.returncode is None:
        pytest.fail(f"the inner Ray tests hung: not done after {timeout_s:.0f} s")
    assert done.returncode == 0, done.stdout[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


class Done(NamedTuple):
    returncode: int | None  # None: timed out
    stdout: str
    stderr: str


def run_in_own_group(argv: list[str], env: dict[str, str], timeout_s: float) -> Done:
    """Run ``argv`` from the repository root in a session (and process group) of its own and
    return its exit status and output; whatever of the group is left when it ends, or when it
    times out (``returncode`` None), is killed. Ray's GCS, raylet and agents do not start
    sessions of their own: a timed-out run killed alone would leave them running."""
    child = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout_s)
        returncode: int | None = child.returncode
    except subprocess.TimeoutExpired:
        _kill_group(child.pid)
        stdout, stderr = child.communicate()
        returncode = None
    finally:
        _kill_group(child.pid)
    return Done(returncode, stdout, stderr)


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of the process group ``pgid`` (none of it, after a clean run)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


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
