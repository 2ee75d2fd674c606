"""What a kept tensor costs: a consumer that keeps a small part of every batch (a label, for its
metrics) keeps each batch's slab, so a slab must not be much larger than its batch
(NOTE [slab size] in aioload/_wire/slabs.py), however large the batches before it were."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

import aioload
from aioload._wire import slabs
from aioload._wire.encoding import encode_batch
from tests.scripts.datasets import FnDataset

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
BIG = 4 * MiB  # a sample of a large batch: two make 8 MiB
SMALL = 80 << 10  # a sample of a small one: two make 160 KiB


def slab_memory() -> int:
    """The bytes the slab memfds this process maps hold (each memfd once): their allocated
    blocks, which is what a kept slab costs, whatever part of it is mapped or touched."""
    seen: set[tuple[int, int]] = set()
    total = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "aioload-slab" not in line:
                continue
            try:
                st = os.stat(f"/proc/self/map_files/{line.split()[0]}")
            except PermissionError:
                pytest.skip("this process may not stat /proc/self/map_files")
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def first_big(i: int) -> dict[str, torch.Tensor]:
    # The case: the first batch is 8 MiB, every later one 160 KiB.
    n = BIG if i < 2 else SMALL
    return {"image": torch.zeros(n, dtype=torch.uint8), "label": torch.tensor(i)}


def every_other_big(i: int) -> dict[str, torch.Tensor]:
    # Large batches (dropped) and small ones (a label kept) by turns: a small batch is made
    # in the large slab the consumer has just let go of.
    n = BIG if (i // 2) % 2 == 0 else SMALL
    return {"image": torch.zeros(n, dtype=torch.uint8), "label": torch.tensor(i)}


@pytest.mark.parametrize("fn", [first_big, every_other_big])
def test_kept_labels_hold_about_what_their_batches_would(
    no_leaks: None, fn: Callable[[int], Any]
) -> None:
    gc.collect()
    before = slab_memory()
    loader = aioload.DataLoader(FnDataset(fn, 80), batch_size=2, num_workers=1)
    kept, whole = [], 0
    for batch in loader:
        if batch["image"].numel() < BIG:
            kept.append(batch["label"])
            whole += batch["image"].nbytes + batch["label"].nbytes
    gc.collect()
    held = slab_memory() - before
    # Each kept batch in a slab of its own size would hold ``whole`` bytes (8 MiB more for
    # the first case's first batch, whose slab the first kept label may share). A slab
    # sized for the largest batch ever made held 8 MiB per label: 300 MiB here.
    assert held <= 3 * whole + 2 * BIG, (held / MiB, whole / MiB)
    assert len(kept) == (39 if fn is first_big else 20)
    del kept, batch
    gc.collect()
    assert slab_memory() == before


def test_batches_of_one_size_reuse_their_slabs(no_leaks: None) -> None:
    made: list[int] = []
    create = slabs._create_memfd

    def counted(size: int) -> int:
        made.append(size)
        return create(size)

    # (In this process: num_workers=0 makes no slab, so the pool is driven as a worker does.)
    pool = slabs.WorkerSlabPool(max_idle=4)
    slabs._create_memfd = counted
    try:
        for i in range(50):
            batch = {"image": torch.full((SMALL,), i, dtype=torch.uint8)}
            encoded = encode_batch(batch, pool, None)
            assert encoded.slab is not None
            pool.release(encoded.slab.id)
    finally:
        slabs._create_memfd = create
        for slab_id in list(pool.slabs):
            pool.discard(slab_id)
    assert len(made) == 1
