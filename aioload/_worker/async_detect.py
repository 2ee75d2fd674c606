"""Whether a dataset is async (and so fetched by ``_worker.async_fetch.AsyncFetcher``), decided from
its class: cheap to import, since the loader asks it of every dataset and every worker asks it
before its first task, while the async fetch machinery (and anyio) is needed only when the
answer is yes."""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["batched_hook", "has_async_context", "is_async_dataset"]


def batched_hook(dataset: Any) -> Any:
    """The dataset's async batched fetch (torch's ``__getitems__`` name, or ``getitems``)."""
    for name in ("__getitems__", "getitems"):
        method = getattr(type(dataset), name, None)
        if method is not None and inspect.iscoroutinefunction(method):
            return getattr(dataset, name)
    return None


def is_async_dataset(dataset: Any, dataset_kind: int) -> bool:
    """Whether aioload fetches ``dataset`` with ``AsyncFetcher``: a map-style dataset whose
    ``__getitem__`` or batched hook is ``async def``, or an IterableDataset with
    ``__aiter__`` (preferred over its ``__iter__`` when it has both). Decided from the class,
    so it is the same in the parent and in every worker."""
    if dataset_kind == 1:
        return callable(getattr(type(dataset), "__aiter__", None))
    getitem = getattr(type(dataset), "__getitem__", None)
    return inspect.iscoroutinefunction(getitem) or batched_hook(dataset) is not None


def has_async_context(dataset: Any) -> bool:
    """Whether the dataset asks for per-worker async setup: it is an async context manager,
    entered once per worker on the worker's loop and exited when the worker shuts down."""
    kind = type(dataset)
    return inspect.iscoroutinefunction(
        getattr(kind, "__aenter__", None)
    ) and inspect.iscoroutinefunction(getattr(kind, "__aexit__", None))
