"""Async datasets: ``async def __getitem__`` / ``__getitems__`` / ``__aiter__``, fetched
concurrently inside each worker (``worker_concurrency``) and, with ``num_workers=0``, on the
consumer's loop or the private one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import Dataset

import aioload
from tests.helpers import flat, run_on, wait_until, within
from tests.scripts.datasets import Squares

pytestmark = [pytest.mark.timeout(60)]


async def _acollect(loader: Any) -> list[Any]:
    return [batch async for batch in loader]


# -- datasets ------------------------------------------------------------------------------


class AsyncSquares(Dataset[torch.Tensor]):
    """Sleeps a little, differently per index, so that samples complete out of order."""

    def __init__(self, n: int, delay: float = 0.002) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        await anyio.sleep(self.delay * ((i * 7) % 5))
        return torch.tensor([i, i * i])


class InFlight(Dataset[torch.Tensor]):
    """Each sample reports how many fetches of its worker were in flight when it started (or
    when it ended, if more). (Counted per worker id: thread workers share this object.)

    With ``stall`` (a file), a fetch of an index from ``stall_from`` on that starts while the
    file exists touches ``<stall>-<index>`` and sleeps for an hour: it ends only if cancelled.
    """

    def __init__(
        self, n: int, delay: float, stall: Path | None = None, stall_from: int = 0
    ) -> None:
        self.n = n
        self.delay = delay
        self.stall = stall
        self.stall_from = stall_from
        self.in_flight: dict[int, int] = {}

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        me = -1 if info is None else info.id
        self.in_flight[me] = self.in_flight.get(me, 0) + 1
        try:
            seen = self.in_flight[me]
            if self.stall is not None and i >= self.stall_from and self.stall.exists():
                Path(f"{self.stall}-{i}").touch()
                await anyio.sleep(3600)
            await anyio.sleep(self.delay)
            # Let every sibling that can start do so before this one reports.
            return torch.tensor([i, max(seen, self.in_flight[me])])
        finally:
            self.in_flight[me] -= 1


class WhoFetches(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 32

    async def __getitem__(self, i: int) -> torch.Tensor:
        await anyio.sleep(0)
        info = torch.utils.data.get_worker_info()
        ours = aioload.get_worker_info()
        assert info is ours
        return torch.tensor([i, -1 if info is None else info.id])


class Failing(Dataset[torch.Tensor]):
    """Index ``bad`` fails at once; its siblings would take ``slow`` seconds."""

    def __init__(self, n: int, bad: int, slow: float) -> None:
        self.n = n
        self.bad = bad
        self.slow = slow
        self.cancelled: list[int] = []

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            await anyio.sleep(0.01)
            raise ValueError(f"sample {i} is broken")
        if i // 8 == self.bad // 8:
            try:
                await anyio.sleep(self.slow)
            except BaseException:
                self.cancelled.append(i)
                raise
        return torch.tensor(i)


class Augmented(Dataset[torch.Tensor]):
    """Random draws from all three global RNGs, with awaits of index-dependent length in
    between: under concurrency, the draws of different samples interleave."""

    def __len__(self) -> int:
        return 24

    async def __getitem__(self, i: int) -> torch.Tensor:
        a = random.random()
        await anyio.sleep(0.001 * ((i * 5) % 3))
        b = float(torch.rand(()))
        await anyio.sleep(0.001 * ((i * 3) % 4))
        c = float(np.random.rand())
        await anyio.sleep(0)
        return torch.tensor([i, a, b, c], dtype=torch.float64)


class SyncAugmented(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        a = random.random()
        b = float(torch.rand(()))
        c = float(np.random.rand())
        return torch.tensor([i, a, b, c], dtype=torch.float64)


class Batched(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        raise AssertionError("the async __getitems__ should be used")

    async def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        await anyio.sleep(0.001)
        return [torch.tensor(i * 10) for i in indices]


class Counting(aioload.AsyncIterableDataset[torch.Tensor]):
    """0..n-1, split between workers; optionally stateful (state_dict/load_state_dict)."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, self.n, nw):
            await anyio.sleep(0)
            yield torch.tensor(i)


class StatefulCounting(aioload.AsyncIterableDataset[torch.Tensor]):
    """Like Counting, but it can say where it is, and resume there without replaying."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.next_i: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next_i}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_i = state["next"]

    async def __aiter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        start = wid if self.next_i is None else self.next_i
        for i in range(start, self.n, nw):
            self.next_i = i + nw
            await anyio.sleep(0)
            yield torch.tensor(i)


class Forever(Dataset[torch.Tensor]):
    """Every fetch sleeps an hour; the indices whose fetch started, and those cancelled (seen in
    the process that fetches: num_workers=0)."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.cancelled: list[int] = []

    def __len__(self) -> int:
        return 8

    async def __getitem__(self, i: int) -> torch.Tensor:
        self.started.append(i)
        try:
            await anyio.sleep(3600)
        except BaseException:
            self.cancelled.append(i)
            raise
        return torch.tensor(i)


class WithSession(Dataset[torch.Tensor]):
    """Per-worker setup through the dataset's async context; writes what happened to ``log``
    (a directory: workers are processes)."""

    def __init__(self, log: Path, n: int = 16, hang_at: int | None = None) -> None:
        self.log = log
        self.n = n
        self.hang_at = hang_at
        self.session: str | None = None

    def __len__(self) -> int:
        return self.n

    def _note(self, what: str) -> None:
        info = torch.utils.data.get_worker_info()
        wid = "main" if info is None else info.id
        with open(self.log / f"{what}-{os.getpid()}-{wid}-{time.monotonic_ns()}", "w"):
            pass

    async def __aenter__(self) -> WithSession:
        await anyio.sleep(0.001)
        self.session = f"session-{os.getpid()}"
        self._note("enter")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await anyio.sleep(0.001)
        self._note("exit")
        self.session = None

    async def __getitem__(self, i: int) -> torch.Tensor:
        assert self.session == f"session-{os.getpid()}", "fetched outside the session"
        if i == self.hang_at:
            await anyio.sleep(3600)
        await anyio.sleep(0)
        return torch.tensor(i)


def _events(log: Path, what: str) -> list[str]:
    """The workers (``pid-id``: thread workers share a pid) that noted ``what``."""
    return sorted(
        "-".join(name.split("-")[1:3]) for name in os.listdir(log) if name.startswith(what + "-")
    )


# -- order, contents, equivalence with sync --------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_same_batches_as_the_sync_dataset(
    num_workers: int, concurrency: int, no_leaks: None
) -> None:
    def batches(ds: Dataset[Any], **kw: Any) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(3)
        loader = aioload.DataLoader(
            ds, batch_size=5, shuffle=True, generator=generator, num_workers=num_workers, **kw
        )
        return list(loader)

    expected = batches(Squares(53))
    got = batches(AsyncSquares(53), worker_concurrency=concurrency)
    assert len(got) == len(expected) == 11
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_async_for_and_in_order_false(num_workers: int, no_leaks: None) -> None:
    async def main() -> list[Any]:
        loader = aioload.DataLoader(
            AsyncSquares(64),
            batch_size=4,
            num_workers=num_workers,
            in_order=False,
            worker_concurrency=4,
        )
        return await _acollect(loader)

    batches = run_on("uvloop", main)
    firsts = sorted(int(row[0]) for batch in batches for row in batch)
    assert firsts == list(range(64))  # every sample exactly once
    assert all(batch.shape == (4, 2) for batch in batches)


def test_no_batching_and_async_getitems(no_leaks: None) -> None:
    for num_workers in (0, 2):
        singles = list(
            aioload.DataLoader(AsyncSquares(6), batch_size=None, num_workers=num_workers)
        )
        assert [s.tolist() for s in singles] == [[i, i * i] for i in range(6)]
    for num_workers in (0, 2):
        loader = aioload.DataLoader(Batched(), batch_size=6, num_workers=num_workers)
        assert [int(x) for b in loader for x in b] == [i * 10 for i in range(20)]


@pytest.mark.no_local_workers("num_workers=0: the fetches run inline")
@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_inline_on_each_backend(backend: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(AsyncSquares(40), batch_size=8, worker_concurrency=8)

    async def main() -> list[Any]:
        return await _acollect(loader)

    batches = run_on(backend, main)
    assert [int(row[0]) for b in batches for row in b] == list(range(40))


# -- concurrency -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fetches_overlap_up_to_worker_concurrency(num_workers: int, no_leaks: None) -> None:
    delay = 0.05
    loader = aioload.DataLoader(
        InFlight(128, delay), batch_size=32, num_workers=num_workers, worker_concurrency=16
    )
    batches = list(loader)
    assert [int(row[0]) for b in batches for row in b] == list(range(128))
    peak = max(int(row[1]) for b in batches for row in b)
    # Never more than worker_concurrency at once in one process (with workers, the batches a
    # worker gathers at once share its slots), and really that many. The fetches themselves
    # count how many were in flight together: that, not the wall clock, shows the overlap.
    assert peak == 16


@pytest.mark.no_local_workers("num_workers=0: the fetches run inline")
def test_a_batch_at_concurrency_32_fetches_all_32_at_once(no_leaks: None) -> None:
    loader = aioload.DataLoader(InFlight(32, 0.02), batch_size=32, worker_concurrency=32)
    (batch,) = list(loader)
    # The batch takes one fetch's latency, not 32: every fetch was in flight with the 31 others
    # (counted by the fetches, not read off the clock).
    assert int(batch[:, 1].max()) == 32


def test_get_worker_info_inside_async_getitem(no_leaks: None) -> None:
    loader = aioload.DataLoader(WhoFetches(), batch_size=4, num_workers=2, worker_concurrency=4)
    for k, batch in enumerate(loader):
        # torch's round robin: batch k goes to worker k % 2.
        assert batch[:, 1].tolist() == [k % 2] * 4
    assert [int(b[0, 1]) for b in aioload.DataLoader(WhoFetches(), batch_size=4)] == [-1] * 8


# -- errors, timeouts, cancellation ----------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_fetch_cancels_its_siblings_and_the_epoch_goes_on(
    num_workers: int, no_leaks: None
) -> None:
    dataset = Failing(32, bad=11, slow=30.0)
    loader = aioload.DataLoader(
        dataset, batch_size=8, num_workers=num_workers, worker_concurrency=8
    )
    it = iter(loader)
    assert [int(x) for x in next(it)] == list(range(8))
    start = time.monotonic()
    with pytest.raises(ValueError, match="sample 11 is broken") as caught:
        next(it)
    # The siblings' 30 s sleeps were cancelled, not waited for (a guard against that hang; with
    # num_workers=0 the dataset also counts the cancelled siblings, below).
    assert time.monotonic() - start < within(10)
    if num_workers:
        assert "Caught ValueError in DataLoader worker process 1" in str(caught.value)
        assert "__getitem__" in str(caught.value)  # the worker's traceback
    else:
        assert sorted(dataset.cancelled) == [8, 9, 10, 12, 13, 14, 15]
    # Like torch, the epoch goes on after an error.
    assert [int(x) for b in it for x in b] == list(range(16, 32))


def test_timeout_bounds_a_stalled_async_fetch(no_leaks: None) -> None:
    loader = aioload.DataLoader(
        Forever(), batch_size=4, num_workers=2, timeout=0.5, worker_concurrency=4
    )
    start = time.monotonic()
    with pytest.raises(aioload.DataLoaderTimeoutError, match=r"timed out after 0\.5 seconds"):
        next(iter(loader))
    assert time.monotonic() - start < within(5)  # a hang guard: the fetch sleeps an hour


@pytest.mark.no_local_workers("num_workers=0: the fetches run inline")
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancelling_the_consumer_cancels_inline_fetches(backend: str, no_leaks: None) -> None:
    dataset = Forever()

    async def main() -> float:
        loader = aioload.DataLoader(dataset, batch_size=8, worker_concurrency=8)

        async def consume() -> None:
            async with aiter(loader) as it:
                await it.__anext__()

        start = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(consume)
            with anyio.fail_after(within(10)):
                while len(dataset.started) < 8:  # the consumer is cancelled mid-fetch
                    await anyio.sleep(0.001)
            group.cancel_scope.cancel()
        return time.monotonic() - start

    assert run_on(backend, main) < within(5)  # a hang guard: the fetches sleep an hour
    assert sorted(dataset.cancelled) == list(range(8))  # each fetch saw the cancellation


@pytest.mark.no_local_workers("refused at construction: no worker starts")
def test_validation() -> None:
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="worker_concurrency option should be a positive"):
            aioload.DataLoader(AsyncSquares(4), worker_concurrency=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs an async dataset"):
        aioload.DataLoader(Squares(4), worker_concurrency=2)

    async def init(worker_id: int) -> None:
        pass

    with pytest.raises(ValueError, match="async worker_init_fn needs an async dataset"):
        aioload.DataLoader(Squares(4), num_workers=1, worker_init_fn=init)
    with pytest.raises(TypeError, match="is an async dataset"):
        iter(Counting(3))


# -- seeds -----------------------------------------------------------------------------------


@pytest.mark.processes_only(
    "seed_per_sample seeds the process-wide generators in worker processes only; thread workers seed their rng instead (docs/threads.md; test_threads.py checks it)"
)
def test_seed_per_sample_does_not_depend_on_interleaving(no_leaks: None) -> None:
    def batches(ds: Dataset[Any], num_workers: int, concurrency: int) -> list[torch.Tensor]:
        loader = aioload.DataLoader(
            ds,
            batch_size=6,
            num_workers=num_workers,
            seed_per_sample=True,
            generator=torch.Generator().manual_seed(7),
            worker_concurrency=concurrency,
        )
        return list(loader)

    reference = batches(Augmented(), 0, 1)
    draws = torch.cat(reference)[:, 1:]
    assert len(set(draws.flatten().tolist())) == draws.numel()  # really random
    for num_workers, concurrency in [(0, 8), (2, 1), (2, 8)]:
        got = batches(Augmented(), num_workers, concurrency)
        for a, b in zip(got, reference, strict=True):
            assert torch.equal(a, b), (num_workers, concurrency)
    # And the same as the sync version of the dataset.
    for a, b in zip(batches(SyncAugmented(), 2, 1), reference, strict=True):
        assert torch.equal(a, b)


@pytest.mark.no_local_workers("num_workers=0: the fetches run inline")
def test_inline_seed_per_sample_leaves_the_callers_rng_alone(no_leaks: None) -> None:
    random.seed(1)
    torch.manual_seed(1)
    np.random.seed(1)
    before = (random.getstate(), torch.get_rng_state(), np.random.get_state()[1].copy())

    async def main() -> list[Any]:
        loader = aioload.DataLoader(
            Augmented(),
            batch_size=6,
            seed_per_sample=True,
            generator=torch.Generator().manual_seed(7),
            worker_concurrency=6,
        )
        out = []
        async with aiter(loader) as it:
            async for batch in it:
                # The consumer's own draws between batches are its own.
                out.append(batch)
        return out

    run_on("asyncio", main)
    assert random.getstate() == before[0]
    assert torch.equal(torch.get_rng_state(), before[1])
    assert np.array_equal(np.random.get_state()[1], before[2])


# -- iterable datasets and resume ------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_async_iterable_every_sample_once(num_workers: int, no_leaks: None) -> None:
    loader = aioload.DataLoader(Counting(50), batch_size=4, num_workers=num_workers)
    assert sorted(flat(list(loader))) == list(range(50))
    loader = aioload.DataLoader(Counting(50), batch_size=4, num_workers=num_workers, drop_last=True)
    assert all(len(b) == 4 for b in loader)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dataset_class", [Counting, StatefulCounting])
def test_async_iterable_resume(
    num_workers: int, dataset_class: type[Dataset[Any]], worker_method: str, no_leaks: None
) -> None:
    if worker_method == "thread" and dataset_class is StatefulCounting:
        pytest.skip("its place is the dataset object's, shared by thread workers (docs/threads.md)")

    def make() -> aioload.DataLoader[Any]:
        ds: Any = dataset_class(60)  # type: ignore[call-arg]
        return aioload.DataLoader(ds, batch_size=4, num_workers=num_workers)

    full = flat(list(make()))
    loader = make()
    it = iter(loader)
    head = flat([next(it) for _ in range(5)])
    state = loader.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    tail = flat(list(resumed))
    assert head + tail == full


@pytest.mark.processes_only(
    "StatefulCounting keeps its place in the dataset object, which thread workers share (docs/threads.md: a Stateful dataset state is the one object)"
)
def test_async_iterable_resume_under_async_for(no_leaks: None) -> None:
    full = flat(list(aioload.DataLoader(StatefulCounting(40), batch_size=3, num_workers=2)))

    async def main() -> list[int]:
        loader = aioload.DataLoader(StatefulCounting(40), batch_size=3, num_workers=2)
        head = []
        async with aiter(loader) as it:
            for _ in range(4):
                head.append(await it.__anext__())
            state = loader.state_dict()
        resumed = aioload.DataLoader(StatefulCounting(40), batch_size=3, num_workers=2)
        resumed.load_state_dict(state)
        return flat(head) + flat(await _acollect(resumed))

    assert run_on("uvloop", main) == full


# -- per-worker setup and shutdown -----------------------------------------------------------


def test_async_context_entered_once_per_worker_and_exited(
    tmp_path: Path, no_leaks: None, patient_shutdown: None
) -> None:
    loader = aioload.DataLoader(
        WithSession(tmp_path, n=64), batch_size=4, num_workers=2, worker_concurrency=4
    )
    assert flat(list(loader)) == list(range(64))
    entered = _events(tmp_path, "enter")
    assert len(entered) == 2 and len(set(entered)) == 2  # one per worker process
    assert _events(tmp_path, "exit") == entered  # each exited, on shutdown


def test_async_context_with_persistent_workers(
    tmp_path: Path, no_leaks: None, patient_shutdown: None
) -> None:
    loader = aioload.DataLoader(
        WithSession(tmp_path), batch_size=4, num_workers=2, persistent_workers=True
    )
    for _ in range(3):
        assert flat(list(loader)) == list(range(16))
    assert len(_events(tmp_path, "enter")) == 2  # not once per epoch
    assert _events(tmp_path, "exit") == []
    loader.shutdown()
    assert _events(tmp_path, "exit") == _events(tmp_path, "enter")


def test_shutdown_with_fetches_in_flight_still_exits_the_context(
    tmp_path: Path, no_leaks: None, patient_shutdown: None
) -> None:
    loader = aioload.DataLoader(
        WithSession(tmp_path, n=32, hang_at=9), batch_size=4, num_workers=2, worker_concurrency=4
    )
    it = iter(loader)
    assert flat([next(it), next(it)]) == list(range(8))
    it.close()  # worker 0 is stuck in sample 9: the fetch is cancelled, the context exited
    # Two exit events, not a time bound, are the proof: a worker killed after the shutdown
    # grace period, still stuck in the hour-long fetch, would never write its own.
    assert len(_events(tmp_path, "exit")) == 2


@pytest.mark.no_local_workers("num_workers=0: the fetches run inline")
@pytest.mark.parametrize("door", ["for", "async for"])
def test_async_context_inline(door: str, tmp_path: Path, no_leaks: None) -> None:
    loader = aioload.DataLoader(WithSession(tmp_path), batch_size=4)
    if door == "for":
        assert flat(list(loader)) == list(range(16))
    else:
        assert flat(run_on("trio", lambda: _acollect(loader))) == list(range(16))
    assert len(_events(tmp_path, "enter")) == 1
    assert len(_events(tmp_path, "exit")) == 1


# What each worker's init saw, by worker id (thread workers share this module).
_init_loops: dict[int, int] = {}


async def _async_init(worker_id: int) -> None:
    await asyncio.sleep(0.001)
    # Awaited on the worker's own loop, the one its fetches run on.
    _init_loops[worker_id] = id(asyncio.get_running_loop())


class SeesInit(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    async def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        assert info is not None and info.id in _init_loops
        assert _init_loops[info.id] == id(asyncio.get_running_loop())
        return torch.tensor(info.id)


def test_async_worker_init_fn(no_leaks: None) -> None:
    loader = aioload.DataLoader(SeesInit(), batch_size=2, num_workers=2, worker_init_fn=_async_init)
    assert [int(b[0]) for b in loader] == [0, 1, 0, 1]


def test_a_new_pass_cancels_the_stale_fetches_of_persistent_workers(
    tmp_path: Path, no_leaks: None
) -> None:
    stall = tmp_path / "stall"
    stall.touch()
    loader = aioload.DataLoader(
        InFlight(64, 0.01, stall=stall, stall_from=4),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        worker_concurrency=4,
        timeout=within(20),  # waiting behind a stale fetch would wait an hour: fail instead
    )
    try:
        it = iter(loader)
        next(it)
        # The batches sent ahead fill both workers' 4 slots with fetches that end only if
        # cancelled; a break leaves them there.
        assert wait_until(lambda: len(list(tmp_path.glob("stall-*"))) >= 2 * 4)
        del it
        stall.unlink()
        second = iter(loader)
        first_batch = next(second)
        assert first_batch[:, 0].tolist() == [0, 1, 2, 3]
        # The stale fetches were cancelled when the new pass began: they hold no slots, so
        # the new pass's fetches never see more than worker_concurrency in flight, nor wait
        # (the loader's timeout turns such a wait into a failure).
        assert int(first_batch[:, 1].max()) <= 4
        rest = list(second)
        assert [int(row[0]) for b in rest for row in b] == list(range(4, 64))
        assert max(int(row[1]) for b in rest for row in b) <= 4
    finally:
        loader.shutdown()


_ORPHAN_SCRIPT = """
import asyncio, json, os, sys
import torch
import aioload

class Remote(torch.utils.data.Dataset):
    def __len__(self):
        return 100_000

    async def __getitem__(self, i):
        await asyncio.sleep(0.05)
        return torch.tensor(os.getpid())

pids = set()
for batch in aioload.DataLoader(Remote(), batch_size=4, num_workers=2, worker_concurrency=4):
    pids.add(int(batch[0]))
    if len(pids) == 2:
        print(json.dumps(sorted(pids)), flush=True)
        pids.add(-1)
"""


@pytest.mark.processes_only("SIGKILL of the parent, whose worker processes must leave")
def test_async_workers_leave_when_their_parent_is_killed(no_leaks: None) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    workers: list[int] = []
    try:
        assert proc.stdout is not None
        workers = json.loads(proc.stdout.readline())
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # Each worker is awaiting its socket (or its fetches) on its own loop: the parent's
        # death closes the socket, and the reader sees EOF.
        limit = within(5)
        _, alive = psutil.wait_procs([psutil.Process(pid) for pid in workers], timeout=limit)
        assert alive == [], f"workers outlived their parent by {limit} s: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()


class BrokenSetup(AsyncSquares):
    async def __aenter__(self) -> BrokenSetup:
        raise ConnectionRefusedError("the store is down")

    async def __aexit__(self, *exc: object) -> None:
        raise AssertionError("never entered, so never exited")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_setup_fails_the_batches(num_workers: int, no_leaks: None) -> None:
    loader = aioload.DataLoader(BrokenSetup(8), batch_size=4, num_workers=num_workers)
    with pytest.raises(ConnectionRefusedError, match="the store is down"):
        next(iter(loader))
