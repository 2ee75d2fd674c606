"""Real HTTP servers on loopback, for the HTTP tests, the ``http`` benchmark and
``examples/http_dataset.py``.

``FileServer`` is the stdlib's ``ThreadingHTTPServer`` serving a directory of generated files
over HTTP/1.1 keep-alive, in a thread of the calling process (the tests use it).

Besides the files it has routes that fail the way networks do:

- ``/missing/...``: 404;
- ``/reset/...``: the connection is reset (RST, not a clean close) before any response;
- ``/stall/...``: no answer until the server is told to ``release()`` (or 60 s pass).

``latency`` delays every answer, as a remote object store would.

``object_store`` runs a minimal asyncio (uvloop) HTTP/1.1 server in a process of its own,
serving the same generated files from memory. It is what the benchmark and the example read
from: with a thread per connection and the GIL, ``ThreadingHTTPServer`` gets *slower* as
concurrent connections go from 8 to 32 (about 960 to 370 requests/s on 2 cores, measured),
so it would measure itself rather than the loader.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing
import socket
import struct
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["FileServer", "file_bytes", "file_name", "make_files", "object_store", "serve_files"]


def file_bytes(i: int) -> bytes:
    """The content of generated file ``i``: 16 to 271 bytes, different for every ``i``."""
    digest = hashlib.blake2b(str(i).encode(), digest_size=16).digest()
    return digest * (1 + i % 17)


def file_name(i: int) -> str:
    return f"{i:06d}.bin"


def make_files(directory: Path, count: int) -> list[str]:
    """Write ``count`` generated files into ``directory``; returns their names, in order."""
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    for i in range(count):
        name = file_name(i)
        (directory / name).write_bytes(file_bytes(i))
        names.append(name)
    return names


class _Handler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client's pool reuses its connections
    # Headers and body go out in two writes; with Nagle's algorithm the second waits for the
    # client's delayed ACK of the first, ~40 ms per request on a kept-alive connection.
    disable_nagle_algorithm = True
    server: FileServer

    def do_GET(self) -> None:
        server = self.server
        if server.latency:
            time.sleep(server.latency)
        if self.path.startswith("/reset/"):
            # Close with SO_LINGER 0 once the handler lets go of the socket: the kernel sends
            # RST, and the client sees "connection reset by peer".
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            server.to_reset.add(self.connection)
            self.close_connection = True
            return
        if self.path.startswith("/stall/"):
            server.released.wait(60)
        if self.path.startswith("/missing/"):
            self.send_error(404, "no such file")
            return
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: thousands of requests per test


class FileServer(ThreadingHTTPServer):
    """Serves ``directory`` on ``127.0.0.1`` (a free port) from a daemon thread."""

    daemon_threads = True
    # The listen backlog: a benchmark opens 64 connections at once.
    request_queue_size = 256

    def __init__(self, directory: Path, latency: float = 0.0) -> None:
        self.directory = str(directory)
        self.latency = latency
        self.released = threading.Event()
        self.to_reset: set[socket.socket] = set()
        self._lock = threading.Lock()
        # Connections accepted and not yet closed (tests wait for 0 before counting fds).
        self.open_connections = 0
        super().__init__(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, name="http-files", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def finish_request(self, request: Any, client_address: Any) -> None:
        _Handler(request, client_address, self, directory=self.directory)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self.open_connections += 1
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        if request in self.to_reset:
            # No shutdown(SHUT_WR) first: that would send a FIN, a clean close.
            self.to_reset.discard(request)
            self.close_request(request)
        else:
            super().shutdown_request(request)
        with self._lock:
            self.open_connections -= 1

    def release(self) -> None:
        """Let stalled requests go (they answer normally)."""
        self.released.set()

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until every accepted connection is closed."""
        deadline = time.monotonic() + timeout
        while self.open_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.open_connections

    def start(self) -> FileServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self.shutdown()
        self.server_close()
        self.thread.join(5)


@contextlib.contextmanager
def serve_files(directory: Path, latency: float = 0.0) -> Iterator[FileServer]:
    """``with serve_files(dir) as server: ... server.url ...``"""
    server = FileServer(directory, latency).start()
    try:
        yield server
    finally:
        server.stop()


# -- a fast server in its own process ----------------------------------------------------------


async def _answer(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    files: dict[bytes, bytes],
    latency: float,
) -> None:
    """One keep-alive connection: GET requests, one at a time (clients do not pipeline)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1]
            if latency:
                await asyncio.sleep(latency)
            body = files.get(path)
            status = b"200 OK"
            if body is None:
                status, body = b"404 Not Found", b"no such file"
            writer.write(
                b"HTTP/1.1 %s\r\nContent-Type: application/octet-stream\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body)
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, IndexError):
        pass
    finally:
        writer.close()


def _run_store(count: int, latency: float, report: Any) -> None:
    import uvloop

    files = {b"/" + file_name(i).encode(): file_bytes(i) for i in range(count)}

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: _answer(r, w, files, latency), "127.0.0.1", 0, backlog=1024
        )
        report.send(server.sockets[0].getsockname()[1])
        report.close()
        await server.serve_forever()

    uvloop.run(main())


@contextlib.contextmanager
def object_store(count: int, latency: float = 0.0) -> Iterator[str]:
    """Serve files ``file_name(0..count-1)`` (contents ``file_bytes(i)``) from a separate
    process, each answer ``latency`` seconds late; yields the base URL."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(
        target=_run_store, args=(count, latency, send), name="object-store", daemon=True
    )
    process.start()
    send.close()
    try:
        if not receive.poll(30):
            raise RuntimeError("the object store did not start")
        port = receive.recv()
        yield f"http://127.0.0.1:{port}"
    finally:
        receive.close()
        process.kill()
        process.join(5)
        process.close()
