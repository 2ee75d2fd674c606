"""collate_fn (default_collate, default_convert, user functions) and pin_memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from .conftest import Reference, batches, outcome, plain
from .datasets import Indices, Mixed, Points, Tensors, collate_as_sum, collate_custom_pin


@pytest.mark.parametrize("num_workers", [0, 2])
def test_default_collate_of_every_sample_type(
    num_workers: int, loader_cls: type[Any], reference: Reference, no_leaks_with_workers: None
) -> None:
    """Tensors, numpy arrays and scalars, Python numbers, bools, strings, bytes, lists, dicts
    and namedtuples, nested: the same types, dtypes, shapes and values."""

    def scenario(cls: type[Any]) -> list[Any]:
        return batches(cls(Mixed(), batch_size=3, num_workers=num_workers))

    got = reference.run(scenario)
    assert got == reference(scenario)
    first = got[0][1]
    assert first["nested"][1]["point"][0] == "Point"  # the namedtuple type is kept
    assert first["str"] == ("list", [("str", "s0"), ("str", "s1"), ("str", "s2")])


@pytest.mark.parametrize("num_workers", [0, 1])
def test_default_convert_without_batching(
    num_workers: int, loader_cls: type[Any], reference: Reference, no_leaks_with_workers: None
) -> None:
    """batch_size=None: default_convert turns numpy arrays into tensors and keeps the rest."""

    def scenario(cls: type[Any]) -> list[Any]:
        return batches(cls(Mixed(), batch_size=None, num_workers=num_workers))

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got[0][1]["array"][0] == "Tensor"
    assert got[0][1]["list"][0] == "list"


def test_namedtuple_and_tensor_dataset(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    def scenario(cls: type[Any]) -> list[Any]:
        tensors = TensorDataset(torch.arange(10.0).view(5, 2), torch.arange(5))
        return [
            batches(cls(Points(), batch_size=4, num_workers=1)),
            batches(cls(tensors, batch_size=2, num_workers=1)),
        ]

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got[0][0][0] == "Point"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_collate_fn(
    num_workers: int, loader_cls: type[Any], reference: Reference, no_leaks_with_workers: None
) -> None:
    """A collate_fn that returns a dict of Python values, and one that returns a plain list
    (``collate_fn=list``), as torch returns them."""

    def scenario(cls: type[Any]) -> list[Any]:
        return [
            batches(cls(Indices(7), batch_size=3, num_workers=num_workers, collate_fn=collate)),
        ][0]

    for collate in (collate_as_sum, list):
        got = reference.run(scenario)
        assert got == reference(scenario, label=getattr(collate, "__name__", "list"))
        assert got[0][0] in ("dict", "list")


def test_collate_fn_with_batch_size_none(loader_cls: type[Any], reference: Reference) -> None:
    """Without batching, collate_fn gets one sample at a time."""

    def scenario(cls: type[Any]) -> list[Any]:
        return batches(cls(Indices(4), batch_size=None, collate_fn=lambda x: [x, x]))

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got[1] == ("list", [("int", 1), ("int", 1)])


def test_batches_can_be_kept_and_modified(loader_cls: type[Any], no_leaks: None) -> None:
    """Batches the consumer keeps stay intact while later batches arrive, and writing to one
    changes no other (torch hands out a fresh tensor per batch)."""
    loader = loader_cls(Tensors(40, size=16), batch_size=4, num_workers=2)
    kept = list(loader)
    kept[0].add_(1000)
    assert kept[0][0, 0].item() == 1000.0
    assert [b[:, 0].tolist() for b in kept[1:3]] == [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    assert kept[-1][:, 0].tolist() == [36.0, 37.0, 38.0, 39.0]


class SparseRows(Dataset[torch.Tensor]):
    """Sparse COO samples, which torch's default collate refuses to batch."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.sparse_coo_tensor([[0], [i]], [1.0], (1, 4))


def test_a_batch_of_sparse_tensors_fails_as_in_torch(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """The default collate's own error, of torch's type, from a worker: a sparse sample is
    not looked at before the collate sees it."""

    def scenario(cls: type[Any]) -> tuple[type[BaseException], bool] | None:
        raised = outcome(lambda: batches(cls(SparseRows(), batch_size=2, num_workers=1))).raised
        if raised is None:
            return None
        return raised.type, "default_collate" in raised.message or "collate_fn" in raised.message

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got is not None and got[1], got


# What the first batch's collate kept in the worker: its storage (and nothing that views the
# batch as a tensor), where the batch's bytes began, and a copy of them.
_kept_storage: list[tuple[Any, int, bytes]] = []


def _collate_keeping_the_storage(samples: list[torch.Tensor]) -> torch.Tensor:
    batch: torch.Tensor = default_collate(samples)
    start = batch.storage_offset() * batch.element_size()
    size = batch.numel() * batch.element_size()
    if not _kept_storage:
        storage = batch.untyped_storage()
        _kept_storage.append((storage, start, bytes(storage[start : start + size].tolist())))
    else:
        storage, start, first = _kept_storage[0]
        if bytes(storage[start : start + len(first)].tolist()) != first:
            raise AssertionError("a later batch was written into a storage the collate kept")
    return batch


def test_a_storage_kept_by_the_collate_is_not_written_again(
    loader_cls: type[Any], no_leaks: None
) -> None:
    """A collate_fn that keeps only a batch's ``untyped_storage()`` (no tensor) keeps its
    bytes: the worker does not make a later batch in the memory that storage holds."""
    _kept_storage.clear()
    loader = loader_cls(
        Tensors(48, size=4096),
        batch_size=4,
        num_workers=1,
        collate_fn=_collate_keeping_the_storage,
    )
    got = [batch[:, 0].tolist() for batch in loader]
    assert got == [[float(i) for i in range(s, s + 4)] for s in range(0, 48, 4)]


def test_batch_tensors_report_is_shared(
    loader_cls: type[Any], is_aioload: bool, no_leaks: None
) -> None:
    """DEVIATION (is-shared): torch's worker batches are in shared memory and say
    ``is_shared() == True``; aioload's are views of a reused memfd slab, which torch does not
    count as shared: ``False``."""
    batch = next(iter(loader_cls(Tensors(4), batch_size=2, num_workers=1)))
    assert batch.is_shared() is (not is_aioload)


# -- pin_memory ------------------------------------------------------------------------------


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator path")
@pytest.mark.parametrize("num_workers", [0, 1])
def test_pin_memory_without_an_accelerator(
    num_workers: int, loader_cls: type[Any], reference: Reference, no_leaks_with_workers: None
) -> None:
    """torch's warning (from torch 2.9 on; none before), once per pass, and plain (unpinned)
    batches, also from a CUDA build on a machine without a GPU; a batch type's own
    pin_memory() is not called."""

    def scenario(cls: type[Any]) -> dict[str, Any]:
        plain_loader = cls(Indices(6), batch_size=2, num_workers=num_workers, pin_memory=True)
        run = outcome(lambda: list(plain_loader))
        custom_loader = cls(
            Indices(4),
            batch_size=2,
            num_workers=num_workers,
            pin_memory=True,
            collate_fn=collate_custom_pin,
        )
        custom = outcome(lambda: list(custom_loader))
        raised = [None if r is None else (r.type, r.message) for r in (run.raised, custom.raised)]
        return {
            "raised": raised,
            "batches": [plain(b) for b in run.value or []],
            "pinned": [b.is_pinned() for b in run.value or []],
            "warnings": run.warnings,
            "custom_types": [type(b).__name__ for b in custom.value or []],
            "custom_pinned": [b.pinned for b in custom.value or []],
            "custom_data": [b.data.tolist() for b in custom.value or []],
        }

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got["raised"] == [None, None]
    assert len(got["warnings"]) <= 1  # what the installed torch says, once
    assert got["pinned"] == [False] * 3


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator path")
@pytest.mark.parametrize("pin_memory", [True, False])
def test_pin_memory_device(pin_memory: bool, loader_cls: type[Any], reference: Reference) -> None:
    """``pin_memory_device`` as the installed torch takes it: deprecated and ignored, with a
    warning, from torch 2.9 on; up to 2.8 the device to pin for (here, where there is none, the
    pass fails as torch's does), with a warning when ``pin_memory`` is off."""

    def scenario(cls: type[Any]) -> dict[str, Any]:
        loader = cls(Indices(2), pin_memory=pin_memory, pin_memory_device="cuda")
        run = outcome(lambda: [plain(b) for b in loader])
        raised = None if run.raised is None else (run.raised.type, run.raised.message)
        return {"value": run.value, "raised": raised, "warnings": run.warnings}

    got = reference.run(scenario)
    assert got == reference(scenario)
