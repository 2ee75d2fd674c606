"""What a loader's passes need, imported before their clock starts, not with the package.

``import aioload`` imports almost nothing (see ``aioload/__init__.py``): the engine, anyio's
backends and the worker-side code cost milliseconds each, which a script that only imports the
package, or builds a loader it never iterates, should not pay. They are imported here, before a
pass begins, rather than on its first ``next()``: a pass's clock (its stats, its ``timeout``)
starts with the first ``next()``, and a one-time import inside it would read as a slow first
batch. The time to the first batch counted from before ``import aioload`` is the same either
way.

``for batch in loader`` needs neither anyio nor an event loop (it waits in the calling thread,
see ``Orchestrator.next_blocking``), and ``async for`` under asyncio needs no anyio either (see
``warm_async``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import sys
from collections.abc import Iterator

_done: set[str] = set()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while our modules are imported.

    Their bodies make a few thousand objects (classes, functions, NamedTuples), which trigger
    the collector's young generations several times, and with torch imported those collections
    cost 1-2 ms of the ~12 ms that ``aioload.DataLoader`` takes to import: time to the first
    batch. Nothing they make is garbage, so nothing is lost by collecting afterwards. A
    collector the program had switched off stays off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load(names: list[str]) -> None:
    with collector_paused():
        for name in names:
            if name not in _done:
                importlib.import_module(name)
                _done.add(name)


def warm(num_workers: int) -> None:
    """Import what a pass with ``num_workers`` workers runs in this process (once); called by
    ``DataLoader(...)``."""
    # _worker.main: a fork runs it in the child, so the parent holds it before forking;
    # num_workers=0 runs the dataset here, in _backends.inline.
    _load(["aioload._worker.main"] if num_workers > 0 else ["aioload._backends.inline"])


def warm_async() -> None:
    """Import what ``async for`` needs on the running loop; called by ``__aiter__``. Under
    asyncio (and uvloop), nothing: the engine waits, checkpoints and starts its workers with
    asyncio's own primitives there (``_aio.waiting.ReadableWait``, ``run_off_loop``). Under trio,
    anyio and its trio backend, through which the engine does the same."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        # Not under asyncio: trio (anyio supports no other), if it is running at all.
        if "trio" in sys.modules:
            _load(["anyio", "anyio.lowlevel", "anyio.to_thread", "anyio._backends._trio"])
