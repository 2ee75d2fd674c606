"""Early exit (break, del, abandoned iterators, many loaders in a row) and descriptor limits:
nothing grows with the number of passes or loaders."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from ..leaks import worker_threads
from .conftest import Reference, outcome
from .datasets import Indices, Tensors


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled_fds(baseline: int, within: float = 2.0) -> int:
    """The descriptor count once it is back to ``baseline``, or after ``within`` seconds: a
    descriptor that another thread of the test process holds for a moment (a finalizer
    closing an earlier test's loader, a read of /proc) is not one the scenario left behind,
    and one that was left behind is still there when the time is up."""
    deadline = time.monotonic() + within
    while True:
        count = _fds()
        if count <= baseline or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


def _fd_targets() -> list[str]:
    """What each open descriptor is, for a failure's message."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own, closed by now)
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(targets)


def _live_children(wait: float = 5.0) -> int:
    """Workers still alive once the ones that are exiting have had ``wait`` seconds: child
    processes, or (``worker_method="thread"``) aioload's worker threads."""
    gc.collect()
    children = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(children, timeout=wait)
    return len(alive) + len(worker_threads(wait))


def _remove_orphaned_torch_segments(before: set[str]) -> None:
    """torch's workers, failing on "Too many open files", leave their /dev/shm segments
    (torch_<pid>_...) behind. Remove the new ones whose process is gone (a live one may
    belong to another program), so that the leak check sees only what aioload leaves."""
    for name in set(os.listdir("/dev/shm")) - before:
        parts = name.split("_")
        orphaned = parts[0] == "torch" and len(parts) > 1 and parts[1].isdigit()
        if orphaned and not psutil.pid_exists(int(parts[1])):
            os.unlink(os.path.join("/dev/shm", name))


@pytest.fixture
def low_fd_limit() -> Iterator[int]:
    """Lower the soft RLIMIT_NOFILE to what is open now plus 64 (workers inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = _fds() + 64
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_break_in_many_loaders_in_a_row(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """A break ends the pass: its workers go, and five loaders in a row leave no more
    processes or descriptors than two."""

    def scenario(cls: type[Any]) -> dict[str, Any]:
        firsts, fds = [], []
        for n in range(5):
            loader = cls(Indices(40), batch_size=4, num_workers=2)
            for batch in loader:
                firsts.append(batch.tolist())
                break
            del loader
            alive = _live_children()
            # From the third loader on, against the second's count: torch's queues close
            # their pipes' write ends from feeder threads, after the iterator is gone.
            fds.append(_fds() if n < 2 else _settled_fds(fds[1]))
            if alive:
                return {"alive_after": n, "firsts": firsts}
        return {"alive_after": None, "firsts": firsts, "fd_growth": fds[-1] - fds[1] > 0}

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got["alive_after"] is None
    assert got["fd_growth"] is False


def test_del_iterator_mid_epoch(loader_cls: type[Any], no_leaks: None) -> None:
    loader = loader_cls(Indices(40), batch_size=2, num_workers=2)
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]
    assert _live_children(wait=0) == 2
    del iterator
    assert _live_children() == 0
    assert [b.tolist() for b in loader][:1] == [[0, 1]]  # the loader starts over


def test_abandoned_iterators_then_a_full_pass(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """Iterators started and dropped after one batch, several at once, then a complete pass:
    the complete pass is exact and the abandoned workers are gone."""

    def scenario(cls: type[Any]) -> Any:
        loader = cls(Indices(12), batch_size=3, num_workers=2)
        iterators = [iter(loader) for _ in range(3)]
        heads = [next(it).tolist() for it in iterators]
        del iterators
        full = [b.tolist() for b in loader]
        return heads, full, _live_children()

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got[2] == 0


def test_persistent_workers_many_epochs_do_not_grow(
    loader_cls: type[Any], is_aioload: bool, reference: Reference, no_leaks: None
) -> None:
    """Epochs on persistent workers, finished or broken off: the same totals, the same two
    workers, and (aioload) no descriptor that stays. torch's own count may grow here: its
    file_descriptor sharing keeps a cache of received descriptors, so it is not compared."""

    def scenario(cls: type[Any]) -> dict[str, Any]:
        loader = cls(Tensors(24), batch_size=4, num_workers=2, persistent_workers=True)
        fds, totals = [], []
        for epoch in range(8):
            if epoch % 2:
                for _ in loader:
                    break
            else:
                totals.append(sum(b.sum().item() for b in loader))
            gc.collect()
            fds.append(_fds())
        growth = _settled_fds(fds[2]) - fds[2]
        children = len(psutil.Process().children(recursive=True)) + len(worker_threads())
        del loader
        return {"totals": totals, "children": children, "fd_growth": growth}

    got = reference.run(scenario)
    expected = reference(scenario)
    assert (got["totals"], got["children"]) == (expected["totals"], expected["children"])
    assert got["children"] == 2
    if is_aioload:
        assert got["fd_growth"] <= 0, _fd_targets()


def test_kept_batches_under_a_low_descriptor_limit(
    loader_cls: type[Any], is_aioload: bool, reference: Reference, low_fd_limit: int, no_leaks: None
) -> None:
    """Keeping every batch of an epoch of 200 batches with 64 descriptors to spare.

    torch (file_descriptor sharing, its Linux default) holds a descriptor per kept batch's
    storage and fails with its "Too many open files" RuntimeError, which names the fixes.
    DEVIATION (fd-per-batch): aioload's batches are views of mapped slabs that hold no
    descriptor in the consumer, so the epoch completes."""

    def scenario(cls: type[Any]) -> Any:
        before = set(os.listdir("/dev/shm"))
        loader = cls(Tensors(400, size=32), batch_size=2, num_workers=2)
        result = outcome(lambda loader=loader: list(loader))
        count = None if result.value is None else len(result.value)
        raised = result.raised
        del loader, result
        _live_children()  # the workers' exit first: a live worker's segment is not removed
        _remove_orphaned_torch_segments(before)
        return count, raised

    got = reference.run(scenario)
    expected = reference(scenario)
    assert expected[1] is not None and expected[1].type is RuntimeError
    assert expected[1].message.startswith("Too many open files.")
    if is_aioload:
        assert got == (200, None)


def test_many_epochs_under_a_low_descriptor_limit(
    loader_cls: type[Any], reference: Reference, low_fd_limit: int, no_leaks: None
) -> None:
    """Twelve short passes, each with its own workers, fit under a limit of 64 spare
    descriptors: nothing accumulates from pass to pass."""

    def scenario(cls: type[Any]) -> list[int]:
        loader = cls(Tensors(8), batch_size=4, num_workers=1)
        return [len(list(loader)) for _ in range(12)]

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got == [2] * 12
