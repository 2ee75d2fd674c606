"""Reading files over HTTP with an async dataset: many requests in flight per worker.

The pattern, for any latency-bound source (object stores, HTTP, databases):

- ``async def __getitem__`` does the I/O with an async client;
- the clients are opened once per worker, on the worker's event loop, by making the dataset an
  async context manager (``__aenter__``/``__aexit__``); aioload enters it when a worker starts
  and exits it when the worker shuts down;
- ``worker_concurrency=32`` lets each worker keep 32 requests in flight.

The example starts its own HTTP server on 127.0.0.1 with 20 ms of added latency per request, as
a remote store would have (in a process of its own, so that it does not compete with the
loader for the GIL), and compares with torch's DataLoader reading the same files with a
blocking client. ``AIOLOAD_EXAMPLE_SMALL=1`` runs it on a tiny size in a few seconds.

    python examples/http_dataset.py [--files 2048] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpcore  # noqa: F401 - see below
import httpx
import torch
from torch.utils.data import Dataset

import aioload

# The local object store this example reads from is the benchmarks' (benchmarks/httpserver.py,
# beside this folder in a checkout).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.httpserver import file_bytes, file_name, object_store

# httpx imports its transport, httpcore, only when the first client is made: importing it here,
# before the workers fork, saves each worker ~70 ms before its first request.


class RemoteFiles(Dataset[tuple[int, bytes]]):
    """``base_url/<name>`` for each name, with ``httpx.AsyncClient``s opened once per worker."""

    def __init__(self, base_url: str, names: list[str], concurrency: int) -> None:
        self.base_url = base_url
        self.names = names
        self.concurrency = concurrency
        self.clients: list[httpx.AsyncClient] = []

    def __len__(self) -> int:
        return len(self.names)

    async def __aenter__(self) -> RemoteFiles:
        # Runs in each worker, on the loop its fetches run on: the client's connection pool
        # belongs to that loop.
        # httpx's pool does work proportional to (requests waiting) x (connections) on every
        # event (encode/httpx#3215), so a client with 32 connections is much slower than four
        # with 8: spread the requests over small clients. (verify=False: this is plain http,
        # and it saves loading the CA bundle for every client.)
        limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
        self.clients = [
            httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=30.0, verify=False)
            for _ in range(max(1, self.concurrency // 8))
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        clients, self.clients = self.clients, []
        for client in clients:
            await client.aclose()

    async def __getitem__(self, i: int) -> tuple[int, bytes]:
        assert self.clients, "aioload.DataLoader opens the clients (the dataset's async context)"
        response = await self.clients[i % len(self.clients)].get("/" + self.names[i])
        response.raise_for_status()
        return i, response.content


class BlockingRemoteFiles(Dataset[tuple[int, bytes]]):
    """The same files, one blocking request at a time, for torch's DataLoader."""

    def __init__(self, base_url: str, names: list[str]) -> None:
        self.base_url = base_url
        self.names = names
        self.client: tuple[int, httpx.Client] | None = None

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> tuple[int, bytes]:
        if self.client is None or self.client[0] != os.getpid():
            client = httpx.Client(base_url=self.base_url, timeout=30.0, verify=False)
            self.client = (os.getpid(), client)
        response = self.client[1].get("/" + self.names[i])
        response.raise_for_status()
        return i, response.content


def as_list(samples: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    return samples


def check(batch: list[tuple[int, bytes]]) -> int:
    for i, content in batch:
        assert content == file_bytes(i), f"file {i} came back wrong"
    return len(batch)


class Timing:
    """Each batch's arrival. The rate counts from the first batch on: the workers' start, and
    each worker's first requests (its client, its connections), are left out."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.files = 0

    def add(self, batch: list[tuple[int, bytes]]) -> None:
        self.arrivals.append(time.perf_counter())
        if len(self.arrivals) > 1:  # the first batch starts the clock
            self.files += check(batch)
        else:
            check(batch)

    def report(self) -> str:
        if len(self.arrivals) < 2:
            return "too few batches to time"
        gaps = sorted(b - a for a, b in itertools.pairwise(self.arrivals))
        p99 = gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))]
        rate = self.files / (self.arrivals[-1] - self.arrivals[0])
        return (
            f"{rate:6.0f} files/s; time between batches: median "
            f"{statistics.median(gaps) * 1e3:5.1f} ms, p99 {p99 * 1e3:5.1f} ms"
        )


async def read_async(loader: Any) -> Timing:
    timing = Timing()
    async for batch in loader:
        timing.add(batch)
    return timing


def read_sync(loader: Any) -> Timing:
    timing = Timing()
    for batch in loader:
        timing.add(batch)
    return timing


def main() -> None:
    small = os.environ.get("AIOLOAD_EXAMPLE_SMALL") == "1"
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=128 if small else 2048)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--skip-torch", action="store_true", default=small)
    args = parser.parse_args()

    names = [file_name(i) for i in range(args.files)]
    # A small asyncio HTTP server in a process of its own, answering each request
    # latency-ms late: a stand-in for a remote object store.
    with object_store(args.files, latency=args.latency_ms / 1e3) as url:
        print(f"{args.files} files on {url}, {args.latency_ms:g} ms per request")
        loader = aioload.DataLoader(
            RemoteFiles(url, names, args.concurrency),
            batch_size=args.batch_size,
            num_workers=args.workers,
            collate_fn=as_list,
            worker_concurrency=args.concurrency,
        )
        print("  rates from each pass's first batch on (the workers' start left out):")
        timing = asyncio.run(read_async(loader))
        print(
            f"  aioload, async dataset, {args.workers} workers x {args.concurrency} in flight: "
            f"{timing.report()}"
        )
        timing = read_sync(loader)  # `for` works the same
        print(f"  aioload, the same loader under `for`:           {timing.report()}")
        if not args.skip_torch:
            blocking = BlockingRemoteFiles(url, names)
            torch_loader = torch.utils.data.DataLoader(
                blocking, batch_size=args.batch_size, num_workers=args.workers, collate_fn=as_list
            )
            timing = read_sync(torch_loader)
            print(f"  torch DataLoader, blocking client:              {timing.report()}")


if __name__ == "__main__":
    main()
