"""aioload: an asyncio-native, drop-in replacement for torch.utils.data.DataLoader."""

from torch.utils.data import default_collate, default_convert

from ._async_fetch import AsyncIterableDataset
from ._worker_main import WorkerInfo, get_worker_info
from .errors import DataLoaderTimeoutError, LoaderError, WorkerDiedError, WorkerError
from .loader import DataLoader

__all__ = [
    "AsyncIterableDataset",
    "DataLoader",
    "DataLoaderTimeoutError",
    "LoaderError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerInfo",
    "default_collate",
    "default_convert",
    "get_worker_info",
]

__version__ = "0.1.0"
