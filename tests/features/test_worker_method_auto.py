"""``worker_method="auto"``: threads or processes, chosen once per loader by measurement
(``aioload._backends.method_choice``), and reported in ``stats()["tuning"]``."""

from __future__ import annotations

import random
import sys
import threading
import time
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import aioload

pytestmark = [
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.own_worker_method('every test here passes worker_method="auto" itself'),
]


class Tensors(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64,), i)


class Streams(IterableDataset[int]):
    """Each worker's own stream: iter() makes a new generator, sharded by worker id."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, count = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(wid, 20, count))


class Drawing(Dataset[int]):
    """Draws from the global generator in every fetch."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> int:
        random.random()
        return i


@pytest.mark.parametrize(
    "rates, chosen", [((100.0, 195.0), "thread"), ((100.0, 120.0), "multiprocessing")]
)
def test_auto_chooses_by_the_trial_and_reports_it(
    rates: tuple[float, float], chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioload._backends import method_choice as thread_backend
    from aioload._engine import setup

    monkeypatch.setattr(thread_backend, "_rates", lambda spec, size, workers, drew_rng: rates)
    monkeypatch.setattr(setup, "usable_cores", lambda: 2)
    loader = aioload.DataLoader(Tensors(), batch_size=2, num_workers=2, worker_method="auto")
    assert [int(b[0, 0]) for b in loader] == [0, 2, 4, 6]
    choice = loader.stats().as_dict()["tuning"]["worker_method"]
    assert choice["value"] == chosen and choice["auto"]
    assert choice["samples_per_s_one_thread"] == 100.0
    assert choice["samples_per_s_2_threads"] == rates[1]
    # Chosen once: the next pass neither tries again nor changes its mind.
    monkeypatch.setattr(thread_backend, "_rates", lambda *args: pytest.fail("tried again"))
    assert [int(b[0, 0]) for b in loader] == [0, 2, 4, 6]
    assert loader.stats().as_dict()["tuning"]["worker_method"] == choice


def test_auto_takes_threads_on_a_free_threaded_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    loader = aioload.DataLoader(Streams(), batch_size=2, num_workers=2, worker_method="auto")
    assert sorted(i for b in loader for i in b.tolist()) == list(range(20))
    choice = loader.stats().as_dict()["tuning"]["worker_method"]
    assert (choice["value"], choice["reason"]) == ("thread", "free-threaded interpreter")


def test_auto_does_not_try_an_iterable_dataset() -> None:
    loader = aioload.DataLoader(Streams(), batch_size=2, num_workers=2, worker_method="auto")
    assert sorted(i for b in loader for i in b.tolist()) == list(range(20))
    choice = loader.stats().as_dict()["tuning"]["worker_method"]
    assert choice["value"] == "multiprocessing" and "IterableDataset" in choice["reason"]


@pytest.mark.parametrize("num_workers, cores", [(1, 4), (2, 1)])
def test_one_worker_or_one_core_is_not_tried_and_says_which(
    monkeypatch: pytest.MonkeyPatch, num_workers: int, cores: int
) -> None:
    from aioload._engine import setup

    monkeypatch.setattr(setup, "usable_cores", lambda: cores)
    loader = aioload.DataLoader(
        Tensors(), batch_size=2, num_workers=num_workers, worker_method="auto"
    )
    assert [int(b[0, 0]) for b in loader] == [0, 2, 4, 6]
    choice = loader.stats().as_dict()["tuning"]["worker_method"]
    assert choice["value"] == "multiprocessing"
    assert ("one worker" if num_workers == 1 else "one usable core") in choice["reason"]


def test_a_datapipe_gets_processes() -> None:
    # Each worker shards and reseeds its own copy of a DataPipe: threads share one, so "auto"
    # takes processes (worker_method="thread" refuses it).
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(10)).sharding_filter()
    loader = aioload.DataLoader(pipe, batch_size=2, num_workers=2, worker_method="auto")
    assert sorted(i for b in loader for i in b.tolist()) == list(range(10))
    choice = loader.stats().as_dict()["tuning"]["worker_method"]
    assert choice["value"] == "multiprocessing" and "DataPipe" in choice["reason"]


def test_the_trial_leaves_the_global_generators_as_they_were() -> None:
    from aioload._backends.base import WorkerSpec
    from aioload._backends.method_choice import choose_worker_method

    spec = WorkerSpec(Drawing(), 0, True, None, False, None, 2, 2, None, False)
    random.seed(11)
    choice = choose_worker_method(spec, cores=2)
    assert choice["value"] in ("thread", "multiprocessing")
    assert "samples_per_s_one_thread" in choice
    assert random.random() == random.Random(11).random()


class PerWorkerThread(Dataset[float]):
    """Written for thread workers, as docs/threads.md shows: a client per worker id, and draws
    from the worker's own generators."""

    def __init__(self) -> None:
        self.clients: dict[int, object] = {}

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> float:
        info = torch.utils.data.get_worker_info()
        assert info is not None and info.worker_method == "thread"
        self.clients.setdefault(info.id, object())
        return i + float(torch.rand((), generator=info.rng.torch_generator))


class PerWorkerId(PerWorkerThread):
    """Only the client per worker id (no draws from ``rng``)."""

    def __getitem__(self, i: int) -> float:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        self.clients.setdefault(info.id, object())
        return float(i)


def test_the_trial_threads_are_worker_threads_to_the_dataset() -> None:
    # In the trial, get_worker_info() is a thread worker's (else such a dataset fails there,
    # and "auto" took processes for a failed trial). A dataset that draws from its rng gets
    # threads: under processes it has none and every sample would fail.
    loader = aioload.DataLoader(
        PerWorkerThread(), batch_size=4, num_workers=2, worker_method="auto"
    )
    assert sorted(int(x) for b in loader for x in b.tolist()) == list(range(32))
    choice = loader.stats().as_dict()["tuning"]["worker_method"]
    assert choice["value"] == "thread" and "rng" in choice["reason"]
    assert torch.utils.data.get_worker_info() is None
    loader = aioload.DataLoader(PerWorkerId(), batch_size=4, num_workers=2, worker_method="auto")
    assert sorted(int(x) for b in loader for x in b.tolist()) == list(range(32))
    choice = loader.stats().as_dict()["tuning"]["worker_method"]
    assert "samples/s" in choice["reason"], choice["reason"]


@pytest.mark.parametrize(
    "rates, chosen",
    [
        # Fast samples (a few microseconds): a process's trip to the consumer is most of what
        # each costs it, so threads that scale 1.33x beat the 2 processes' estimate.
        ((300_000.0, 400_000.0), "thread"),
        # Slow samples that do not scale across threads: processes.
        ((1_000.0, 1_100.0), "multiprocessing"),
        # Slow samples that scale (a decoder that releases the GIL): threads.
        ((1_000.0, 1_850.0), "thread"),
    ],
)
def test_auto_weighs_threads_against_the_processes_estimate(
    rates: tuple[float, float], chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioload._backends import method_choice
    from aioload._backends.base import WorkerSpec

    monkeypatch.setattr(method_choice, "_rates", lambda spec, size, workers, drew_rng: rates)
    spec = WorkerSpec(Tensors(), 0, True, None, False, None, 2, 2, None, False)
    choice = method_choice.choose_worker_method(spec, cores=2)
    assert choice["value"] == chosen, choice["reason"]
    estimate = choice["samples_per_s_2_processes_estimated"]
    assert estimate == round(2 / (1 / rates[0] + method_choice._PROCESS_OVERHEAD_PER_SAMPLE_S), 1)
    assert (rates[1] >= 0.9 * estimate) == (chosen == "thread")


def test_a_dataset_that_draws_from_the_global_generators_keeps_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Threads would share the global generators, drawn from in whatever order they run: even
    where threads are faster, "auto" keeps processes, whose draws are reproducible."""
    from aioload._backends import method_choice
    from aioload._backends.base import WorkerSpec

    def rates(spec: Any, size: int, workers: int, drew_rng: Any) -> tuple[float, float]:
        spec.dataset[0]  # (draws, as the real trial's samples would)
        return 100.0, 195.0

    monkeypatch.setattr(method_choice, "_rates", rates)
    spec = WorkerSpec(Drawing(), 0, True, None, False, None, 2, 2, None, False)
    choice = method_choice.choose_worker_method(spec, cores=2)
    assert choice["value"] == "multiprocessing", choice
    assert "process-wide generators" in choice["reason"]
    spec = WorkerSpec(Tensors(), 0, True, None, False, None, 2, 2, None, False)
    assert method_choice.choose_worker_method(spec, cores=2)["value"] == "thread"


class ThreadBound(Dataset[int]):
    """Opens a resource per worker id, bound to the thread that opened it (as a sqlite
    connection is): used from another thread, it fails."""

    def __init__(self) -> None:
        self.owners: dict[int, int] = {}

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        info = torch.utils.data.get_worker_info()
        owner = self.owners.setdefault(info.id, threading.get_ident())
        if owner != threading.get_ident():
            raise RuntimeError("a resource opened in another thread")
        return i


@pytest.mark.timeout(60)
def test_the_trial_leaves_nothing_in_the_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trial runs in a copy of the process: what its samples open per worker stays there,
    and neither the thread workers nor the forked processes meet it (they failed on it)."""
    from aioload._backends import method_choice
    from aioload._engine import setup

    monkeypatch.setattr(setup, "usable_cores", lambda: 2)
    trial = method_choice._rates
    for threads_win in (True, False):
        rates = (100.0, 195.0 if threads_win else 100.0)

        def measured(*args: Any, rates: tuple[float, float] = rates) -> tuple[float, float]:
            trial(*args)  # (the real trial: its samples open what they open)
            return rates

        monkeypatch.setattr(method_choice, "_rates", measured)
        dataset = ThreadBound()
        loader = aioload.DataLoader(
            dataset, batch_size=4, num_workers=2, worker_method="auto", persistent_workers=True
        )
        assert [i for b in loader for i in b.tolist()] == list(range(16))
        chosen = loader.stats().as_dict()["tuning"]["worker_method"]["value"]
        assert chosen == ("thread" if threads_win else "multiprocessing")
        loader.shutdown()


class Locked(Dataset[int]):
    """A slow sample behind the dataset's lock (a shared handle guarded for threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        with self.lock:
            time.sleep(0.5)
            return i


@pytest.mark.timeout(60)
def test_a_sample_the_trial_gave_up_on_does_not_hang_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trial sample still running when the trial gives up held the dataset's lock while the
    worker processes were forked: they inherited it locked, and the pass hung."""
    from aioload._backends import method_choice
    from aioload._engine import setup

    monkeypatch.setattr(setup, "usable_cores", lambda: 2)
    monkeypatch.setattr(method_choice, "_TRIAL_S", 0.01)  # (gives up on a sample after 0.2 s)
    loader = aioload.DataLoader(
        Locked(), batch_size=1, num_workers=2, worker_method="auto", timeout=20
    )
    assert [b.tolist() for b in loader] == [[0], [1], [2], [3]]
    choice = loader.stats().as_dict()["tuning"]["worker_method"]
    assert choice["value"] == "multiprocessing" and "too long" in choice["reason"]


def test_under_async_for_the_trial_runs_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trial takes a fraction of a second: under `async for` it runs in a thread, as the
    workers' start does, never on the loop."""
    import asyncio

    from aioload._engine import passes

    ran_in: list[threading.Thread] = []
    decide = passes.auto_worker_method

    def recorded(spec: Any) -> dict[str, Any]:
        ran_in.append(threading.current_thread())
        return decide(spec)

    monkeypatch.setattr(passes, "auto_worker_method", recorded)

    async def main() -> list[int]:
        loader = aioload.DataLoader(Tensors(), batch_size=2, num_workers=2, worker_method="auto")
        return [int(b[0, 0]) async for b in loader]

    assert asyncio.run(main()) == [0, 2, 4, 6]
    assert len(ran_in) == 1 and ran_in[0] is not threading.main_thread()


_CHATTY = """
import sys, torch, aioload
from torch.utils.data import Dataset

class Chatty(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        print("sample", i, "x" * 200)
        return torch.tensor(i)

print("BEFORE-THE-LOADER")  # (still in the stdout buffer: stdout is a pipe)
loader = aioload.DataLoader(Chatty(), batch_size=8, num_workers=2, worker_method="auto")
assert sum(len(b) for b in loader) == 64
"""


@pytest.mark.timeout(60)
def test_the_trial_writes_nothing_and_nothing_twice() -> None:
    """The trial's copy inherited what the parent had buffered for stdout and wrote it again
    when a sample printed; what the trial's own samples print is not the user's output."""
    import os
    import subprocess

    from tests.helpers import _REPO, within

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _CHATTY],
        capture_output=True,
        text=True,
        timeout=within(50),
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines.count("BEFORE-THE-LOADER") == 1
    # Each sample once, from the workers (the trial's copy prints none of its own).
    printed = sorted(int(line.split()[1]) for line in lines if line.startswith("sample"))
    assert printed == list(range(64))


def test_passes_made_before_the_first_choice_share_one_trial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two iterators made before "auto" has chosen: one trial, one method for both passes."""
    from aioload._engine import passes

    calls: list[int] = []
    decide = passes.auto_worker_method

    def counted(spec: Any) -> dict[str, Any]:
        calls.append(1)
        return decide(spec)

    monkeypatch.setattr(passes, "auto_worker_method", counted)
    loader = aioload.DataLoader(Tensors(), batch_size=2, num_workers=2, worker_method="auto")
    first, second = iter(loader), iter(loader)
    assert int(next(first)[0, 0]) == 0
    assert [int(b[0, 0]) for b in second] == [0, 2, 4, 6]
    assert len(calls) == 1
    choice = loader.stats().as_dict()["tuning"]["worker_method"]
    assert choice["value"] in ("thread", "multiprocessing")
