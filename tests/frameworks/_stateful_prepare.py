"""accelerate's ``prepare()`` with ``use_stateful_dataloader=True``, in a process of its own
(accelerate's state is per process): it rebuilds the aioload loader as a torchdata
``StatefulDataLoader`` over the loader's ``batch_sampler``. An uninterrupted run, a run
checkpointed with ``accelerator.save_state`` at step ``STOP`` of its second epoch, and a run
resumed with ``load_state`` after the global RNG was moved elsewhere (a new process's): the
indices of each, and the aioload loader's own orders under ``for`` and ``async for``.

``python -m tests.frameworks._stateful_prepare WORKERS STOP seeded|global OUT.json``
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from typing import Any

import torch

import aioload

from ._ranks import Indexed

SIZE, BATCH, EPOCHS = 64, 4, 3


def _loader(workers: int, seeded: bool) -> aioload.DataLoader[Any]:
    generator = torch.Generator().manual_seed(7) if seeded else None
    return aioload.DataLoader(
        Indexed(SIZE), batch_size=BATCH, shuffle=True, num_workers=workers, generator=generator
    )


def _accelerator() -> Any:
    from accelerate import Accelerator, DataLoaderConfiguration

    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    return Accelerator(cpu=True, dataloader_config=config)


def _indices(batch: Any) -> list[int]:
    return [int(i) for i in batch["index"]]


def main(workers: int, stop: int, seeded: bool) -> dict[str, Any]:
    report: dict[str, Any] = {}
    # (An Accelerator per run: save_state and load_state go by the order of its prepare()s.)
    torch.manual_seed(0)
    prepared = _accelerator().prepare(_loader(workers, seeded))
    report["prepared_type"] = f"{type(prepared).__module__}.{type(prepared).__qualname__}"
    report["uninterrupted"] = [_indices(b) for _ in range(EPOCHS) for b in prepared]

    torch.manual_seed(0)
    loader = _loader(workers, seeded)
    report["aioload_for"] = [_indices(b) for _ in range(EPOCHS) for b in loader]
    torch.manual_seed(0)
    loader = _loader(workers, seeded)

    async def epochs() -> list[list[int]]:
        return [_indices(b) async for _ in _aranged(EPOCHS) for b in loader]

    report["aioload_async_for"] = asyncio.run(epochs())

    with tempfile.TemporaryDirectory() as checkpoint:
        torch.manual_seed(0)
        accelerator = _accelerator()
        prepared = accelerator.prepare(_loader(workers, seeded))
        got = [_indices(b) for b in prepared]  # the first epoch
        for step, batch in enumerate(prepared):
            got.append(_indices(batch))
            if step + 1 == stop:
                accelerator.save_state(checkpoint)
                break
        torch.manual_seed(1234)  # a new process's RNG is elsewhere
        accelerator = _accelerator()
        resumed = accelerator.prepare(_loader(workers, seeded))
        accelerator.load_state(checkpoint)
        for _ in range(EPOCHS - 1):
            got += [_indices(b) for b in resumed]
        report["resumed"] = got
    return report


async def _aranged(count: int) -> Any:
    for value in range(count):
        yield value


if __name__ == "__main__":
    result = main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "seeded")
    with open(sys.argv[4], "w") as out:
        json.dump(result, out)
