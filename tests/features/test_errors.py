"""Errors reach the consumer as torch's DataLoader delivers them.

Dataset, collate and worker_init_fn exceptions keep their type, and carry the worker id and the
worker's traceback; a dead worker or a timeout raises a RuntimeError with torch's wording, fast,
and never hangs; after a per-batch error the epoch goes on; argument validation is torch's.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset, SequentialSampler

import aioload
from tests.helpers import batches_and_errors, values, wait_no_children, within
from tests.scripts import datasets
from tests.scripts.datasets import (
    DiesAt,
    DistinctiveError,
    FailingAt,
    Scalars,
    SlowAt,
    Squares,
    TwoArgError,
    collate_failing_on_5,
    init_failing_on_worker_1,
)

pytestmark = [pytest.mark.timeout(60)]

APIS = ["sync", "async"]


# -- helpers ---------------------------------------------------------------------------------


def _epoch(loader: Any, api: str, catch: tuple[type[BaseException], ...] = ()) -> list[Any]:
    """One pass over ``loader``: the batches, with each caught exception in its place.

    Bounded, so an iterator that keeps raising cannot loop forever."""
    limit = len(loader) + 5
    if api == "sync":
        return batches_and_errors(loader, catch, limit)

    async def main() -> list[Any]:
        out: list[Any] = []
        it = aiter(loader)
        while True:
            assert len(out) <= limit, "the iterator does not end"
            try:
                out.append(await anext(it))
            except StopAsyncIteration:
                return out
            except catch as exc:
                out.append(exc)

    return [_detached(x) for x in asyncio.run(main())]


def _first_error(
    loader: Any, api: str, fatal: bool = False
) -> tuple[BaseException, list[Any], float]:
    """Iterate until something raises: (the exception, the batches before it, the monotonic
    time of the raise). With ``fatal``, asking for another batch must not hang either."""
    batches: list[Any] = []
    if api == "sync":
        it = iter(loader)
        try:
            for batch in it:
                batches.append(batch)
        except Exception as exc:
            raised_at = time.monotonic()
            if fatal:
                with pytest.raises((RuntimeError, StopIteration)):
                    next(it)
            return exc, batches, raised_at
        raise AssertionError("the epoch ended without an error")

    async def main() -> tuple[BaseException, list[Any], float]:
        it = aiter(loader)
        try:
            async for batch in it:
                batches.append(batch)
        except Exception as exc:
            raised_at = time.monotonic()
            if fatal:
                with pytest.raises((RuntimeError, StopAsyncIteration)):
                    await anext(it)
            return exc, batches, raised_at
        raise AssertionError("the epoch ended without an error")

    exc, batches, raised_at = asyncio.run(main())
    return _detached(exc), batches, raised_at


def _error_of(fn: Callable[[], Any]) -> tuple[type[BaseException], str]:
    """The type and message of what ``fn()`` raises. The exception itself is dropped (and
    collected), so that a torch iterator its traceback holds stops its workers now."""
    try:
        fn()
    except Exception as exc:
        result = type(exc), str(exc)
    else:
        raise AssertionError("nothing was raised")
    gc.collect()
    return result


def _detached(item: Any) -> Any:
    """An exception caught under ``async for`` without its traceback, whose frames hold the
    iterator. (anyio's worker threads keep the finished root task, and so its result, alive for a
    moment after ``asyncio.run`` returns; the leak check must not depend on that moment.)"""
    if isinstance(item, BaseException):
        item.__traceback__ = None
    return item


@pytest.fixture(autouse=True)
def _clear_collate_record() -> Iterator[None]:
    yield
    datasets.COLLATE_RAISED.clear()


# -- exceptions in user code -----------------------------------------------------------------


# Where user code raises in a worker: (the loader's arguments, the worker that raises, what its
# traceback shows, the values of the batches before the error).
USER_CODE_ERRORS: dict[str, tuple[dict[str, Any], int, list[str], list[list[int]]]] = {
    # batch_size=1, in order, round robin: index 3 is fetched by worker 1.
    "getitem": (
        {"dataset": FailingAt(10, bad=3), "batch_size": 1},
        1,
        [
            "in __getitem__",
            'raise DistinctiveError(f"getitem-marker index {i}")',
            "DistinctiveError: getitem-marker index 3",
        ],
        [[0], [1], [2]],
    ),
    # batch_size=2: index 5 is in batch 2, fetched by worker 0.
    "collate": (
        {"dataset": Squares(12), "batch_size": 2, "collate_fn": collate_failing_on_5},
        0,
        ["in collate_failing_on_5", 'raise DistinctiveError("collate-marker saw index 5")'],
        [[0, 0, 1, 1], [2, 4, 3, 9]],
    ),
    # Batch 0 comes from worker 0, whose init went fine.
    "worker_init_fn": (
        {"dataset": Squares(8), "batch_size": 1, "worker_init_fn": init_failing_on_worker_1},
        1,
        ["in init_failing_on_worker_1", "init-marker worker 1"],
        [[0, 0]],
    ),
}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("case", list(USER_CODE_ERRORS))
def test_user_code_error_keeps_type_worker_id_and_traceback(
    case: str, api: str, no_leaks: None
) -> None:
    kwargs, worker_id, shown, expected_before = USER_CODE_ERRORS[case]
    loader = aioload.DataLoader(num_workers=2, **kwargs)
    exc, before, _ = _first_error(loader, api)
    assert type(exc) is DistinctiveError
    message = str(exc)
    assert message.startswith(
        f"Caught DistinctiveError in DataLoader worker process {worker_id}.\n"
        "Original Traceback (most recent call last):\n"
    )
    for text in shown:
        assert text in message
    assert values(before) == expected_before


def test_getitem_error_message_matches_torch(no_leaks: None) -> None:
    ds = FailingAt(6, bad=3)
    ours = _error_of(lambda: list(aioload.DataLoader(ds, batch_size=1, num_workers=2)))
    # torch's pass goes on after the error, as ours does: it runs to its end here, because a
    # torch iterator dropped mid-pass stops its workers by waiting 5 s for each to exit.
    torch_pass = batches_and_errors(torch.utils.data.DataLoader(ds, batch_size=1, num_workers=2))
    ref = next((type(x), str(x)) for x in torch_pass if isinstance(x, BaseException))
    assert ours[0] is ref[0] is DistinctiveError
    ours_lines, ref_lines = ours[1].splitlines(), ref[1].splitlines()
    assert ours_lines[:2] == ref_lines[:2]
    assert ours_lines[-1] == ref_lines[-1]


@pytest.mark.parametrize("api", APIS)
def test_key_error_keeps_type_and_readable_message(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(KeyErrorAt(6, bad=2), batch_size=1, num_workers=2)
    exc, _, _ = _first_error(loader, api)
    assert type(exc) is KeyError
    # torch's KeyErrorMessage: str() shows the traceback's lines, not a repr of one string.
    assert "Caught KeyError in DataLoader worker process 0.\n" in str(exc)
    assert "keyerror-marker" in str(exc)


class KeyErrorAt(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise KeyError("keyerror-marker")
        return torch.tensor([i])


@pytest.mark.no_local_workers("num_workers=0: the caller runs the samples")
@pytest.mark.parametrize("api", APIS)
def test_getitem_error_without_workers_is_the_original_object(api: str, no_leaks: None) -> None:
    ds = FailingAt(6, bad=2)
    exc, before, _ = _first_error(aioload.DataLoader(ds, batch_size=1), api)
    assert exc is ds.raised[-1]
    assert str(exc) == "getitem-marker index 2"
    assert values(before) == [[0], [1]]


@pytest.mark.no_local_workers("num_workers=0: the caller runs the samples")
@pytest.mark.parametrize("api", APIS)
def test_collate_error_without_workers_is_the_original_object(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Squares(12), batch_size=2, collate_fn=collate_failing_on_5)
    exc, _, _ = _first_error(loader, api)
    assert exc is datasets.COLLATE_RAISED[-1]
    assert str(exc) == "collate-marker saw index 5"


@pytest.mark.parametrize("api", APIS)
def test_unbuildable_exception_type_falls_back_to_worker_error(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(FailingAt(6, bad=3, two_arg=True), batch_size=1, num_workers=2)
    exc, _, _ = _first_error(loader, api)
    assert type(exc) is aioload.WorkerError
    assert isinstance(exc, RuntimeError)
    assert isinstance(exc, aioload.LoaderError)
    assert exc.worker_id == 1
    message = str(exc)
    assert message.startswith("Caught TwoArgError in DataLoader worker process 1.\n")
    assert "two-arg-marker index 3" in message
    assert "in __getitem__" in message


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("two_arg", [False, True], ids=["original-type", "worker-error"])
def test_epoch_goes_on_after_a_caught_error(
    api: str, num_workers: int, two_arg: bool, no_leaks: None
) -> None:
    n, bad = 13, 4
    loader = aioload.DataLoader(
        FailingAt(n, bad=bad, two_arg=two_arg), batch_size=1, num_workers=num_workers
    )
    expected_type = TwoArgError if num_workers == 0 and two_arg else DistinctiveError
    if num_workers and two_arg:
        expected_type = aioload.WorkerError
    for _ in range(2):  # and the next epoch is whole too
        out = _epoch(loader, api, catch=(Exception,))
        errors = [i for i, item in enumerate(out) if isinstance(item, BaseException)]
        assert errors == [bad]
        assert type(out[bad]) is expected_type
        assert values([b for b in out if not isinstance(b, BaseException)]) == [
            [i] for i in range(n) if i != bad
        ]


@pytest.mark.parametrize("api", APIS)
def test_epoch_goes_on_after_a_caught_error_out_of_order(api: str, no_leaks: None) -> None:
    n, bad = 17, 6
    loader = aioload.DataLoader(FailingAt(n, bad=bad), batch_size=1, num_workers=2, in_order=False)
    out = _epoch(loader, api, catch=(DistinctiveError,))
    assert sum(isinstance(x, DistinctiveError) for x in out) == 1
    got = sorted(int(x) for x in out if not isinstance(x, BaseException))
    assert got == [i for i in range(n) if i != bad]  # every other batch, exactly once


@pytest.mark.parametrize("api", APIS)
def test_epoch_goes_on_after_collate_errors_with_batches(api: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(
        Squares(12), batch_size=2, num_workers=2, collate_fn=collate_failing_on_5
    )
    out = _epoch(loader, api, catch=(DistinctiveError,))
    assert [isinstance(x, DistinctiveError) for x in out] == [
        False,
        False,
        True,
        False,
        False,
        False,
    ]
    got = [x[:, 0].tolist() for x in out if not isinstance(x, BaseException)]
    assert got == [[0, 1], [2, 3], [6, 7], [8, 9], [10, 11]]


class SamplerError(Exception):
    pass


class FailingBatchSampler:
    """Batches ``[0, 1], [2, 3], ...``; drawing batch ``fail_at`` raises SamplerError."""

    def __init__(self, n: int, fail_at: int) -> None:
        self.n = n
        self.fail_at = fail_at

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(self.n):
            if i == self.fail_at:
                raise SamplerError(f"the sampler failed at batch {i}")
            yield [2 * i, 2 * i + 1]

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize(
    "num_workers, in_order", [(0, True), (2, True), (2, False)], ids=["inline", "2", "unordered"]
)
@pytest.mark.parametrize("api", APIS)
def test_a_failing_sampler_loses_no_batch(
    api: str, num_workers: int, in_order: bool, no_leaks: None
) -> None:
    """NOTE [a failing sampler]: the batches drawn before the sampler failed are all delivered
    (torch loses the one it was handing over when the refill raised), the error comes in the
    place of the batch it failed to make, once, and then the pass is over; a checkpoint taken
    at the error records exactly what was yielded."""
    loader = aioload.DataLoader(
        Squares(40),
        batch_sampler=FailingBatchSampler(10, fail_at=5),
        num_workers=num_workers,
        in_order=in_order,
    )
    states: list[dict[str, Any]] = []

    def record(out: list[Any]) -> None:
        if out and isinstance(out[-1], SamplerError):
            states.append(loader.state_dict())

    out = _epoch_recording(loader, api, record)
    errors = [i for i, item in enumerate(out) if isinstance(item, SamplerError)]
    assert errors == [5]
    got = [x[:, 0].tolist() for x in out if not isinstance(x, BaseException)]
    expected = [[2 * i, 2 * i + 1] for i in range(5)]
    assert (got if in_order else sorted(got)) == expected
    # Exactly what was yielded: a resumed pass would start at the sampler's failing batch.
    assert [s["yielded_prefix"] for s in states] == [5]


def _epoch_recording(loader: Any, api: str, after_each: Callable[[list[Any]], None]) -> list[Any]:
    """``_epoch`` with every caught Exception in its place, calling ``after_each(out)`` after
    each step."""
    limit = len(loader) + 5
    out: list[Any] = []
    if api == "sync":
        it = iter(loader)
        while len(out) <= limit:
            try:
                out.append(next(it))
            except StopIteration:
                return out
            except Exception as exc:
                out.append(exc)
            after_each(out)
        raise AssertionError("the iterator does not end")

    async def main() -> list[Any]:
        it = aiter(loader)
        while len(out) <= limit:
            try:
                out.append(await anext(it))
            except StopAsyncIteration:
                return out
            except Exception as exc:
                out.append(exc)
            after_each(out)
        raise AssertionError("the iterator does not end")

    return asyncio.run(main())


# -- timeouts --------------------------------------------------------------------------------


# Lets a stuck sample go once its test has seen the timeout: a thread worker cannot be killed,
# and an abandoned one still in its sample would outlive the test (a worker process is killed).
_RELEASE = threading.Event()


def _worker_place() -> str:
    """Where this sample runs, as the loader's messages name it (``Place``): a worker
    process by its pid, a worker thread by its name."""
    name = threading.current_thread().name
    return f"thread {name}" if name.startswith("aioload-worker-") else f"pid {os.getpid()}"


class StuckAt(datasets.SlowAt):
    """Waits up to ``seconds`` at index ``slow`` (for ``_RELEASE``, in a thread worker),
    writing where it runs to ``marker`` first."""

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.slow:
            assert self.marker is not None
            Path(self.marker).write_text(_worker_place())
            _RELEASE.wait(self.seconds)
        return torch.tensor([i])


@pytest.mark.parametrize("timeout, shown", [(0.5, "0.5"), (1, "1")])
@pytest.mark.parametrize("api", APIS)
def test_timeout_names_the_worker_and_its_indices(
    api: str, timeout: float, shown: str, tmp_path: Path, no_leaks: None
) -> None:
    marker = tmp_path / "slow-place"
    ds = StuckAt(8, slow=0, seconds=20, marker=str(marker))
    loader = aioload.DataLoader(ds, batch_size=2, num_workers=2, timeout=timeout)
    _RELEASE.clear()
    started = time.monotonic()
    try:
        exc, before, raised_at = _first_error(loader, api)
    finally:
        _RELEASE.set()
    assert before == []
    assert type(exc) is aioload.DataLoaderTimeoutError
    assert isinstance(exc, RuntimeError)
    assert exc.timeout == timeout
    message = str(exc)
    assert message.startswith(f"DataLoader timed out after {shown} seconds")
    # Batch 0 ([0, 1]) is held by worker 0, whose place (its pid, or its thread's name) the
    # dataset wrote down.
    assert f"DataLoader worker 0, {marker.read_text()}," in message
    assert "[0, 1]" in message
    # Not before the timeout (the point); the upper bound is a hang guard (the sample takes 20 s).
    assert timeout * 0.9 <= raised_at - started < timeout + within(10)


def test_timeout_message_matches_torch_prefix(no_leaks: None) -> None:
    # Slow enough for the 0.5 s timeout to fire whatever the load; not so slow that torch's
    # iterator, which lets its worker finish the sample (5 s at most) before it stops, waits.
    ds = SlowAt(4, slow=0, seconds=2.5)
    ours = _error_of(
        lambda: next(iter(aioload.DataLoader(ds, batch_size=1, num_workers=1, timeout=0.5)))
    )
    ref = _error_of(
        lambda: next(
            iter(torch.utils.data.DataLoader(ds, batch_size=1, num_workers=1, timeout=0.5))
        )
    )
    assert ref == (RuntimeError, "DataLoader timed out after 0.5 seconds")
    assert issubclass(ours[0], RuntimeError)
    assert ours[1].startswith(ref[1])


@pytest.mark.parametrize("api", APIS)
def test_timeout_does_not_fire_on_a_slow_but_steady_epoch(api: str, no_leaks: None) -> None:
    # Each batch takes ~0.15 s, the epoch well over the timeout: the timeout is per batch.
    ds = Scalars(16, delay=0.15)
    out = _epoch(aioload.DataLoader(ds, batch_size=1, num_workers=2, timeout=1.5), api)
    assert values(out) == [[i] for i in range(16)]


@pytest.mark.no_local_workers("num_workers=0: refused before any worker starts")
def test_timeout_without_workers_is_refused_like_torch() -> None:
    ds = Squares(4)
    with pytest.raises(AssertionError) as ref:
        iter(torch.utils.data.DataLoader(ds, timeout=1))
    with pytest.raises(AssertionError) as ours:
        iter(aioload.DataLoader(ds, timeout=1))
    assert str(ours.value) == str(ref.value)


# -- dead workers ----------------------------------------------------------------------------

DEATHS = {
    "sigkill": (r"DataLoader worker \(pid (\d+)\) is killed by signal: ", -9),
    "segv": (r"DataLoader worker \(pid (\d+)\) is killed by signal: ", -11),
    "exit3": (r"DataLoader worker \(pid (\d+)\) exited unexpectedly with exit code 3", 3),
}


@pytest.mark.processes_only(
    "its dataset kills the process it runs in (SIGKILL, SIGSEGV, os._exit): over threads, the test process"
)
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "persistent"])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("how", list(DEATHS))
def test_dead_worker_raises_fast_and_the_loader_recovers(
    how: str, api: str, persistent: bool, tmp_path: Path, no_leaks: None
) -> None:
    pattern, exitcode = DEATHS[how]
    marker = tmp_path / "died"
    n = 10
    ds = DiesAt(n, at=4, how=how, marker=str(marker))
    loader = aioload.DataLoader(ds, batch_size=1, num_workers=2, persistent_workers=persistent)
    exc, before, raised_at = _first_error(loader, api, fatal=True)

    assert type(exc) is aioload.WorkerDiedError
    assert isinstance(exc, RuntimeError)
    match = re.search(pattern, str(exc))
    assert match is not None, str(exc)
    dead_pid_text, fetch_started_text = marker.read_text().split()
    dead_pid = int(dead_pid_text)
    assert int(match.group(1)) == dead_pid
    assert exc.pid == dead_pid
    assert exc.exitcode == exitcode
    assert exc.worker_id == 0  # index 4, batch_size=1: worker 0
    # Measured from the start of the fatal fetch, in the worker, to the raise (a hang guard: a
    # death nobody noticed would leave the pass waiting for good).
    assert raised_at - float(fetch_started_text) < within(5)
    # Whatever came before the error is a prefix of the epoch, in order.
    assert values(before) == [[i] for i in range(len(before))]
    assert len(before) <= 4

    # The pass is over and every worker is gone, the survivor included.
    assert wait_no_children() == []

    # A new pass over the same loader works (the dataset dies only once).
    out = _epoch(loader, api)
    assert values(out) == [[i] for i in range(n)]
    if persistent:
        loader.shutdown()


# -- argument validation ---------------------------------------------------------------------


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


_MAP = Squares(4)
_STREAM = Stream()
_SAMPLER = SequentialSampler(range(4))

VALIDATION: dict[str, tuple[Any, dict[str, Any]]] = {
    "num_workers=-1": (_MAP, {"num_workers": -1}),
    "timeout=-1": (_MAP, {"timeout": -1}),
    "prefetch_factor without workers": (_MAP, {"prefetch_factor": 2}),
    "negative prefetch_factor": (_MAP, {"num_workers": 2, "prefetch_factor": -1}),
    "persistent_workers without workers": (_MAP, {"persistent_workers": True}),
    "shuffle with IterableDataset": (_STREAM, {"shuffle": True}),
    "sampler with IterableDataset": (_STREAM, {"sampler": _SAMPLER}),
    "batch_sampler with IterableDataset": (_STREAM, {"batch_sampler": [[0, 1]]}),
    "sampler and shuffle": (_MAP, {"sampler": _SAMPLER, "shuffle": True}),
    "batch_sampler with batch_size": (_MAP, {"batch_sampler": [[0, 1]], "batch_size": 2}),
    "batch_sampler with shuffle": (_MAP, {"batch_sampler": [[0, 1]], "shuffle": True}),
    "batch_sampler with sampler": (_MAP, {"batch_sampler": [[0, 1]], "sampler": _SAMPLER}),
    "batch_sampler with drop_last": (_MAP, {"batch_sampler": [[0, 1]], "drop_last": True}),
    "batch_size=None with drop_last": (_MAP, {"batch_size": None, "drop_last": True}),
    "bad multiprocessing_context string": (
        _MAP,
        {"num_workers": 2, "multiprocessing_context": "no-such-method"},
    ),
    "multiprocessing_context of a wrong type": (
        _MAP,
        {"num_workers": 2, "multiprocessing_context": 3},
    ),
    "multiprocessing_context without workers": (_MAP, {"multiprocessing_context": "spawn"}),
}


def _raised(ctor: Callable[..., Any], dataset: Any, kwargs: dict[str, Any]) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        ctor(dataset, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.no_local_workers("refused at construction: no worker starts")
@pytest.mark.parametrize("case", list(VALIDATION))
def test_argument_validation_matches_torch(case: str) -> None:
    dataset, kwargs = VALIDATION[case]
    ref_type, ref_message = _raised(torch.utils.data.DataLoader, dataset, kwargs)
    our_type, our_message = _raised(aioload.DataLoader, dataset, kwargs)
    assert ref_type in (ValueError, TypeError)
    assert (our_type, our_message) == (ref_type, ref_message)


@pytest.mark.no_local_workers("num_workers=0: no worker starts")
@pytest.mark.parametrize(
    "attr, value",
    [
        ("batch_size", 3),
        ("drop_last", True),
        ("sampler", _SAMPLER),
        ("batch_sampler", None),
        ("dataset", _MAP),
        ("persistent_workers", True),
    ],
)
def test_setting_locked_attributes_after_init_matches_torch(attr: str, value: Any) -> None:
    ref = torch.utils.data.DataLoader(_MAP, batch_size=2)
    ours = aioload.DataLoader(_MAP, batch_size=2)
    with pytest.raises(ValueError) as ref_info:
        setattr(ref, attr, value)
    with pytest.raises(ValueError) as our_info:
        setattr(ours, attr, value)
    # torch's message names the class; ours says DataLoader like torch's.
    assert (
        str(ref_info.value) == f"{attr} attribute should not be set after DataLoader is initialized"
    )
    assert str(our_info.value) == str(ref_info.value)
    assert ours.batch_size == 2
