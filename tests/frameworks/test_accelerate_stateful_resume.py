"""accelerate's ``prepare()`` with ``DataLoaderConfiguration(use_stateful_dataloader=True)``
rebuilds an aioload loader as torchdata's ``StatefulDataLoader`` from the loader's
``batch_sampler``, and checkpoints it with ``accelerator.save_state`` / ``load_state``.

With torch's stateless samplers, the resumed epoch drew a new order and skipped as many batches
as had been yielded: indices repeated and others never seen. The samplers ``shuffle=True``
builds now carry their state, so the resumed epoch is the uninterrupted one. With a
``generator=`` every later epoch is too; without one, later epochs draw their order from
torch's global RNG, as torch's sampler does, and StatefulDataLoader's resumed iterator draws
one base seed from it that the uninterrupted run drew before the checkpoint (docs/resume.md).

The orders are also the aioload loader's own, under ``for`` and under ``async for``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("torchdata.stateful_dataloader")

pytestmark = [pytest.mark.usefixtures("no_leaks"), pytest.mark.timeout(240)]

EPOCH = 16  # batches: 64 samples of 4
STOP = 7  # the checkpoint: after the 7th batch of the second epoch


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "generator"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_prepared_stateful_loader_resumes_exactly(
    tmp_path: Path, workers: int, seeded: bool
) -> None:
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "tests.frameworks._stateful_prepare", str(workers)]
    command += [str(STOP), "seeded" if seeded else "global", str(out)]
    done = subprocess.run(command, capture_output=True, timeout=220, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    report = json.loads(out.read_text())
    uninterrupted = report["uninterrupted"]
    assert report["prepared_type"] == "accelerate.data_loader.DataLoaderShard"
    assert len(uninterrupted) == 3 * EPOCH
    assert report["aioload_for"] == uninterrupted
    assert report["aioload_async_for"] == uninterrupted
    resumed = report["resumed"]
    assert len(resumed) == len(uninterrupted)
    # The interrupted epoch, resumed: every index once, in the uninterrupted order.
    assert resumed[: 2 * EPOCH] == uninterrupted[: 2 * EPOCH]
    if seeded:
        assert resumed == uninterrupted
