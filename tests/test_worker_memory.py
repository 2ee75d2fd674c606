"""What a worker does with memory between batches: freed slabs reach the worker before it needs
them."""

from __future__ import annotations

import collections
import os
import select
import socket
from typing import Any

from aioload import _channel, _transport, _worker_main
from aioload._messages import FreeSlabs, Task


def _worker_over(sock: socket.socket, pool: _transport.WorkerSlabPool) -> Any:
    """A worker's message handling over a real socket, without the process."""
    worker: Any = object.__new__(_worker_main._ProcessWorker)
    worker.channel = _channel.WorkerChannel(sock)
    worker.slabs = pool
    worker.step = type("Step", (), {"generation": 0})()
    worker.pending = collections.deque()
    worker.drained = False
    worker.parent_pid = os.getppid()
    worker.poller = select.poll()
    worker.poller.register(sock.fileno(), select.POLLIN)
    return worker


def test_a_slab_freed_right_behind_a_task_is_used_for_it() -> None:
    """The parent refills the window as it hands a batch over, and frees that batch's slab a
    moment later: both can arrive in the worker's one read. The task must find the slab free,
    not make another."""
    pool = _transport.WorkerSlabPool(max_idle=3)
    parent_sock, worker_sock = socket.socketpair()
    try:
        slab = pool.acquire(_transport._MIN_SLAB)  # in the parent's hands
        worker = _worker_over(worker_sock, pool)
        parent = _channel.ParentChannel(parent_sock)
        parent.queue(Task(7, 0, [0, 1]))
        parent.queue(FreeSlabs([slab.id]))
        parent.pump_out()
        task = worker._next_message()
        assert task.task_id == 7
        assert worker._current(task)
        assert pool.acquire(_transport._MIN_SLAB) is slab
        assert len(pool.slabs) == 1
    finally:
        parent_sock.close()
        worker_sock.close()
        for kept in pool.slabs.values():
            fd = kept.take_fd()
            if fd is not None:
                os.close(fd)
