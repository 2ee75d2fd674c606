"""Mid-epoch resume (``state_dict``/``load_state_dict``) and ``seed_per_sample``.

The reference for every resume test is an uninterrupted run of an identical loader: the
interrupted run's batches, followed by the resumed loader's, must be exactly that (in order), or
the same multiset with ``in_order=False``. States go through ``torch.save`` and
``torch.load(weights_only=True)``, as a checkpoint would.
"""

from __future__ import annotations

import io
import random
import time
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    IterableDataset,
    RandomSampler,
    WeightedRandomSampler,
)

import aioload
import aioload._engine.pinning  # named at import time below (the package imports it lazily)
import aioload.loader  # monkeypatched below: imported here, or a test run alone finds no aioload.loader

pytestmark = [pytest.mark.usefixtures("no_leaks")]

N = 60
BATCH = 4


class Indexed(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


def _shuffled(**kwargs: Any) -> aioload.DataLoader[Any]:
    """A shuffled loader of ``Indexed``, ``BATCH`` samples a batch."""
    return aioload.DataLoader(Indexed(), batch_size=BATCH, shuffle=True, **kwargs)


class Augmented(Dataset[torch.Tensor]):
    """Random augmentation from all three RNGs, as real pipelines do."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        noise = torch.rand(2)
        flip = random.random()
        jitter = float(np.random.rand())
        return torch.cat([torch.tensor([float(index), flip, jitter]), noise])


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _rows(batch: Any) -> list[tuple[float, ...]]:
    return [tuple(row) for row in batch.reshape(batch.shape[0], -1).tolist()]


def _sampler_kwargs(kind: str) -> Callable[[], dict[str, Any]]:
    """Fresh sampler arguments for each loader (a generator is state: never share one)."""

    def make() -> dict[str, Any]:
        if kind == "sequential":
            return {}
        if kind == "shuffle":
            return {"shuffle": True}
        if kind == "shuffle-generator":
            return {"shuffle": True, "generator": torch.Generator().manual_seed(7)}
        if kind == "sampler-generator":
            generator = torch.Generator().manual_seed(11)
            return {"sampler": RandomSampler(range(N), generator=generator)}
        if kind == "weighted":
            return {"sampler": WeightedRandomSampler([1.0] * N, N)}
        if kind == "batch-sampler":
            generator = torch.Generator().manual_seed(13)
            sampler = RandomSampler(range(N), generator=generator)
            return {"batch_size": 1, "batch_sampler": BatchSampler(sampler, BATCH, False)}
        if kind == "no-batching":
            return {"batch_size": None, "shuffle": True}
        raise AssertionError(kind)

    return make


def _run(
    make: Callable[[], aioload.DataLoader[Any]],
    *,
    stop_after: int,
    epochs_before: int = 0,
    mode: str = "sync",
) -> tuple[list[list[tuple[float, ...]]], list[list[tuple[float, ...]]]]:
    """(reference batches of the interrupted epoch, interrupted + resumed batches)."""
    torch.manual_seed(1234)
    reference_loader = make()
    for _ in range(epochs_before):
        list(reference_loader)
    reference = [_rows(batch) for batch in reference_loader]

    torch.manual_seed(1234)
    loader = make()
    for _ in range(epochs_before):
        list(loader)
    got: list[list[tuple[float, ...]]] = []
    if mode == "sync":
        iterator = iter(loader)
        for _ in range(stop_after):
            got.append(_rows(next(iterator)))
        state = _roundtrip(loader.state_dict())
        del iterator
    else:

        async def partial() -> dict[str, Any]:
            async with aiter(loader) as iterator:
                for _ in range(stop_after):
                    got.append(_rows(await anext(iterator)))
                return loader.state_dict()

        state = _roundtrip(anyio.run(partial))
    if hasattr(loader, "shutdown"):
        loader.shutdown()

    torch.manual_seed(999)  # the resumed process's RNG is elsewhere: the state must not care
    resumed = make()
    resumed.load_state_dict(state)
    if mode == "sync":
        rest = [_rows(batch) for batch in resumed]
    else:

        async def finish() -> list[list[tuple[float, ...]]]:
            return [_rows(batch) async for batch in resumed]

        rest = anyio.run(finish)
    resumed.shutdown()
    return reference, got + rest


@pytest.mark.parametrize(
    "kind",
    [
        "sequential",
        "shuffle",
        "shuffle-generator",
        "sampler-generator",
        "weighted",
        "batch-sampler",
        "no-batching",
    ],
)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_style_resume_in_order(kind: str, num_workers: int) -> None:
    kwargs = _sampler_kwargs(kind)

    def make() -> aioload.DataLoader[Any]:
        arguments = {"batch_size": BATCH, **kwargs()}
        return aioload.DataLoader(Indexed(), num_workers=num_workers, **arguments)

    reference, resumed = _run(make, stop_after=4)
    assert resumed == reference


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_map_style_resume_out_of_order_same_multiset(num_workers: int) -> None:
    def make() -> aioload.DataLoader[Any]:
        return _shuffled(num_workers=num_workers, in_order=False)

    reference, resumed = _run(make, stop_after=5)
    assert sorted(resumed) == sorted(reference)
    assert len(resumed) == len(reference)  # nothing duplicated


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("persistent", [False, True])
def test_resume_mid_nth_epoch(mode: str, persistent: bool) -> None:
    def make() -> aioload.DataLoader[Any]:
        return _shuffled(num_workers=2, persistent_workers=persistent)

    reference, resumed = _run(make, stop_after=6, epochs_before=2, mode=mode)
    assert resumed == reference


def test_resume_at_every_point_and_with_other_num_workers() -> None:
    """Any stopping point, including 0 and the very end; a map-style state may be resumed
    with a different number of workers."""
    torch.manual_seed(5)
    reference = [_rows(b) for b in _shuffled()]
    for stop in (0, 1, 7, len(reference) - 1, len(reference)):
        torch.manual_seed(5)
        loader = _shuffled()
        iterator = iter(loader)
        got = [_rows(next(iterator)) for _ in range(stop)]
        state = _roundtrip(loader.state_dict())
        resumed = _shuffled(num_workers=2)
        resumed.load_state_dict(state)
        assert got + [_rows(b) for b in resumed] == reference, stop


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_state_between_epochs_names_the_next_epoch() -> None:
    def make() -> aioload.DataLoader[Any]:
        return _shuffled()

    torch.manual_seed(3)
    reference_loader = make()
    first = [_rows(b) for b in reference_loader]
    second = [_rows(b) for b in reference_loader]
    assert first != second

    torch.manual_seed(3)
    loader = make()
    assert [_rows(b) for b in loader] == first
    state = _roundtrip(loader.state_dict())
    assert state["in_progress"] is False and state["epoch"] == 1
    torch.manual_seed(42)
    resumed = make()
    resumed.load_state_dict(state)
    assert [_rows(b) for b in resumed] == second


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_load_state_dict_leaves_the_callers_rng_alone() -> None:
    loader = _shuffled()
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    torch.manual_seed(77)
    expected = torch.rand(3)
    torch.manual_seed(77)
    resumed = _shuffled()
    resumed.load_state_dict(state)
    next(iter(resumed))
    assert torch.equal(torch.rand(3), expected)


class Stream(IterableDataset[int]):
    """Shards itself by worker; no state_dict: resumed by fast-forward."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(worker, N + 3, workers))


class StatefulStream(IterableDataset[int]):
    """Knows where it is, as torchdata's stateful datasets do."""

    def __init__(self) -> None:
        self.position = 0
        self.iters = 0

    def __iter__(self) -> Any:
        self.iters += 1
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        items = list(range(worker, N + 3, workers))
        while self.position < len(items):
            self.position += 1
            yield items[self.position - 1]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("stateful", [True, False])
def test_iterable_resume(
    num_workers: int, in_order: bool, stateful: bool, worker_method: str
) -> None:
    if stateful and worker_method == "thread":
        pytest.skip("its place is the dataset object's, shared by thread workers (docs/threads.md)")

    def make() -> aioload.DataLoader[Any]:
        dataset = StatefulStream() if stateful else Stream()
        return aioload.DataLoader(
            dataset, batch_size=BATCH, num_workers=num_workers, in_order=in_order
        )

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference, resumed = _run(make, stop_after=5)
    fast_forward = [w for w in caught if "fast-forward" in str(w.message)]
    assert bool(fast_forward) is (not stateful)
    if in_order:
        assert resumed == reference
    else:
        assert sorted(resumed) == sorted(reference)
        assert len(resumed) == len(reference)


def test_iterable_resume_needs_the_same_num_workers() -> None:
    loader = aioload.DataLoader(Stream(), batch_size=BATCH, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    del iterator
    other = aioload.DataLoader(Stream(), batch_size=BATCH, num_workers=3)
    with pytest.raises(ValueError, match="num_workers=2"):
        other.load_state_dict(state)


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_load_state_dict_rejects_foreign_state() -> None:
    loader = aioload.DataLoader(Indexed(), batch_size=BATCH)
    with pytest.raises(ValueError, match=r"state_dict\(\)"):
        loader.load_state_dict({"epoch": 0})
    iterable = aioload.DataLoader(Stream(), batch_size=BATCH)
    with pytest.raises(ValueError, match="map-style"):
        iterable.load_state_dict(loader.state_dict())


# -- seed_per_sample -----------------------------------------------------------------------


def _augmented_epoch(**kwargs: Any) -> list[tuple[float, ...]]:
    torch.manual_seed(2024)
    loader = aioload.DataLoader(Augmented(), batch_size=BATCH, seed_per_sample=True, **kwargs)
    rows = [row for batch in loader for row in _rows(batch)]
    return sorted(rows) if kwargs.get("in_order") is False else rows


@pytest.mark.processes_only(
    "seed_per_sample seeds the process-wide generators in worker processes only; thread workers seed their rng instead (docs/threads.md; test_threads.py checks it)"
)
def test_seed_per_sample_is_bitwise_identical_for_any_num_workers_and_order() -> None:
    reference = _augmented_epoch(num_workers=0)
    for kwargs in (
        {"num_workers": 1},
        {"num_workers": 2},
        {"num_workers": 3, "prefetch_factor": 1},
        {"num_workers": 2, "in_order": False},
    ):
        got = _augmented_epoch(**kwargs)
        if kwargs.get("in_order") is False:
            assert got == sorted(reference), kwargs
        else:
            assert got == reference, kwargs


def test_without_seed_per_sample_augmentation_depends_on_workers() -> None:
    """The problem seed_per_sample solves (and proof the test above can fail)."""

    def epoch(num_workers: int) -> list[tuple[float, ...]]:
        torch.manual_seed(2024)
        loader = aioload.DataLoader(Augmented(), batch_size=BATCH, num_workers=num_workers)
        return [row for batch in loader for row in _rows(batch)]

    assert epoch(1) != epoch(2)


@pytest.mark.processes_only(
    "seed_per_sample seeds the process-wide generators in worker processes only; thread workers seed their rng instead (docs/threads.md; test_threads.py checks it)"
)
def test_seed_per_sample_changes_with_epoch_and_survives_resume() -> None:
    def make() -> aioload.DataLoader[Any]:
        return aioload.DataLoader(
            Augmented(), batch_size=BATCH, num_workers=2, shuffle=True, seed_per_sample=True
        )

    torch.manual_seed(8)
    loader = make()
    first = sorted(row for batch in loader for row in _rows(batch))
    second = sorted(row for batch in loader for row in _rows(batch))
    assert first != second  # a new epoch, new augmentations

    reference, resumed = _run(make, stop_after=3, epochs_before=1)
    assert resumed == reference
    # set_epoch jumps to an epoch's augmentations directly.
    torch.manual_seed(8)
    jumper = make()
    list(jumper)  # draws the base seed on the first pass, as the loader above did
    jumper.set_epoch(1)
    assert sorted(row for batch in jumper for row in _rows(batch)) == second


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_seed_per_sample_leaves_the_callers_rng_alone_in_process() -> None:
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expected = (torch.rand(1).item(), random.random(), float(np.random.rand()))
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    # With its own generator the loader draws nothing from the global RNGs itself; only a
    # leak from the per-sample seeding could change them.
    loader = aioload.DataLoader(
        Augmented(),
        batch_size=BATCH,
        seed_per_sample=True,
        generator=torch.Generator().manual_seed(0),
    )
    list(loader)
    assert (torch.rand(1).item(), random.random(), float(np.random.rand())) == expected


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_shard_and_seed_per_sample_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="shard option"):
        aioload.DataLoader(Indexed(), shard="yes")
    with pytest.raises(ValueError, match="epoch"):
        aioload.DataLoader(Indexed()).set_epoch(-1)


# -- regressions found in review -----------------------------------------------------------


def test_next_epoch_after_resume_with_persistent_workers_and_a_generator() -> None:
    """The resumed loader must start a pool the original reused, without moving the
    generator the next epoch's shuffle comes from."""

    def make() -> aioload.DataLoader[Any]:
        return _shuffled(
            num_workers=2, persistent_workers=True, generator=torch.Generator().manual_seed(21)
        )

    reference_loader = make()
    list(reference_loader)
    middle = [_rows(b) for b in reference_loader]
    following = [_rows(b) for b in reference_loader]
    reference_loader.shutdown()

    loader = make()
    list(loader)
    iterator = iter(loader)
    got = [_rows(next(iterator)) for _ in range(5)]
    state = _roundtrip(loader.state_dict())
    del iterator
    loader.shutdown()
    resumed = make()
    resumed.load_state_dict(state)
    assert got + [_rows(b) for b in resumed] == middle
    assert [_rows(b) for b in resumed] == following
    resumed.shutdown()


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_resume_with_a_user_sampler_that_has_set_epoch() -> None:
    def make() -> aioload.DataLoader[Any]:
        sampler = torch.utils.data.DistributedSampler(
            Indexed(), num_replicas=1, rank=0, shuffle=True, seed=3
        )
        return aioload.DataLoader(Indexed(), batch_size=BATCH, sampler=sampler)

    reference_loader = make()
    reference_loader.set_epoch(2)
    reference = [_rows(b) for b in reference_loader]
    loader = make()
    loader.set_epoch(2)
    iterator = iter(loader)
    got = [_rows(next(iterator)) for _ in range(4)]
    state = _roundtrip(loader.state_dict())
    resumed = make()
    resumed.load_state_dict(state)  # passes epoch 2 on to the sampler
    assert got + [_rows(b) for b in resumed] == reference


class RewindingStream(IterableDataset[int]):
    """Rewinds itself once exhausted, as multi-epoch stateful datasets commonly do."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Any:
        while self.position < 5:
            self.position += 1
            yield self.position - 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_checkpoint_after_a_streams_last_partial_batch(num_workers: int) -> None:
    loader = aioload.DataLoader(RewindingStream(), batch_size=2, num_workers=num_workers)
    iterator = iter(loader)
    got = [next(iterator).tolist() for _ in range(3)]
    assert got == [[0, 1], [2, 3], [4]]
    state = _roundtrip(loader.state_dict())
    del iterator
    resumed = aioload.DataLoader(RewindingStream(), batch_size=2, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert list(resumed) == []  # the stream had ended: nothing is read again


class Uneven(IterableDataset[int]):
    """Worker shards of different lengths: some run dry while others go on."""

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info else 0
        return iter(range(worker * 100, worker * 100 + (16, 4, 12)[worker]))


class _CloningTransfer(aioload._engine.pinning.Transfer):
    def run(self, batch: Any) -> Any:
        return batch.clone()


@pytest.mark.parametrize(("in_order", "num_workers", "prefetch"), [(True, 3, 2), (False, 2, 3)])
def test_iterable_resume_through_the_pin_stage(
    in_order: bool, num_workers: int, prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a pin stage, answers are popped before they are yielded: a stream's end must
    only count once every batch before it has been yielded."""
    monkeypatch.setattr(aioload.loader, "make_transfer", lambda pin, device: _CloningTransfer())

    def make() -> aioload.DataLoader[Any]:
        return aioload.DataLoader(
            Uneven(),
            batch_size=BATCH,
            num_workers=num_workers,
            in_order=in_order,
            prefetch_factor=prefetch,
            pin_memory=True,
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = [_rows(b) for b in make()]
        # The path under test needs answers that arrived before the checkpoint and were not
        # yet yielded (stats().waiting_in_order: in the reorder buffer or the pin stage). The
        # engine reads answers only inside next(), so the workers are given time between
        # batches, more on each try, until some checkpoint had answers waiting (bounded).
        for pause in (0.05, 0.2, 0.8, 3.2):
            if _resume_through_the_pin_stage(make, reference, in_order, pause):
                break
        else:
            pytest.fail("no checkpoint had answers waiting: the path was not exercised")


def _resume_through_the_pin_stage(
    make: Callable[[], aioload.DataLoader[Any]],
    reference: list[list[tuple[float, ...]]],
    in_order: bool,
    pause: float,
) -> bool:
    """Checkpoint after several batches, resume, compare; whether answers were waiting."""
    exercised = False
    for stop in sorted({1, len(reference) // 2, len(reference) - 1}):
        loader = make()
        iterator = iter(loader)
        got = []
        for _ in range(stop):
            got.append(_rows(next(iterator)))
            time.sleep(pause)  # the workers answer meanwhile; the next next() reads them
        exercised |= loader.stats().waiting_in_order > 0
        state = _roundtrip(loader.state_dict())
        del iterator
        resumed = make()
        resumed.load_state_dict(state)
        everything = got + [_rows(b) for b in resumed]
        if in_order:
            assert everything == reference, stop
        else:
            assert sorted(everything) == sorted(reference), stop
    return exercised


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_set_epoch_after_loading_a_mid_epoch_state_drops_it() -> None:
    loader = _shuffled()
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = _shuffled()
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the checkpoint's own epoch: kept
    assert resumed.state_dict()["in_progress"] is True
    with pytest.warns(UserWarning, match="dropped"):
        resumed.set_epoch(3)
    assert resumed.state_dict()["in_progress"] is False
    assert len([row for b in resumed for row in _rows(b)]) == N


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_load_state_dict_checks_the_generators_up_front() -> None:
    loader = _shuffled()
    other = aioload.DataLoader(
        Indexed(), batch_size=BATCH, shuffle=True, generator=torch.Generator()
    )
    with pytest.raises(ValueError, match="generator"):
        other.load_state_dict(loader.state_dict())


class LiveStateStream(IterableDataset[int]):
    """Returns its live state object from state_dict(), as some datasets do."""

    def __init__(self) -> None:
        self.state = {"position": 0}

    def __iter__(self) -> Any:
        while self.state["position"] < N:
            self.state["position"] += 1
            yield self.state["position"] - 1

    def state_dict(self) -> dict[str, int]:
        return self.state

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_in_process_stream_state_is_a_snapshot() -> None:
    loader = aioload.DataLoader(LiveStateStream(), batch_size=BATCH)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    before = state["streams"][0]["dataset_state"]["position"]
    next(iterator)
    assert state["streams"][0]["dataset_state"]["position"] == before
