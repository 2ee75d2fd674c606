"""HF transformers ``Trainer`` on 2 real ranks (CPU, gloo over 127.0.0.1) with
``get_train_dataloader`` overridden to return an aioload loader: the Trainer uses it as it is
(aioload's engine), aioload shards it, and every index is trained on exactly once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ._ranks import BATCH, WORLD_SIZE, N, assert_exactly_once, launch

pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("no_leaks"), pytest.mark.timeout(240)]


def test_trainer_with_aioload_loader_sees_every_index_once(tmp_path: Path) -> None:
    reports = launch("transformers", tmp_path, timeout=220)
    steps = N // BATCH // WORLD_SIZE
    for report in reports:
        assert report["type"] == "aioload.loader.DataLoader"
        # The Trainer sizes the epoch from len(loader): this rank's batches.
        assert report["len"] == steps
        assert report["global_step"] == steps
        assert report["stats"]["batches"] == steps
    assert_exactly_once([report["train"]["indices"] for report in reports])
