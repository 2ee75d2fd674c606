"""aioload: an asyncio-native, drop-in replacement for torch.utils.data.DataLoader."""

from torch.utils.data import default_collate, default_convert

from ._async_fetch import AsyncIterableDataset
from ._progress import Progress, progress
from ._ray_workers import RayWorkers
from ._worker_main import WorkerInfo, get_worker_info
from .errors import (
    DataLoaderTimeoutError,
    LoaderError,
    TooManySampleErrors,
    WorkerDiedError,
    WorkerError,
)
from .loader import DataLoader
from .stats import LoaderStats, SkippedSample, WorkerStats

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
