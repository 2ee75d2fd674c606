"""Benchmark workloads: picklable, module-level datasets plus batch helpers.

The same dataset class (and constructor arguments) is used for both loaders; datasets are
deliberately cheap to produce so that what is measured is the loader's transport and
per-batch overhead, not sample generation.

The exceptions are the latency-bound workloads (``latency``, ``http``): there the point is an
async dataset, so torch reads the synchronous version of the same data and aioload the async
one, with ``worker_concurrency`` (``Workload.aioload_kwargs``). ``image-collate`` gives both
loaders the same ``collate_fn`` of a user's own (``Workload.collate_fn``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

IMAGE_SHAPE: tuple[int, int, int] = (3, 224, 224)
IMAGE_POOL: int = 4
"""Number of distinct preallocated images the image dataset cycles through."""


class TinyDataset(Dataset[torch.Tensor]):
    """``n`` scalar int64 tensors: measures per-sample / per-batch overhead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


class ImageDataset(Dataset[torch.Tensor]):
    """``n`` uint8 ``3x224x224`` tensors: measures transport bandwidth.

    A small pool of images is preallocated once; each ``__getitem__`` returns a fresh
    ``clone()`` of one of them, i.e. exactly one 150 KB memcpy per sample (what a real
    decoder would hand over as freshly allocated memory).
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        gen = torch.Generator().manual_seed(seed)
        self._pool = torch.randint(
            0, 256, (IMAGE_POOL, *IMAGE_SHAPE), dtype=torch.uint8, generator=gen
        )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._pool[index % IMAGE_POOL].clone()


class BytesDataset(Dataset[torch.Tensor]):
    """``n`` uint8 samples of ``nbytes`` each, cloned from a small pool (one memcpy per sample):
    the sweep's sample-size, batch-size and worker-count axes (``bytes:<nbytes>``)."""

    def __init__(self, n: int, nbytes: int, seed: int = 0) -> None:
        self.n = n
        gen = torch.Generator().manual_seed(seed)
        self._pool = torch.randint(0, 256, (IMAGE_POOL, nbytes), dtype=torch.uint8, generator=gen)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._pool[index % IMAGE_POOL].clone()


def burn(iters: int, salt: int) -> int:
    """Pure-Python busy loop (holds the GIL); cost is linear in ``iters``."""
    acc = salt
    for j in range(iters):
        acc = (acc * 31 + j) & 0xFFFFFFFF
    return acc


class CpuDataset(Dataset[torch.Tensor]):
    """``n`` samples each costing ``iters`` iterations of :func:`burn` (~1 ms, calibrated)."""

    def __init__(self, n: int, iters: int) -> None:
        self.n = n
        self.iters = iters

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(burn(self.iters, index))


def calibrate_cpu_iters(target_s: float = 1e-3, probe_iters: int = 50_000) -> int:
    """Number of :func:`burn` iterations that take about ``target_s`` on this machine.

    Done once in the parent so that every run (torch and aioload) uses the same count.
    """
    burn(probe_iters, 0)  # warm-up
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        burn(probe_iters, 1)
        best = min(best, time.perf_counter() - t0)
    return max(1, round(probe_iters * target_s / best))


JPEG_SIDE = 224
JPEG_FILES = 64
"""Distinct JPEGs the ``jpeg`` workload cycles through (drawn once, then cached on disk)."""
JPEG_CROP = 192


def _draw_jpeg(index: int, side: int) -> Any:
    """JPEG ``index``: a bright box on a noisy background, seeded by the index (as ``make
    run``'s demo draws its images), so every run decodes the same bytes."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(index)
    image = Image.fromarray(rng.integers(0, 90, size=(side, side, 3), dtype=np.uint8), "RGB")
    size = int(rng.integers(side // 4, side // 2))
    x, y = (int(v) for v in rng.integers(4, side - size - 4, size=2))
    colour = tuple(int(c) for c in rng.integers(120, 256, size=3))
    ImageDraw.Draw(image).rectangle((x, y, x + size, y + size), fill=colour)
    return image


def ensure_jpegs(count: int = JPEG_FILES, side: int = JPEG_SIDE) -> list[str]:
    """The ``jpeg`` workload's files, drawn into a cache folder under the temporary directory
    on first use; a marker written last says the set is complete."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.gettempdir()) / f"aioload-bench-jpeg-v1-{side}-{count}"
    paths = [folder / f"{i:04d}.jpg" for i in range(count)]
    marker = folder / ".complete"
    if not marker.exists():
        folder.mkdir(parents=True, exist_ok=True)
        for i, path in enumerate(paths):
            _draw_jpeg(i, side).save(path, quality=90)
        marker.touch()
    return [str(p) for p in paths]


class JpegDataset(Dataset[torch.Tensor]):
    """``n`` samples decoded from real JPEG files with Pillow and augmented with numpy (random
    crop, flip, brightness, normalisation into a float32 CHW tensor), as ``make run``'s demo
    does: Pillow's decoder releases the GIL, the numpy steps mostly too."""

    def __init__(self, n: int, paths: Sequence[str]) -> None:
        self.n = n
        self.paths = list(paths)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        with Image.open(self.paths[index % len(self.paths)]) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
        # numpy's global generator: each worker's own under processes, shared under threads
        # (the augmentation's randomness is not what is measured).
        top, left = np.random.randint(0, pixels.shape[0] - JPEG_CROP + 1, size=2)
        pixels = pixels[top : top + JPEG_CROP, left : left + JPEG_CROP]
        if np.random.rand() < 0.5:
            pixels = pixels[:, ::-1]
        pixels = pixels * (np.random.uniform(0.8, 1.2) / 255.0)
        pixels = (pixels - 0.25) / 0.25
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


LATENCY_S = 0.020
"""Simulated per-sample latency of the ``latency`` workload, and the ``http`` server's."""


class LatencyDataset(Dataset[torch.Tensor]):
    """Each sample waits ``latency`` seconds, blocking (``time.sleep``): a network read one
    request at a time, as torch's workers do it."""

    def __init__(self, n: int, latency: float = LATENCY_S) -> None:
        self.n = n
        self.latency = latency

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.latency)
        return torch.tensor(index)


class AsyncLatencyDataset(Dataset[torch.Tensor]):
    """The same, awaiting (``asyncio.sleep``): many samples can wait at once."""

    def __init__(self, n: int, latency: float = LATENCY_S) -> None:
        self.n = n
        self.latency = latency

    def __len__(self) -> int:
        return self.n

    # torch types Dataset.__getitem__ as synchronous; aioload accepts a coroutine function.
    async def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        await asyncio.sleep(self.latency)
        return torch.tensor(index)


def _head(content: bytes) -> torch.Tensor:
    # Every generated file has at least 16 bytes; a fixed-size sample collates by default.
    return torch.frombuffer(bytearray(content[:16]), dtype=torch.uint8)


# Plain http:// on loopback, so no TLS: without verify=False, every httpx client loads the CA
# bundle when it is made (130 ms for the first in a process, 20 ms after; 1 ms without), which
# would land in the time to first batch of both loaders.
_VERIFY = False


def _import_httpx() -> None:
    """Import httpx and its transport, httpcore, in the parent, before workers fork: httpx
    imports httpcore (and with it trio, when installed) only when its first client is made,
    ~70 ms that every worker would otherwise pay before its first request."""
    import httpcore  # noqa: F401
    import httpx  # noqa: F401


class HttpDataset(Dataset[torch.Tensor]):
    """File ``i`` from an HTTP server, with a blocking ``httpx.Client`` (one per process, made
    on first use). The sample is the file's first 16 bytes."""

    def __init__(self, n: int, url: str) -> None:
        _import_httpx()

        self.n = n
        self.url = url
        self._client: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        import httpx

        from benchmarks.httpserver import file_name

        if self._client is None or self._client[0] != os.getpid():
            self._client = (
                os.getpid(),
                httpx.Client(base_url=self.url, timeout=60.0, verify=_VERIFY),
            )
        response = self._client[1].get("/" + file_name(index))
        response.raise_for_status()
        return _head(response.content)


# httpx's connection pool does work proportional to (requests waiting) x (connections) on every
# event, polling each connection's socket (encode/httpx#3215): one AsyncClient with 32
# connections managed about 270 requests/s against this server, four clients of 8 connections
# about 970 (measured on the benchmark machine, 20 ms latency). So requests are spread over
# small clients.
_CONNECTIONS_PER_CLIENT = 8


class AsyncHttpDataset(Dataset[torch.Tensor]):
    """The same with ``httpx.AsyncClient``: the clients are opened in each worker, on its
    loop, by the dataset's async context (aioload enters it once per worker)."""

    def __init__(self, n: int, url: str, concurrency: int = 32) -> None:
        _import_httpx()

        self.n = n
        self.url = url
        self.concurrency = concurrency
        self.clients: list[Any] = []

    def __len__(self) -> int:
        return self.n

    async def __aenter__(self) -> AsyncHttpDataset:
        import httpx

        per = _CONNECTIONS_PER_CLIENT
        limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
        self.clients = [
            httpx.AsyncClient(base_url=self.url, limits=limits, timeout=60.0, verify=_VERIFY)
            for _ in range(max(1, -(-self.concurrency // per)))
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        clients, self.clients = self.clients, []
        for client in clients:
            await client.aclose()

    async def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        from benchmarks.httpserver import file_name

        client = self.clients[index % len(self.clients)]
        response = await client.get("/" + file_name(index))
        response.raise_for_status()
        return _head(response.content)


@dataclass(frozen=True)
class Workload:
    name: str
    default_size: int
    batch_size: int
    num_workers: int
    target_ratio: float
    description: str
    # Extra DataLoader arguments on the aioload side (with the async dataset).
    aioload_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # The collate_fn both torch's and aioload's loaders get (None: their default).
    collate_fn: Callable[[list[Any]], Any] | None = None

    def loader_kwargs(self, *, on_aioload: bool) -> dict[str, Any]:
        """The DataLoader arguments beyond dataset, batch_size and num_workers."""
        kwargs = dict(self.aioload_kwargs) if on_aioload else {}
        if self.collate_fn is not None:
            kwargs["collate_fn"] = self.collate_fn
        return kwargs


def users_collate(samples: list[Any]) -> Any:
    """A user's own ``collate_fn`` that calls ``default_collate``, as many do to add a step
    around it. In a worker, torch's ``default_collate`` stacks into a fresh shared-memory
    segment per batch (aioload's, into the batch's slab); the ``image-collate`` workload
    measures what each loader makes of it."""
    return default_collate(samples)


CONCURRENCY = 32

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        # Sizes: one epoch outlasts a run's 3 s of steady state, which stops mid-epoch.
        Workload("tiny", 4_000_000, 256, 2, 2.5, "scalar tensors, per-batch overhead"),
        Workload("image", 400_000, 64, 2, 4.0, "uint8 3x224x224, transport bandwidth"),
        Workload(
            "image-collate",
            400_000,
            64,
            2,
            # Set when a collate_fn of the user's own made aioload copy each batch once more
            # than under image; its default_collate now stacks into the slab too.
            3.0,
            "image, collate_fn of the user's own that calls default_collate",
            collate_fn=users_collate,
        ),
        Workload("cpu", 20_000, 32, 2, 1.0, "~1 ms pure Python per sample, compute scaling"),
        Workload(
            "latency",
            16_384,
            32,
            2,
            15.0,
            f"{LATENCY_S * 1e3:g} ms wait per sample: time.sleep (torch) vs asyncio.sleep "
            f"(aioload, worker_concurrency={CONCURRENCY})",
            {"worker_concurrency": CONCURRENCY},
        ),
        Workload(
            "http",
            8_192,
            32,
            2,
            5.0,
            f"small files over loopback HTTP, {LATENCY_S * 1e3:g} ms server latency: httpx.Client "
            f"(torch) vs httpx.AsyncClient (aioload, worker_concurrency={CONCURRENCY})",
            {"worker_concurrency": CONCURRENCY},
        ),
    )
}


def make_dataset(
    name: str, size: int, cpu_iters: int, *, asynchronous: bool = False, url: str = ""
) -> Dataset[torch.Tensor]:
    """The workload's dataset; ``asynchronous`` picks the async version where there is one."""
    if name == "tiny":
        return TinyDataset(size)
    if name.startswith("bytes:"):
        return BytesDataset(size, int(name.split(":", 1)[1]))
    if name in ("image", "image-collate"):
        return ImageDataset(size)
    if name == "cpu":
        return CpuDataset(size, cpu_iters)
    if name == "jpeg":
        return JpegDataset(size, ensure_jpegs())
    if name == "latency":
        return AsyncLatencyDataset(size) if asynchronous else LatencyDataset(size)
    if name == "http":
        if not url:
            raise ValueError("the http workload needs the server's url")
        return AsyncHttpDataset(size, url, CONCURRENCY) if asynchronous else HttpDataset(size, url)
    raise ValueError(f"unknown workload {name!r}")


def count_items(batch: object) -> int:
    """Number of samples in a collated batch (leading dimension of the first leaf)."""
    if isinstance(batch, torch.Tensor):
        return 1 if batch.dim() == 0 else int(batch.shape[0])
    if isinstance(batch, Mapping):
        return count_items(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        return count_items(batch[0])
    raise TypeError(f"cannot count items of {type(batch).__name__}")


def touch(batch: object) -> int:
    """Read a few elements of the batch (at most 8) so lazy transports must materialise it.

    Only a tiny view is reduced, never the whole batch, so the consumer stays negligible.
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return int(batch.item())
        row = batch[(0,) * (batch.dim() - 1)]
        return int(row[:8].sum().item())
    if isinstance(batch, Mapping):
        return touch(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, str | bytes):
        return touch(batch[0])
    raise TypeError(f"cannot touch {type(batch).__name__}")
