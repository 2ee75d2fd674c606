"""A worker's Python stack, read from outside it: what the hang report shows
(``_engine/hang.py``).

A worker process installs ``install()`` as it starts: ``faulthandler`` writes every thread's
stack to an anonymous memfd of the worker's own when the worker gets ``STACK_SIGNAL``. Its
handler is C code that needs neither the GIL nor a return to the interpreter loop, so it answers
a worker stuck in native code, or in a C extension holding the GIL, as well as one in a Python
sleep; it is installed with ``SA_RESTART``, so the worker's blocking calls go on as before.

The parent reads it with ``read_stack(pid)``, bounded in time: it sends the signal only to a
worker that catches it (its ``/proc`` status says so; the default action of a real-time signal
is to end the process, and a worker still starting must not be killed by a report), reads the
memfd through ``/proc/PID/fd``, and gives up after ``READ_LIMIT_S``. Nothing is written to a
file system, so nothing is left behind when either side dies.

``format_threads`` is the same for threads of the calling process (the calling process's fetch,
a thread worker): their frames are read directly, with no signal.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterable

__all__ = ["READ_LIMIT_S", "STACK_SIGNAL", "format_threads", "install", "read_stack"]

# A real-time signal, not SIGUSR1/SIGUSR2: those are the ones programs (and the frameworks
# around a training loop) take for themselves. None where the platform has none.
STACK_SIGNAL: int | None = signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN") else None
# The longest the parent waits for a worker's stack. A worker answers within a millisecond
# unless it cannot run at all (stopped, or in an uninterruptible sleep).
READ_LIMIT_S = 0.25
# The dump is complete once the memfd has not grown for this long: faulthandler writes it in
# one go, line by line, with no pause a scheduler would not explain.
_QUIET_S = 0.02
_POLL_S = 0.002


def _memfd_name(pid: int) -> str:
    # With the pid: a process forked from a worker inherits its memfd, and must not be
    # mistaken for it.
    return f"aioload-stack-{pid}"


def install() -> None:
    """In a worker process: dump every thread's stack into this process's memfd on
    ``STACK_SIGNAL``. Leaves alone a signal that already has a handler."""
    sig = STACK_SIGNAL
    if sig is None or not hasattr(os, "memfd_create"):
        return
    with contextlib.suppress(OSError, ValueError, RuntimeError):
        if signal.getsignal(sig) not in (signal.SIG_DFL, None):
            return  # the user's program handles it
        # (The memfd before the handler: a parent that sees the signal caught finds it.)
        fd = os.memfd_create(_memfd_name(os.getpid()), os.MFD_CLOEXEC)
        faulthandler.register(sig, file=fd, all_threads=True, chain=False)


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` in its ``/proc`` status)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _find_memfd(pid: int) -> str | None:
    target = f"/memfd:{_memfd_name(pid)} (deleted)"
    folder = f"/proc/{pid}/fd"
    for entry in os.listdir(folder):
        with contextlib.suppress(OSError):
            if os.readlink(f"{folder}/{entry}") == target:
                return f"{folder}/{entry}"
    return None


def read_stack(pid: int, limit: float = READ_LIMIT_S) -> str | None:
    """Every thread's stack in worker process ``pid``, as faulthandler writes it (most recent
    call first); None where it cannot be had within ``limit`` seconds (no such worker, a
    worker that has not installed the handler yet, or one that cannot run)."""
    sig = STACK_SIGNAL
    if sig is None:
        return None
    try:
        if not _catches(pid, sig):
            return None
        path = _find_memfd(pid)
        if path is None:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        start = os.fstat(fd).st_size
        os.kill(pid, sig)
        return _read_new(fd, start, time.monotonic() + limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_new(fd: int, start: int, deadline: float) -> str | None:
    """What is written to ``fd`` past ``start``, once it stops growing (or at ``deadline``)."""
    size, changed = start, time.monotonic()
    while True:
        now = time.monotonic()
        current = os.fstat(fd).st_size
        if current != size:
            size, changed = current, now
        elif size > start and now - changed >= _QUIET_S:
            break
        if now >= deadline:
            break
        time.sleep(_POLL_S)
    if size <= start:
        return None
    return _below_worker_main(os.pread(fd, size - start, start).decode("utf-8", "replace"))


def _below_worker_main(dump: str) -> str:
    """The dump without the frames under the worker's entry point (``_worker.main.worker_main``):
    in a forked worker those are the parent's, as they stood at the fork, and would read as if
    the worker ran the training loop."""
    kept: list[str] = []
    skipping = False
    for line in dump.rstrip("\n").splitlines():
        if not line.startswith("  "):  # a thread's header, or the blank line between two
            skipping = False
        elif skipping:
            continue
        kept.append(line)
        if line.endswith(" in worker_main"):
            skipping = True
    return "\n".join(kept)


def format_threads(idents: Iterable[int]) -> str | None:
    """The stacks of these threads of the calling process (most recent call last, as in a
    traceback); None where none of them is running."""
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident in idents:
        frame = frames.get(ident)
        if frame is None:
            continue
        name = names.get(ident, "?")
        lines = "".join(traceback.format_stack(frame)).rstrip("\n")
        parts.append(f"Thread {ident:#x} ({name}), most recent call last:\n{lines}")
    return "\n\n".join(parts) if parts else None
