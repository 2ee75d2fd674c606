"""Thread workers (``worker_method="thread"``): what holds for them beyond the conformance
suite (which runs every scenario over them too): ``get_worker_info()`` per thread, nothing in
shared memory, a stuck thread abandoned and replaced exactly once, the randomness the docs
promise, and checkpoints that move between worker methods."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import aioload
from tests.helpers import run_fresh, run_on, within

pytestmark = [
    pytest.mark.usefixtures("no_leaks"),
    pytest.mark.own_worker_method("every test here says which worker methods it runs"),
]


class Infos(Dataset[dict[str, Any]]):
    """Each sample: what ``get_worker_info()`` said in the thread that fetched it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        rng = info.rng
        return {
            "index": i,
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "method": info.worker_method,
            "dataset_is_self": info.dataset is self,
            "same_as_aioload": aioload.get_worker_info() is info,
            "thread": threading.get_ident(),
            "draw": rng.random_generator.random(),
        }


def test_get_worker_info_is_each_threads_own() -> None:
    loader = aioload.DataLoader(
        Infos(12),
        batch_size=None,
        num_workers=3,
        worker_method="thread",
        generator=torch.Generator().manual_seed(5),
    )
    seen_elsewhere: list[Any] = []
    samples = []
    for sample in loader:
        # The consumer's thread, and any other thread that is not a worker: None.
        assert torch.utils.data.get_worker_info() is None
        other = threading.Thread(
            target=lambda: seen_elsewhere.append(torch.utils.data.get_worker_info())
        )
        other.start()
        other.join()
        samples.append(sample)
    assert seen_elsewhere == [None] * 12
    assert aioload.get_worker_info() is None
    by_worker: dict[int, set[Any]] = {}
    for s in samples:
        assert s["num_workers"] == 3 and s["method"] == "thread"
        assert s["dataset_is_self"] and s["same_as_aioload"]
        by_worker.setdefault(s["id"], set()).add((s["seed"], s["thread"]))
    # One thread and one seed per worker id, base seed + id, never the consumer's thread.
    assert sorted(by_worker) == [0, 1, 2]
    assert all(len(v) == 1 for v in by_worker.values())
    seeds = {w: next(iter(v))[0] for w, v in by_worker.items()}
    assert seeds[1] == seeds[0] + 1 and seeds[2] == seeds[0] + 2
    assert threading.get_ident() not in {next(iter(v))[1] for v in by_worker.values()}
    # Each worker's rng is seeded with its seed: its first draw is random.Random(seed)'s.
    firsts = {s["id"]: s["draw"] for s in samples if s["index"] < 3}
    assert firsts == {w: random.Random(seeds[w]).random() for w in range(3)}


def test_get_worker_info_imported_before_aioload() -> None:
    """``from torch.utils.data import get_worker_info`` taken before ``import aioload`` is
    torch's function object: it answers per thread too."""
    script = """
from torch.utils.data import Dataset, get_worker_info
import aioload

class D(Dataset):
    def __len__(self): return 4
    def __getitem__(self, i):
        info = get_worker_info()
        return -1 if info is None else info.id

loader = aioload.DataLoader(D(), batch_size=None, num_workers=2, worker_method="thread")
print(sorted(loader), get_worker_info())
"""
    assert run_fresh(script) == "[0, 0, 1, 1] None"


class Tensors(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64,), i)


def _default_collate_inside(batch: list[Any]) -> Any:
    return torch.utils.data.default_collate(batch)


@pytest.mark.parametrize("collate_fn", [None, _default_collate_inside], ids=["default", "custom"])
def test_nothing_goes_to_shared_memory(collate_fn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's collate puts a worker's batch in a fresh shared-memory segment (for its queue);
    a thread hands its batch over by reference, so none is made, even where the user's
    collate_fn calls default_collate."""
    made: list[int] = []
    new_shared = torch.TypedStorage._new_shared

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return new_shared(self, *args, **kwargs)

    monkeypatch.setattr(torch.TypedStorage, "_new_shared", spy)
    loader = aioload.DataLoader(
        Tensors(), batch_size=4, num_workers=2, worker_method="thread", collate_fn=collate_fn
    )
    batches = list(loader)
    assert [b[:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not any(b.is_shared() for b in batches)
    assert made == []


class Stuck(Dataset[int]):
    """Index ``stuck`` blocks its first fetch until ``release`` is set; every fetch is
    counted."""

    def __init__(self, n: int, stuck: int) -> None:
        self.n = n
        self.stuck = stuck
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.fetches: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        with self.lock:
            self.fetches.append(i)
            first = self.fetches.count(i) == 1
        if i == self.stuck and first:
            self.release.wait(within(30))
        return i


def _restarting(dataset: Stuck, prefetch_factor: int = 2) -> aioload.DataLoader[Any]:
    """Two thread workers, a stuck one abandoned after 2 s and replaced (once)."""
    return aioload.DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        worker_method="thread",
        timeout=2.0,
        max_worker_restarts=1,
        prefetch_factor=prefetch_factor,
    )


def test_a_stuck_thread_is_abandoned_and_replaced_exactly_once() -> None:
    dataset = Stuck(16, stuck=5)
    loader = _restarting(dataset)
    try:
        with pytest.warns(RuntimeWarning, match="abandoned"):
            got = [b.tolist() for b in loader]
    finally:
        dataset.release.set()
    # Every index once, in order, though index 5 was fetched twice (its first answer, if it
    # comes, is dropped).
    assert got == [[i, i + 1] for i in range(0, 16, 2)]
    assert dataset.fetches.count(5) == 2


class SlowStuck(Stuck):
    """``Stuck``, each sample taking 20 ms."""

    def __getitem__(self, i: int) -> int:
        time.sleep(0.02)
        return super().__getitem__(i)


def test_an_abandoned_thread_runs_none_of_the_batches_queued_for_it() -> None:
    # Worker 0 holds batches [0, 1], [4, 5], [8, 9], ... (prefetch 4); it sticks in index 4.
    # Its replacement takes over [4, 5] and the batches queued behind it. Unstuck while the
    # pass goes on, the abandoned thread finishes [4, 5] and must fetch nothing more.
    dataset = SlowStuck(48, stuck=4)
    loader = _restarting(dataset, prefetch_factor=4)
    try:
        with pytest.warns(RuntimeWarning, match="abandoned"):
            got = []
            for batch in loader:
                got.append(batch.tolist())
                if got[-1] == [4, 5]:
                    dataset.release.set()
    finally:
        dataset.release.set()
    assert got == [[i, i + 1] for i in range(0, 48, 2)]
    twice = {i for i in dataset.fetches if dataset.fetches.count(i) > 1}
    assert twice <= {4, 5} and 4 in twice


def test_a_stuck_thread_times_out_naming_worker_and_indices() -> None:
    dataset = Stuck(8, stuck=2)
    loader = aioload.DataLoader(
        dataset, batch_size=2, num_workers=2, worker_method="thread", timeout=0.3
    )
    try:
        with pytest.raises(aioload.DataLoaderTimeoutError) as raised:
            list(loader)
    finally:
        dataset.release.set()
    message = str(raised.value)
    assert message.startswith("DataLoader timed out after 0.3 seconds")
    assert "worker 1" in message and "thread aioload-worker-1" in message and "[2, 3]" in message


def test_a_stuck_thread_never_blocks_the_interpreters_exit() -> None:
    script = """
import threading, time
from torch.utils.data import Dataset
import aioload

class Forever(Dataset):
    def __len__(self): return 4
    def __getitem__(self, i):
        threading.Event().wait()  # never returns
        return i

loader = aioload.DataLoader(Forever(), batch_size=2, num_workers=1, worker_method="thread",
                            timeout=0.2)
try:
    list(loader)
except aioload.DataLoaderTimeoutError:
    print("timed out")
"""
    # (The bound is only a hang guard: exit waited for the stuck thread before the fix.)
    assert run_fresh(script, timeout=60) == "timed out"


@pytest.mark.parametrize("persistent", [False, True], ids=["per-pass", "persistent"])
def test_a_thread_in_a_native_op_does_not_abort_the_interpreters_exit(persistent: bool) -> None:
    # A sample that spends about a second inside torch's own C++ (one matmul after another),
    # and a script that takes the first batch and ends: the interpreter's exit found a worker
    # thread still inside the op and aborted ("terminate called without an active
    # exception", status 134) before the exit waited for samples in hand.
    script = f"""
import torch
from torch.utils.data import Dataset
import aioload

class Native(Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        a = torch.randn(1500, 1500)
        for _ in range(10):
            a = a @ a
            a = a / a.norm()
        return a.sum()

loader = aioload.DataLoader(Native(), batch_size=1, num_workers=2, worker_method="thread",
                            persistent_workers={persistent})
for batch in loader:
    break
print("ended")
"""
    assert run_fresh(script, timeout=100) == "ended"


class Failing(Dataset[int]):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        if i == 3:
            raise KeyError(f"no sample {i}")
        return i


def test_an_error_keeps_its_type_and_traceback() -> None:
    loader = aioload.DataLoader(Failing(), batch_size=2, num_workers=2, worker_method="thread")
    with pytest.raises(KeyError) as raised:
        list(loader)
    text = str(raised.value)
    assert "Caught KeyError in DataLoader worker process 1." in text
    assert "no sample 3" in text and "in __getitem__" in text


class Draws(Dataset[list[float]]):
    """Draws from the global generators in a process worker, from the worker's own in a
    thread worker."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> list[float]:
        info = torch.utils.data.get_worker_info()
        rng = info.rng if getattr(info, "worker_method", None) == "thread" else None
        if rng is None:
            return [random.random(), torch.rand(()).item(), float(np.random.rand())]
        return [
            rng.random_generator.random(),
            torch.rand((), generator=rng.torch_generator).item(),
            float(rng.numpy_generator.rand()),
        ]


def test_seed_per_sample_seeds_each_samples_own_generators() -> None:
    """Under threads seed_per_sample cannot seed the global generators (another thread's
    sample would draw from them): it warns at construction, and seeds the worker's rng per
    sample, with what a process worker's globals get, so the draws are the same."""
    kwargs: dict[str, Any] = {"batch_size": None, "seed_per_sample": True, "shuffle": True}
    with pytest.warns(UserWarning, match="seed_per_sample seeds each sample's"):
        threads = aioload.DataLoader(
            Draws(),
            num_workers=2,
            worker_method="thread",
            generator=torch.Generator().manual_seed(1),
            **kwargs,
        )
    processes = aioload.DataLoader(
        Draws(), num_workers=3, generator=torch.Generator().manual_seed(1), **kwargs
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aioload.DataLoader(Draws(), num_workers=2, worker_method="thread")  # no warning
    assert list(threads) == list(processes)


class Methods(Dataset[str]):
    """Each sample: the worker method of the worker that fetched it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> str:
        info = get_worker_info()
        return "caller" if info is None else str(getattr(info, "worker_method", "multiprocessing"))


def test_worker_method_set_after_construction_is_checked_and_runs() -> None:
    """As the constructor checks it: a misspelt value set on the loader ran processes."""
    loader = aioload.DataLoader(Methods(), batch_size=None, num_workers=2, worker_method="thread")
    with pytest.raises(ValueError, match="worker_method option should be"):
        loader.worker_method = "threads"  # type: ignore[assignment]
    assert loader.worker_method == "thread" and set(loader) == {"thread"}
    loader.worker_method = "multiprocessing"
    assert set(loader) == {"multiprocessing"}
    with pytest.warns(UserWarning, match="seed_per_sample"):
        aioload.DataLoader(Methods(), num_workers=2, seed_per_sample=True).worker_method = "thread"


def test_thread_workers_leave_the_global_generators_alone() -> None:
    """A process worker's globals are seeded per worker; a thread's are the consumer's, and no
    thread worker reseeds them."""
    random.seed(7)
    expected = random.Random(7).random()
    loader = aioload.DataLoader(Tensors(), batch_size=2, num_workers=2, worker_method="thread")
    list(loader)
    assert random.random() == expected


class OwnIterator(IterableDataset[int]):
    def __iter__(self) -> Any:
        return self

    def __next__(self) -> int:
        raise StopIteration


def test_an_iterable_that_is_its_own_iterator_is_refused_with_several_threads() -> None:
    loader = aioload.DataLoader(OwnIterator(), num_workers=2, worker_method="thread")
    with pytest.raises(TypeError, match="returns the dataset itself"):
        list(loader)


class OwnAsyncIterator(aioload.AsyncIterableDataset[int]):
    def __init__(self) -> None:
        self.next = 0

    def __aiter__(self) -> OwnAsyncIterator:
        self.next = 0
        return self

    async def __anext__(self) -> int:
        value = self.next
        await asyncio.sleep(0)
        if value >= 20:
            raise StopAsyncIteration
        self.next = value + 1
        return value


def test_an_async_iterable_that_is_its_own_iterator_is_refused_with_several_threads() -> None:
    """As the sync one: the threads would draw from one stream, from loops of their own (it
    gave some samples twice and lost others)."""
    loader = aioload.DataLoader(OwnAsyncIterator(), num_workers=2, worker_method="thread")
    with pytest.raises(TypeError, match=r"__aiter__ returns the dataset itself"):
        list(loader)
    one = aioload.DataLoader(OwnAsyncIterator(), num_workers=1, worker_method="thread")
    assert [int(b) for b in one] == list(range(20))


class Ranged(IterableDataset[int]):
    """torch's IterableDataset docstring example: ``[start, end)``, sharded by a
    ``worker_init_fn`` that changes the worker's dataset (``_shard_by_changing``)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self) -> Any:
        return iter(range(self.start, self.end))


def _shard_by_changing(worker_id: int) -> None:
    info = get_worker_info()
    dataset = info.dataset
    per = -(-(dataset.end - dataset.start) // info.num_workers)
    dataset.start = dataset.start + info.id * per
    dataset.end = min(dataset.start + per, dataset.end)


def _open_a_client(worker_id: int) -> None:
    get_worker_info().dataset.client = object()  # added, not changed: each worker's own


@pytest.mark.parametrize("persistent", [False, True])
def test_sharding_by_changing_the_shared_dataset_is_refused(persistent: bool) -> None:
    """torch's recipe changes each worker's copy of the dataset; thread workers share one, so
    the workers' shards overlapped and missed elements (it gave [3, 4, 4] for range(3, 7),
    then an empty epoch), silently. With one thread worker, or processes, it holds."""
    kwargs: dict[str, Any] = {"worker_init_fn": _shard_by_changing}
    torchs = sorted(
        int(x) for x in torch.utils.data.DataLoader(Ranged(3, 7), num_workers=2, **kwargs)
    )
    assert torchs == [3, 4, 5, 6]
    threads = aioload.DataLoader(
        Ranged(3, 7), num_workers=2, worker_method="thread", persistent_workers=persistent, **kwargs
    )
    with pytest.raises(
        TypeError, match=r"worker_init_fn changed (end|start|end, start) of the Ranged"
    ):
        list(threads)
    threads.shutdown()
    assert (
        sorted(int(x) for x in aioload.DataLoader(Ranged(3, 7), num_workers=2, **kwargs)) == torchs
    )
    one = aioload.DataLoader(Ranged(3, 7), num_workers=1, worker_method="thread", **kwargs)
    assert [int(x) for x in one] == torchs
    # What worker_init_fn adds to the dataset is not a change of it (the last one wins).
    opened = aioload.DataLoader(
        Ranged(0, 8), num_workers=2, worker_method="thread", worker_init_fn=_open_a_client
    )
    assert sorted(int(x) for x in opened) == sorted(2 * list(range(8)))


class AsyncRanged(aioload.AsyncIterableDataset[int]):
    """``Ranged``, async."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    async def __aiter__(self) -> Any:
        for i in range(self.start, self.end):
            await asyncio.sleep(0)
            yield i


async def _shard_by_changing_async(worker_id: int) -> None:
    _shard_by_changing(worker_id)


@pytest.mark.parametrize("init", [_shard_by_changing, _shard_by_changing_async])
def test_an_async_iterable_sharded_by_changing_it_is_refused_too(init: Any) -> None:
    """The same, for an async stream, whichever kind of worker_init_fn changes it (an async
    one runs on the worker's loop, after its setup)."""
    threads = aioload.DataLoader(
        AsyncRanged(0, 8), num_workers=2, worker_method="thread", worker_init_fn=init
    )
    with pytest.raises(TypeError, match=r"worker_init_fn changed (end|start|end, start) of"):
        list(threads)
    processes = aioload.DataLoader(AsyncRanged(0, 8), num_workers=2, worker_init_fn=init)
    assert sorted(int(x) for x in processes) == list(range(8))


class Streams(IterableDataset[int]):
    """Each worker's own stream: iter() makes a new generator, sharded by worker id."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, count = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(wid, 20, count))


def test_iterable_each_thread_its_own_iterator() -> None:
    loader = aioload.DataLoader(Streams(), batch_size=2, num_workers=2, worker_method="thread")
    got = [i for b in loader for i in b.tolist()]
    assert sorted(got) == list(range(20))


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_async_for_each_loop(backend: str) -> None:
    loader = aioload.DataLoader(Tensors(), batch_size=2, num_workers=2, worker_method="thread")

    async def main() -> list[int]:
        return [int(b[0, 0]) async for b in loader]

    assert run_on(backend, main) == [0, 2, 4, 6]


class AsyncSquares(Dataset[int]):
    def __len__(self) -> int:
        return 10

    async def __getitem__(self, i: int) -> int:
        import asyncio

        await asyncio.sleep(0)
        return i * i


def test_async_dataset_on_thread_workers() -> None:
    loader = aioload.DataLoader(
        AsyncSquares(), batch_size=3, num_workers=2, worker_method="thread", worker_concurrency=3
    )
    assert [i for b in loader for i in b.tolist()] == [i * i for i in range(10)]


@pytest.mark.parametrize(
    "first, second", [("thread", "multiprocessing"), ("multiprocessing", "thread")]
)
@pytest.mark.parametrize("taken_after", [0, 3, 7])
def test_a_checkpoint_resumes_under_the_other_worker_method(
    first: str, second: str, taken_after: int
) -> None:
    """A state taken under one worker method resumes, exactly, under the other."""

    def loader(method: str) -> aioload.DataLoader[Any]:
        return aioload.DataLoader(
            Tensors(),
            batch_size=1,
            shuffle=True,
            num_workers=2,
            worker_method=method,
            generator=torch.Generator().manual_seed(3),
        )

    whole = [int(b[0, 0]) for b in loader(first)]
    interrupted = loader(first)
    it = iter(interrupted)
    head = [int(next(it)[0, 0]) for _ in range(taken_after)]
    state = interrupted.state_dict()
    del it
    resumed = loader(second)
    resumed.load_state_dict(state)
    assert head + [int(b[0, 0]) for b in resumed] == whole


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="worker_method option should be"):
        aioload.DataLoader(Tensors(), num_workers=1, worker_method="threads")
    with pytest.raises(ValueError, match="does not support DataPipes"):
        from torch.utils.data.datapipes.iter import IterableWrapper

        aioload.DataLoader(IterableWrapper(range(4)), num_workers=1, worker_method="thread")


def test_auto_worker_count_skipping_and_pinning_run_on_threads() -> None:
    """The engine's features need nothing of the backend beyond the seam: num_workers and
    prefetch_factor "auto" (the controller activates slots), skipped samples, and the pin
    stage (on a machine without an accelerator, torch's warning and plain batches)."""
    tuned = aioload.DataLoader(
        Tensors(), batch_size=2, num_workers="auto", prefetch_factor="auto", worker_method="thread"
    )
    assert [int(b[0, 0]) for b in tuned] == [0, 2, 4, 6]
    assert tuned.stats().as_dict()["tuning"] is not None
    skipping = aioload.DataLoader(
        Failing(), batch_size=2, num_workers=2, worker_method="thread", on_sample_error="skip"
    )
    assert [b.tolist() for b in skipping] == [[0, 1], [2], [4, 5]]
    assert [s.index for s in skipping.stats().skipped] == [3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's, where no accelerator is usable)
        pinned = aioload.DataLoader(
            Tensors(), batch_size=4, num_workers=2, worker_method="thread", pin_memory=True
        )
        assert [b[:, 0].tolist() for b in pinned] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_in_order_false_with_persistent_thread_workers() -> None:
    loader = aioload.DataLoader(
        Stuck(12, stuck=-1),
        batch_size=2,
        num_workers=2,
        worker_method="thread",
        in_order=False,
        persistent_workers=True,
    )
    for _ in range(3):
        assert sorted(i for b in loader for i in b.tolist()) == list(range(12))
    where = loader.stats().as_dict()["workers"]
    assert len(where) == 2
    loader.shutdown()


_INTRA_OP = """
import json, threading
import torch
from torch.utils.data import Dataset
import aioload

class IntraOp(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.get_num_threads()

torch.set_num_threads(2)
loader = aioload.DataLoader(IntraOp(), batch_size=2, num_workers=2, worker_method="thread")
workers = sorted({n for b in loader for n in b.tolist()})
other = []
thread = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
thread.start()
thread.join()
print(json.dumps([workers, torch.get_num_threads(), other[0]]))
"""


def test_each_worker_thread_runs_torch_on_one_intra_op_thread() -> None:
    # As a worker process does (torch.set_num_threads(1)), but the thread's own setting: the
    # consumer's thread, and any thread that is not a worker, keep the process's two.
    # NOTE [ Thread workers' intra-op threads ]
    assert json.loads(run_fresh(_INTRA_OP)) == [[1], 2, 2]
