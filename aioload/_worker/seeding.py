"""A worker's seeds: the ones torch's own workers set, for ``random``, torch and numpy.

Seeded as torch seeds its workers, so random augmentations match torch's loader, and without
two costs of torch's way that buy nothing: seeding accelerator backends a torch build cannot
start, and importing ``numpy.random`` only to seed it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
import sys
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

import torch
from torch.utils.data._utils.worker import _generate_state

__all__ = ["seed_worker"]


def seed_worker(base_seed: int, worker_id: int) -> int:
    # The same seeds torch's own workers use, so random augmentations match torch's loader.
    seed = base_seed + worker_id
    random.seed(seed)
    if _accelerators_to_seed():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)
    _seed_numpy(_generate_state(base_seed, worker_id))  # type: ignore[no-untyped-call]
    return seed


def _accelerators_to_seed() -> bool:
    """Whether this torch could ever run on an accelerator in this process, so that
    ``torch.manual_seed`` must seed it too.

    torch's workers call ``torch.manual_seed``, which also seeds every accelerator backend. An
    uninitialized one (CUDA, XPU, MTIA) defers its seeding: it keeps the seed and a formatted
    stack trace of the call for when it starts. That costs a worker about 2 ms and 500
    copy-on-write page faults of its start, on the path to the first batch, and in a torch
    built without any accelerator it is for a backend that can never start: there, seeding
    the CPU generator (all that call then does that can be observed) is enough. Anything
    unsure, a custom device backend included, takes the full call."""
    try:
        return bool(
            torch.cuda._is_compiled()
            or torch.xpu._is_compiled()
            or torch.mtia._is_compiled()
            or torch.backends.mps.is_built()
            or torch._C._get_privateuse1_backend_name() != "privateuseone"
        )
    except Exception:  # a torch without one of these: do as torch's workers do
        return True


def _seed_numpy(state: list[int]) -> None:
    """Seed numpy's global RNG with ``state``, as torch's workers do, without importing
    ``numpy.random`` only for that.

    torch's workers import ``numpy.random`` to seed it: about 10 ms of a worker's start (before
    its first batch) and 2-3 MiB of its memory, whether or not the dataset ever draws from it.
    Where nothing in this process has imported it yet, nothing can have drawn from it either,
    so the seed is applied the moment it is imported (by the dataset, ``worker_init_fn`` or a
    library, through the import system in every case), before anyone can draw: every draw sees
    the state torch's worker gives it.
    """
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed(state)
        return

    def seed(module: ModuleType) -> None:
        module.seed(state)

    # A seeding not applied yet (numpy.random still not imported) is replaced, not stacked:
    # two hooks for one import would each wrap the same loader's ``exec_module``.
    for finder in sys.meta_path:
        if isinstance(finder, _AfterImport) and finder.name == "numpy.random":
            finder.then = seed
            return
    sys.meta_path.insert(0, _AfterImport("numpy.random", seed))


class _AfterImport:
    """A meta path finder that runs ``then(module)`` right after the module ``name`` has been
    executed, before the import that loads it returns, and then leaves ``sys.meta_path``.

    It finds nothing itself: the module is found by the finders behind it, and loaded by its own
    loader, whose ``exec_module`` is wrapped on that one loader object for that one call (so the
    module's ``__loader__`` and ``__spec__`` are what they would have been)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        # Out first: the search below, and any later import of the name, skip this finder.
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader: Any = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        then = self.then

        def exec_then(module: ModuleType) -> None:
            try:
                exec_module(module)
            finally:
                del loader.exec_module
            then(module)

        loader.exec_module = exec_then
        return spec
