"""The conformance suite runs each behaviour check against torch's DataLoader and aioload's.

Every test takes the ``loader_cls`` fixture (``torch`` or ``aioload``) and a ``reference``: a
scenario (a function of the loader class) is run with ``reference.run(scenario)``, and
``reference(scenario)`` is torch's result for it, cached for the session (torch runs each
scenario once: under the ``torch`` parametrization, its run is the reference). The
``torch`` parametrization checks what users rely on against torch itself; the ``aioload`` one
checks the same and that aioload's result equals torch's. Expected values come from torch's
run, never from constants.
"""

from __future__ import annotations

import gc
import inspect
import math
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import psutil
import pytest
import torch
import torch.utils.data

import aioload
from tests.helpers import ignore_fork_in_threads

T = TypeVar("T")

TorchDataLoader = torch.utils.data.DataLoader
T_co = TypeVar("T_co", covariant=True)


class ThreadDataLoader(aioload.DataLoader[T_co], Generic[T_co]):
    """aioload's loader with thread workers by default: the same contract, every scenario
    that starts workers running them as threads of this process (``_backends.thread``)."""

    def __init__(self, *args: Any, worker_method: str = "thread", **kwargs: Any) -> None:
        super().__init__(*args, worker_method=worker_method, **kwargs)


# Its signature is aioload's, worker_method's default aside (the argument tests read it).
_signature = inspect.signature(aioload.DataLoader.__init__)
ThreadDataLoader.__init__.__signature__ = _signature.replace(  # type: ignore[attr-defined]
    parameters=[
        p.replace(default="thread") if p.name == "worker_method" else p
        for p in _signature.parameters.values()
    ]
)
# torch's messages name the class (``self.__class__.__name__``): the same as the others'.
ThreadDataLoader.__name__ = ThreadDataLoader.__qualname__ = "DataLoader"


LOADERS: dict[str, type[torch.utils.data.DataLoader[Any]]] = {
    "torch": TorchDataLoader,
    "aioload": aioload.DataLoader,
    # One contract for every backend: the same scenarios over worker threads.
    "aioload-thread": ThreadDataLoader,
}

_REFERENCES: dict[tuple[str, ...], Any] = {}


@pytest.fixture(params=list(LOADERS))
def loader_cls(request: pytest.FixtureRequest) -> type[torch.utils.data.DataLoader[Any]]:
    return LOADERS[request.param]


@pytest.fixture
def is_aioload(loader_cls: type[Any]) -> bool:
    return issubclass(loader_cls, aioload.DataLoader)


@pytest.fixture
def is_thread(loader_cls: type[Any]) -> bool:
    """Whether the scenario's workers are threads (``worker_method="thread"``)."""
    return loader_cls is ThreadDataLoader


class Reference:
    """Torch's result for this test's scenario, computed once per parametrization."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._loader_cls = request.getfixturevalue("loader_cls")
        callspec = getattr(request.node, "callspec", None)
        params = {} if callspec is None else dict(callspec.params)
        params.pop("loader_cls", None)
        self._key = (
            request.node.module.__name__,
            request.node.originalname,
            *(f"{name}={value!r}" for name, value in sorted(params.items())),
        )

    def __call__(self, scenario: Callable[[type[Any]], T], label: str = "") -> T:
        """``scenario(torch.utils.data.DataLoader)``, run at most once per test and label."""
        key = (*self._key, label)
        if key not in _REFERENCES:
            _REFERENCES[key] = scenario(TorchDataLoader)
        result: T = _REFERENCES[key]
        return result

    def run(self, scenario: Callable[[type[Any]], T], label: str = "") -> T:
        """``scenario`` with this test's loader. Under the ``torch`` parametrization the run
        becomes the reference (torch runs each scenario once, not twice)."""
        result = scenario(self._loader_cls)
        if self._loader_cls is TorchDataLoader:
            _REFERENCES[(*self._key, label)] = result
        return result


@pytest.fixture
def reference(request: pytest.FixtureRequest) -> Reference:
    return Reference(request)


@dataclass(frozen=True)
class Raised:
    """What a call raised: the type and the message, comparable across loaders."""

    type: type[BaseException]
    message: str
    error: BaseException


@dataclass(frozen=True)
class Outcome:
    value: Any
    raised: Raised | None
    warnings: list[str]


def outcome(call: Callable[[], Any]) -> Outcome:
    """Run ``call``; keep its value or its exception, and the warnings it emitted."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ignore_fork_in_threads()
        try:
            value = call()
        except Exception as error:  # the exception is the result under test
            _detach(error)
            return Outcome(None, Raised(type(error), str(error), error), _texts(caught))
    return Outcome(value, None, _texts(caught))


def _detach(error: BaseException | None) -> None:
    """Drop the tracebacks of ``error`` and its chain. Their frames hold the iterator that
    raised, and with it the worker processes: a kept (cached) error would keep them alive."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        _detach(error.__cause__)
        error = error.__context__


def _texts(caught: list[warnings.WarningMessage]) -> list[str]:
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def plain(value: Any) -> Any:
    """A batch as plain data that keeps what users can observe: container types (namedtuple
    and dict classes included), tensor dtypes and shapes, numpy dtypes, Python scalar types."""
    if isinstance(value, torch.Tensor):
        return ("Tensor", str(value.dtype), tuple(value.shape), value.tolist())
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.shape, value.tolist())
    if isinstance(value, np.generic):
        return (type(value).__name__, value.item())
    if isinstance(value, dict):
        return (type(value).__name__, {key: plain(item) for key, item in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return (type(value).__name__, tuple(plain(item) for item in value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [plain(item) for item in value])
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


def batches(loader: Any) -> list[Any]:
    """One pass over ``loader``, as plain data."""
    return [plain(batch) for batch in loader]


@pytest.fixture
def no_leaks_with_workers(request: pytest.FixtureRequest, num_workers: int) -> None:
    """``no_leaks`` for the cells of a test's ``num_workers`` parametrization that start
    workers: only workers can leak, and a leak check costs ~0.5 s."""
    if num_workers:
        request.getfixturevalue("no_leaks")


@pytest.fixture
def stop_mp_helpers(request: pytest.FixtureRequest, is_aioload: bool) -> Iterator[None]:
    """spawn and forkserver start multiprocessing's helpers (the resource tracker, the fork
    server), which live as long as the interpreter; they are stopped after the test. Only
    aioload's run is held to the leak check: torch's spawned worker sometimes outlives its
    pass by more than the check's 5 s (its own watchdog polls every 5 s), which is torch's
    behaviour, not the one under test. Its leftovers are ended here so that they cannot fail
    the next test's check."""
    if is_aioload:
        request.getfixturevalue("no_leaks")  # set up first, so its check runs after this
    yield
    gc.collect()
    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    multiprocessing.resource_tracker._resource_tracker._stop()  # type: ignore[attr-defined]
    if not is_aioload:
        # (Given a second to leave on their own, not the watchdog's period: what is left is
        # ended either way, and waiting cost every such test of torch's 10 s.)
        leftover = psutil.Process().children(recursive=True)
        _, alive = psutil.wait_procs(leftover, timeout=1)
        for process in alive:
            process.kill()
        psutil.wait_procs(alive, timeout=5)


def xfail_aioload(request: pytest.FixtureRequest, reason: str) -> None:
    """Mark the ``aioload`` parametrization of this test as a known deviation: strict, so the
    test fails (and the marker must go) once the deviation is fixed. The ``torch``
    parametrization runs as usual."""
    if issubclass(request.getfixturevalue("loader_cls"), aioload.DataLoader):
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


def thread_deviation(request: pytest.FixtureRequest, reason: str) -> bool:
    """Whether this test runs over thread workers, where ``reason`` says why its scenario does
    not apply as it is (a documented deviation of ``worker_method="thread"``; the test then
    checks the deviation itself)."""
    del reason  # (for the reader: each call says why)
    return request.getfixturevalue("loader_cls") is ThreadDataLoader
