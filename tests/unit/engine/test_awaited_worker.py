"""The wait for the worker whose batch is next (``_backends.process._AwaitedEpoll``, which the
pool offers the engine's ``_aio.waiting.Waiter`` under both front ends).

In order, the consumer needs one worker's answer at a time; the engine then sleeps on that
worker's socket (and on every worker's exit) rather than on every answer, and the others'
answers are read when it wakes. These tests check, under both front ends, what that must not
cost: no batch lost or reordered, a lost worker noticed at once while another is awaited, a
replaced worker awaited on its new socket, and workers with answers too large to wait in their
sockets watched all the time again.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import socket
import time
from typing import Any

import pytest
from torch.utils.data import Dataset, get_worker_info

import aioload
from aioload._aio import waiting
from aioload._backends import process as _workers
from aioload._engine import orchestrator as _orchestrator
from aioload.errors import WorkerDiedError
from tests.helpers import run_on, within
from tests.scripts.datasets import KillsItselfOnce

# "for", or ``async for`` on this event loop.
FRONTS = ["for", "asyncio", "uvloop", "trio"]


def _batches(loader: aioload.DataLoader[Any], front: str) -> list[Any]:
    """Every batch of a pass, as lists, through ``front``."""
    if front == "for":
        return [batch.tolist() for batch in loader]

    async def main() -> list[Any]:
        return [batch.tolist() async for batch in loader]

    return list(run_on(front, main))


def _first(loader: aioload.DataLoader[Any], front: str) -> Any:
    if front == "for":
        return next(iter(loader))

    async def main() -> Any:
        batches = aiter(loader)
        try:
            return await anext(batches)
        finally:
            await batches.aclose()  # type: ignore[attr-defined]

    return run_on(front, main)


class _WorkerPaced(Dataset[int]):
    """Worker 0 takes ``slow_s`` per sample, worker 1 none: worker 1's answers arrive while
    the consumer waits for worker 0's. ``die_in_1``: worker 1 exits in its first sample."""

    def __init__(self, n: int, slow_s: float, die_in_1: bool = False) -> None:
        self.n = n
        self.slow_s = slow_s
        self.die_in_1 = die_in_1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        info = get_worker_info()
        assert info is not None
        if info.id == 0:
            time.sleep(self.slow_s)
        elif self.die_in_1:
            os._exit(3)
        return index


class _Blobs(Dataset[bytes]):
    """Samples of ``size`` bytes, which travel pickled (no tensor to put in a slab)."""

    def __init__(self, n: int, size: int) -> None:
        self.n = n
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> bytes:
        return bytes([index % 256]) * self.size


def _wake_ups(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """One entry per step after a wait: whether that wait brought the batch it waited for."""
    seen: list[bool] = []
    step = _orchestrator.Orchestrator.step

    def counting(self: Any, intake: bool = True) -> Any:
        result = step(self, intake)
        if intake:
            seen.append(result is not _orchestrator.PENDING)
        return result

    monkeypatch.setattr(_orchestrator.Orchestrator, "step", counting)
    return seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("front", FRONTS)
def test_the_other_workers_answers_do_not_wake_the_consumer(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None, front: str
) -> None:
    wake_ups = _wake_ups(monkeypatch)
    loader = aioload.DataLoader(_WorkerPaced(24, slow_s=0.01), batch_size=2, num_workers=2)
    got = _batches(loader, front)
    assert got == [[i, i + 1] for i in range(0, 24, 2)], "every batch once, in order"
    # Worker 1 answers at once and worker 0 in 20 ms, so a wait that any answer ended would
    # wake for worker 1's answer while worker 0's batch is due (about one wait in two).
    assert wake_ups, "the consumer had to wait"
    assert wake_ups.count(False) <= 1, f"woken without the awaited batch: {wake_ups}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("front", FRONTS)
def test_a_worker_lost_while_another_is_awaited_is_noticed_at_once(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None, front: str
) -> None:
    # The health check (which would notice a death without any descriptor) is pushed out of
    # reach: only the exited worker's sentinel, watched by the wait for worker 0, can end it.
    # Worker 0's samples take an hour: nothing else ends the wait either.
    monkeypatch.setattr(_workers, "_HEALTH_CHECK_S", 3600.0)
    loader = aioload.DataLoader(
        _WorkerPaced(8, slow_s=3600.0, die_in_1=True), batch_size=2, num_workers=2
    )
    started = time.monotonic()
    with pytest.raises(WorkerDiedError):
        _first(loader, front)
    assert time.monotonic() - started < within(10)  # a hang guard


@pytest.mark.timeout(60)
def test_answers_too_large_to_wait_in_a_socket_make_every_wait_watch_every_worker(
    no_leaks: None,
) -> None:
    # 4 x 64 KiB samples a batch: an answer larger than a socket holds comfortably. The worker
    # would block in its send until its turn, so the pool goes back to watching every worker.
    size = 64 * 1024
    loader = aioload.DataLoader(_Blobs(16, size), batch_size=4, num_workers=2)
    it = iter(loader)
    got = [next(it) for _ in range(4)]
    pool = it._engine._backend  # type: ignore[attr-defined]
    assert not pool._await_one
    assert [len(b) for b in got] == [4] * 4
    assert [b[0][:1] for b in got] == [bytes([i]) for i in range(0, 16, 4)]
    it.close()
    # Small answers (a tensor batch in a slab is answered in a few hundred bytes) keep it.
    loader = aioload.DataLoader(_Blobs(16, 16), batch_size=4, num_workers=2)
    it = iter(loader)
    assert len([next(it) for _ in range(4)]) == 4
    assert it._engine._backend._await_one  # type: ignore[attr-defined]
    it.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("front", FRONTS)
def test_a_replaced_worker_is_awaited_on_its_new_socket(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, no_leaks: None, front: str
) -> None:
    # The epoll kept for the awaited worker, and the engine's watch of it, must not outlive
    # the descriptors they were made from: the replacement in slot 0 (batch 6 is worker 0's)
    # has a new socket and sentinel, and a poll of its predecessor's closed ones either never
    # ends or returns at once, every time (POLLNVAL): a set kept by slot, not by worker, hangs
    # here or spins. The kernel may hand the replacement its predecessor's numbers again,
    # which would hide that, so a few descriptors are taken first.
    taken: list[int] = []
    spawn = _workers.WorkerPool._spawn

    def spawn_elsewhere(self: Any, worker_id: int) -> Any:
        taken.extend(os.dup(0) for _ in range(4))
        return spawn(self, worker_id)

    polls: list[int] = []
    wait_blocking = waiting.Waiter.wait_blocking

    def counting(self: Any, *args: Any) -> bool:
        polls.append(1)
        return wait_blocking(self, *args)

    wait = waiting.Waiter.wait

    async def counting_async(self: Any, *args: Any) -> bool:
        polls.append(1)
        return await wait(self, *args)

    monkeypatch.setattr(_workers.WorkerPool, "_spawn", spawn_elsewhere)
    monkeypatch.setattr(waiting.Waiter, "wait_blocking", counting)
    monkeypatch.setattr(waiting.Waiter, "wait", counting_async)
    loader = aioload.DataLoader(
        KillsItselfOnce(40, at=13, marker=tmp_path / "killed"),
        batch_size=2,
        num_workers=2,
        max_worker_restarts=1,
    )
    try:
        with pytest.warns(RuntimeWarning, match="replaced it"):
            got = _batches(loader, front)
    finally:
        for fd in taken:
            os.close(fd)
    assert taken, "a worker was replaced"
    assert got == [[i, i + 1] for i in range(0, 40, 2)]
    assert 0 < len(polls) <= 2 * len(got), f"{len(polls)} waits for {len(got)} batches"


class _Handle:
    """What ``_AwaitedEpoll`` reads of a worker handle: its socket, as ``channel.sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.channel = self
        self.sock = sock


def test_the_async_wait_follows_the_selector_and_the_awaited_worker() -> None:
    # Two workers' sockets and a sentinel in the pool's selector. A wait for worker 0 ignores
    # worker 1's answers; moved to worker 1, it hears them; a sentinel registered after the
    # epoll was made (a replacement's) ends a wait too; a replaced socket is awaited.
    selector = _workers._Selector()
    pairs = [socket.socketpair() for _ in range(3)]
    workers = [_Handle(pairs[0][0]), _Handle(pairs[1][0])]
    for worker in workers:
        selector.register(worker.sock, selectors.EVENT_READ, (worker, "sock"))
    exit_r, exit_w = os.pipe()
    waits = _workers._AwaitedEpoll()
    waiter = waiting.Waiter(None)  # the engine's, on what the pool offers
    long_s = 30.0  # a wait that something must end

    async def wait_for(worker: Any, timeout: float) -> bool:
        return await waiter.wait(waits.offer(selector, worker), timeout)

    async def main() -> list[bool]:
        woken = []
        pairs[1][1].send(b"x")  # worker 1 answers
        woken.append(await wait_for(workers[0], 0.05))
        woken.append(await wait_for(workers[1], long_s))
        pairs[1][0].recv(1)
        # The loop may have queued one more call of the reader before the answer was read
        # (readiness is level-triggered): let it find nobody waiting.
        for _ in range(3):
            await asyncio.sleep(0)
        # Worker 0 exits: its sentinel, registered only now, ends a wait for worker 1.
        selector.register(exit_r, selectors.EVENT_READ, (workers[0], "exit"))
        os.write(exit_w, b"x")
        woken.append(await wait_for(workers[1], long_s))
        selector.unregister(exit_r)
        # Worker 0 is replaced by one on a new socket, which has answered.
        selector.unregister(workers[0].sock)
        workers[0].sock.close()
        replacement = _Handle(pairs[2][0])
        selector.register(replacement.sock, selectors.EVENT_READ, (replacement, "sock"))
        pairs[2][1].send(b"x")
        woken.append(await wait_for(replacement, long_s))
        waiter.close()
        waits.close()
        return woken

    try:
        started = time.monotonic()
        # Only the first wait runs out its time: the others say they were woken, and none
        # took its 30 s (a hang guard, scaled; far from what a wait that ran out takes).
        assert asyncio.run(main()) == [False, True, True, True]
        assert time.monotonic() - started < within(5)
    finally:
        selector.close()
        for a, b in pairs:
            a.close()
            b.close()
        os.close(exit_r)
        os.close(exit_w)
