"""A worker process's watch on its parent: it never outlives it, even inside a slow sample.

Between tasks a worker notices a dead parent by itself (EOF on its socket, or a changed parent
pid, in its read loop). Inside ``__getitem__`` it reads nothing, and a sample can take minutes.
Two things end it there, whatever the dataset is doing:

- **The kernel** (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, Linux). The signal comes when the
  *thread* that forked the worker exits, not the process. So it is asked for only where that
  thread lives as long as the parent: the main thread, or the fork server's (whose server
  exits when its own parent does). Under ``async for`` workers are forked from short-lived
  threads (NOTE [staggered start]); those rely on the watch below. It works even while the
  sample holds the GIL in C code.
- **A watch thread**, for every worker: it waits for its socket's peer to hang up, and checks
  the parent pid once a second. A hang-up is also how a shutdown begins (the parent closes its
  ends first): an idle worker has left by then; a busy one gets the parent's own grace, and
  then the thread SIGKILLs its process, as the parent would have. A thread can do this while
  the main thread sleeps in ``__getitem__`` (Python interrupts a sleep only by a signal, and
  this thread sends one).
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import functools
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from .._named_tuple import NamedTuple

__all__ = ["ParentWatch", "watch_parent"]

# How often the watch looks at the parent pid when nothing hangs up.
_CHECK_S = 1.0
# After a hang-up, how long a worker may go on before the watch kills it: more than the
# parent's shutdown grace (0.5 s, ``_backends.process.SHUTDOWN_GRACE_S``), so that an orderly
# shutdown is the parent's, never cut short here.
_GRACE_S = 1.0
_PR_SET_PDEATHSIG = 1


class ParentWatch(NamedTuple):
    """What the parent tells a worker about itself when it starts it."""

    # The worker's parent process, as its ``getppid()`` must read: the pool's process under
    # fork and spawn; 0 under forkserver (the parent is the fork server, unknown here).
    parent_pid: int
    # Whether the thread that starts the worker lives as long as its process (see above).
    death_signal: bool


def parent_watch(start_method: str) -> ParentWatch:
    """In the parent, as it starts a worker with ``start_method``, in the thread that starts it."""
    if start_method == "forkserver":
        return ParentWatch(0, True)
    if start_method == "fork":
        _find_prctl()  # (inherited by the worker: NOTE [the watch's start])
    return ParentWatch(os.getpid(), threading.current_thread() is threading.main_thread())


def watch_parent(watch: ParentWatch, sock: Any) -> None:
    """In the worker, first thing: the kernel's signal where it is safe, and the watch thread.
    Leaves the process at once if the parent is already gone."""
    if watch.death_signal and sys.platform.startswith("linux"):
        _ask_for_death_signal()
    # The parent may have died before the kernel was asked: then nothing will ever signal us.
    if watch.parent_pid and os.getppid() != watch.parent_pid:
        os._exit(0)
    # A descriptor of its own: the worker's main thread closes its socket as it leaves, and a
    # poll on a closed (or reused) descriptor number would watch something else.
    fd = os.dup(sock.fileno())
    # (Not kept by a process the dataset forks: this thread is not there to watch with it.)
    os.register_at_fork(after_in_child=functools.partial(_close, fd))
    # NOTE [the watch's start]. ``_thread``'s start, not ``threading.Thread.start``: that one
    # waits until the new thread has run, and a worker starts while its parent forks the next
    # worker on the same cores, so the wait was 5-6 ms of the first batch's path (a thread
    # that is not a ``threading.Thread`` is not joined at exit either, as a daemon is not).
    _thread.start_new_thread(_watch, (fd, os.getppid()))


# ``prctl`` through ctypes, found once: looking a symbol up in a process that has loaded torch
# takes a few hundred microseconds, which a forked worker would pay at its start. The parent
# finds it before it forks (``parent_watch``), and every forked worker inherits it.
_prctl: Any = None


def _find_prctl() -> Any:
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def _ask_for_death_signal() -> None:
    prctl = _find_prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _watch(fd: int, ppid: int) -> None:
    poller = select.poll()
    # Only a hang-up (and errors, always reported): data for the main thread wakes nothing.
    poller.register(fd, select.POLLRDHUP)
    while not poller.poll(int(_CHECK_S * 1000)) and os.getppid() == ppid:
        pass
    time.sleep(_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
