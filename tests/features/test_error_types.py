"""Every exception class in aioload.errors crosses a process boundary whole.

The classes are found by introspection, so a class added later is covered without touching
this file: each must pickle with its message and attributes, and be constructible from its
message alone, as the builtins it subclasses are.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

import aioload.errors

pytestmark = pytest.mark.no_local_workers("exception classes only, no loader")


def _error_classes() -> list[type[BaseException]]:
    return sorted(
        (
            value
            for value in vars(aioload.errors).values()
            if isinstance(value, type)
            and issubclass(value, BaseException)
            and value.__module__ == aioload.errors.__name__
        ),
        key=lambda cls: cls.__name__,
    )


def _extra_arguments(cls: type[BaseException]) -> dict[str, Any]:
    """A distinct value for every keyword argument the constructor accepts beyond the message,
    so that losing any one of them on the way through pickle shows."""
    values: dict[str, Any] = {}
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    for number, parameter in enumerate(parameters):
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            values[parameter.name] = 1000 + number
    return values


def test_there_are_error_classes_to_check() -> None:
    names = {cls.__name__ for cls in _error_classes()}
    assert {"LoaderError", "WorkerError", "WorkerDiedError", "DataLoaderTimeoutError"} <= names


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda cls: cls.__name__)
def test_builds_from_its_message_alone(cls: type[BaseException]) -> None:
    error = cls("DataLoader worker (pid 42) is killed by signal: Killed (SIGKILL).")
    again = type(error)(str(error))
    assert type(again) is cls
    assert str(again) == str(error)
    assert again.args == error.args


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda cls: cls.__name__)
def test_pickles_with_message_and_attributes(cls: type[BaseException]) -> None:
    extra = _extra_arguments(cls)
    error = cls("DataLoader timed out after 5 seconds", **extra)
    for name, value in extra.items():
        # The keyword arguments are kept as attributes of the same name.
        assert getattr(error, name) == value, name
    restored = pickle.loads(pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(restored) is cls
    assert str(restored) == str(error)
    assert restored.args == error.args
    assert vars(restored) == vars(error)
    assert isinstance(restored, RuntimeError)
    # Raised in another process and re-raised here, it is still caught as itself.
    with pytest.raises(cls, match="timed out after 5 seconds"):
        raise restored


def test_pickle_keeps_a_worker_death_whole() -> None:
    error = aioload.errors.WorkerDiedError(
        "DataLoader worker (pid 7) exited unexpectedly with exit code 1.",
        worker_id=3,
        pid=7,
        exitcode=1,
    )
    restored = pickle.loads(pickle.dumps(error))
    assert (restored.worker_id, restored.pid, restored.exitcode) == (3, 7, 1)
    timeout = pickle.loads(
        pickle.dumps(aioload.errors.DataLoaderTimeoutError("timed out", timeout=2.5))
    )
    assert timeout.timeout == 2.5
