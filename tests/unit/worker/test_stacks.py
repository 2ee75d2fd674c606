"""A worker's stack read from outside it (``_worker/stacks.py``): every thread's, from a
process stuck in a sleep; never by killing a process that does not catch the signal; bounded
in time; and the stacks of threads of the calling process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aioload._worker import stacks

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(stacks.STACK_SIGNAL is None, reason="no real-time signals here"),
]

FORK = multiprocessing.get_context("fork")


def _stuck_in_a_sleep(install: bool, ready: Any) -> None:
    if install:
        stacks.install()
    else:
        # Its memfd, as a worker makes it just before it installs the handler.
        os.memfd_create(stacks._memfd_name(os.getpid()))
    threading.Thread(target=_helper_thread, daemon=True).start()
    ready.set()
    _deep_in_user_code()


def _helper_thread() -> None:
    time.sleep(30)


def _deep_in_user_code() -> None:
    time.sleep(30)


def _child(install: bool) -> Iterator[Any]:
    ready = FORK.Event()
    process = FORK.Process(target=_stuck_in_a_sleep, args=(install, ready))
    process.start()
    try:
        assert ready.wait(20)
        yield process
    finally:
        process.kill()
        process.join()
        process.close()


@pytest.fixture
def installed() -> Iterator[Any]:
    yield from _child(install=True)


@pytest.fixture
def not_installed() -> Iterator[Any]:
    yield from _child(install=False)


def _whole_dump(pid: int) -> str | None:
    """Asked until a dump has both threads, for ten seconds at most. (The event is set
    before the sleep: the first ask may come before it is entered. And a read ends once the
    dump has not grown for a while: a loaded machine can pause the child mid-dump.)"""
    stack = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stack = stacks.read_stack(pid)
        if stack is not None and "in _deep_in_user_code" in stack and "in _helper_thread" in stack:
            break
    return stack


def test_every_thread_of_a_worker_stuck_in_user_code(installed: Any) -> None:
    stack = _whole_dump(installed.pid)
    assert stack is not None
    assert "in _deep_in_user_code" in stack and "in _helper_thread" in stack
    assert stack.count("most recent call first") == 2  # each thread
    # Asked again, the same: each read takes only the new dump.
    again = _whole_dump(installed.pid)
    assert again is not None and again.count("most recent call first") == 2
    assert installed.is_alive()


def test_a_process_without_the_handler_is_not_signalled(not_installed: Any) -> None:
    # The default action of a real-time signal ends the process: a worker that has not
    # installed the handler yet (here, one caught between its memfd and its handler) must
    # not be asked.
    assert stacks.read_stack(not_installed.pid) is None
    time.sleep(0.1)
    assert not_installed.is_alive()


def test_a_process_that_cannot_run_costs_the_limit_at_most(installed: Any) -> None:
    os.kill(installed.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert stacks.read_stack(installed.pid, limit=0.2) is None
        assert time.monotonic() - started < 5  # bounded (the limit, on a loaded machine)
    finally:
        os.kill(installed.pid, signal.SIGCONT)


def test_no_such_process() -> None:
    process = FORK.Process(target=time.sleep, args=(0,))
    process.start()
    process.join()
    pid = process.pid
    process.close()
    assert pid is not None and stacks.read_stack(pid) is None


def test_threads_of_the_calling_process() -> None:
    started = threading.Event()
    release = threading.Event()

    def waits_here() -> None:
        started.set()
        release.wait(10)

    thread = threading.Thread(target=waits_here, name="the-fetch")
    thread.start()
    try:
        assert started.wait(10) and thread.ident is not None
        text = stacks.format_threads([thread.ident])
        assert text is not None and "the-fetch" in text and "in waits_here" in text
        assert "release.wait(10)" in text  # the source line, as a traceback shows it
    finally:
        release.set()
        thread.join()
    assert stacks.format_threads([thread.ident]) is None  # gone
