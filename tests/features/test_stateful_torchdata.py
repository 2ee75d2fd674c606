"""aioload against torchdata's StatefulDataLoader itself, where it is installed: the same
Stateful datasets, iterators and samplers, checkpointed at the same points, give the same
batches from both loaders, before and after the resume.

The cases are those StatefulDataLoader resumes exactly. Two it does not, and aioload does, are
checked in test_stateful.py: torch's own ``BatchSampler`` over a Stateful sampler (torchdata
saves only its own BatchSampler's state), and a Stateful sampler checkpointed between epochs
with workers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import aioload

from ..scripts.stateful import CursorStream, EpochStream, RngMap, RngSampler, SelfIterating
from .test_stateful import ONE_STREAM, _interrupted, _uninterrupted

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")


def _loader(cls: Any, case: str, num_workers: int) -> Any:
    extra = {"num_workers": num_workers}
    if case == "map":
        return cls(RngMap(12), batch_size=3, **extra)
    if case == "sampler":
        return cls(list(range(12)), batch_size=3, sampler=RngSampler(12), **extra)
    if case == "stream":
        # (Without the workers' seeds in the samples: StatefulDataLoader's resumed iterator
        # draws one more base seed than the uninterrupted run, so the later epochs' workers
        # are seeded otherwise. aioload's are not: see test_stateful.py.)
        return cls(EpochStream(12, seeded=False), batch_size=2, **extra)
    dataset = {"self-iterating": SelfIterating, "cursor": CursorStream}
    return cls(dataset[case](12), batch_size=2, **extra)


CASES = [
    (case, workers, boundary)
    for case in ("map", "sampler", "stream", "cursor")
    for workers in (0, 2)
    for boundary in ("mid-epoch", "between-epochs")
    # (StatefulDataLoader replays a Stateful sampler's first order after this one.)
    if not (case == "sampler" and workers and boundary == "between-epochs")
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("case", "num_workers", "boundary"), CASES)
def test_same_batches_as_statefuldataloader(case: str, num_workers: int, boundary: str) -> None:
    _compare(case, num_workers, boundary)


@ONE_STREAM
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("boundary", ["mid-epoch", "between-epochs"])
def test_same_batches_as_statefuldataloader_self_iterating(num_workers: int, boundary: str) -> None:
    _compare("self-iterating", num_workers, boundary)


def _compare(case: str, num_workers: int, boundary: str) -> None:
    """aioload's batches are StatefulDataLoader's, uninterrupted and resumed at ``boundary``."""

    def maker(cls: Any) -> Callable[[], Any]:
        return lambda: _loader(cls, case, num_workers)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torchdata's set_vital deprecation
        theirs = _uninterrupted(maker(stateful_dataloader.StatefulDataLoader), seed_global=True)
        theirs_resumed = _interrupted(
            maker(stateful_dataloader.StatefulDataLoader), boundary, len(theirs[1]), True
        )
    ours = _uninterrupted(maker(aioload.DataLoader), seed_global=True)
    assert ours == theirs
    assert theirs_resumed == theirs  # the reference behaviour: StatefulDataLoader's own resume
    assert _interrupted(maker(aioload.DataLoader), boundary, len(ours[1]), True) == ours


@pytest.mark.no_local_workers("num_workers=0: the argument")
def test_snapshot_every_n_steps_is_the_same_argument() -> None:
    """The one argument StatefulDataLoader adds is taken by name, with its default."""
    import inspect

    theirs = inspect.signature(stateful_dataloader.StatefulDataLoader.__init__).parameters
    ours = inspect.signature(aioload.DataLoader.__init__).parameters
    assert ours["snapshot_every_n_steps"].default == theirs["snapshot_every_n_steps"].default
    assert ours["snapshot_every_n_steps"].kind == theirs["snapshot_every_n_steps"].kind
    torch.manual_seed(0)
    loader = aioload.DataLoader(list(range(6)), batch_size=2, snapshot_every_n_steps=4)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
