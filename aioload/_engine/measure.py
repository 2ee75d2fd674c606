"""What the ``"auto"`` controller (:mod:`._tuning.controller`'s ``Controller``) and run-ahead
read off the machine and the batches: the cores this process may use (affinity and cgroup
quota), the idle share of those cores, a batch's bytes, and the process's resident memory.
Cheap to import: run-ahead uses ``batch_bytes`` on every loader, auto or not."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

__all__ = ["IdleCpus", "affinity", "batch_bytes", "cgroup_cpu_quota", "rss_bytes", "usable_cores"]

# -- the machine ------------------------------------------------------------------------------


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_self: str = "/proc/self") -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 ``cpu.max``, or v1
    ``cpu.cfs_quota_us / cpu.cfs_period_us``), the smallest along the path to the root; None
    where there is none (or no cgroup file system)."""
    quotas: list[float] = []
    base = Path(root)
    try:
        lines = Path(proc_self, "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    paths: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            # v2: cpu.max in the process's own cgroup and each above it.
            here = base / path.lstrip("/")
            while True:
                paths.append(here / "cpu.max")
                if here == base or base not in here.parents:
                    break
                here = here.parent
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                directory = base / mount
                if directory.is_dir():
                    paths.append(directory / path.lstrip("/") / "cpu.cfs_quota_us")
                    paths.append(directory / "cpu.cfs_quota_us")
                    break
    if not paths:
        paths = [base / "cpu.max"]
    for candidate in paths:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if candidate.name == "cpu.max":
                fields = candidate.read_text().split()
                if fields[0] != "max":
                    period = int(fields[1]) if len(fields) > 1 else 100_000
                    quotas.append(int(fields[0]) / period)
            else:
                quota_us = int(candidate.read_text())
                period_us = int((candidate.parent / "cpu.cfs_period_us").read_text())
                if quota_us > 0 and period_us > 0:
                    quotas.append(quota_us / period_us)
    return min(quotas) if quotas else None


def affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, and its cgroup's CPU quota (rounded
    to the nearest core, at least one)."""
    cores = len(affinity()) or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota + 0.5)))
    return max(1, cores)


class IdleCpus:
    """Idle time of the cores in this process's affinity, from ``/proc/stat`` (idle + iowait
    jiffies), in cores, between two calls; None where it cannot be read."""

    def __init__(self, cpus: set[int], path: str = "/proc/stat") -> None:
        self.names = {f"cpu{n}" for n in cpus}
        self.path = path
        self.last = self._read()

    def _read(self) -> tuple[int, int] | None:
        idle = total = 0
        try:
            with open(self.path, "rb") as source:
                for raw in source:
                    if not raw.startswith(b"cpu"):
                        break
                    fields = raw.split()
                    if fields[0].decode() not in self.names:
                        continue
                    ticks = [int(x) for x in fields[1:9]]
                    idle += ticks[3] + ticks[4]
                    total += sum(ticks)
        except (OSError, ValueError, IndexError):
            return None
        return (idle, total) if total else None

    def sample(self, since: tuple[int, int] | None = None) -> float | None:
        """Idle cores since the last call (or since ``since``, a reading: then the last
        reading stays)."""
        now = self._read()
        if since is None:
            since, self.last = self.last, now
        if now is None or since is None or now[1] <= since[1]:
            return None
        return (now[0] - since[0]) / (now[1] - since[1]) * len(self.names)


def batch_bytes(batch: Any, depth: int = 0) -> int:
    """Bytes of a batch's tensors and arrays (in lists, tuples and dicts, a few levels deep)."""
    try:
        nbytes = getattr(batch, "nbytes", None)
    except Exception:
        # A sparse tensor has no nbytes (its dense size below stands in), and a user's object
        # may raise anything: this is an estimate, which must never end the pass.
        nbytes = None
    if isinstance(nbytes, int):
        return nbytes
    element_size = getattr(batch, "element_size", None)
    if callable(element_size) and hasattr(batch, "nelement"):
        return int(element_size()) * int(batch.nelement())
    if depth >= _MAX_DEPTH:
        return 0
    if isinstance(batch, dict):
        return _sampled_bytes(list(batch.values()), depth)
    if isinstance(batch, list | tuple):
        if batch and type(batch[0]) in _SCALARS and type(batch[-1]) in _SCALARS:
            # A collated list of strings or numbers (a text batch's): no tensors in it, and
            # walking a few hundred of them costs the consumer's thread 150 us.
            return 0
        return _sampled_bytes(batch, depth)
    return 0


def _sampled_bytes(items: list[Any] | tuple[Any, ...], depth: int) -> int:
    """The bytes of a container's items: all of them up to ``_SAMPLED`` items, else that many
    spread over it, scaled up to the whole (a batch kept as a list of a thousand tensors
    counts as a thousand, not as its first few hundred)."""
    count = len(items)
    if count <= _SAMPLED:
        return sum(batch_bytes(v, depth + 1) for v in items)
    sampled = sum(batch_bytes(items[k * count // _SAMPLED], depth + 1) for k in range(_SAMPLED))
    return sampled * count // _SAMPLED


# How many items of a container are measured, and how deep containers are walked: a batch's
# size is read at each answer that waits behind a late head, in the consumer's thread.
_SAMPLED = 256
_MAX_DEPTH = 8


# What a collated batch holds in plain lists (default_collate keeps strings and bytes as lists).
_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})


def rss_bytes() -> int:
    """This process's resident memory, 0 where ``/proc`` cannot tell."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
