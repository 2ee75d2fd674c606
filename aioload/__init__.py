"""aioload: an asyncio-native, drop-in replacement for torch.utils.data.DataLoader."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torch.utils.data import default_collate, default_convert

from .errors import (
    DataLoaderTimeoutError,
    LoaderError,
    TooManySampleErrors,
    WorkerDiedError,
    WorkerError,
)

if TYPE_CHECKING:
    from ._backends.ray_config import RayWorkers
    from ._progress import Progress, progress
    from ._worker.async_fetch import AsyncIterableDataset
    from ._worker.info import WorkerInfo, get_worker_info
    from .loader import DataLoader
    from .stats import LoaderStats, SkippedSample, WorkerStats

# The public names below are imported on first use (PEP 562), not by `import aioload`: the
# engine, anyio, uvloop and the worker-side code cost tens of ms to import, and a script that
# only imports the package (or its errors) should not pay for them. `from aioload import
# DataLoader` imports the loader and what it needs to start; worker-side modules, anyio's
# backend and uvloop still wait for the first pass (docs/benchmarks.md, start-up).
_LAZY: dict[str, str] = {
    "AsyncIterableDataset": "._worker.async_fetch",
    "DataLoader": ".loader",
    "LoaderStats": ".stats",
    "SkippedSample": ".stats",
    "Progress": "._progress",
    "RayWorkers": "._backends.ray_config",
    "WorkerInfo": "._worker.info",
    "WorkerStats": ".stats",
    "get_worker_info": "._worker.info",
    "progress": "._progress",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ._aio.lazy_import import collector_paused

    with collector_paused():
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AsyncIterableDataset",
    "DataLoader",
    "DataLoaderTimeoutError",
    "LoaderError",
    "LoaderStats",
    "Progress",
    "RayWorkers",
    "SkippedSample",
    "TooManySampleErrors",
    "WorkerDiedError",
    "WorkerError",
    "WorkerInfo",
    "WorkerStats",
    "default_collate",
    "default_convert",
    "get_worker_info",
    "progress",
]

__version__ = "0.1.0"
