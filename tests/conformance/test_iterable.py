"""IterableDataset (per-worker sharding, len() and its warning) and DataPipes."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests.scripts.datasets import Sharded

from .conftest import Reference, batches, outcome, thread_deviation
from .datasets import LyingLength, UnevenIterable, Unsharded

with warnings.catch_warnings():
    # DataPipes are deprecated in torch, and still shipped and used.
    warnings.simplefilter("ignore")
    from torch.utils.data.datapipes.iter import IterableWrapper
    from torch.utils.data.datapipes.map import SequenceWrapper


@pytest.mark.parametrize(
    "num_workers, batch_size, drop_last",
    [(0, 3, False), (2, 3, True), (2, None, False)],
)
def test_sharded_by_get_worker_info(
    num_workers: int,
    batch_size: int | None,
    drop_last: bool,
    loader_cls: type[Any],
    reference: Reference,
    no_leaks_with_workers: None,
) -> None:
    """A dataset that shards itself with get_worker_info(): every item once, in torch's
    order (batches taken from the workers in turn), drop_last applied per worker."""

    def scenario(cls: type[Any]) -> list[Any]:
        loader = cls(
            Sharded(17), batch_size=batch_size, num_workers=num_workers, drop_last=drop_last
        )
        return batches(loader)

    got = reference.run(scenario)
    assert got == reference(scenario)
    if not drop_last:
        items = [x for b in got for x in (b[3] if batch_size else [b[1]])]
        assert sorted(items) == list(range(17))


def test_unsharded_is_duplicated_per_worker(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    def scenario(cls: type[Any]) -> list[Any]:
        return batches(cls(Unsharded(5), batch_size=2, num_workers=2))

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert len(got) == 6  # each worker yields [0,1], [2,3], [4]


def test_a_worker_with_nothing_to_yield(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """Worker 0 yields nothing, worker 1 three items: the pass ends once both are done."""

    def scenario(cls: type[Any]) -> list[Any]:
        return batches(cls(UnevenIterable(), batch_size=2, num_workers=2))

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got  # worker 1's batches arrive


@pytest.mark.parametrize("num_workers", [0, 2])
def test_len_and_the_wrong_length_warning(
    num_workers: int, loader_cls: type[Any], reference: Reference, no_leaks_with_workers: None
) -> None:
    """len(loader) comes from the dataset's __len__; yielding more than it said gives torch's
    warning (worded for multiprocessing when there are workers)."""

    def scenario(cls: type[Any]) -> dict[str, Any]:
        dataset = LyingLength(6, reported=2)
        loader = cls(dataset, batch_size=None, num_workers=num_workers)
        length = len(loader)
        run = outcome(lambda: batches(loader))
        return {"len": length, "items": run.value, "warnings": sorted(set(run.warnings))}

    got = reference.run(scenario)
    expected = reference(scenario)
    assert got == expected
    assert got["len"] == 2
    assert any("Length of IterableDataset" in text for text in got["warnings"])


@pytest.mark.parametrize("batch_size, drop_last", [(4, False), (4, True)])
def test_len_with_batching(
    batch_size: int, drop_last: bool, loader_cls: type[Any], reference: Reference
) -> None:
    def scenario(cls: type[Any]) -> int:
        return len(cls(LyingLength(10, reported=10), batch_size=batch_size, drop_last=drop_last))

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got == len(range(0, 10 - (10 % batch_size if drop_last else 0), batch_size))


def test_len_without_dunder_len(loader_cls: type[Any], reference: Reference) -> None:
    def scenario(cls: type[Any]) -> Any:
        loader = cls(Unsharded(3))
        return outcome(lambda: len(loader)).raised

    got = reference.run(scenario)
    expected = reference(scenario)
    assert got is not None and expected is not None
    assert (got.type, got.message) == (expected.type, expected.message)


def test_iterable_in_the_calling_process_is_iterated_afresh_each_epoch(
    loader_cls: type[Any], reference: Reference
) -> None:
    def scenario(cls: type[Any]) -> list[Any]:
        loader = cls(Sharded(5), batch_size=2)
        return [batches(loader), batches(loader)]

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got[0] == got[1]


# -- DataPipes -------------------------------------------------------------------------------


def test_datapipes_in_the_calling_process(loader_cls: type[Any], reference: Reference) -> None:
    """Without workers nothing is sharded, and a map-style DataPipe is a dataset."""

    def scenario(cls: type[Any]) -> list[Any]:
        iter_pipe = IterableWrapper(range(7)).map(_double).sharding_filter()
        map_pipe = SequenceWrapper(list(range(5)))
        return [batches(cls(iter_pipe, batch_size=3)), batches(cls(map_pipe, batch_size=2))]

    got = reference.run(scenario)
    assert got == reference(scenario)


def _double(x: int) -> int:
    return 2 * x


def test_datapipe_sharded_across_workers(
    loader_cls: type[Any], reference: Reference, request: pytest.FixtureRequest, no_leaks: None
) -> None:
    def scenario(cls: type[Any]) -> list[Any]:
        pipe = IterableWrapper(range(10)).sharding_filter()
        return batches(cls(pipe, batch_size=None, num_workers=2))

    if thread_deviation(request, "each worker shards its own copy of a DataPipe"):
        with pytest.raises(ValueError, match="does not support DataPipes"):
            scenario(loader_cls)
        return

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert sorted(item for _, item in got) == list(range(10))


def test_datapipe_shuffle_agrees_across_workers_and_changes_per_epoch(
    loader_cls: type[Any], reference: Reference, request: pytest.FixtureRequest, no_leaks: None
) -> None:
    if thread_deviation(request, "each worker shards its own copy of a DataPipe"):
        pytest.skip("refused at construction (test_datapipe_sharded_across_workers)")

    def scenario(cls: type[Any]) -> list[Any]:
        pipe = IterableWrapper(range(12)).shuffle().sharding_filter()
        loader = cls(
            pipe,
            batch_size=None,
            num_workers=2,
            shuffle=True,
            generator=torch.Generator().manual_seed(8),
            persistent_workers=True,
        )
        return [batches(loader), batches(loader)]

    got = reference.run(scenario)
    assert got == reference(scenario)
    for epoch in got:
        assert sorted(item for _, item in epoch) == list(range(12))
    assert got[0] != got[1]
