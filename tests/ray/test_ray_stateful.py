"""Resume with Stateful datasets on Ray actors: the actors run the same worker-side code as
local workers (each actor's dataset reports its state with its batches, and loads it when a
pass starts), so a checkpoint taken on Ray resumes exactly, on Ray or on local workers.

As in test_ray_workers.py, the outer test re-runs this module inside a loopback-only network
namespace, where the inner tests start a real Ray instance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import aioload

from ..features.test_stateful import _interrupted, _uninterrupted
from ..helpers import within
from ..scripts.stateful import EpochStream, RngMap
from . import test_ray_workers as _ray
from .test_ray_workers import INSIDE, inner, run_inside_a_namespace

# The Ray session and the per-test RayWorkers, shared with test_ray_workers.py.
ray_session = _ray.ray_session
ray_workers = _ray.ray_workers


@pytest.mark.skipif(INSIDE, reason="this is the outer test")
@pytest.mark.timeout(within(420))
def test_ray_stateful_in_a_loopback_only_namespace() -> None:
    run_inside_a_namespace(Path(__file__), within(400))


def _map(workers: aioload.RayWorkers | None, persistent: bool = True) -> Any:
    return aioload.DataLoader(
        RngMap(12),
        batch_size=3,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
        num_workers=2,
        persistent_workers=persistent,
        workers=workers,
    )


# Two pools of two actors per test: each fresh actor is a process that imports torch, which
# takes seconds on a busy machine. The code paths are the workers' own (see
# tests/features/test_stateful.py for every boundary on local workers).


@inner
def test_a_stateful_map_dataset_resumes_on_ray(ray_workers: aioload.RayWorkers) -> None:
    """The same batches as local workers give, over three epochs, with a checkpoint in the
    second: each actor's copy of the dataset goes on from its own state, and kept actors
    carry it into the next epoch."""
    reference = _uninterrupted(lambda: _map(None), seed_global=False)
    assert _interrupted(lambda: _map(ray_workers), "mid-epoch", 4, restore_rng=False) == reference


@inner
def test_a_stream_checkpointed_on_ray_resumes_on_local_workers(
    ray_workers: aioload.RayWorkers,
) -> None:
    def make(workers: aioload.RayWorkers | None) -> Any:
        return aioload.DataLoader(EpochStream(12), batch_size=2, num_workers=2, workers=workers)

    torch.manual_seed(0)
    reference = [b.tolist() for b in make(None)]
    torch.manual_seed(0)
    on_ray = make(ray_workers)
    iterator = iter(on_ray)
    head = [next(iterator).tolist() for _ in range(3)]
    state = on_ray.state_dict()
    del iterator
    local = make(None)
    local.load_state_dict(state)
    assert head + [b.tolist() for b in local] == reference
