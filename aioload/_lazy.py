"""What a loader's first pass needs, imported when a loader is made, not with the package.

``import aioload`` imports almost nothing (see ``aioload/__init__.py``): the engine, anyio's
asyncio backend, uvloop and the worker-side code cost tens of ms, which a script that only
imports the package, or builds a loader it never iterates, should not pay. They are imported
here, by ``DataLoader(...)``, rather than on the first ``next()``: a pass's clock (its stats, its
``timeout``) starts with the first ``next()``, and a one-time import inside it would read as a
slow first batch. The time to the first batch counted from before ``import aioload`` is the same
either way.
"""

from __future__ import annotations

import importlib

_done: set[str] = set()


def warm(num_workers: int) -> None:
    """Import what a pass with ``num_workers`` workers runs in this process (once)."""
    # uvloop: the sync front end's private loop. _worker_main: a fork runs it in the child, so
    # the parent holds it before forking; num_workers=0 runs the dataset here, in _inline.
    names = ["anyio._backends._asyncio", "uvloop"]
    names += ["aioload._worker_main"] if num_workers > 0 else ["aioload._inline"]
    for name in names:
        if name not in _done:
            importlib.import_module(name)
            _done.add(name)
