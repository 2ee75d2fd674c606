"""The hang report (``hang_report_after``): one WARNING on the "aioload" logger, and
``stats().stalled``, when the consumer has waited for one batch past the threshold; the wait
goes on and the batch arrives.

A map-style dataset sleeps in ``__getitem__`` for one index, long past the threshold, only
once a flag file exists: a pass with worker processes first runs without it (and without a
threshold), so that the reported pass runs on warm persistent workers and the only wait past
the threshold is the slow sample's.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import Dataset

import aioload
from tests.helpers import run_on

pytestmark = [pytest.mark.timeout(60)]

THRESHOLD = 0.25
SLOW_S = 0.8
SLOW_INDEX = 5  # in batch 2 of batch_size 2: indices [4, 5]


def _worker_place() -> str:
    """Where this sample runs, as the report names it (``Place``): a worker process by its
    pid, a worker thread by its name."""
    name = threading.current_thread().name
    return f"thread {name}" if name.startswith("aioload-worker-") else f"pid {os.getpid()}"


def _place_file(flag: Path) -> Path:
    return flag.with_name(flag.name + ".place")


class SlowOnce(Dataset[int]):
    """Index 5 sleeps ``slow_s`` while ``flag`` exists, writing where it runs next to it."""

    def __init__(self, flag: Path, slow_s: float = SLOW_S) -> None:
        self.flag = str(flag)
        self.slow_s = slow_s

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == SLOW_INDEX and Path(self.flag).exists():
            _place_file(Path(self.flag)).write_text(_worker_place())
            time.sleep(self.slow_s)  # the stack must show this line
        return index


def _reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "aioload" and r.levelno == logging.WARNING
    ]


def _iterate(loader: Any, front: str) -> list[list[int]]:
    if front == "sync":
        return [batch.tolist() for batch in loader]

    async def run() -> list[list[int]]:
        return [batch.tolist() async for batch in loader]

    return list(run_on(front, run))


class _StallSeen:
    """Reads ``loader.stats().stalled`` from another thread until the pass reports a stall:
    what a monitoring thread of the user's would see while the consumer waits."""

    def __init__(self, loader: Any) -> None:
        self.seen: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._look, args=(loader,))
        self._thread.start()

    def _look(self, loader: Any) -> None:
        while not self._stop.wait(0.05):
            stalled = loader.stats().stalled
            if stalled is not None and stalled["waiting"]:
                self.seen = stalled
                return

    def join(self) -> dict[str, Any] | None:
        self._stop.set()
        self._thread.join()
        return self.seen


def _check_report(message: str, stalled: dict[str, Any] | None, worker: str | None) -> None:
    """``worker``: "N (place)", the worker and where it runs; None: the calling process."""
    assert stalled is not None
    assert stalled["batch"] == 2 and stalled["indices"] == [4, 5]
    assert stalled["worker"] == (None if worker is None else int(worker.split()[0]))
    assert "with indices [4, 5]" in message and "for batch 2, and still waits" in message
    holder = "The calling process" if worker is None else f"DataLoader worker {worker}"
    assert holder in message
    stack = stalled["stack"]
    assert stack is not None and "__getitem__" in stack and "test_hang_report.py" in stack
    assert stack in message


FRONTS = ["sync", "asyncio", "trio"]


@pytest.mark.parametrize("front", FRONTS)
def test_a_worker_in_a_slow_sample_is_reported_once_with_its_stack(
    front: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, no_leaks: None
) -> None:
    flag = tmp_path / "slow"
    loader = aioload.DataLoader(
        SlowOnce(flag),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        hang_report_after=None,
    )
    try:
        assert _iterate(loader, front) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # warm workers
        flag.touch()
        loader.hang_report_after = THRESHOLD
        caplog.set_level(logging.WARNING, logger="aioload")
        watcher = _StallSeen(loader)
        # The batch arrives, in order: the report stops nothing.
        assert _iterate(loader, front) == [[0, 1], [2, 3], [4, 5], [6, 7]]
        seen = watcher.join()
    finally:
        loader.shutdown()
    [message] = _reports(caplog)
    # Seen while the consumer waited, and kept after the batch arrived.
    assert seen is not None and seen["waiting"] and seen["waited_s"] >= THRESHOLD
    after = loader.stats().stalled
    # Worker 0 (its pid, or its thread's name), as the dataset wrote it down.
    place = _place_file(flag).read_text()
    _check_report(message, after, worker=f"0 ({place})")
    assert after is not None and not after["waiting"]
    assert after["waited_s"] >= seen["waited_s"] and after["where"] == place
    assert f"stalled (hang_report_after): batch 2 from worker 0 ({place})" in str(loader.stats())
    assert json.loads(json.dumps(loader.stats().as_dict()))["stalled"] == after


@pytest.mark.no_local_workers("num_workers=0: the calling process runs the samples")
@pytest.mark.parametrize("front", ["sync", "asyncio"])
def test_the_calling_process_in_a_slow_sample_is_reported_once(
    front: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, no_leaks: None
) -> None:
    flag = tmp_path / "slow"
    flag.touch()
    caplog.set_level(logging.WARNING, logger="aioload")
    loader = aioload.DataLoader(SlowOnce(flag), batch_size=2, hang_report_after=THRESHOLD)
    watcher = _StallSeen(loader)
    assert _iterate(loader, front) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    seen = watcher.join()
    [message] = _reports(caplog)
    assert seen is not None and seen["waiting"]
    stalled = loader.stats().stalled
    _check_report(message, stalled, worker=None)
    assert stalled is not None and stalled["where"] == "the calling process"
    # The sample's own line, as a traceback shows it.
    assert "time.sleep(self.slow_s)" in stalled["stack"]


@pytest.mark.no_local_workers("num_workers=0: the calling process runs the samples")
def test_no_report_when_turned_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flag = tmp_path / "slow"
    flag.touch()
    caplog.set_level(logging.DEBUG, logger="aioload")
    for off in (None, math.inf):
        loader = aioload.DataLoader(SlowOnce(flag, 0.4), batch_size=2, hang_report_after=off)
        assert len(list(loader)) == 4
        assert loader.stats().stalled is None
    assert _reports(caplog) == []


@pytest.mark.no_local_workers("no worker starts: the argument alone")
def test_the_default_is_a_minute() -> None:
    loader = aioload.DataLoader(list(range(4)))
    assert loader.hang_report_after == 60.0


@pytest.mark.no_local_workers("no worker starts: the argument alone")
@pytest.mark.parametrize("value", [0, -1, True, "60", float("nan")])
def test_hang_report_after_refuses_what_is_not_seconds(value: Any) -> None:
    with pytest.raises(ValueError, match="hang_report_after option should be None or a pos"):
        aioload.DataLoader(list(range(4)), hang_report_after=value)


@pytest.mark.no_local_workers("num_workers=0: the calling process runs the samples")
@pytest.mark.parametrize("value", [None, 0.5, 5, math.inf])
def test_hang_report_after_takes_seconds_or_none(value: Any) -> None:
    loader = aioload.DataLoader(list(range(4)), hang_report_after=value)
    assert loader.hang_report_after == value
    assert [int(b) for b in loader] == [0, 1, 2, 3]


@pytest.mark.no_local_workers("num_workers=0: the calling process runs the samples")
def test_an_unreadable_stack_still_reports(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend that cannot read the stack (Ray) still names the batch and its worker."""
    from aioload._backends.inline import InlineBackend

    monkeypatch.setattr(InlineBackend, "dump_stack", lambda self, worker_id: None)
    flag = tmp_path / "slow"
    flag.touch()
    caplog.set_level(logging.WARNING, logger="aioload")
    loader = aioload.DataLoader(SlowOnce(flag, 0.6), batch_size=2, hang_report_after=THRESHOLD)
    assert len(list(loader)) == 4
    [message] = _reports(caplog)
    assert "indices [4, 5]" in message and "could not be read" in message
    stalled = loader.stats().stalled
    assert stalled is not None and stalled["stack"] is None
