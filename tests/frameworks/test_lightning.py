"""Lightning on 2 real ranks (strategy ddp, gloo over 127.0.0.1, ranks launched as torchrun
would): with ``use_distributed_sampler=True`` Lightning rebuilds the aioload loader with a
DistributedSampler, from a ``train_dataloader`` hook (saved arguments) and from a loader passed
to ``fit`` (arguments read back from attributes). The rebuilt loader is still aioload's, and
it does not shard a second time: every index exactly once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._ranks import BATCH, WORLD_SIZE, N, assert_exactly_once, launch

pytest.importorskip("lightning")

pytestmark = [pytest.mark.usefixtures("no_leaks"), pytest.mark.timeout(240)]


def test_rebuilt_loader_keeps_aioload_and_sees_every_index_once(tmp_path: Path) -> None:
    reports = launch("lightning", tmp_path, timeout=220)
    for flow in ("hook", "fit_argument"):
        for report in reports:
            assert report[flow + "_type"] == "aioload.loader.DataLoader"
            assert report[flow + "_is_aioload"]
            # Lightning's sampler (so the loader was rebuilt), shuffling as the original did.
            assert report[flow + "_sampler"] == "torch.utils.data.distributed.DistributedSampler"
            assert report[flow + "_shuffles"]
            assert report[flow + "_len"] == N // BATCH // WORLD_SIZE
            assert report[flow + "_stats"]["batches"] == N // BATCH // WORLD_SIZE
        assert_exactly_once([report[flow]["indices"] for report in reports])
