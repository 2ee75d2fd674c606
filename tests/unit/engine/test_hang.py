"""The hang report over the fake backend (``_engine/hang.py``): which task it names, in order
and not; that it comes when due, not at the backend's next health check; once per batch."""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio
import pytest

from aioload._backends.base import OUT_OF_PROCESS
from aioload._backends.fake import FakeBackend
from aioload._engine.counters import PassStats
from aioload._engine.hang import HangWatch
from aioload._engine.orchestrator import END, NEEDS_LOOP, Orchestrator, PassSetup
from aioload._engine.resume import PassProgress, numbered_batches
from aioload._wire.messages import PassPlan

pytestmark = pytest.mark.timeout(30)

BATCHES = [[0, 1], [2, 3], [4, 5], [6, 7]]


def _engine(backend: FakeBackend, *, threshold: float, in_order: bool = True) -> Orchestrator:
    stats = PassStats(backend.num_workers, False, True)
    progress = PassProgress(
        epoch=0, rng={}, sample_seed=None, iterable=False, num_streams=backend.num_workers
    )
    setup = PassSetup(
        batches=numbered_batches(iter(BATCHES), None, 0),
        num_workers=backend.num_workers,
        prefetch=2,
        in_order=in_order,
        timeout=0,
        max_worker_restarts=0,
        progress=progress,
        plans=[PassPlan()] * backend.num_workers,
        traits=OUT_OF_PROCESS,
        hang=HangWatch(threshold, stats, in_order=in_order),
    )
    return Orchestrator(lambda: backend, setup, owns_backend=True, stats=stats)


def _drain(engine: Orchestrator, front: str) -> list[Any]:
    out = []
    while True:
        # (As the front ends do: a stall ends, for stats, when next() returns.)
        entered = engine.stats.enter()
        if front == "blocking":
            batch = engine.next_blocking()
            assert batch is not NEEDS_LOOP
        else:
            batch = anyio.run(engine.next)
        engine.stats.leave(entered)
        if batch is END:
            return out
        out.append(batch)


def _reports(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aioload"]


@pytest.mark.parametrize("front", ["async", "blocking"])
def test_the_report_comes_when_due_not_at_the_next_health_check(
    front: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The fake lets the engine sleep up to a second between polls, as a pool's health check
    # does: a report made only at those wake-ups would come a second after the wait began.
    backend = FakeBackend(2, delay=lambda task_id: 1.5 if task_id == 1 else 0.0)
    backend.stacks[1] = 'File "ds.py", line 9 in __getitem__'
    engine = _engine(backend, threshold=0.1)
    caplog.set_level(logging.WARNING, logger="aioload")
    started = time.monotonic()
    assert _drain(engine, front) == BATCHES
    [record] = _reports(caplog)
    assert record.created - (time.time() - (time.monotonic() - started)) < 0.9
    message = record.getMessage()
    assert "for batch 1, and still waits" in message
    assert "DataLoader worker 1 (fake 1) holds it, with indices [2, 3]" in message
    assert backend.stacks[1] in message
    assert backend.dumped == [1]
    stalled = engine.stats.snapshot().stalled
    assert stalled is not None
    assert (stalled["batch"], stalled["worker"], stalled["indices"]) == (1, 1, [2, 3])
    assert not stalled["waiting"] and stalled["waited_s"] >= 1.0


@pytest.mark.parametrize("front", ["async", "blocking"])
def test_out_of_order_names_the_oldest_unanswered_task(
    front: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Batch 0 is late; the others arrive and are delivered first. The consumer then waits
    # for batch 0 alone.
    # (Well past the threshold: a loaded machine that stalls the engine until batch 0 is in
    # would leave nothing to report.)
    backend = FakeBackend(2, delay=lambda task_id: 1.5 if task_id == 0 else 0.0)
    engine = _engine(backend, threshold=0.2, in_order=False)
    caplog.set_level(logging.WARNING, logger="aioload")
    out = _drain(engine, front)
    assert sorted(out) == BATCHES and out[-1] == [0, 1]
    [record] = _reports(caplog)
    assert "for batch 0," in record.getMessage()
    assert "DataLoader worker 0 (fake 0) holds it" in record.getMessage()
    assert "could not be read" in record.getMessage()  # the fake has no stack for it


def test_each_slow_batch_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    # (All four are sent at once: batch 3 is due well after batch 1, and both well past the
    # threshold, for a loaded machine's stalls.)
    backend = FakeBackend(2, delay=lambda task_id: {1: 1.0, 3: 2.0}.get(task_id, 0.0))
    engine = _engine(backend, threshold=0.1)
    caplog.set_level(logging.WARNING, logger="aioload")
    assert _drain(engine, "blocking") == BATCHES
    reported = [r.getMessage().split(",")[0] for r in _reports(caplog)]
    assert [text.split()[-1] for text in reported] == ["1", "3"]
    assert backend.dumped == [1, 1]
