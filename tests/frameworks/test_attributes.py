"""What frameworks read from a loader, checked in-process (fast): every constructor argument
reads back under its own name, and Lightning's own rebuild functions give an aioload loader
with the same settings and the injected sampler, without a second shard."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

import aioload

from ._ranks import BATCH, Indexed, N

# A value for every argument that differs from its default, where one can be given here.
NON_DEFAULTS: dict[str, Any] = {
    "batch_size": BATCH,
    "shuffle": True,
    "num_workers": 1,
    "drop_last": True,
    "timeout": 30.0,
    "prefetch_factor": 3,
    "persistent_workers": False,
    "in_order": False,
    "seed_per_sample": True,
    "max_worker_restarts": 1,
    "shard": "auto",
    "generator": torch.Generator().manual_seed(3),
}


def _parameters() -> list[str]:
    return [name for name in inspect.signature(aioload.DataLoader.__init__).parameters][1:]


def test_every_argument_reads_back_as_an_attribute() -> None:
    loader = aioload.DataLoader(Indexed(), **NON_DEFAULTS)
    missing = [name for name in _parameters() if not hasattr(loader, name)]
    assert missing == []
    for name, value in NON_DEFAULTS.items():
        assert getattr(loader, name) == value, name
    # The public samplers describe the whole dataset.
    assert isinstance(loader.sampler, RandomSampler)
    assert isinstance(loader.batch_sampler, BatchSampler)
    assert len(loader.batch_sampler) == len(loader) == N // BATCH


def _indices(loader: Any) -> list[int]:
    return [int(i) for batch in loader for i in batch["index"]]


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("saved_by_hook", [False, True])
def test_lightning_rebuilds_an_aioload_loader(saved_by_hook: bool) -> None:
    """``_update_dataloader`` is what Lightning's ``use_distributed_sampler`` calls. From a
    ``*_dataloader`` hook it replays the saved arguments; otherwise it reads attributes."""
    data = pytest.importorskip("lightning.pytorch.utilities.data")
    fabric_data = pytest.importorskip("lightning.fabric.utilities.data")
    arguments: dict[str, Any] = dict(
        batch_size=BATCH, shuffle=True, num_workers=1, seed_per_sample=True, drop_last=True
    )
    if saved_by_hook:
        with fabric_data._replace_dunder_methods(torch.utils.data.DataLoader, "dataset"):
            original = aioload.DataLoader(Indexed(), **arguments)
    else:
        original = aioload.DataLoader(Indexed(), **arguments)
    assert data._is_dataloader_shuffled(original)
    rank_sampler = DistributedSampler(Indexed(), num_replicas=2, rank=1, shuffle=True, seed=5)
    rebuilt = data._update_dataloader(original, rank_sampler)
    assert type(rebuilt) is aioload.DataLoader
    assert rebuilt.sampler is rank_sampler
    for name in ("batch_size", "num_workers", "seed_per_sample", "drop_last", "shard"):
        assert getattr(rebuilt, name) == getattr(original, name), name
    # The sampler Lightning injected is the only shard: this rank's half, in its order.
    expected = list(rank_sampler)
    expected = expected[: len(expected) // BATCH * BATCH]
    assert _indices(rebuilt) == expected
