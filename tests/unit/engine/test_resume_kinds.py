"""A pass's start by its kind (``_engine.pass_start``), without a loader: a mid-pass resume
replays the pass it was taken from, and the kind of pass is decided by what lies between
passes (``_engine.passes.pass_kind``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler

from aioload._engine.pass_start import (
    PassContext,
    PassKind,
    start_at_boundary,
    start_fresh,
    start_mid_pass,
)
from aioload._engine.passes import LoadedState, pass_kind
from aioload._engine.resume import PassProgress


def _context(generator: torch.Generator, epoch: int = 0, workers: int = 2) -> PassContext:
    sampler = BatchSampler(RandomSampler(range(20), generator=generator), 3, drop_last=False)
    return PassContext(
        epoch=epoch,
        dataset=range(20),
        index_sampler=sampler,
        generators=[generator],
        draw_base_seed=lambda: int(
            torch.empty((), dtype=torch.int64).random_(generator=generator).item()
        ),
        draw_shared_seed=None,
        iterable=False,
        num_streams=max(1, workers),
        rank=0,
        starts_workers=workers > 0,
        seed_per_sample=False,
        sample_seed=None,
    )


def _batches(start: Any) -> list[tuple[int, list[int]]]:
    return [(position, list(indices)) for position, indices in start.batches]


@pytest.mark.parametrize(
    ("loaded", "reuse", "kind"),
    [
        (None, False, PassKind.FRESH),
        (None, True, PassKind.ON_KEPT_WORKERS),
        (True, False, PassKind.RESUMED_MID_PASS),
        (False, False, PassKind.RESUMED_AT_BOUNDARY),
    ],
)
def test_the_kind_of_pass(loaded: bool | None, reuse: bool, kind: PassKind) -> None:
    state = None
    if loaded is not None:
        progress = PassProgress(epoch=0, rng={}, sample_seed=None, iterable=False, num_streams=1)
        state = LoadedState(progress, mid_pass=loaded)
    assert pass_kind(state, reuse) is kind


def test_a_mid_pass_resume_yields_the_rest_of_the_pass() -> None:
    generator = torch.Generator().manual_seed(7)
    fresh = start_fresh(_context(generator))
    batches = _batches(fresh)
    for position in (0, 1, 3):
        fresh.progress.yielded.add(position)
    # Elsewhere, with the generator moved on: the replay draws from the recorded states.
    other = torch.Generator().manual_seed(99)
    resumed = start_mid_pass(_context(other), fresh.progress)
    assert _batches(resumed) == [b for b in batches if b[0] not in (0, 1, 3)]
    assert resumed.base_seed == fresh.base_seed
    assert len(resumed.progress.yielded) == 3


def test_a_resume_at_a_boundary_draws_as_the_next_pass_would() -> None:
    generator = torch.Generator().manual_seed(3)
    recorded = PassProgress(
        epoch=1,
        rng={"torch": torch.get_rng_state(), "generators": [generator.get_state()]},
        sample_seed=None,
        iterable=False,
        num_streams=2,
    )
    following = start_fresh(_context(generator, epoch=1))
    resumed = start_at_boundary(_context(torch.Generator(), epoch=1), recorded)
    assert _batches(resumed) == _batches(following)
    assert resumed.base_seed == following.base_seed
    assert all(plan.epoch == 1 for plan in resumed.plans)
