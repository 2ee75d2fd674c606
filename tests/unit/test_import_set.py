"""What a default loader imports on its way to the first batch, in a fresh interpreter.

The first batch counts from before ``import aioload`` (``python -m benchmarks.startup``), and
most of the parent's work on the way there was importing modules that a default loader never
runs: the self-tuning controller, the pin stage, the checkpoint parser. They are imported where
they are used; these tests pin that, so that a module-level import cannot bring them back
silently, and cap the number of aioload modules the first batch needs.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_fresh

# Modules a default loader's first batch (2 worker processes, no pin_memory, no "auto", no
# loaded state), under `for` and `async for`, must not import.
_LAZY = (
    "aioload._engine.tuning",  # the "auto" controller
    "aioload._engine.pass_tuning",  # its feed and the "auto" arguments' check
    "aioload._engine.pinning",  # pin_memory / device's stage
    "aioload._engine.state_format",  # load_state_dict's parser
    "aioload._aio.sync_loop",  # `for`'s private loop (an async dataset in this process)
    "aioload._backends.method_choice",  # worker_method="auto"
    "aioload._backends.inline",  # num_workers=0
    "aioload._backends.thread",  # worker_method="thread"
    "aioload._backends.ray",
    "aioload._progress",  # progress=True
    "aioload._worker.async_fetch",  # async datasets
    "anyio",  # trio only
    "uvloop",  # `for` over an async dataset in this process only
)

# The aioload modules (the package and its folders included) in sys.modules once a default
# loader has its first batch. Raising it is a choice: each module is paid for by every
# script's first batch (docs/benchmarks.md, start-up). (48: aioload._named_tuple, which saves
# more of the import than a module costs.)
_MAX_MODULES = 48

_SCRIPT = """
import asyncio, json, sys
import torch

class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.tensor(index)

def ours():
    return sorted(m for m in sys.modules if m == "aioload" or m.startswith("aioload."))

import aioload
on_import = ours()
loader = aioload.DataLoader(Numbers(), batch_size=8, num_workers=2)
if sys.argv[1] == "for":
    it = iter(loader)
    first = next(it)
    it.close()
else:
    async def main():
        it = aiter(loader)
        first = await anext(it)
        await it.aclose()
    asyncio.run(main())
print(json.dumps({"on_import": on_import, "first_batch": ours(), "all": sorted(sys.modules)}))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("front", ["for", "async for"])
def test_a_default_loaders_first_batch_imports_only_what_it_runs(front: str) -> None:
    got = json.loads(run_fresh(_SCRIPT, front.split()[0]))
    assert got["on_import"] == ["aioload", "aioload.errors"], got["on_import"]
    leaked = sorted(set(got["all"]) & set(_LAZY))
    assert not leaked, leaked
    assert len(got["first_batch"]) <= _MAX_MODULES, got["first_batch"]
