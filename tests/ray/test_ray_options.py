"""RayWorkers without a cluster: the optional extra, and that ``import aioload`` needs no Ray;
and the runner of the Ray tests' child (conftest.py) leaves nothing behind when it hangs."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import aioload
from aioload._backends import ray_config as _ray_workers
from tests.helpers import wait_gone, within

from .conftest import run_in_own_group


def test_import_aioload_does_not_import_ray() -> None:
    code = "import sys, aioload; aioload.RayWorkers; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_ray_workers_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "ray" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_ray_workers.importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"pip install 'aioload\[ray\]'"):
        aioload.RayWorkers()


def test_workers_argument_is_checked() -> None:
    with pytest.raises(TypeError, match="workers option should be None"):
        aioload.DataLoader(range(4), workers="ray")  # type: ignore[arg-type]
    options = aioload.RayWorkers(num_cpus=2)
    loader = aioload.DataLoader(range(4), num_workers=2, workers=options)
    assert loader.workers is options


def test_a_hung_child_run_leaves_none_of_its_processes() -> None:
    """What a timed-out namespace run does to Ray's daemons (they do not start sessions of
    their own): a grandchild of the run is killed with it."""
    grandchild = "sleep 1000 & echo $!; wait"
    done = run_in_own_group(["sh", "-c", grandchild], dict(os.environ), timeout_s=within(1))
    assert done.returncode is None, "the run should have timed out"
    pid = int(done.stdout.split()[0])
    assert wait_gone([pid], timeout=5) == [], f"process {pid} outlived the run"
