"""Errors: a dataset's, collate_fn's and worker_init_fn's exceptions, timeouts and dead
workers reach the consumer with torch's type and message."""

from __future__ import annotations

import pickle
import re
import signal
from typing import Any

import pytest

import aioload

from .conftest import Raised, Reference, outcome, thread_deviation
from .datasets import (
    Failing,
    Indices,
    Sleepy,
    Suicidal,
    TwoArgError,
    failing_collate,
    failing_init,
)


def _first_line(message: str) -> str:
    return message.split("\n", 1)[0]


def _raised(call: Any) -> Raised:
    result = outcome(call)
    assert result.raised is not None, "no exception"
    return result.raised


@pytest.mark.parametrize(
    "error, num_workers",
    [
        (ValueError("bad sample 5"), 0),
        (KeyError("no-such-key"), 0),
        (IndexError("index 5 is out"), 0),
        (ValueError("bad sample 5"), 1),
        # torch rebuilds a KeyError's message specially (a KeyError quotes its argument).
        (KeyError("no-such-key"), 1),
    ],
    ids=["ValueError-0", "KeyError-0", "IndexError-0", "ValueError-1", "KeyError-1"],
)
def test_dataset_error(
    error: Exception,
    num_workers: int,
    loader_cls: type[Any],
    reference: Reference,
    no_leaks_with_workers: None,
) -> None:
    """The exception's type, torch's "Caught X in DataLoader worker process N." line, the
    original message and the worker's traceback."""

    def scenario(cls: type[Any]) -> Raised:
        loader = cls(Failing(12, bad=5, error=error), batch_size=2, num_workers=num_workers)
        return _raised(lambda: list(loader))

    got = reference.run(scenario)
    expected = reference(scenario)
    assert got.type is expected.type is type(error)
    assert _first_line(got.message) == _first_line(expected.message)
    assert str(error) in got.message
    if num_workers:
        assert "Original Traceback (most recent call last):" in got.message
        assert "in __getitem__" in got.message
    else:
        assert got.message == expected.message  # the original object, untouched


def test_iteration_goes_on_after_an_error(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """Catching the error and calling next() again yields the following batches, as torch's
    iterator does."""

    def scenario(cls: type[Any]) -> list[Any]:
        loader = cls(Failing(10, bad=3, error=ValueError("three")), batch_size=2, num_workers=2)
        seen: list[Any] = []
        iterator = iter(loader)
        while True:
            try:
                seen.append(next(iterator).tolist())
            except StopIteration:
                return seen
            except ValueError:
                seen.append("ValueError")

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got.count("ValueError") == 1 and len(got) == 5


def test_unbuildable_exception_type(
    loader_cls: type[Any], is_aioload: bool, reference: Reference, no_leaks: None
) -> None:
    """DEVIATION (unbuildable-exception): an exception that cannot be rebuilt from a message
    becomes, in torch, a bare ``RuntimeError`` whose message says so; aioload raises
    ``aioload.WorkerError`` (a ``RuntimeError``, with ``.worker_id``) with torch's
    "Caught X in DataLoader worker process N." line and the traceback."""

    def scenario(cls: type[Any]) -> Raised:
        loader = cls(Failing(6, bad=1, error=TwoArgError(7, "seven")), batch_size=2, num_workers=1)
        return _raised(lambda: list(loader))

    got = reference.run(scenario)
    expected = reference(scenario)
    assert expected.type is RuntimeError
    assert issubclass(got.type, RuntimeError)
    assert "code 7: seven" in got.message
    if is_aioload:
        assert got.type is aioload.WorkerError
        assert isinstance(got.error, aioload.WorkerError) and got.error.worker_id == 0
        assert got.message.startswith("Caught TwoArgError in DataLoader worker process 0.\n")
    else:
        assert got.type is RuntimeError


@pytest.mark.parametrize(
    "where, refusal",
    [
        ({"collate_fn": failing_collate}, "collate refuses a batch of 3"),
        ({"worker_init_fn": failing_init}, "worker_init_fn refuses worker 0"),
    ],
    ids=["collate_fn", "worker_init_fn"],
)
def test_user_function_error(
    where: dict[str, Any],
    refusal: str,
    loader_cls: type[Any],
    reference: Reference,
    no_leaks: None,
) -> None:
    def scenario(cls: type[Any]) -> Raised:
        loader = cls(Indices(6), batch_size=3, num_workers=1, **where)
        return _raised(lambda: list(loader))

    got = reference.run(scenario)
    expected = reference(scenario)
    assert got.type is expected.type is ValueError
    assert _first_line(got.message) == _first_line(expected.message)
    assert refusal in got.message


def test_timeout(
    loader_cls: type[Any], is_aioload: bool, reference: Reference, no_leaks: None
) -> None:
    """DEVIATION (timeout-details): torch raises ``RuntimeError("DataLoader timed out after N
    seconds")``. aioload raises ``aioload.DataLoaderTimeoutError``, a ``RuntimeError`` whose
    message starts with torch's sentence and goes on to name the batch, the worker, its pid and
    the indices it holds."""

    def scenario(cls: type[Any]) -> Raised:
        loader = cls(Sleepy(4, slow=0, seconds=1.5), batch_size=2, num_workers=1, timeout=0.5)
        return _raised(lambda: list(loader))

    got = reference.run(scenario)
    expected = reference(scenario)
    assert expected.message == "DataLoader timed out after 0.5 seconds"
    assert issubclass(got.type, RuntimeError)
    assert got.message.startswith(expected.message)
    if is_aioload:
        assert got.type is aioload.DataLoaderTimeoutError
        assert "worker 0" in got.message and "[0, 1]" in got.message
    else:
        assert got.type is RuntimeError


def test_worker_killed_by_signal(
    loader_cls: type[Any], is_aioload: bool, is_thread: bool, reference: Reference, no_leaks: None
) -> None:
    """A worker that dies of a signal: torch's "DataLoader worker (pid N) is killed by signal:
    Killed." (torch may instead report "DataLoader worker (pid(s) N) exited unexpectedly" when
    its queue notices first). DEVIATION (worker-died): aioload always gives the signal
    sentence, with the signal's name added before the period ("Killed (SIGKILL)."), raised as
    ``aioload.WorkerDiedError`` (a ``RuntimeError``) with ``.pid``, ``.worker_id`` and
    ``.exitcode``. (Not for thread workers: a signal to the process is the consumer's.)"""
    if is_thread:
        pytest.skip("a thread worker is the consumer's process: a signal kills both")

    def scenario(cls: type[Any]) -> Raised:
        loader = cls(Suicidal(8, bad=4, signum=signal.SIGKILL), batch_size=2, num_workers=2)
        return _raised(lambda: list(loader))

    got = reference.run(scenario)
    expected = reference(scenario)
    torch_forms = (
        r"DataLoader worker \(pid \d+\) is killed by signal: Killed\. ",
        r"DataLoader worker \(pid\(s\) [\d, ]+\) exited unexpectedly",
    )
    assert expected.type is RuntimeError
    assert any(re.match(form, expected.message) for form in torch_forms), expected.message
    assert issubclass(got.type, RuntimeError)
    if is_aioload:
        assert got.type is aioload.WorkerDiedError
        assert isinstance(got.error, aioload.WorkerDiedError)
        assert got.message.startswith(
            f"DataLoader worker (pid {got.error.pid}) is killed by signal: Killed (SIGKILL)."
        )
        assert got.error.worker_id == 0 and got.error.exitcode == -signal.SIGKILL
    else:
        assert any(re.match(form, got.message) for form in torch_forms)


def test_errors_cross_a_process_boundary(
    loader_cls: type[Any],
    is_aioload: bool,
    is_thread: bool,
    request: pytest.FixtureRequest,
    no_leaks: None,
) -> None:
    """What a harness that re-raises in another process needs: the error pickles, with its
    message. torch's are builtins, so they do; aioload's must too. (A thread worker cannot
    die of a signal: only its timeout.)"""
    cases: list[tuple[Any, dict[str, Any]]] = [(Sleepy(4, slow=0, seconds=1.5), {"timeout": 0.5})]
    if not is_thread:
        cases.append((Suicidal(4, bad=0, signum=signal.SIGKILL), {}))
    for dataset, kwargs in cases:
        loader = loader_cls(dataset, batch_size=2, num_workers=1, **kwargs)
        raised = _raised(lambda loader=loader: list(loader))
        copy = pickle.loads(pickle.dumps(raised.error))
        assert type(copy) is raised.type and str(copy) == raised.message


def test_an_unpicklable_argument_under_spawn_warns_as_torch_does(
    loader_cls: type[Any],
    reference: Reference,
    request: pytest.FixtureRequest,
    stop_mp_helpers: None,
) -> None:
    # A lambda collate_fn cannot reach a spawned worker. The installed torch decides whether a
    # warning comes with the error (torch's loader gives one from 2.11); the error's type is
    # pickle's either way (aioload's message names the argument on top of pickle's).
    def scenario(cls: type[Any]) -> tuple[type[BaseException] | None, list[str]]:
        loader = cls(
            Indices(8),
            batch_size=2,
            num_workers=1,
            collate_fn=lambda batch: batch,
            multiprocessing_context="spawn",
        )
        result = outcome(lambda: next(iter(loader)))
        pickle_warnings = [w for w in result.warnings if "pickle error" in w]
        return (result.raised.type if result.raised else None), pickle_warnings

    got = reference.run(scenario)
    if thread_deviation(request, "thread workers pickle nothing: a lambda is fine"):
        assert got == (None, [])
        return
    expected = reference(scenario)
    assert got[0] is not None and issubclass(got[0], expected[0] or Exception)
    assert got[1] == expected[1]
