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
    """Base class of the errors aioload raises itself."""


class WorkerError(LoaderError):
    """An exception from dataset or collate code in a worker that could not be re-created with
    its original type (for instance because its constructor takes extra arguments).

    Exceptions that can be re-created are re-raised with their original type instead, with the
    worker id and the worker's traceback in the message, as torch does.
    """

    def __init__(self, message: str, *, worker_id: int | None = None) -> None:
        super().__init__(message)
        self.worker_id = worker_id


class WorkerDiedError(LoaderError):
    """A worker process ended while the loader still needed it."""

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
    """No batch arrived within the loader's ``timeout``."""

    def __init__(self, message: str, *, timeout: float | None = None) -> None:
        super().__init__(message)
        self.timeout = timeout


class TooManySampleErrors(LoaderError):
    """A pass skipped more samples than ``max_skipped`` allows.

    The message gives the cap, the count, and the last few skipped indices with their errors.
    ``max_skipped`` is the cap as a count of samples (a fraction already resolved), ``count``
    the number skipped, ``skipped`` the records (``aioload.stats.SkippedSample``) of the pass.
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
