"""``aioload.RayWorkers``: run a loader's workers as Ray actors. Importing this imports no Ray."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import WorkerBackend, WorkerSpec

__all__ = ["RayWorkers"]


class RayWorkers:
    """Pass as ``DataLoader(..., workers=aioload.RayWorkers(...))`` to run the loader's
    ``num_workers`` workers as Ray actors, each with ``num_cpus``/``num_gpus``/``resources``
    and ``runtime_env`` as Ray takes them.

    Connecting: ``address=None`` uses the Ray session already initialized in this process;
    if there is none, ``ray.init(address)`` connects to ``address``, else to ``RAY_ADDRESS``,
    else starts a local instance, as Ray Data does.

    Needs the ``ray`` extra: ``pip install 'aioload[ray]'``.

    Raises:
        ImportError: Ray is not installed; the message names the extra.
        ValueError: ``num_cpus`` or ``num_gpus`` is negative.
    """

    def __init__(
        self,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: Mapping[str, float] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        address: str | None = None,
    ) -> None:
        if importlib.util.find_spec("ray") is None:
            raise ImportError(
                "aioload.RayWorkers needs Ray: install the extra with `pip install 'aioload[ray]'`"
            )
        if num_cpus < 0 or num_gpus < 0:
            raise ValueError("RayWorkers: num_cpus and num_gpus should be non-negative")
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.resources = dict(resources) if resources else None
        self.runtime_env = dict(runtime_env) if runtime_env else None
        self.address = address
        # (dataset, collate_fn, worker_init_fn) in the object store, put once per loader (one
        # RayWorkers per loader; a shared one keeps one object per dataset it has seen).
        self._payloads: dict[int, tuple[Any, Any]] = {}

    def make_backend(self, spec: WorkerSpec, base_seed: int) -> WorkerBackend:
        """The Ray actors of a pass (``_backends.choice.WorkerFactory``)."""
        from .ray import RayBackend  # imports Ray: only when a pass needs it

        return RayBackend(spec, base_seed, self)

    def payload_ref(self, spec: Any) -> Any:
        import ray

        objects = (spec.dataset, spec.collate_fn, spec.worker_init_fn)
        key = id(spec.dataset)
        cached = self._payloads.get(key)
        if cached is None or cached[0] != objects:
            cached = (objects, ray.put(objects))
            self._payloads[key] = cached
        return cached[1]

    def __repr__(self) -> str:
        return (
            f"RayWorkers(num_cpus={self.num_cpus}, num_gpus={self.num_gpus}, "
            f"resources={self.resources}, runtime_env={self.runtime_env}, "
            f"address={self.address!r})"
        )
