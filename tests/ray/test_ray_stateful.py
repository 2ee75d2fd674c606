"""Resume with Stateful datasets on Ray actors: the actors run the same worker-side code as
local workers (each actor's dataset reports its state with its batches, and loads it when a
pass starts), so a checkpoint taken on Ray resumes exactly, on Ray or on local workers.

Inner tests only: the outer test in test_ray_workers.py runs them, with that module's, inside
a loopback-only network namespace on one local Ray (see conftest.py).
"""

from __future__ import annotations

from typing import Any

import torch

import aioload

from ..features.test_stateful import _interrupted, _uninterrupted, rng_map
from ..scripts.stateful import EpochStream
from .conftest import inner


def _map(workers: aioload.RayWorkers | None) -> Any:
    return rng_map(7, num_workers=2, persistent_workers=True, workers=workers)


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
