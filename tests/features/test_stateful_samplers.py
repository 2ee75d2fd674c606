"""The samplers ``shuffle=True`` builds: torch's classes (a ``RandomSampler`` subclass, torch's
own ``BatchSampler``), torch's orders, and a ``state_dict()``/``load_state_dict()`` on both that
a framework can checkpoint and load (as torchdata's StatefulDataLoader does with stateful
samplers)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler

import aioload

pytestmark = pytest.mark.no_local_workers(
    "the samplers' state, in loaders that start no worker (num_workers=0)"
)


def _loader(**extra: Any) -> aioload.DataLoader[Any]:
    return aioload.DataLoader(list(range(23)), batch_size=4, shuffle=True, **extra)


def test_they_are_torchs_samplers_with_torchs_orders() -> None:
    loader = _loader()
    assert isinstance(loader.sampler, RandomSampler)
    # Exactly torch's class: Lightning rebuilds a loader with any other as a custom one.
    assert type(loader.batch_sampler) is BatchSampler
    torch.manual_seed(3)
    ours = [list(loader.batch_sampler) for _ in range(3)]  # type: ignore[arg-type]
    torch.manual_seed(3)
    theirs = torch.utils.data.DataLoader(list(range(23)), batch_size=4, shuffle=True)
    assert ours == [list(theirs.batch_sampler) for _ in range(3)]  # type: ignore[arg-type]


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("taken", [1, 3, 5])
def test_a_state_loads_into_a_fresh_loaders_samplers(
    seeded: bool, drop_last: bool, taken: int
) -> None:
    """The batch sampler's state after ``taken`` batches, through JSON, into a new loader's
    batch sampler (the global RNG moved elsewhere meanwhile, another generator seed): its next
    iteration yields the same remaining batches."""
    generator = torch.Generator().manual_seed(5) if seeded else None
    torch.manual_seed(0)
    batches: Any = _loader(generator=generator, drop_last=drop_last).batch_sampler
    iterator = iter(batches)
    for _ in range(taken):
        next(iterator)
    state = json.loads(json.dumps(batches.state_dict()))
    assert state == batches.sampler.state_dict()
    expected = list(iterator)
    torch.manual_seed(99)
    generator = torch.Generator().manual_seed(123) if seeded else None
    again: Any = _loader(generator=generator, drop_last=drop_last).batch_sampler
    again.load_state_dict(state)
    assert again.state_dict() == state  # loaded, not yet iterated
    assert list(again) == expected
    # Only the next iteration: the one after it draws a new order.
    assert len(list(again)) == len(list(_loader(drop_last=drop_last).batch_sampler))


def test_a_state_before_the_first_batch_draws_on_the_next() -> None:
    batches: Any = _loader().batch_sampler
    assert batches.state_dict() == {"start": None, "yielded": 0}
    iterator = iter(batches)
    assert batches.state_dict() == {"start": None, "yielded": 0}
    batches.load_state_dict(batches.state_dict())
    torch.manual_seed(1)
    first = list(iterator)
    torch.manual_seed(1)
    assert list(batches) == first


@pytest.mark.parametrize("state", [{"start": None, "yielded": -1}, {"start": 3, "yielded": 0}])
def test_a_malformed_sampler_state_is_refused(state: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="RandomSampler state"):
        _loader().sampler.load_state_dict(state)  # type: ignore[attr-defined]


def test_aioload_itself_replays_them_and_its_state_format_is_unchanged() -> None:
    """aioload's own state_dict() replays the pass's RNG states, as before: its 'sampler' entry
    stays empty for these samplers (a state saved before them still loads)."""
    torch.manual_seed(0)
    loader = _loader(num_workers=0)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert state["sampler"] is None
    expected = [batch.tolist() for batch in iterator]
    torch.manual_seed(42)
    resumed = _loader()
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == expected
