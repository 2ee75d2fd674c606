"""The engine's modules are imported on first use (``aioload.__getattr__``, ``_aio.lazy_import.warm``),
with the cyclic garbage collector paused while they are: collections in the middle of their
bodies cost 1-2 ms of the time to the first batch, with nothing to collect."""

from __future__ import annotations

import gc
import json

import pytest

from aioload._aio.lazy_import import collector_paused
from tests.helpers import run_fresh


def test_the_collector_is_paused_and_then_left_as_it_was() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ImportError), collector_paused():
        raise ImportError("a failing import")
    assert gc.isenabled(), "on again after an import that failed"
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "a collector the program switched off stays off"
    finally:
        gc.enable()


_SCRIPT = """
import gc, json, sys
import torch
if sys.argv[1] == "off":
    gc.disable()

def collections():
    return [generation["collections"] for generation in gc.get_stats()]

before = collections()
import aioload
loader = aioload.DataLoader(list(range(8)), batch_size=2, num_workers=2)
during = [after - then for after, then in zip(collections(), before)]
print(json.dumps({"collections": during, "enabled": gc.isenabled()}))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collector", ["on", "off"])
def test_importing_the_engine_runs_one_collection_per_pause_at_most(collector: str) -> None:
    # Without the pause, `aioload.DataLoader` and the worker-side module that a loader's first
    # pass imports made enough objects for five young-generation collections and one of the
    # middle generation. Paused, the young generation is collected at most once right after
    # each of the two pauses (the engine's import, and the first loader's warm-up of the
    # worker side), as the objects they made tip the count; none in the middle of an import.
    got = json.loads(run_fresh(_SCRIPT, collector))
    young, middle, old = got["collections"]
    assert got["enabled"] == (collector == "on")
    assert young <= (2 if collector == "on" else 0) and middle == old == 0, got
