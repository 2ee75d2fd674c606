"""The CUDA path of the pin / host-to-device stage. Skipped where there is no GPU (CI, and the
CPU-only development machines); run on a machine with one: ``pytest tests/gpu``."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import aioload

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class Images(Dataset[dict[str, Any]]):
    def __init__(self, n: int = 96) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        return {
            "image": torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g),
            "label": i,
        }


# pin_memory and device= over both kinds of local worker (thread workers hand batches over by
# reference, so pinning starts from a tensor a worker thread made, not from a shared slab).
WORKER_METHODS = pytest.mark.parametrize("worker_method", ["multiprocessing", "thread"])


def _cpu_batches(n: int = 96, batch_size: int = 8) -> list[dict[str, Any]]:
    return list(torch.utils.data.DataLoader(Images(n), batch_size=batch_size))


@WORKER_METHODS
def test_pinned_batches_match_cpu_and_are_pinned(worker_method: str) -> None:
    ref = _cpu_batches()
    loader = aioload.DataLoader(
        Images(), batch_size=8, num_workers=2, pin_memory=True, worker_method=worker_method
    )
    got = list(loader)
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert a["image"].is_pinned() and a["label"].is_pinned()
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])


@pytest.mark.parametrize(
    ("num_workers", "worker_method"),
    [(0, "multiprocessing"), (2, "multiprocessing"), (2, "thread")],
)
def test_device_batches_match_cpu_over_many_epochs(num_workers: int, worker_method: str) -> None:
    ref = _cpu_batches()
    loader = aioload.DataLoader(
        Images(),
        batch_size=8,
        num_workers=num_workers,
        device="cuda",
        persistent_workers=False,
        worker_method=worker_method,
    )
    for _ in range(5):
        got = list(loader)
        assert len(got) == len(ref)
        for a, b in zip(got, ref, strict=True):
            assert a["image"].device.type == "cuda"
            assert torch.equal(a["image"].cpu(), b["image"])
            assert torch.equal(a["label"].cpu(), b["label"])


@WORKER_METHODS
def test_batches_kept_alive_stay_correct(worker_method: str) -> None:
    ref = _cpu_batches(192)
    loader = aioload.DataLoader(
        Images(192), batch_size=8, num_workers=2, device="cuda", worker_method=worker_method
    )
    kept = list(loader)
    # Churn the caching allocator so that early reuse of any kept block would show.
    for _ in range(20):
        junk = torch.empty(8 * 3 * 64 * 64, dtype=torch.uint8, device="cuda").fill_(7)
        del junk
    torch.cuda.synchronize()
    for a, b in zip(kept, ref, strict=True):
        assert torch.equal(a["image"].cpu(), b["image"])


def test_stream_ordering_under_a_long_kernel() -> None:
    """The consumer's stream is busy when batches arrive; its next kernel must still see the
    copied data, with no host synchronisation in between."""
    ref = _cpu_batches()
    loader = aioload.DataLoader(Images(), batch_size=8, num_workers=2, device="cuda")
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):
        for batch in loader:
            torch.cuda._sleep(2_000_000)  # keep this stream busy (~ms)
            sums.append(batch["image"].to(torch.int64).sum())
            del batch
            gc.collect()
    torch.cuda.synchronize()
    expected = [int(b["image"].to(torch.int64).sum()) for b in ref]
    assert [int(s) for s in sums] == expected


@WORKER_METHODS
@pytest.mark.asyncio
async def test_device_batches_under_async_for(worker_method: str) -> None:
    ref = _cpu_batches()
    loader = aioload.DataLoader(
        Images(), batch_size=8, num_workers=2, device="cuda", worker_method=worker_method
    )
    got = [b async for b in loader]
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a["image"].cpu(), b["image"])
