"""A worker copies each large tensor of a sample into the batch's slab as the dataset returns it
(``aioload._worker.stacking``), so that a batch's samples need not all be alive at once.

What must hold: the batches are torch's, whatever the samples are (a tensor, a tuple, list or
dict of them, with small leaves and other values beside); a sample unlike the batch's first
(another shape, dtype or type) gets torch's result or torch's error; a user's own
``collate_fn`` sees the samples the dataset returned, not slab rows; and each sample is
indeed let go of before the next is made.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import aioload
from aioload._wire import slabs as _transport
from aioload._worker import fetch as _fetch
from aioload._worker import stacking as _stacking
from tests.scripts.datasets import FnDataset
from tests.unit.wire.test_transport import leaves

pytestmark = pytest.mark.timeout(60)

# 147 KiB of float32: copied as it comes (_worker.stacking._MIN_ROW_BYTES); 37 KiB of uint8: not.
_SHAPE = (3, 112, 112)


def _image(index: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (
        torch.arange(int(np.prod(_SHAPE)), dtype=torch.float32).reshape(_SHAPE).add(index).to(dtype)
    )


def _lone(i: int) -> Any:
    return _image(i)


def _pair(i: int) -> Any:
    return (_image(i), i)


def _labelled(i: int) -> Any:
    return [_image(i), torch.tensor(i), "name", 0.5 * i]


def _record(i: int) -> Any:
    return {"image": _image(i), "mask": _image(-i, torch.uint8), "label": i, "small": torch.ones(2)}


def _strided(i: int) -> Any:
    # Not contiguous: the row is written from a transposed view.
    return _image(i).transpose(1, 2)


def test_the_images_here_are_copied_as_they_come() -> None:
    # (Or these tests would test nothing new.)
    assert _image(0).numel() * 4 >= _stacking._MIN_ROW_BYTES > _image(0).numel()


@pytest.mark.parametrize("make", [_lone, _pair, _labelled, _record, _strided])
def test_batches_are_torchs(make: Any, no_leaks: None) -> None:
    dataset = FnDataset(make, 50)
    expected = list(DataLoader(dataset, batch_size=8))
    got = list(aioload.DataLoader(dataset, batch_size=8, num_workers=2))
    _assert_same(got, expected)
    for batch in got:
        for leaf in leaves(batch):
            assert leaf.is_contiguous()


def _assert_same(got: Any, expected: Any) -> None:
    """Equal values, dtypes, shapes and types, all the way down."""
    assert type(got) is type(expected), (type(got), type(expected))
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            _assert_same(got[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            _assert_same(g, e)
    else:
        assert got == expected


def _assert_like_torch(dataset: Any) -> None:
    """aioload's batches (2 workers) are torch's loader's, or it raises torch's error."""
    try:
        expected: Any = list(DataLoader(dataset, batch_size=8))
    except Exception as error:
        with pytest.raises(type(error)) as raised:
            list(aioload.DataLoader(dataset, batch_size=8, num_workers=2))
        assert str(error).splitlines()[0] in str(raised.value)
        return
    _assert_same(list(aioload.DataLoader(dataset, batch_size=8, num_workers=2)), expected)


class ReportsThePreviousSample(Dataset[Any]):
    """Each sample is an image and whether the sample before it in this worker was still
    alive when this one was made."""

    def __init__(self, n: int, array: bool = False) -> None:
        self.n = n
        self.array = array
        self.previous: weakref.ref[Any] | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        alive = self.previous is not None and self.previous() is not None
        image: Any = _image(index).numpy().copy() if self.array else _image(index)
        self.previous = weakref.ref(image)
        return image, int(alive)


@pytest.mark.parametrize("array", [False, True], ids=["tensors", "arrays"])
@pytest.mark.parametrize("policy", [{}, {"on_sample_error": "skip"}, {"sample_retries": 1}])
def test_each_sample_is_let_go_of_before_the_next_is_made(
    policy: dict[str, Any], array: bool, no_leaks: None
) -> None:
    loader = aioload.DataLoader(
        ReportsThePreviousSample(64, array), batch_size=8, num_workers=2, **policy
    )
    images, alive = zip(*loader, strict=True)
    assert torch.cat(alive).tolist() == [0] * 64
    # (torch's loader, and aioload without the copy, keep the batch's samples until it is
    # collated: every sample but the first of each batch finds the one before alive.)
    kept = torch.cat([a for _, a in DataLoader(ReportsThePreviousSample(16), batch_size=8)])
    assert kept.tolist() == ([0] + [1] * 7) * 2
    _assert_same(torch.cat(images), torch.stack([_image(i) for i in range(64)]))


def _odd_one_out(odd: Any) -> Any:
    def make(i: int) -> Any:
        return odd(i) if i == 5 else _image(i)

    return make


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda i: _image(i, torch.float64), id="another-dtype"),
        pytest.param(lambda i: _image(i).numpy(), id="a-numpy-array"),
        pytest.param(lambda i: _image(i)[None], id="another-shape"),
        pytest.param(lambda i: _image(i).to(torch.int64), id="an-integer-dtype"),
    ],
)
def test_a_sample_unlike_the_first_gets_torchs_result_or_error(odd: Any, no_leaks: None) -> None:
    dataset = FnDataset(_odd_one_out(odd), 16)
    _assert_like_torch(dataset)


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda i: (_image(i), i, "extra"), id="a-longer-tuple"),
        pytest.param(lambda i: [_image(i), i], id="a-list-among-tuples"),
        pytest.param(lambda i: (_image(i)[:2], i), id="a-smaller-image"),
    ],
)
def test_a_structure_unlike_the_first_gets_torchs_result_or_error(odd: Any, no_leaks: None) -> None:
    def make(i: int) -> Any:
        return odd(i) if i == 3 else (_image(i), i)

    dataset = FnDataset(make, 16)
    _assert_like_torch(dataset)


def test_dicts_with_other_keys_get_torchs_error(no_leaks: None) -> None:
    def make(i: int) -> Any:
        return {"image": _image(i), "label": i} if i != 2 else {"image": _image(i), "y": i}

    dataset = FnDataset(make, 8)
    with pytest.raises(KeyError):
        list(DataLoader(dataset, batch_size=8))
    with pytest.raises(KeyError):
        list(aioload.DataLoader(dataset, batch_size=8, num_workers=2))


def test_a_users_collate_sees_the_datasets_own_samples(no_leaks: None) -> None:
    def collate(samples: list[torch.Tensor]) -> torch.Tensor:
        # Rows of a slab would share one storage, the slab's, much larger than a sample.
        for sample in samples:
            assert sample.untyped_storage().nbytes() == sample.numel() * sample.element_size()
        return torch.stack(samples)

    dataset = FnDataset(_lone, 24)
    got = list(aioload.DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate))
    _assert_same(got, list(DataLoader(dataset, batch_size=8)))


class _Batches(Sampler[Any]):
    """Batches of indices, as ``kind`` makes them."""

    def __init__(self, kind: Any) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Iterator[Any]:
        for start in (0, 8, 16):
            yield self.kind(range(start, start + 8))


@pytest.mark.parametrize("kind", [list, tuple, np.array, torch.tensor])
def test_any_batch_of_indices(kind: Any, no_leaks: None) -> None:
    dataset = FnDataset(_pair, 24)
    expected = list(DataLoader(dataset, batch_sampler=_Batches(list)))
    got = list(aioload.DataLoader(dataset, batch_sampler=_Batches(kind), num_workers=2))
    _assert_same(got, expected)


class Augmented(Dataset[torch.Tensor]):
    """A random augmentation: under seed_per_sample, the same for every worker count."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return _image(index) + torch.rand(_SHAPE)


def test_seed_per_sample_gives_the_same_samples(no_leaks: None) -> None:
    def batches(workers: int) -> list[torch.Tensor]:
        loader = aioload.DataLoader(
            Augmented(),
            batch_size=8,
            num_workers=workers,
            seed_per_sample=True,
            generator=torch.Generator().manual_seed(7),
        )
        return list(loader)

    in_process = batches(0)
    _assert_same(batches(2), in_process)


def test_the_copy_is_taken_as_the_stacked_leaf_only_for_exactly_its_rows(arena: Any) -> None:
    region = torch.arange(12.0).reshape(3, 4)
    rows = region.unbind(0)
    arena.stacked[id(rows[0])] = (rows, region)
    # Other tensors with the same values, or the rows in another order, are stacked.
    other = [row.clone() for row in rows]
    assert arena.stack(other) is not region
    assert arena.stacked
    shuffled = [rows[0], rows[2], rows[1]]
    stacked = arena.stack(shuffled)
    assert stacked is not region and stacked.tolist() == torch.stack(shuffled).tolist()
    # Taken once: the entry is gone after a look.
    assert not arena.stacked
    arena.stacked[id(rows[0])] = (rows, region)
    assert arena.stack(list(rows)) is region


@pytest.fixture
def arena() -> Iterator[Any]:
    """A worker's slab pool, in this process, and the arena of one batch."""
    pool = _transport.WorkerSlabPool(max_idle=2)
    try:
        yield pool.arena()
    finally:
        for slab in pool.slabs.values():
            fd = slab.take_fd()
            if fd is not None:
                os.close(fd)


def _slab_collate(samples: Any, arena: Any) -> Any:
    """aioload's collate of a worker's batch whose arena is ``arena``."""
    _transport.collating_into(arena)
    try:
        return _transport.slab_collate(samples)
    finally:
        _transport.collating_into(None)


def _in_slab(t: torch.Tensor, arena: Any) -> bool:
    return arena.arena is not None and arena.arena.holds(t)


@pytest.mark.parametrize("policy", [None, _fetch.SamplePolicy("skip", 0)])
def test_a_fetch_stacks_into_the_arena_it_is_given(
    arena: Any, policy: _fetch.SamplePolicy | None
) -> None:
    """The arena reaches the fetch as its argument (no module global carries it), and the
    collate, pointed at it for the batch, takes the rows as the stacked leaf."""
    spec = _fetch.FetchSpec(0, FnDataset(_lone, 8), True, _transport.slab_collate, False, policy)
    fetcher = _fetch.Fetcher(spec, _fetch.PassPlan())
    _transport.collating_into(arena)
    try:
        batch = fetcher.fetch(list(range(4)), arena)
    finally:
        _transport.collating_into(None)
    _assert_same(batch, torch.stack([_lone(i) for i in range(4)]))
    assert _in_slab(batch, arena) and not arena.stacked
    # Without one, the same fetch stacks privately.
    alone = fetcher.fetch(list(range(4)))
    _assert_same(alone, batch)
    assert not _in_slab(alone, arena)


def test_pointing_the_collate_at_an_arena_leaves_a_users_map_alone(arena: Any) -> None:
    """In a process that is not aioload's worker, torch's ``default_collate`` stays torch's
    (only ``slab_collate`` stacks into the arena)."""
    before = torch.utils.data._utils.collate.default_collate_fn_map[torch.Tensor]
    _transport.collating_into(arena)
    try:
        assert torch.utils.data._utils.collate.default_collate_fn_map[torch.Tensor] is before
        assert _in_slab(_transport.slab_collate([_lone(i) for i in range(4)]), arena)
    finally:
        _transport.collating_into(None)
    assert not _in_slab(_transport.slab_collate([_lone(i) for i in range(4)]), arena)


def test_samples_become_rows_and_the_leaf_is_stacked_once(arena: Any) -> None:
    samples = _stacking.fetch_stacking(_record, range(4), arena)
    assert [s["label"] for s in samples] == [0, 1, 2, 3]
    assert all(_in_slab(s["image"], arena) for s in samples)
    # The uint8 mask is too small to copy as it comes: the dataset's own tensor.
    assert not any(_in_slab(s["mask"], arena) for s in samples)
    assert list(arena.stacked) == [id(samples[0]["image"])]
    batch = _slab_collate(samples, arena)
    _assert_same(batch, torch.utils.data.default_collate([_record(i) for i in range(4)]))
    assert _in_slab(batch["image"], arena)
    assert not arena.stacked


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda i: _image(i, torch.float64), id="another-dtype"),
        pytest.param(lambda i: _image(i)[:2], id="another-shape"),
        pytest.param(lambda i: (_image(i),), id="another-type"),
        pytest.param(lambda i: _image(i).requires_grad_(), id="requires-grad"),
    ],
)
def test_an_unlike_sample_stops_the_copy_and_nothing_is_taken_as_stacked(
    odd: Any, arena: Any
) -> None:
    samples = _stacking.fetch_stacking(_odd_one_out(odd), range(8), arena)
    assert not arena.stacked
    assert [_in_slab(s, arena) for s in samples if isinstance(s, torch.Tensor)][:5] == [True] * 5
    assert not any(_in_slab(s, arena) for s in samples[5:] if isinstance(s, torch.Tensor))
    expected = [_odd_one_out(odd)(i) for i in range(8)]
    for got, want in zip(samples, expected, strict=True):
        assert type(got) is type(want)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got.detach(), want.detach())


def test_fewer_indices_than_len_says_are_not_taken_as_stacked(arena: Any) -> None:
    class Short:
        def __len__(self) -> int:
            return 6

        def __iter__(self) -> Iterator[int]:
            return iter(range(4))

    samples = _stacking.fetch_stacking(_lone, Short(), arena)
    assert len(samples) == 4 and not arena.stacked
    _assert_same(_slab_collate(samples, arena), torch.stack([_lone(i) for i in range(4)]))


def _broken(bad: set[int]) -> Any:
    """``_pair``, with the indices in ``bad`` raising ValueError."""

    def make(index: int) -> Any:
        if index in bad:
            raise ValueError(f"sample {index} is broken")
        return _pair(index)

    return make


@pytest.mark.parametrize("bad", [{0}, {3, 4}, {8, 9, 10, 11, 12, 13, 14, 15}, {7, 15}])
def test_skipped_samples_take_no_row(bad: set[int], no_leaks: None) -> None:
    loader = aioload.DataLoader(
        FnDataset(_broken(bad), 24), batch_size=8, num_workers=2, on_sample_error="skip"
    )
    got = list(loader)
    kept = [i for i in range(24) if i not in bad]
    batches = [[i for i in kept if start <= i < start + 8] for start in (0, 8, 16)]
    expected = [
        torch.utils.data.default_collate([_pair(i) for i in batch]) for batch in batches if batch
    ]
    _assert_same(got, expected)
    assert sorted(s.index for s in loader.stats().skipped) == sorted(bad)


def test_under_the_policy_the_rows_of_the_kept_samples_are_the_stacked_leaf(arena: Any) -> None:
    failed = _fetch._Failed(None)  # type: ignore[arg-type]

    def fetch(index: int) -> Any:
        return failed if index in (2, 5) else _lone(index)

    samples = _stacking.fetch_stacking(fetch, range(8), arena, _fetch._Failed)
    assert [s is failed for s in samples] == [i in (2, 5) for i in range(8)]
    kept = [s for s in samples if s is not failed]
    assert all(_in_slab(s, arena) for s in kept)
    batch = _slab_collate(kept, arena)
    _assert_same(batch, torch.stack([_lone(i) for i in range(8) if i not in (2, 5)]))
    assert _in_slab(batch, arena) and not arena.stacked


def _np_image(index: int) -> np.ndarray[Any, Any]:
    # Height, width, channels, as image libraries decode them: 147 KiB of float32.
    return np.ascontiguousarray(_image(index).numpy().transpose(1, 2, 0))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_np_image, id="array"),
        pytest.param(lambda i: (_np_image(i), i), id="array-and-label"),
        pytest.param(lambda i: {"image": _np_image(i), "t": _image(i), "y": i}, id="dict"),
        pytest.param(lambda i: _np_image(i).transpose(2, 1, 0), id="strided-array"),
        pytest.param(lambda i: np.frombuffer(_np_image(i).tobytes(), np.float32), id="read-only"),
    ],
)
def test_numpy_samples_give_torchs_batches(make: Any, no_leaks: None) -> None:
    dataset = FnDataset(make, 24)
    expected = list(DataLoader(dataset, batch_size=8))
    got = list(aioload.DataLoader(dataset, batch_size=8, num_workers=2))
    _assert_same(got, expected)


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda i: _np_image(i).astype(np.float64), id="another-dtype"),
        pytest.param(lambda i: _np_image(i)[:2], id="another-shape"),
        pytest.param(lambda i: _image(i), id="a-tensor"),
        pytest.param(lambda i: _np_image(i).astype(">f4"), id="big-endian"),
    ],
)
def test_an_array_unlike_the_first_gets_torchs_result_or_error(odd: Any, no_leaks: None) -> None:
    def make(i: int) -> Any:
        return (odd(i) if i == 5 else _np_image(i), i)

    dataset = FnDataset(make, 16)
    _assert_like_torch(dataset)


def test_arrays_become_tensor_rows_and_back_to_arrays_when_unlike(arena: Any) -> None:
    samples = _stacking.fetch_stacking(_np_image, range(4), arena)
    assert all(type(s) is torch.Tensor and _in_slab(s, arena) for s in samples)
    assert arena.stacked
    arena.stacked.clear()

    def make(i: int) -> Any:
        return _np_image(i)[:2] if i == 3 else _np_image(i)

    samples = _stacking.fetch_stacking(make, range(6), arena)
    assert [type(s) for s in samples] == [np.ndarray] * 6
    assert not arena.stacked
    for i, sample in enumerate(samples):
        assert np.array_equal(sample, make(i))
