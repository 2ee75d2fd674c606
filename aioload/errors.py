"""Errors aioload raises in the consumer.

The messages that torch users grep for are kept word for word:
``DataLoader worker (pid N) is killed by signal: ...``,
``DataLoader worker (pid N) exited unexpectedly with exit code N`` and
``DataLoader timed out after N seconds``. Each class subclasses RuntimeError, which is what torch
raises in the same situations, so existing ``except RuntimeError`` handlers keep working.

Like the builtins they subclass, every class can be built from its message alone
(``type(e)(str(e))``), and pickles with its message and attributes: a parent test harness, Ray or
a multiprocessing pool that re-raises an error in another process gets it whole. The extra
attributes are therefore keyword arguments with defaults, and live in the instance ``__dict__``,
which ``BaseException.__reduce__`` carries alongside ``args``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DataLoaderTimeoutError",
    "LoaderError",
    "TooManySampleErrors",
    "WorkerDiedError",
    "WorkerError",
]


class LoaderError(RuntimeError):
    """Base class of the errors aioload raises itself: catch it to catch the four below. Not
    raised itself. A ``RuntimeError``, as torch's errors are in the same situations."""


class WorkerError(LoaderError):
    """An exception from dataset or collate code in a worker that could not be re-created with
    its original type (for instance because its constructor takes extra arguments).

    Exceptions that can be re-created are re-raised with their original type instead, with the
    worker id and the worker's traceback in the message, as torch does.

    Attributes:
        worker_id: The worker the exception came from.
    """

    def __init__(self, message: str, *, worker_id: int | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class WorkerDiedError(LoaderError):
    """A worker process ended while the loader still needed it: killed by a signal (the
    out-of-memory killer, a crash in a C extension) or exited. The message is torch's
    (``DataLoader worker (pid N) is killed by signal: ...`` or ``... exited unexpectedly with
    exit code N``), followed by the indices the worker held. With ``max_worker_restarts``, the
    worker is replaced instead while restarts are left.

    Attributes:
        worker_id: The worker's id.
        pid: Its process id (``None`` for a Ray actor).
        exitcode: Its exit code; negative: the signal number, as in ``multiprocessing``
            (``None`` for a Ray actor).
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int | None = None,
        pid: int | None = None,
        exitcode: int | None = None,
    ) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode


class DataLoaderTimeoutError(LoaderError):
    """No batch arrived within the loader's ``timeout`` (only with ``timeout > 0``). The message
    starts with torch's ``DataLoader timed out after N seconds``, then names the batch waited
    for, the worker, its pid and the indices it holds.

    Attributes:
        timeout: The loader's ``timeout``, in seconds.
    """

    def __init__(self, message: str, *, timeout: float | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout


class TooManySampleErrors(LoaderError):
    """A pass skipped more samples than ``max_skipped`` allows.

    The message gives the cap, the count, and the last few skipped indices with their errors.

    Attributes:
        max_skipped: The cap, as a count of samples (a fraction already resolved).
        count: The number of samples skipped.
        skipped: The pass's records (`aioload.SkippedSample`).
    """

    def __init__(
        self,
        message: str,
        *,
        max_skipped: int | None = None,
        count: int = 0,
        skipped: tuple[Any, ...] = (),
    ) -> None:
        super().__init__(message)
        self.max_skipped = max_skipped
        self.count = count
        self.skipped = skipped
