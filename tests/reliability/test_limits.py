"""The process's limits, reached during a pass: a full descriptor table, shared memory that
cannot be had or mapped. Each costs at most the batches it touched, with an error that says
what happened and what to do; nothing after them is lost, and nothing hangs.

Descriptor limits are lowered in a fresh interpreter (``run_fresh``), not in the test process.
"""

from __future__ import annotations

import errno
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import aioload
from aioload._wire import slabs
from tests.helpers import run_fresh

pytestmark = pytest.mark.timeout(120)

# A pass whose batches grow, so that every batch needs a new slab, whose descriptor must
# arrive while the table is full. Prints the indices delivered and the errors raised.
_FULL_TABLE = """
import asyncio, os, resource, sys, torch, aioload

class Grow(torch.utils.data.Dataset):
    def __len__(self):
        return 10
    def __getitem__(self, i):
        return torch.full(((1 << 15) * (i + 1),), i, dtype=torch.float32)

def fill():
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        return held

def take(step):
    try:
        return int(step()[0, 0])
    except Exception as error:
        return error

def main(mode):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    loader = aioload.DataLoader(Grow(), batch_size=1, num_workers=1, timeout=30)
    got, errors = [], []
    if mode == "sync":
        it = iter(loader)
        step = lambda: next(it)
    else:
        runner = asyncio.Runner()
        ait = loader.__aiter__()
        step = lambda: runner.run(ait.__anext__())
    got.append(take(step))
    held = fill()
    for _ in range(3):
        result = take(step)
        (errors if isinstance(result, Exception) else got).append(result)
    for fd in held:
        os.close(fd)
    while not isinstance(result := take(step), (StopIteration, StopAsyncIteration)):
        (errors if isinstance(result, Exception) else got).append(result)
    assert errors, "no batch met the full table"
    for error in errors:
        assert type(error) is RuntimeError, repr(error)
        assert "Too many open files" in str(error) and "ulimit -n" in str(error), error
    print(got, len(errors))

main(sys.argv[1])
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_descriptor_table_costs_the_batches_it_met_and_no_more(mode: str) -> None:
    got, errors = run_fresh(_FULL_TABLE, mode).rsplit(" ", 1)
    delivered = eval(got)  # a list of ints, printed by the script
    # Every batch is either delivered once, in order, or raised its one error.
    assert delivered == sorted(set(delivered))
    assert len(delivered) + int(errors) == 10
    assert delivered[0] == 0 and delivered[-1] == 9


class Sized(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1 << 15,), i, dtype=torch.float32)


def _no_descriptors_in_worker(worker_id: int) -> None:
    import os
    import resource

    # Just what is open now: the worker cannot make a single memfd.
    count = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (count, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )


def _no_shared_memory_in_worker(worker_id: int) -> None:
    def full(size: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    slabs._create_memfd = full


@pytest.mark.parametrize("init", [_no_descriptors_in_worker, _no_shared_memory_in_worker])
def test_a_worker_without_shared_memory_sends_its_batches_by_value(init: Any) -> None:
    loader = aioload.DataLoader(
        Sized(), batch_size=2, num_workers=2, worker_init_fn=init, timeout=30
    )
    assert [int(b[0, 0]) for b in loader] == list(range(0, 12, 2))


def test_a_slab_that_cannot_be_mapped_costs_its_batch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    mapped = slabs.SlabMappings.add
    calls = []

    def add(self: slabs.SlabMappings, slab_id: int, fd: int, capacity: int) -> None:
        calls.append(slab_id)
        if len(calls) == 2:
            import os

            os.close(fd)
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        mapped(self, slab_id, fd, capacity)

    monkeypatch.setattr(slabs.SlabMappings, "add", add)

    class Grow(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full(((1 << 15) * (i + 1),), i, dtype=torch.float32)

    loader = aioload.DataLoader(Grow(), batch_size=1, num_workers=1, timeout=30)
    got, errors = [], []
    it = iter(loader)
    while True:
        try:
            got.append(int(next(it)[0, 0]))
        except StopIteration:
            break
        except RuntimeError as error:
            errors.append(error)
    assert len(errors) == 1 and "could not be mapped" in str(errors[0])
    assert isinstance(errors[0].__cause__, OSError)
    assert got == [0, 2, 3, 4, 5]
