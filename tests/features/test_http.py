"""A real HTTP server on 127.0.0.1 serving a few thousand small files, read through aioload by
an async dataset (``httpx.AsyncClient``, one per worker, opened in the dataset's async context)
and by a sync one (a blocking ``httpx.Client``): bytes, order, exactly-once delivery, and the
failures a network has (404, a reset connection, a server that stalls past ``timeout``)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

import aioload
from benchmarks.httpserver import FileServer, file_bytes, make_files
from tests.helpers import wait_until, within

pytestmark = [pytest.mark.timeout(60)]

NUM_FILES = 3000


@pytest.fixture(scope="module")
def _server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FileServer, list[str]]]:
    directory = tmp_path_factory.mktemp("files")
    names = make_files(directory, NUM_FILES)
    server = FileServer(directory).start()
    yield server, names
    server.stop()


@pytest.fixture
def server(
    no_leaks: None, _server: tuple[FileServer, list[str]]
) -> Iterator[tuple[FileServer, list[str]]]:
    """The module's server, for one test. Set up after ``no_leaks`` and so torn down before it:
    stalled requests are let go and the server's side of every connection is closed before
    descriptors are counted."""
    server, names = _server
    server.released.clear()
    yield server, names
    server.release()
    assert server.wait_idle(), "the server still has open connections"


def keep_list(samples: list[Any]) -> list[Any]:
    return samples


def _worker_key() -> tuple[int, int]:
    """Whose state this is: the process and, in a worker, its id. Thread workers share the
    one dataset object (docs/threads.md), so what each worker opens is kept under its key,
    not in one attribute that every thread would overwrite."""
    info = get_worker_info()
    return os.getpid(), -1 if info is None else info.id


class AsyncFiles(Dataset[tuple[int, bytes]]):
    """Reads ``base_url/paths[i]``; one ``httpx.AsyncClient`` per worker, opened on the worker's
    loop when it starts and closed when it stops (then, with ``closed_log``, a directory, it
    touches ``closed-<pid>-<worker id>`` there)."""

    def __init__(self, base_url: str, paths: list[str], closed_log: Path | None = None) -> None:
        self.base_url = base_url
        self.paths = paths
        self.closed_log = closed_log
        self.clients: dict[tuple[int, int], httpx.AsyncClient] = {}

    def __len__(self) -> int:
        return len(self.paths)

    async def __aenter__(self) -> AsyncFiles:
        self.clients[_worker_key()] = httpx.AsyncClient(base_url=self.base_url, timeout=30.0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        key = _worker_key()
        client = self.clients.pop(key, None)
        if client is not None:
            await client.aclose()
            if self.closed_log is not None:
                (self.closed_log / f"closed-{key[0]}-{key[1]}").touch()

    async def __getitem__(self, i: int) -> tuple[int, bytes]:
        response = await self.clients[_worker_key()].get("/" + self.paths[i])
        response.raise_for_status()
        return i, response.content


class SyncFiles(Dataset[tuple[int, bytes]]):
    """The same with a blocking client, made lazily by each worker that reads."""

    def __init__(self, base_url: str, paths: list[str]) -> None:
        self.base_url = base_url
        self.paths = paths
        self._clients: dict[tuple[int, int], httpx.Client] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def _get(self, path: str) -> httpx.Response:
        key = _worker_key()
        if key not in self._clients:
            self._clients[key] = httpx.Client(base_url=self.base_url, timeout=30.0)
        return self._clients[key].get(path)

    def close(self) -> None:
        for key in [key for key in self._clients if key[0] == os.getpid()]:
            self._clients.pop(key).close()

    def __getitem__(self, i: int) -> tuple[int, bytes]:
        response = self._get("/" + self.paths[i])
        response.raise_for_status()
        return i, response.content


def _check(batches: list[list[tuple[int, bytes]]], expected_order: list[int]) -> None:
    order = [i for batch in batches for i, _ in batch]
    assert order == expected_order
    for batch in batches:
        for i, content in batch:
            assert content == file_bytes(i)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_async_dataset_reads_every_file_once_in_order(
    num_workers: int, server: tuple[FileServer, list[str]]
) -> None:
    http, names = server
    generator = torch.Generator().manual_seed(5)
    loader = aioload.DataLoader(
        AsyncFiles(http.url, names),
        batch_size=50,
        shuffle=True,
        generator=generator,
        num_workers=num_workers,
        collate_fn=keep_list,
        worker_concurrency=16,
    )
    # The order torch's own loader draws with the same generator.
    torch_order = torch.utils.data.DataLoader(
        range(NUM_FILES), batch_size=50, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    expected = [int(i) for batch in torch_order for i in batch]
    batches = list(loader)
    _check(batches, expected)
    assert sorted(expected) == list(range(NUM_FILES))  # every file, exactly once


def test_async_for_and_sync_dataset_agree(server: tuple[FileServer, list[str]]) -> None:
    http, names = server
    subset = names[:400]

    async def read_async() -> list[Any]:
        loader = aioload.DataLoader(
            AsyncFiles(http.url, subset),
            batch_size=16,
            num_workers=2,
            collate_fn=keep_list,
            worker_concurrency=8,
        )
        return [batch async for batch in loader]

    async_batches = asyncio.run(read_async())
    sync_dataset = SyncFiles(http.url, subset)
    sync_batches = list(
        aioload.DataLoader(sync_dataset, batch_size=16, num_workers=2, collate_fn=keep_list)
    )
    sync_dataset.close()
    assert async_batches == sync_batches
    _check(async_batches, list(range(400)))


def _with_a_bad_path(
    server: tuple[FileServer, list[str]],
    n: int,
    bad: int,
    how: str,
    batch_size: int,
    closed_log: Path | None = None,
    **kwargs: Any,
) -> aioload.DataLoader[Any]:
    """AsyncFiles over the first ``n`` files, file ``bad`` asked for under ``how/`` (the
    server's ``missing/``, ``reset/`` or ``stall/``), ``batch_size`` files a batch and as many
    in flight per worker."""
    http, names = server
    paths = names[:n]
    paths[bad] = f"{how}/{paths[bad]}"
    return aioload.DataLoader(
        AsyncFiles(http.url, paths, closed_log=closed_log),
        batch_size=batch_size,
        collate_fn=keep_list,
        worker_concurrency=batch_size,
        **kwargs,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_404(num_workers: int, server: tuple[FileServer, list[str]]) -> None:
    loader = _with_a_bad_path(server, 20, 13, "missing", 5, num_workers=num_workers)
    it = iter(loader)
    _check([next(it), next(it)], list(range(10)))
    # httpx.HTTPStatusError cannot be built from a message alone, so from a worker it arrives
    # as aioload's WorkerError (a RuntimeError) carrying its name and the worker's traceback.
    expected = httpx.HTTPStatusError if num_workers == 0 else aioload.WorkerError
    with pytest.raises(expected, match="404"):
        next(it)
    _check(list(it), list(range(15, 20)))  # the epoch goes on


@pytest.mark.parametrize("num_workers", [0, 2])
def test_connection_reset(num_workers: int, server: tuple[FileServer, list[str]]) -> None:
    loader = _with_a_bad_path(server, 12, 6, "reset", 4, num_workers=num_workers)
    it = iter(loader)
    _check([next(it)], list(range(4)))
    with pytest.raises(httpx.TransportError) as caught:
        next(it)
    # The original type (ReadError or RemoteProtocolError, by timing), from the worker.
    if num_workers:
        assert "in DataLoader worker process 1" in str(caught.value)
    _check(list(it), list(range(8, 12)))


def test_sync_dataset_connection_reset(server: tuple[FileServer, list[str]]) -> None:
    http, names = server
    paths = names[:8]
    paths[5] = "reset/" + paths[5]
    dataset = SyncFiles(http.url, paths)
    loader = aioload.DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=keep_list)
    it = iter(loader)
    _check([next(it)], list(range(4)))
    with pytest.raises(httpx.TransportError, match="in DataLoader worker process 1"):
        next(it)
    # Thread workers' clients live in this process, in the one dataset object: once the
    # workers have stopped, close them (a worker process's go with it).
    it.close()
    dataset.close()


def test_stalled_server_times_out_and_workers_shut_down(
    server: tuple[FileServer, list[str]], tmp_path: Path, patient_shutdown: None
) -> None:
    loader = _with_a_bad_path(server, 16, 9, "stall", 4, tmp_path, num_workers=2, timeout=1.0)
    it = iter(loader)
    _check([next(it), next(it)], list(range(8)))
    start = time.monotonic()
    with pytest.raises(aioload.DataLoaderTimeoutError, match=r"holding indices \[8, 9, 10, 11\]"):
        next(it)
    assert time.monotonic() - start < within(5)  # a hang guard: the server stalls for 60 s
    it.close()  # the stalled fetch is cancelled, its client closed, the worker exits
    # Both workers closed their clients, not a time bound, are the proof: a worker killed after
    # the shutdown grace period, still stuck in the stalled fetch, would never close its own.
    assert wait_until(lambda: len(list(tmp_path.glob("closed-*"))) == 2)


def test_sync_dataset_blocking_client_reads_in_order(server: tuple[FileServer, list[str]]) -> None:
    http, names = server
    dataset = SyncFiles(http.url, names[:300])
    batches = list(aioload.DataLoader(dataset, batch_size=10, num_workers=2, collate_fn=keep_list))
    dataset.close()
    _check(batches, list(range(300)))
