"""The feature suites run over both kinds of local worker, as tests/conformance and
tests/contract do: every test here is parametrised by ``worker_method``, ``multiprocessing``
(aioload's default, worker processes) and ``thread`` (``worker_method="thread"``, worker threads
of this process, ``_backends/thread.py``).

Under ``thread``, every ``aioload.DataLoader`` the test builds without saying its
``worker_method`` (and without ``workers=``, or a DataPipe, which run only on processes) gets
thread workers: the test is written once and says nothing of how its workers run. A test that
builds no loader with thread workers under ``thread`` fails there (its thread cell would check
nothing), so what does not apply is said, never assumed:

- ``@pytest.mark.processes_only("why")``: a behaviour of worker processes (a kill, a signal,
  ``/dev/shm``, pickling, the process-wide generators reseeded per worker); runs once, on
  processes.
- ``@pytest.mark.no_local_workers("why")``: the test starts no local workers (``num_workers=0``,
  a fake or Ray backend, a subprocess of its own, no loader at all); runs once, as it is.
- ``@pytest.mark.own_worker_method("why")``: the test passes ``worker_method`` itself (both
  methods, or threads alone: test_threads.py); runs once, as it is.
- ``pytest.mark.threads_pending``: a module whose cells over threads are not yet sorted out
  (issue 45): it runs on processes only, as before. Work left, not a verdict on threads.

Either marks a test, a class or (``pytestmark``) a module. A test that asks for the
``worker_method`` fixture reads which cell it is in.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

import aioload
from aioload._worker.datapipes import is_datapipe

#: The cells; ``AIOLOAD_TEST_WORKER_METHODS=thread`` runs one of them only (a space-separated
#: subset), e.g. to see what fails over threads alone.
WORKER_METHODS = os.environ.get("AIOLOAD_TEST_WORKER_METHODS", "multiprocessing thread").split()
# The test's own outcome, for its thread cell's check (which counts only when the test passed).
_CALL = pytest.StashKey[pytest.TestReport]()
_SINGLE = ("processes_only", "no_local_workers", "own_worker_method", "threads_pending")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "processes_only(reason): a behaviour of worker processes; not run on threads"
    )
    config.addinivalue_line(
        "markers", "no_local_workers(reason): starts no local workers; run once, as it is"
    )
    config.addinivalue_line(
        "markers", "own_worker_method(reason): chooses its worker methods itself; run once"
    )
    config.addinivalue_line(
        "markers", "threads_pending: not yet run over threads (issue 45); runs on processes"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if any(metafunc.definition.get_closest_marker(name) for name in _SINGLE):
        return
    if "worker_method" not in metafunc.fixturenames:
        metafunc.fixturenames.append("worker_method")
    metafunc.parametrize("worker_method", WORKER_METHODS)


def _in_a_thread_worker() -> bool:
    return threading.current_thread().name.startswith("aioload-worker-")


def _refused() -> RuntimeError:
    return RuntimeError(
        "a thread worker tried to end the test process: mark this test processes_only "
        "(tests/features/conftest.py)"
    )


def _kill(kill: Callable[[int, int], None], pid: int, sig: int) -> None:
    if pid == os.getpid() and _in_a_thread_worker():
        raise _refused()
    kill(pid, sig)


def _exit(exit_: Callable[[int], NoReturn], code: int) -> NoReturn:
    if _in_a_thread_worker():
        raise _refused()
    exit_(code)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A thread cell of a test's ``num_workers=0`` case would repeat its ``multiprocessing``
    cell (no workers start): it is left out."""
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("worker_method") == "thread" and params.get("num_workers") == 0:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_CALL] = report
    return report


@pytest.fixture
def worker_method() -> str:
    """The cell's ``worker_method`` (the parametrization overrides this); a test marked to run
    once runs on processes."""
    return "multiprocessing"


@pytest.fixture(autouse=True)
def _local_workers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under the ``thread`` cell, loaders get thread workers (see the module's docstring)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("worker_method") != "thread":
        yield
        return
    built: list[int] = []
    original = aioload.DataLoader.__init__

    @functools.wraps(original)
    def init(self: aioload.DataLoader[Any], dataset: Any, *args: Any, **kwargs: Any) -> None:
        if (
            "worker_method" not in kwargs
            and kwargs.get("workers") is None
            and not is_datapipe(dataset)
        ):
            kwargs["worker_method"] = "thread"
        original(self, dataset, *args, **kwargs)
        if self.worker_method == "thread" and self.num_workers != 0:
            built.append(1)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aioload.DataLoader, "__init__", init)
        # A dataset that ends the process it runs in (a worker's death, scripted) would end
        # the test process from a thread worker: refused there, with what to do.
        patch.setattr(os, "kill", functools.partial(_kill, os.kill))
        patch.setattr(os, "_exit", functools.partial(_exit, os._exit))
        yield
    call = request.node.stash.get(_CALL, None)
    if not built and call is not None and call.passed:
        pytest.fail(
            "no loader with thread workers was built in this test's thread cell: mark it "
            "no_local_workers or processes_only (tests/features/conftest.py)",
            pytrace=False,
        )
