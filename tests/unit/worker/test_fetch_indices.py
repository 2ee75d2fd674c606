"""A sequential sampler's batch reaches a worker as its bounds (``_wire.messages.IndexRange``);
what the dataset, the collate and the error messages see of it must be what torch's fetcher
gives them: each index an int, in order, to ``__getitem__``; the list to ``__getitems__``; and a
sample that cannot be sent named by its index."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, default_collate

import aioload
from aioload._wire import slabs as _transport
from aioload._wire.messages import IndexRange, PassPlan
from aioload._worker.fetch import Fetcher, FetchSpec, SamplePolicy

pytestmark = pytest.mark.timeout(60)


class _Seen(Dataset[Any]):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> torch.Tensor:
        self.seen.append(index)
        return torch.tensor(index)


class _Batched(_Seen):
    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        self.seen.append(indices)
        return [torch.tensor(i) for i in indices]


def _fetcher(dataset: Any, collate: Any, policy: SamplePolicy | None = None) -> Fetcher:
    return Fetcher(FetchSpec(0, dataset, True, collate, False, policy), PassPlan())


@pytest.mark.parametrize("collate", [default_collate, _transport.slab_collate])
@pytest.mark.parametrize("policy", [None, SamplePolicy("skip", 1)])
def test_getitem_gets_each_index_as_an_int(collate: Any, policy: SamplePolicy | None) -> None:
    dataset = _Seen()
    batch = _fetcher(dataset, collate, policy).fetch(IndexRange(10, 14))
    assert dataset.seen == [10, 11, 12, 13]
    assert all(type(i) is int for i in dataset.seen)
    assert torch.equal(batch, torch.arange(10, 14))


def test_getitems_gets_the_list() -> None:
    dataset = _Batched()
    batch = _fetcher(dataset, default_collate).fetch(IndexRange(3, 6))
    assert dataset.seen == [[3, 4, 5]]
    assert type(dataset.seen[0]) is list
    assert torch.equal(batch, torch.arange(3, 6))


class _Unsendable(Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> Any:
        return threading.Lock() if index == 5 else index


def _as_they_are(samples: list[Any]) -> list[Any]:
    return samples


def test_a_sample_that_cannot_be_sent_is_named_by_its_index() -> None:
    loader = aioload.DataLoader(_Unsendable(), batch_size=4, num_workers=1, collate_fn=_as_they_are)
    with pytest.raises(TypeError, match=r"index 5 \(_thread\.lock\)"):
        list(loader)


def test_the_kept_keys_of_a_range_name_the_unsendable_sample() -> None:
    # In a worker the fetcher keeps the batch's keys and samples until it is sent; those of a
    # range are blamed by index, as a list's are.
    fetcher = _fetcher(_Unsendable(), _as_they_are)
    fetcher.keep_last = True
    batch = fetcher.fetch(IndexRange(4, 7))
    with pytest.raises(TypeError) as caught:
        pickle.dumps(batch)
    with pytest.raises(TypeError, match=r"index 5 \(_thread\.lock\)"):
        fetcher.drop_unsendable(caught.value)
