"""The contract every worker backend passes, as anyio runs one suite over each of its event
loops: the ``backend`` fixture is parametrised over the backend kinds, and each case takes it
and builds its loaders through it (``backend.loader(dataset, ...)``), so that a case is written
once and says nothing of how its workers run.

The kinds:

- ``process``: local worker processes (``num_workers=2``), the default.
- ``inline``: ``num_workers=0``, the calling process as the one worker. A case about several
  workers checks there what torch's loader does with none.
- ``fake``: ``workers=FakeWorkers(...)`` (``_backends/fake.py``): every worker a ``WorkerStep``
  in this process, its answers' timing scripted on a ``VirtualClock``, so that the ordering
  cases take no time. A worker lost or hung is scripted too, rather than done to a process.
- ``ray``: ``workers=aioload.RayWorkers(...)``. Ray binds to the machine's external
  interface, and these tests may reach only loopback, so Ray's cases run only inside a
  loopback-only network namespace (``AIOLOAD_RAY_NETNS=1``, as tests/ray runs; the outer test
  is tests/ray/test_ray_workers.py), on one local Ray for the whole run, under ``for`` only
  (see ``backend``).
- ``thread``: ``worker_method="thread"``, present from the build whose ``DataLoader`` takes
  it; skipped before.

A new backend is done when it passes this suite (docs/architecture.md, "The seam").
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aioload
from aioload._backends.fake import HANG, FakeWorkers, VirtualClock
from tests.contract.datasets import Script, Scripted

KINDS = ["process", "inline", "fake", "ray", "thread"]

#: The front ends every case runs under: ``for``, and ``async for`` on asyncio and on trio.
MODES = ["for", "asyncio", "trio"]

RAY_INSIDE = os.environ.get("AIOLOAD_RAY_NETNS") == "1"

#: How late the fake answers a late batch, on its virtual clock: were the clock the machine's,
#: the case would outlast its hang guard.
LATE_S = 3600.0

# A Ray case starts two actors per pass: seconds each on a small machine, and more under load.
RAY_CASE_TIMEOUT_S = 240


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A Ray case's hang guard is longer than the ini's: its actors start slowly."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend") == "ray":
            item.add_marker(pytest.mark.timeout(RAY_CASE_TIMEOUT_S), append=False)


def thread_workers_problem() -> str | None:
    """Why thread workers cannot be asked for here, or None where they can."""
    if "worker_method" not in inspect.signature(aioload.DataLoader.__init__).parameters:
        return "thread workers not in this build"
    return None


class Backend:
    """One kind of backend, as a case sees it: ``loader(dataset, ...)`` builds an
    ``aioload.DataLoader`` whose workers that backend runs, with the case's script (a late
    batch, a lost or hung worker) carried out the way the backend can."""

    def __init__(self, kind: str, folder: Path) -> None:
        self.kind = kind
        self.folder = folder
        self.fakes: list[FakeWorkers] = []
        self.loaders: list[aioload.DataLoader[Any]] = []
        self.scripts: list[Script] = []

    def __repr__(self) -> str:
        return f"Backend({self.kind!r})"

    @property
    def num_workers(self) -> int:
        return 0 if self.kind == "inline" else 2

    @property
    def own_processes(self) -> bool:
        """Whether each worker is a process of its own (with a pid that is not ours)."""
        return self.kind in ("process", "ray")

    def skip_if_ray(self, why: str) -> None:
        if self.kind == "ray":
            pytest.skip(why)

    def skip_unless_workers(self, why: str) -> None:
        if self.kind == "inline":
            pytest.skip(f"num_workers=0 has no worker to {why}")

    def loader(
        self,
        dataset: Any,
        *,
        late: tuple[int, int | str] | None = None,
        kill: int | None = None,
        hang: int | None = None,
        **options: Any,
    ) -> aioload.DataLoader[Any]:
        """The loader, with ``batch_size=2`` unless given. The script is by batch, for a
        sequential sampler: ``late=(k, j)``: batch ``k`` is answered only after batch ``j``
        has been started, or, with a name for ``j``, after the case's ``signal(j)``;
        ``kill=k``: the worker handed batch ``k`` dies, the first time; ``hang=k``: batch
        ``k`` is never answered, the first time it is asked for."""
        options.setdefault("batch_size", 2)
        options.setdefault("num_workers", self.num_workers)
        size = options["batch_size"]
        if self.kind == "fake":
            options["workers"] = self._fake(late, kill, hang)
        elif late is not None or kill is not None or hang is not None:
            if kill is not None and not self.own_processes:
                pytest.skip(f"a {self.kind} worker is no process of its own to kill")
            script = Script(
                self.folder / f"script-{len(self.scripts)}",
                late=None if late is None or self.kind == "inline" else _late(late, size),
                kill=None if kill is None else kill * size,
                hang=None if hang is None else hang * size,
            )
            script.folder.mkdir()
            self.scripts.append(script)
            dataset = Scripted(dataset, script)
        if self.kind == "thread":
            options["worker_method"] = "thread"
        elif self.kind == "ray":
            options["workers"] = aioload.RayWorkers(num_cpus=1)
        made = aioload.DataLoader(dataset, **options)
        self.loaders.append(made)
        return made

    def signal(self, name: str) -> None:
        """Raise the signal ``name`` that a late batch waits for (see ``loader``)."""
        for script in self.scripts:
            script.signal(name)

    def _fake(
        self, late: tuple[int, int | str] | None, kill: int | None, hang: int | None
    ) -> FakeWorkers:
        asked: set[int] = set()

        def delay(task_id: int) -> float:
            first = task_id not in asked
            asked.add(task_id)
            if hang is not None and task_id == hang and first:
                return HANG
            # An hour late, on the virtual clock: it costs no time, it only comes last.
            return LATE_S if late is not None and task_id == late[0] else 0.0

        fake = FakeWorkers(
            delay=delay, lose_on=None if kill is None else {kill}, clock=VirtualClock()
        )
        self.fakes.append(fake)
        return fake

    def close(self) -> None:
        for script in self.scripts:
            script.release()
        for made in self.loaders:
            made.shutdown()


def _late(late: tuple[int, int | str], size: int) -> tuple[int, str]:
    """A late batch's script, by sample: its first sample waits for the signal."""
    batch, after = late
    return batch * size, after if isinstance(after, str) else f"started-{after * size}"


@pytest.fixture(params=KINDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Each backend kind in turn; nothing is left behind after a case: no process, descriptor
    or /dev/shm entry (``no_leaks``), or, on Ray, whose own processes stay, no actor."""
    kind: str = request.param
    if kind == "thread" and (problem := thread_workers_problem()) is not None:
        pytest.skip(problem)
    if kind == "ray":
        if not RAY_INSIDE:
            pytest.skip(
                "Ray binds to the machine's external interface: its cases run inside a "
                "loopback-only network namespace (tests/ray/test_ray_workers.py)"
            )
        if request.node.callspec.params.get("mode", "for") != "for":
            # The front ends are the engine's, whatever the backend; Ray's passes cost seconds
            # each, and tests/ray/test_ray_workers.py runs Ray under asyncio and trio.
            pytest.skip("Ray's contract cases run under `for` only")
        request.getfixturevalue("ray_contract_session")
    elif RAY_INSIDE:
        pytest.skip("inside the namespace only Ray's cases run")
    else:
        request.getfixturevalue("no_leaks")
    made = Backend(kind, tmp_path)
    try:
        yield made
    finally:
        made.close()
    if kind == "ray":
        from tests.ray.conftest import assert_no_actors_left

        assert_no_actors_left()


@pytest.fixture(scope="session")
def ray_contract_session() -> Iterator[None]:
    """One local Ray for every Ray case of the run (``tests.ray.conftest.LocalRay``)."""
    from tests.ray.conftest import LocalRay

    local = LocalRay()
    try:
        local.ensure()
        yield
    finally:
        local.close()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """The front end a case iterates with."""
    return str(request.param)


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
