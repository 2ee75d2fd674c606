"""accelerate on 2 real ranks (gloo over 127.0.0.1): the aioload loader given to
``accelerator.prepare()``, and the aioload loader used directly. Every index exactly once.

Before aioload's public ``sampler``/``batch_sampler`` described the whole dataset, prepare()
sharded an already-sharded batch sampler: 256 of 512 indices were seen across the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._ranks import BATCH, WORLD_SIZE, N, assert_exactly_once, launch

pytest.importorskip("accelerate")

pytestmark = [pytest.mark.usefixtures("no_leaks"), pytest.mark.timeout(240)]


def test_prepare_and_direct_use_see_every_index_once(tmp_path: Path) -> None:
    reports = launch("accelerate", tmp_path, timeout=220)
    for report in reports:
        # What prepare() reads describes the whole dataset; len() is this rank's share.
        assert report["public_len_batch_sampler"] == N // BATCH
        assert report["public_sampler"] == "aioload._engine.samplers.RandomSampler"
        assert report["len_loader"] == N // BATCH // WORLD_SIZE
        # prepare() rebuilds the loader as its own torch DataLoader subclass: aioload's
        # engine is not in that path (docs/migrating.md says so).
        assert report["prepared_type"] == "accelerate.data_loader.DataLoaderShard"
        assert not report["prepared_is_aioload"]
        assert report["prepared_len"] == N // BATCH // WORLD_SIZE
        assert report["direct_len"] == N // BATCH // WORLD_SIZE
        assert report["direct_stats"]["batches"] == N // BATCH // WORLD_SIZE
        # The shard's shuffle moves on with the epoch.
        assert report["direct_epoch1"] != report["direct"]["indices"]
    assert_exactly_once([report["prepare"]["indices"] for report in reports])
    assert_exactly_once([report["direct"]["indices"] for report in reports])
    assert_exactly_once([report["direct_epoch1"] for report in reports])
