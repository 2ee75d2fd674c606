"""Runs failure-matrix cells in processes forked from one interpreter that has imported the cell
module (torch, aioload and the rest) once, instead of a fresh interpreter per cell.

Usage: ``python -m tests.reliability.cell_server``, then one JSON line per cell on stdin:
``{"args": [CASE, "--mode=...", ...], "out": PATH, "err": PATH}``. For each, the server
forks a child that runs ``tests.reliability.cell.main`` with those arguments, its stdout and
stderr in the two files, and answers ``STARTED <pid>``, then ``DONE <pid> <wait status>``
once the child has exited. It ends at the end of stdin.

Each cell still runs in a process of its own, started the way the cell's own workers are
(``fork``), with its checks unchanged: the imports, about 2 s of each cell on the 2-core
machine, happen once. The server forks only while it has one thread.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading

from tests.reliability import cell


def _child(request: dict[str, object]) -> None:
    """In the forked child: the cell, as ``python -m tests.reliability.cell ARGS`` runs it."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(str(request["out"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(str(request["err"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((devnull, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        args = request["args"]
        assert isinstance(args, list)
        sys.argv = ["tests.reliability.cell", *map(str, args)]
        cell.main()
        atexit._run_exitfuncs()
        code = 0
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        assert threading.active_count() == 1, "fork only while single-threaded"
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(f"STARTED {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"DONE {pid} {status}", flush=True)


if __name__ == "__main__":
    serve()
