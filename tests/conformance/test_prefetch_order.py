"""prefetch_factor (how far ahead workers fetch) and in_order=False."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import Reference, TorchDataLoader
from .datasets import FetchLog, Gated, Indices, Sleepy, fetched

RUNS = itertools.count()  # unique file names: a scenario may run more than once per test


def _settled_count(path: Path, at_least: int | None) -> int:
    """How many samples the workers have fetched once they have nothing left to do: wait
    until the log reaches ``at_least`` (torch's count), or stops growing for 1 s; then give
    an over-eager loader 0.3 s more to show itself. Only the count is asserted, never a
    time."""
    deadline = time.monotonic() + 15
    last, still_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = len(fetched(path))
        if at_least is not None and count >= at_least:
            break
        if count != last:
            last, still_since = count, time.monotonic()
        elif time.monotonic() - still_since > 1.0:
            break
        time.sleep(0.02)
    time.sleep(0.3)
    return len(fetched(path))


def _sent_ahead(
    cls: type[Any], log: Path, prefetch_factor: int, expected: list[int] | None
) -> list[int]:
    """Batches fetched after iter(), then after each of the first two batches."""
    batch_size = 2
    loader = cls(
        FetchLog(60, log), batch_size=batch_size, num_workers=2, prefetch_factor=prefetch_factor
    )
    iterator = iter(loader)
    counts = []
    for k in range(3):
        if k:
            next(iterator)
        # torch's count is its own bookkeeping (its iterator's _send_idx); aioload's is the
        # log's, held to torch's.
        sent = getattr(iterator, "_send_idx", None)
        hint = None if sent is None else sent * batch_size
        if expected is not None:
            hint = expected[k] * batch_size
        counts.append(_settled_count(log, hint) // batch_size)
    del iterator
    return counts


@pytest.mark.parametrize("prefetch_factor", [3])
def test_tasks_sent_ahead(
    prefetch_factor: int,
    loader_cls: type[Any],
    is_aioload: bool,
    reference: Reference,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    no_leaks: None,
) -> None:
    """After each of the first batches, the workers have fetched exactly as many batches as
    torch's: prefetch_factor*num_workers sent ahead of the consumer.

    DEVIATION (lazy-start): torch starts its workers and sends the first
    prefetch_factor*num_workers tasks in iter(); aioload starts them at the first next() (or
    __anext__, where the start runs in a thread so that the loop stays free). Nothing is
    fetched between iter() and the first next().

    DEVIATION (run-ahead): later in a pass, in order, while the head of the line is late,
    aioload's workers run ahead of it beyond this window, within a bound
    (``_engine/runahead.py``, docs/tuning.md); not during the pass's first window of batches,
    which is what this test sees."""
    workers = 2

    def scenario(cls: type[Any], expected: list[int] | None = None) -> list[int]:
        return _sent_ahead(cls, tmp_path / f"{next(RUNS)}.log", prefetch_factor, expected)

    expected = reference(scenario)
    got = expected if loader_cls is TorchDataLoader else scenario(loader_cls, expected)
    # torch's rule, which users size their memory by: p*w batches ahead of the consumer.
    assert expected == [prefetch_factor * workers + k for k in range(3)]
    if is_aioload:
        assert got[0] == 0  # lazy-start: nothing before the first next()
    assert got[1:] == expected[1:]


def test_break_keeps_later_epochs_in_torchs_order(
    loader_cls: type[Any], reference: Reference, request: pytest.FixtureRequest, no_leaks: None
) -> None:
    """A ``break`` mid-epoch leaves the shuffle of later epochs as torch's: how far the
    sampler had been drawn when the pass ended decides the generator's state."""

    def scenario(cls: type[Any]) -> list[Any]:
        loader = cls(
            Indices(8),
            batch_size=2,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator().manual_seed(3),
        )
        first = next(iter(loader)).tolist()  # the iterator is dropped at once, like a break
        return [first, [b.tolist() for b in loader]]

    got = reference.run(scenario)
    assert got == reference(scenario)


# -- in_order ----------------------------------------------------------------------------------


def test_in_order_false_yields_ready_batches_first(
    loader_cls: type[Any], reference: Reference, tmp_path: Path, no_leaks: None
) -> None:
    """Batch 0 waits for a gate the consumer opens only after it has received a batch: with
    in_order=False, worker 1's batch comes first; every batch still comes exactly once."""

    def scenario(cls: type[Any]) -> dict[str, Any]:
        gate = tmp_path / f"{cls.__module__}-{next(RUNS)}.gate"
        loader = cls(Gated(12, gated=0, gate=gate), batch_size=2, num_workers=2, in_order=False)
        order = []
        for batch in loader:
            order.append(batch.tolist())
            gate.touch()
        return {"first": order[0], "all": sorted(order), "count": len(order)}

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got["first"] != [0, 1]
    assert got["all"] == [[i, i + 1] for i in range(0, 12, 2)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_in_order_true_waits_for_the_slow_batch(
    num_workers: int, loader_cls: type[Any], reference: Reference, no_leaks_with_workers: None
) -> None:
    def scenario(cls: type[Any]) -> list[Any]:
        loader = cls(Sleepy(8, slow=0, seconds=0.3), batch_size=2, num_workers=num_workers)
        return [b.tolist() for b in loader]

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got == [[i, i + 1] for i in range(0, 8, 2)]


def test_in_order_false_without_workers_is_sequential(
    loader_cls: type[Any], reference: Reference
) -> None:
    def scenario(cls: type[Any]) -> list[Any]:
        return [
            b.tolist() for b in cls(Sleepy(6, slow=0, seconds=0.05), batch_size=2, in_order=False)
        ]

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert list(itertools.chain(*got)) == list(range(6))


def test_in_order_false_persistent_epochs_are_complete(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    def scenario(cls: type[Any]) -> list[Any]:
        loader = cls(
            Indices(10), batch_size=3, num_workers=2, in_order=False, persistent_workers=True
        )
        return [sorted(b.tolist() for b in loader) for _ in range(2)]

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got[0] == got[1]
