"""One worker process as the pool sees it (``WorkerHandle``: its process, socket and slab
mappings), and its life from outside: started on its socket's child end, told apart from the
children of a process forked from ours, described when it exits, stopped within a grace.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any

from .._wire.channel import ParentChannel
from .._wire.messages import PickledBatch, SlabBatch, ValueBatch
from .._wire.slabs import SlabMappings

__all__ = [
    "MAIN_GUARD_HINT",
    "WorkerHandle",
    "describe_exit",
    "not_my_child",
    "start_process",
    "stop_processes",
    "unforked_ends",
]

# The worker ends of sockets whose worker is not forked yet (a staggered start): any other
# process forked meanwhile must not hold one.
unforked_ends: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def _no_release(slab_id: int) -> None:
    pass


class WorkerHandle:
    """The parent's handle on one worker process: its process, socket and slab mappings."""

    def __init__(self, worker_id: int, channel: ParentChannel, child_end: socket.socket) -> None:
        self.worker_id = worker_id
        # None until the worker is forked (WorkerPool._fork); its end of the socket is held
        # here until then.
        self.process: Any = None
        self.pid: int | None = None
        self.child_end: socket.socket | None = child_end
        self.channel = channel
        self.mappings = SlabMappings()
        self.exited = False
        self.release: Callable[[int], None] = _no_release
        # Small freed slabs waiting to ride along with this worker's next task (see
        # EAGER_FREE_BYTES).
        self.deferred_frees: list[int] = []
        # Whether the selector watches its socket for writability (see WorkerPool._pump_out).
        self.watching_write = False
        # A worker of a staggered start: whether a task waits in its socket for its fork.
        self.tasked = False

    def batch_value(self, result: SlabBatch | PickledBatch | ValueBatch) -> Any:
        """A batch this worker sent, as the consumer gets it: a slab's tensors as views of it,
        with no copy."""
        if isinstance(result, SlabBatch):
            return self.mappings.decode(
                result.slab_id, result.used, result.payload, result.leaves, self.release
            )
        if isinstance(result, PickledBatch):
            return pickle.loads(result.payload)
        return result.value

    def take_deferred_frees(self) -> tuple[int, ...]:
        freed = tuple(self.deferred_frees)
        self.deferred_frees.clear()
        return freed


def not_my_child(process: Any) -> None:
    children = getattr(multiprocessing.process, "_children", None)
    if isinstance(children, set):
        children.discard(process)


# A worker that exits with status 1 under spawn or forkserver most often failed while it
# imported the main module, as each such worker does first: a script that makes and iterates
# its DataLoader at the top level starts workers from inside a worker, which Python refuses.
MAIN_GUARD_HINT = (
    " Under the {method!r} start method each worker first imports your main module: if your "
    "script makes or iterates the DataLoader at its top level, move that code under "
    '`if __name__ == "__main__":`. The worker\'s own error is printed above, on stderr.'
)


def describe_exit(worker: WorkerHandle) -> tuple[str, int | None]:
    code = worker.process.exitcode
    pid = worker.pid
    if code is not None and code < 0:
        signum = -code
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        text = signal.strsignal(signum) or name
        return f"DataLoader worker (pid {pid}) is killed by signal: {text} ({name}).", code
    return f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {code}.", code


def start_process(
    ctx: Any, worker: WorkerHandle, *, target: Any, config: Any, parent: Any = None
) -> None:
    """Start ``worker``'s process on its socket's child end, and let go of our copy of that end."""
    child_sock = worker.child_end
    assert child_sock is not None
    process = ctx.Process(
        target=target,
        args=(config, child_sock, parent),
        name=f"aioload-worker-{worker.worker_id}",
        daemon=True,
    )
    # Its own end, the new worker keeps.
    unforked_ends.discard(child_sock)
    try:
        # start() does not wait for the worker to initialise, so workers come up concurrently.
        process.start()
    finally:
        # Our copy of the child's end must go, or the child's death would not close its socket.
        worker.child_end = None
        child_sock.close()
    worker.process = process
    worker.pid = process.pid


def stop_processes(forked: list[WorkerHandle], grace: float) -> None:
    """Steps 2 and 3 of ``WorkerPool.close``: wait up to ``grace`` seconds for the workers to
    leave on their own (their sockets are closed by now), then kill whoever is left and reap
    every one. Bounded: SIGKILL cannot be caught."""
    # 2. Give them ``grace`` seconds to leave on their own, waiting on all sentinels at once.
    pending = [w for w in forked if w.process.exitcode is None]
    deadline = time.monotonic() + grace
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = multiprocessing.connection.wait([w.process.sentinel for w in pending], timeout=left)
        # A ready sentinel means the process is exiting, but it closes a moment before the
        # process can be reaped, and ``exitcode`` reads None until then: waiting on the
        # sentinel again would return at once, a busy loop (hundreds of turns, milliseconds
        # of CPU per pool). join() on a ready sentinel waits for the exit status instead.
        for worker in pending:
            if worker.process.sentinel in ready:
                worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        pending = [w for w in pending if w.process.exitcode is None]
    # 3. Whoever is still there is stuck in user code: kill it. SIGKILL cannot be caught, so
    #    the join below is bounded.
    for worker in pending:
        with contextlib.suppress(ProcessLookupError, OSError, ValueError):
            worker.process.kill()
    for worker in forked:
        with contextlib.suppress(ValueError, AssertionError):
            worker.process.join(timeout=5.0)
            # Process.close() releases the sentinel descriptor now rather than at GC.
            worker.process.close()
