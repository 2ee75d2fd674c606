from __future__ import annotations

import pytest
import torch

import aioload
from tests.scripts.datasets import Squares

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_matches_torch(num_workers: int, no_leaks: None) -> None:
    ds = Squares()
    ours = list(aioload.DataLoader(ds, batch_size=4, num_workers=num_workers))
    ref = list(torch.utils.data.DataLoader(ds, batch_size=4))
    assert len(ours) == len(ref) == 10
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
