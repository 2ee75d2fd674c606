"""Bad samples: on_sample_error, max_skipped, sample_retries, loader.stats().skipped.

Datasets here fail on chosen indices (``Flaky``), or fail a few times and then succeed
(``Transient``); every point of docs/reliability.md "Bad samples" has a test.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import aioload
import aioload.loader
from aioload._engine.pinning import Transfer
from aioload._worker.fetch import retry_delay
from tests.helpers import flat, seeded_per_sample

pytestmark = [pytest.mark.timeout(60)]


class Flaky(Dataset[torch.Tensor]):
    """Sample i is tensor(i); the indices in ``bad`` raise ValueError."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.n = n
        self.bad = set(bad)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.bad:
            raise ValueError(f"sample {i} is broken")
        return torch.tensor(i)


class Transient(Dataset[torch.Tensor]):
    """Index i fails its first ``failures.get(i, 0)`` fetches (counted per process: a sample's
    retries run where it was first tried), then succeeds."""

    def __init__(self, n: int, failures: dict[int, int]) -> None:
        self.n = n
        self.failures = dict(failures)
        self.tries: dict[int, int] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.tries[i] = self.tries.get(i, 0) + 1
        if self.tries[i] <= self.failures.get(i, 0):
            raise ConnectionError(f"sample {i}: try {self.tries[i]} failed")
        return torch.tensor(i)


class Counting(Flaky):
    """Flaky, and counts its fetches of each index (meaningful with num_workers=0)."""

    def __init__(self, n: int, bad: set[int]) -> None:
        super().__init__(n, bad)
        self.fetched: dict[int, int] = {}

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetched[i] = self.fetched.get(i, 0) + 1
        return super().__getitem__(i)


class Batched(Flaky):
    """A batched fetch (torch's ``__getitems__``) that fails when any sample of the batch is
    bad; ``__getitem__`` serves the one-by-one fallback."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        if any(i in self.bad for i in indices):
            raise ValueError("the batched fetch failed")
        return [torch.tensor(i) for i in indices]


class AsyncFlaky(Dataset[torch.Tensor]):
    def __init__(self, n: int, bad: set[int]) -> None:
        self.n = n
        self.bad = set(bad)

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        await anyio.sleep(0)
        if i in self.bad:
            raise ValueError(f"sample {i} is broken")
        return torch.tensor(i)


class AsyncBatched(AsyncFlaky):
    async def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        await anyio.sleep(0)
        if any(i in self.bad for i in indices):
            raise ValueError("the batched fetch failed")
        return [torch.tensor(i) for i in indices]


class AsyncTransient(Dataset[torch.Tensor]):
    """Index 0 fails twice (its retries back off 50 ms, then 100 ms); the others take 10 ms.
    ``finished`` is the order in which fetches completed (num_workers=0: this process)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tries = 0
        self.finished: list[int] = []

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0:
            self.tries += 1
            if self.tries <= 2:
                raise ConnectionError("try again")
        else:
            await anyio.sleep(0.01)
        self.finished.append(i)
        return torch.tensor(i)


class Stream(IterableDataset[torch.Tensor]):
    """An iterator that survives its failures: element i is tensor(i), the ``bad`` ones raise.
    Each worker takes every num_workers-th element."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.n = n
        self.bad = set(bad)

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        worker, count = (info.id, info.num_workers) if info is not None else (0, 1)
        return _StreamIterator(iter(range(worker, self.n, count)), self.bad)


class _StreamIterator:
    def __init__(self, items: Iterator[int], bad: set[int]) -> None:
        self.items = items
        self.bad = bad

    def __iter__(self) -> _StreamIterator:
        return self

    def __next__(self) -> torch.Tensor:
        i = next(self.items)
        if i in self.bad:
            raise ValueError(f"element {i} is broken")
        return torch.tensor(i)


class GeneratorStream(IterableDataset[torch.Tensor]):
    """A generator: after it raises, it is finished, so the stream ends there."""

    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad = bad

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.n):
            if i == self.bad:
                raise ValueError(f"element {i} is broken")
            yield torch.tensor(i)


class AsyncStream(aioload.AsyncIterableDataset[torch.Tensor]):
    def __init__(self, n: int, bad: set[int]) -> None:
        self.n = n
        self.bad = set(bad)

    def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        return _AsyncStreamIterator(self.n, self.bad)


class _AsyncStreamIterator:
    def __init__(self, n: int, bad: set[int]) -> None:
        self.i = 0
        self.n = n
        self.bad = bad

    def __aiter__(self) -> _AsyncStreamIterator:
        return self

    async def __anext__(self) -> torch.Tensor:
        if self.i >= self.n:
            raise StopAsyncIteration
        i = self.i
        self.i += 1
        await anyio.sleep(0)
        if i in self.bad:
            raise ValueError(f"element {i} is broken")
        return torch.tensor(i)


class WithLock(Dataset[Any]):
    """Sample ``locked`` carries a threading.Lock: it can be neither collated by
    default_collate nor pickled."""

    def __init__(self, n: int, locked: set[int]) -> None:
        self.n = n
        self.locked = set(locked)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i in self.locked:
            return {"x": torch.tensor(i), "handle": threading.Lock()}
        return {"x": torch.tensor(i)}


class LockAmongTensors(Dataset[Any]):
    """Sample i is tensor(i), but ``locked`` is a threading.Lock, which default_collate
    cannot stack with the tensors, nor collate alone."""

    def __init__(self, n: int, locked: int) -> None:
        self.n = n
        self.locked = locked

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return threading.Lock() if i == self.locked else torch.tensor(i)


class Random(Dataset[torch.Tensor]):
    """A random augmentation per sample; every 5th index is broken."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        value = torch.rand(())
        if i % 5 == 3:
            raise ValueError(f"sample {i} is broken")
        return value


class DiesOnce(Flaky):
    """Flaky, and kills its worker the first time it reaches ``at`` (a marker remembers)."""

    def __init__(self, n: int, bad: set[int], at: int, marker: Path) -> None:
        super().__init__(n, bad)
        self.at = at
        self.marker = str(marker)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.at and not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(7)
        return super().__getitem__(i)


def skip_only_in_workers(index: Any, error: BaseException) -> str:
    """A callable policy that shows where it runs: it skips only inside a worker."""
    return "skip" if aioload.get_worker_info() is not None else "raise"


def skip_value_errors(index: Any, error: BaseException) -> str:
    return "skip" if isinstance(error, ValueError) else "raise"


# -- skip: shorter batches, no empty batch, records --------------------------------------------


# -- skip: shorter batches, no empty batch, records --------------------------------------------


def check_skip_and_records(num_workers: int) -> None:
    loader = aioload.DataLoader(
        Flaky(20, {3, 8, 9, 10, 11}), batch_size=4, num_workers=num_workers, on_sample_error="skip"
    )
    batches = [batch.tolist() for batch in loader]
    # Batch [8..11] lost every sample: it is not yielded at all.
    assert batches == [[0, 1, 2], [4, 5, 6, 7], [12, 13, 14, 15], [16, 17, 18, 19]]
    stats = loader.stats()
    assert [r.index for r in stats.skipped] == [3, 8, 9, 10, 11]
    assert stats.skipped_count == 5
    assert stats.samples == 15 and stats.batches == 4
    record = stats.skipped[0]
    assert record.error == "ValueError: sample 3 is broken"
    assert record.tries == 1
    assert record.worker == (None if num_workers == 0 else 0)
    if num_workers:
        assert {r.worker for r in stats.skipped[1:]} == {0}  # batch 2 went to worker 0
    as_dict = stats.as_dict()
    assert as_dict["skipped_count"] == 5
    assert as_dict["skipped"][0] == {
        "index": 3,
        "error": "ValueError: sample 3 is broken",
        "worker": record.worker,
        "tries": 1,
    }
    table = str(stats)
    assert "skipped samples: 5" in table
    assert "index 11" in table and "ValueError: sample 11 is broken" in table


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_skip_in_the_calling_process() -> None:
    check_skip_and_records(0)


def test_skip_with_workers(no_leaks: None) -> None:
    check_skip_and_records(2)

    async def under_async_for() -> list[int]:
        loader = aioload.DataLoader(
            Flaky(16, {0, 5}), batch_size=4, num_workers=2, on_sample_error="skip"
        )
        seen = [batch.tolist() async for batch in loader]
        assert loader.stats().skipped_count == 2
        return flat(seen)

    assert anyio.run(under_async_for) == [i for i in range(16) if i not in (0, 5)]

    out_of_order = aioload.DataLoader(
        Flaky(32, {3, 4, 5, 6, 20}),
        batch_size=4,
        num_workers=2,
        in_order=False,
        on_sample_error="skip",
    )
    assert sorted(flat(list(out_of_order))) == [i for i in range(32) if i not in (3, 4, 5, 6, 20)]
    assert sorted(r.index for r in out_of_order.stats().skipped) == [3, 4, 5, 6, 20]

    unbatched = aioload.DataLoader(
        Flaky(6, {2}), batch_size=None, num_workers=1, on_sample_error="skip"
    )
    assert [int(x) for x in unbatched] == [0, 1, 3, 4, 5]
    assert [r.index for r in unbatched.stats().skipped] == [2]


# -- raise, and the callable policy ------------------------------------------------------------


def test_raise_is_the_default_and_the_callable_runs_in_the_worker(no_leaks: None) -> None:
    loader = aioload.DataLoader(Flaky(8, {5}), batch_size=4, num_workers=1)
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="sample 5 is broken") as caught:
        next(it)
    assert "in DataLoader worker process 0" in str(caught.value)
    del it, caught
    assert loader.stats().skipped == []

    # The same callable skips in a worker and raises in the calling process.
    workers = aioload.DataLoader(
        Flaky(8, {2}), batch_size=4, num_workers=1, on_sample_error=skip_only_in_workers
    )
    assert flat(list(workers)) == [0, 1, 3, 4, 5, 6, 7]
    in_process = aioload.DataLoader(
        Flaky(8, {2}), batch_size=4, num_workers=0, on_sample_error=skip_only_in_workers
    )
    with pytest.raises(ValueError, match="sample 2 is broken"):
        list(in_process)


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_callable_decides_per_error() -> None:
    class Mixed(Flaky):
        def __getitem__(self, i: int) -> torch.Tensor:
            if i == 6:
                raise KeyError("not a value error")
            return super().__getitem__(i)

    loader = aioload.DataLoader(
        Mixed(8, {1}), batch_size=2, num_workers=0, on_sample_error=skip_value_errors
    )
    it = iter(loader)
    assert [next(it).tolist() for _ in range(3)] == [[0], [2, 3], [4, 5]]
    with pytest.raises(KeyError, match="not a value error"):
        next(it)
    assert [r.index for r in loader.stats().skipped] == [1]


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_callable_with_a_bad_answer_is_an_error() -> None:
    loader = aioload.DataLoader(
        Flaky(4, {1}), batch_size=2, on_sample_error=lambda index, error: "ignore"
    )
    with pytest.raises(ValueError, match=r"must return 'raise' or 'skip'.*'ignore'"):
        list(loader)


# -- the cap -----------------------------------------------------------------------------------


def test_max_skipped_count(no_leaks: None) -> None:
    loader = aioload.DataLoader(
        Flaky(24, {1, 5, 9, 13, 17}),
        batch_size=4,
        num_workers=2,
        on_sample_error="skip",
        max_skipped=3,
    )
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]  # three batches, three skips: within the cap
    assert flat(got) == [0, 2, 3, 4, 6, 7, 8, 10, 11]
    with pytest.raises(aioload.TooManySampleErrors) as caught:
        next(it)
    error = caught.value
    assert isinstance(error, RuntimeError)
    assert error.max_skipped == 3 and error.count == 4
    assert [r.index for r in error.skipped] == [1, 5, 9, 13]
    message = str(error)
    assert "4 samples skipped" in message and "max_skipped=3" in message
    assert "index 13 (worker 1): ValueError: sample 13 is broken" in message
    # The pass is over: asking again raises the same error, not a batch.
    with pytest.raises(aioload.TooManySampleErrors):
        next(it)
    assert loader.stats().skipped_count == 4


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_max_skipped_fraction_of_the_sampler() -> None:
    # 5 % of 100 samples: 5 may be skipped, the 6th is too many.
    ok = aioload.DataLoader(
        Flaky(100, {3, 20, 40, 60, 99}), batch_size=10, on_sample_error="skip", max_skipped=0.05
    )
    assert len(flat(list(ok))) == 95
    over = aioload.DataLoader(
        Flaky(100, {3, 20, 40, 60, 80, 99}),
        batch_size=10,
        on_sample_error="skip",
        max_skipped=0.05,
    )
    with pytest.raises(aioload.TooManySampleErrors, match=r"at most 5 of 100 samples") as caught:
        list(over)
    assert caught.value.max_skipped == 5 and caught.value.count == 6


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_max_skipped_fraction_without_len() -> None:
    # No len: the fraction is of the samples drawn so far, once 1/fraction have been drawn
    # (10 here), so the early skip of element 1 alone does not end the pass.
    ok = aioload.DataLoader(
        Stream(40, {1, 25}), batch_size=5, on_sample_error="skip", max_skipped=0.1
    )
    assert len(flat(list(ok))) == 38
    over = aioload.DataLoader(
        Stream(40, {1, 2, 3}), batch_size=5, on_sample_error="skip", max_skipped=0.1
    )
    with pytest.raises(aioload.TooManySampleErrors, match="drawn so far"):
        list(over)
    # And at the end of a pass shorter than 1/fraction.
    short = aioload.DataLoader(
        Stream(6, {1, 2}), batch_size=5, on_sample_error="skip", max_skipped=0.1
    )
    with pytest.raises(aioload.TooManySampleErrors):
        list(short)


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_too_many_sample_errors_pickles() -> None:
    error = aioload.TooManySampleErrors(
        "too many", max_skipped=2, count=3, skipped=(aioload.SkippedSample(4, "E: x", 1, 2),)
    )
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is aioload.TooManySampleErrors
    assert str(copy) == "too many"
    assert (copy.max_skipped, copy.count, copy.skipped) == (2, 3, error.skipped)
    assert str(aioload.TooManySampleErrors("only a message")) == "only a message"


# -- retries, and batched fetches falling back to one by one -----------------------------------


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_backoff_doubles_from_50_ms() -> None:
    assert [retry_delay(k) for k in range(4)] == [0.05, 0.1, 0.2, 0.4]
    assert retry_delay(30) == 5.0  # capped


def check_transient(num_workers: int) -> None:
    dataset = Transient(8, {2: 2, 5: 1, 6: 9})
    loader = aioload.DataLoader(
        dataset, batch_size=4, num_workers=num_workers, sample_retries=2, on_sample_error="skip"
    )
    assert flat(list(loader)) == [0, 1, 2, 3, 4, 5, 7]
    # Index 6 failed its first try and both retries: one record, three tries.
    (record,) = loader.stats().skipped
    assert (record.index, record.tries) == (6, 3)
    assert record.error == "ConnectionError: sample 6: try 3 failed"


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_transient_failure_succeeds_on_retry() -> None:
    check_transient(0)


def test_retries_and_fallback_in_workers(no_leaks: None) -> None:
    check_transient(1)
    for dataset_class in (Batched, AsyncBatched):
        loader = aioload.DataLoader(
            dataset_class(12, {5}), batch_size=4, num_workers=1, on_sample_error="skip"
        )
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 6, 7], [8, 9, 10, 11]]
        assert [r.index for r in loader.stats().skipped] == [5]


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_failing_getitems_falls_back_in_the_calling_process() -> None:
    loader = aioload.DataLoader(Batched(8, {1}), batch_size=4, on_sample_error="skip")
    assert [b.tolist() for b in loader] == [[0, 2, 3], [4, 5, 6, 7]]


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_retries_alone_still_raise_in_the_end() -> None:
    loader = aioload.DataLoader(Transient(4, {1: 5}), batch_size=2, sample_retries=1)
    with pytest.raises(ConnectionError, match="try 2 failed"):
        list(loader)


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_async_retry_does_not_block_other_fetches() -> None:
    dataset = AsyncTransient(8)

    async def main() -> list[int]:
        loader = aioload.DataLoader(
            dataset, batch_size=8, num_workers=0, worker_concurrency=4, sample_retries=2
        )
        return flat([batch async for batch in loader])

    assert anyio.run(main) == list(range(8))
    # While index 0 backed off (150 ms in all), the other seven fetches all completed.
    assert dataset.finished[-1] == 0 and sorted(dataset.finished[:-1]) == list(range(1, 8))


# -- what is, and is not, a sample error; samples that cannot be sent --------------------------


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_collate_fn_failing_on_the_survivors_is_a_batch_error() -> None:
    def collate(samples: list[torch.Tensor]) -> torch.Tensor:
        if len(samples) > 1:
            raise RuntimeError("collate_fn cannot batch these")
        return torch.stack(samples)

    loader = aioload.DataLoader(
        Flaky(4, {0}), batch_size=4, collate_fn=collate, on_sample_error="skip"
    )
    with pytest.raises(RuntimeError, match="collate_fn cannot batch these"):
        list(loader)
    # No sample is blamed for the collate's failure, and the batch is lost as a whole, with
    # its error: index 0's skip inside it is not counted on its own.
    assert loader.stats().skipped == []


@pytest.mark.processes_only("a sample that cannot be pickled: thread workers pickle nothing")
def test_uncollatable_and_unsendable_samples(no_leaks: None) -> None:
    # default_collate fails on the lock, and on that sample alone too: it is to blame.
    loader = aioload.DataLoader(
        LockAmongTensors(8, 2), batch_size=4, num_workers=1, on_sample_error="skip"
    )
    assert [b.tolist() for b in loader] == [[0, 1, 3], [4, 5, 6, 7]]
    (record,) = loader.stats().skipped
    assert record.index == 2 and record.error.startswith("TypeError: default_collate")

    # A collate that keeps the samples as they are: the lock reaches the transport. In raise
    # mode the error names the sample and what cannot be pickled (sync and async datasets).
    for dataset in (WithLock(8, {5}), AsyncWithLock(8, {5})):
        it = iter(aioload.DataLoader(dataset, batch_size=4, num_workers=1, collate_fn=keep))
        assert [s["x"].item() for s in next(it)] == [0, 1, 2, 3]
        with pytest.raises(TypeError) as caught:
            next(it)
        message = str(caught.value)
        assert "index 5 (builtins.dict)" in message
        assert "cannot pickle '_thread.lock' object" in message
        assert "in DataLoader worker process 0" in message
        del it, caught

    # In skip mode it is skipped, and a batch of nothing but such samples is not yielded.
    for num_workers in (1, 2):
        skipping = aioload.DataLoader(
            WithLock(12, {5, 8, 9, 10, 11}),
            batch_size=4,
            num_workers=num_workers,
            collate_fn=keep,
            on_sample_error="skip",
        )
        batches = [[s["x"].item() for s in batch] for batch in skipping]
        assert batches == [[0, 1, 2, 3], [4, 6, 7]]
        records = skipping.stats().skipped
        assert [r.index for r in records] == [5, 8, 9, 10, 11]
        assert records[0].error == "TypeError: cannot pickle '_thread.lock' object"


@pytest.mark.processes_only(
    "its dataset ends the process it runs in (os._exit): over threads, the test process"
)
def test_worker_failures_are_not_sample_errors(tmp_path: Path, no_leaks: None) -> None:
    def init(worker_id: int) -> None:
        raise OSError("no GPU for this worker")

    failing_init = aioload.DataLoader(
        Flaky(4, set()), batch_size=2, num_workers=1, worker_init_fn=init, on_sample_error="skip"
    )
    with pytest.raises(OSError, match="no GPU for this worker"):
        list(failing_init)

    dying = aioload.DataLoader(
        DiesOnce(8, set(), at=5, marker=tmp_path / "died"),
        batch_size=2,
        num_workers=1,
        on_sample_error="skip",
    )
    with pytest.raises(aioload.WorkerDiedError, match="exit code 7"):
        list(dying)
    assert dying.stats().skipped == []

    slow = aioload.DataLoader(
        Slow(4, set()), batch_size=2, num_workers=1, timeout=0.5, on_sample_error="skip"
    )
    with pytest.raises(aioload.DataLoaderTimeoutError, match=r"timed out after 0\.5 seconds"):
        list(slow)


class Slow(Flaky):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 2:
            time.sleep(3)
        return super().__getitem__(i)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"on_sample_error": "ignore"}, "on_sample_error option should be"),
        ({"on_sample_error": "skip", "max_skipped": 1.5}, "max_skipped option should be"),
        ({"on_sample_error": "skip", "max_skipped": -1}, "max_skipped option should be"),
        ({"on_sample_error": "skip", "max_skipped": True}, "max_skipped option should be"),
        ({"max_skipped": 3}, "on_sample_error='raise' skips none"),
        ({"sample_retries": -1}, "sample_retries option should be"),
        ({"sample_retries": 1.5}, "sample_retries option should be"),
    ],
)
@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        aioload.DataLoader(Flaky(4, set()), **kwargs)


class AsyncWithLock(WithLock):
    async def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        return WithLock.__getitem__(self, i)


def keep(samples: list[Any]) -> list[Any]:
    return samples


# -- resume ------------------------------------------------------------------------------------


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_resume_carries_the_skips_and_does_not_refetch_them() -> None:
    def make(dataset: Dataset[Any]) -> aioload.DataLoader[Any]:
        return aioload.DataLoader(
            dataset,
            batch_size=4,
            shuffle=True,
            generator=torch.Generator().manual_seed(3),
            on_sample_error="skip",
            max_skipped=3,
        )

    bad = {2, 9, 14}
    first = make(Counting(24, bad))
    it = iter(first)
    head = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    skipped_before = [r.index for r in first.stats().skipped]
    del it
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    dataset = Counting(24, bad)
    resumed = make(dataset)
    resumed.load_state_dict(state)
    tail = [b.tolist() for b in resumed]
    assert sorted(flat(head) + flat(tail)) == [i for i in range(24) if i not in bad]
    # The resumed pass fetched none of the batches that were yielded, skipped samples included.
    assert skipped_before, "the checkpoint should come after a skip"
    assert not set(dataset.fetched) & set(skipped_before)
    assert sum(dataset.fetched.values()) == 24 - len(flat(head)) - len(skipped_before)
    # The count went on from the checkpoint's.
    indices = [r.index for r in resumed.stats().skipped]
    assert indices[: len(skipped_before)] == skipped_before and sorted(indices) == sorted(bad)
    assert resumed.stats().skipped_count == 3


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_resume_count_continues_against_the_cap() -> None:
    def make() -> aioload.DataLoader[Any]:
        return aioload.DataLoader(
            Flaky(16, {1, 6, 13}), batch_size=4, on_sample_error="skip", max_skipped=2
        )

    first = make()
    it = iter(first)
    next(it), next(it)  # indices 1 and 6 skipped
    state = first.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    with pytest.raises(aioload.TooManySampleErrors) as caught:
        list(resumed)
    assert [r.index for r in caught.value.skipped] == [1, 6, 13]


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_iterable_resume_carries_the_skips() -> None:
    def make() -> aioload.DataLoader[Any]:
        return aioload.DataLoader(Stream(20, {2, 13}), batch_size=4, on_sample_error="skip")

    first = make()
    it = iter(first)
    head = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()
    del it
    resumed = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fast-forward: Stream has no state_dict
        resumed.load_state_dict(state)
    tail = [b.tolist() for b in resumed]
    assert flat(head) + flat(tail) == [i for i in range(20) if i not in (2, 13)]
    assert [r.index for r in resumed.stats().skipped] == [2, 13]


# -- composition -------------------------------------------------------------------------------


@pytest.mark.processes_only(
    "seed_per_sample seeds the process-wide generators in worker processes only; thread workers seed their rng instead (docs/threads.md; test_threads.py checks it)"
)
def test_seed_per_sample_and_persistent_workers(no_leaks: None) -> None:
    def run(num_workers: int) -> list[list[float]]:
        loader = seeded_per_sample(Random(), num_workers, on_sample_error="skip")
        return [batch.tolist() for batch in loader]

    # The surviving batches are the same whatever the number of workers.
    assert run(0) == run(2)

    persistent = aioload.DataLoader(
        Flaky(12, {4}),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        on_sample_error="skip",
    )
    for _ in range(2):
        assert flat(list(persistent)) == [i for i in range(12) if i != 4]
        # Counted per pass.
        assert [r.index for r in persistent.stats().skipped] == [4]
    persistent.shutdown()


def check_iterable(num_workers: int) -> None:
    loader = aioload.DataLoader(
        Stream(20, {3, 10}), batch_size=3, num_workers=num_workers, on_sample_error="skip"
    )
    assert sorted(flat(list(loader))) == [i for i in range(20) if i not in (3, 10)]
    stats = loader.stats()
    assert stats.skipped_count == 2 and stats.samples == 18
    if num_workers == 0:
        # For an IterableDataset a record's index is the element's place in its stream.
        assert [(r.index, r.worker) for r in stats.skipped] == [(3, None), (10, None)]
    else:
        # Worker 1 holds 3 (its 2nd element, place 1), worker 0 holds 10 (its 6th).
        assert sorted((r.worker, r.index) for r in stats.skipped) == [(0, 5), (1, 1)]


def check_async(num_workers: int) -> None:
    async def main() -> tuple[list[int], list[int], list[int], list[Any]]:
        mapped = aioload.DataLoader(
            AsyncFlaky(12, {1, 7}),
            batch_size=4,
            num_workers=num_workers,
            worker_concurrency=3,
            on_sample_error="skip",
        )
        got = flat([b async for b in mapped])
        stream = aioload.DataLoader(
            AsyncStream(10, {4}), batch_size=4, num_workers=num_workers, on_sample_error="skip"
        )
        streamed = flat([b async for b in stream])
        return got, streamed, [r.index for r in mapped.stats().skipped], stream.stats().skipped

    got, streamed, skipped, stream_skips = anyio.run(main)
    assert got == [0, 2, 3, 4, 5, 6, 8, 9, 10, 11]
    assert sorted(skipped) == [1, 7]
    assert streamed == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert [r.index for r in stream_skips] == [4]


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_iterable_and_async_in_the_calling_process() -> None:
    check_iterable(0)
    check_async(0)


def test_iterable_and_async_in_workers(no_leaks: None) -> None:
    check_iterable(2)
    check_async(1)


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_a_generator_that_raised_has_ended() -> None:
    loader = aioload.DataLoader(GeneratorStream(10, 4), batch_size=3, on_sample_error="skip")
    assert flat(list(loader)) == [0, 1, 2, 3]
    assert [r.index for r in loader.stats().skipped] == [4]


@pytest.mark.processes_only(
    "its dataset ends the process it runs in (os._exit): over threads, the test process"
)
def test_max_worker_restarts(tmp_path: Path, no_leaks: None) -> None:
    loader = aioload.DataLoader(
        DiesOnce(16, {2, 6}, at=6, marker=tmp_path / "died"),
        batch_size=4,
        num_workers=2,
        max_worker_restarts=1,
        on_sample_error="skip",
    )
    with pytest.warns(RuntimeWarning, match="replaced it"):
        got = flat(list(loader))
    assert got == [i for i in range(16) if i not in (2, 6)]
    # Index 6's batch was re-sent to the replacement, and its skip counted once.
    assert [r.index for r in loader.stats().skipped] == [2, 6]


class Clone(Transfer):
    """Stands in for the pin stage's transfer on a machine without an accelerator."""

    def run(self, batch: Any) -> Any:
        return batch.clone()

    def handover(self, result: Any) -> Any:
        return result


def test_all_skipped_batch_through_the_pin_stage(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    monkeypatch.setattr(aioload.loader, "make_transfer", lambda pin, device: Clone())
    loader = aioload.DataLoader(
        Flaky(16, {4, 5, 6, 7, 9}),
        batch_size=4,
        num_workers=1,
        pin_memory=True,
        on_sample_error="skip",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator
        it = iter(loader)
        assert next(it).tolist() == [0, 1, 2, 3]
        # The all-skipped batch [4..7] is recorded in order, as the next batch is handed over.
        assert next(it).tolist() == [8, 10, 11]
        assert [r.index for r in loader.stats().skipped] == [4, 5, 6, 7, 9]
        assert next(it).tolist() == [12, 13, 14, 15]
        assert next(it, None) is None
    assert loader.stats().skipped_count == 5


@pytest.mark.no_local_workers(
    "runs in the calling process (num_workers=0), or refused at construction"
)
def test_progress_bar_shows_the_skips() -> None:
    out = io.StringIO()
    loader = aioload.DataLoader(Flaky(8, {1, 2}), batch_size=4, on_sample_error="skip")
    assert len(flat(list(aioload.progress(loader, file=out)))) == 6
    assert "skipped 2" in out.getvalue()
