"""Shared-memory slabs: a worker's pool of them, the arena a batch is collated into, and the
parent's mappings.

A *slab* is an anonymous memfd that a worker creates once and reuses for many batches. Its
descriptor crosses to the parent once, as SCM_RIGHTS data on the frame of the first batch that
uses it; both sides map it and close the descriptor at once. Three things follow:

* There is no name in /dev/shm at any time, so a crash of the parent or a worker cannot leak
  one: the memory is freed by the kernel when the last mapping goes away.
* Neither side holds a descriptor per slab (mappings are made with libc's mmap through ctypes,
  because Python 3.11's mmap module keeps a dup'd descriptor for every mapping), so a user who
  keeps thousands of batches does not run out of descriptors.
* Steady state is a reused, already-faulted mapping: no shm_open, mmap or page fault per batch.

A batch travels as a pickle whose array leaves (tensors, numpy arrays) point into its slab
(``_wire.leaves``); ``_wire.encoding`` puts a worker's batch there.

Lifetime. In the parent, every batch gets its own *lease*: a fresh ctypes array over the used part
of the slab. All tensors and arrays of the batch are made from the lease (each tensor with a
storage of its own bytes, as torch's loader gives), so the lease dies exactly when the
consumer's last reference into the batch dies. A weak reference's callback on the lease then
queues the slab for return to its worker. Until then the worker never writes to that slab, so a
batch the user keeps is never overwritten; a worker that needs a slab and has none free makes a
new one (the pool grows) rather than waiting.
"""

from __future__ import annotations

import ctypes
import mmap
import operator
import os
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from .leaves import TORCH_DTYPES, LeafDesc, empty_leaf, leaf_view, load_batch

__all__ = [
    "ALIGN",
    "EAGER_FREE_BYTES",
    "LazyArena",
    "SlabMappings",
    "WorkerSlabPool",
    "collating_into",
    "collating_privately",
    "slab_collate",
    "stack_tensors_privately",
]

ALIGN = 64
_MIN_SLAB = 1 << 16
# Below this, stacking into the slab saves less than checking every sample costs; such small
# batches are stacked as usual and copied into the slab when encoded.
_ARENA_MIN_BYTES = 1 << 16
_PAGE = mmap.PAGESIZE
# A slab the parent's consumer let go of goes back to its worker at once (before the parent
# next waits) when it is at least this large; a smaller one rides along on that worker's next
# task (Task.freed_slabs). The large ones matter: a worker that starts a batch before hearing
# that a slab is free makes another, and for a large batch that is megabytes more resident
# memory and a working set that outgrows the cache. For a small one it is a few pages, and
# returning it at once cost a send (a system call and a pickled frame) of its own on every
# batch: with two workers, the batch the consumer just dropped and the task that refills the
# window go to different workers. A worker waits a little for the free of a slab this large
# (WorkerSlabPool.acquire), and never for a smaller one, whose free comes with a task.
EAGER_FREE_BYTES = 1 << 20
# The most a worker waits for a free before it makes a slab, and how many slabs it then makes
# without waiting, when the wait was in vain (the consumer keeps its batches).
_FREE_PATIENCE_MAX_S = 0.02
_WAITS_SKIPPED_AFTER_IN_VAIN = 64
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
# NOTE [slab size]. A slab is sized before its batch is known (by the batches before it),
# and a tensor the consumer keeps keeps its batch's whole slab. So a slab is sized by the
# largest of a worker's last few batches, not the largest it ever made (one large first
# batch made every later slab that large: 8 MB slabs kept alive by 16-byte labels); and a
# slab whose batch uses less than a quarter of it gives the rest back to the kernel before
# the batch goes out (``_Slab.fit``), so what a kept batch holds stays within a few times
# its own size. Batches of one size, the steady state, use their slabs whole: reuse and
# the absence of per-batch system calls are untouched.
_RECENT_BATCHES = 4
_FIT_BELOW = 4  # a batch that uses less than 1/_FIT_BELOW of its slab...
_FIT_MIN_SAVING = 1 << 18  # ...and leaves at least this much of it unused
_MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)


# --------------------------------------------------------------------------------------------
# Mappings
# --------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_fd(fd: int, size: int, *, populate: bool) -> ctypes.Array[ctypes.c_ubyte]:
    """Map ``size`` bytes of ``fd`` shared and read-write. The mapping lives exactly as long as
    the returned ctypes array (numpy and torch views keep it alive); the descriptor may be
    closed as soon as this returns.

    ``populate`` faults every page in now (MAP_POPULATE), in one system call rather than one
    page fault per page: the worker's side, which writes the whole slab for every batch. The
    parent maps its side lazily: it only reads, often only part of a batch (the consumer may
    look at a few fields, or hand the batch to a copy that reads each page once), and a page
    it never touches then costs it nothing, neither the fault nor resident memory. A page it
    does touch stays mapped for the slab's life, so steady state still has no page faults."""
    flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"aioload: mmap of a {size}-byte slab failed: {os.strerror(err)}")
    buf = (ctypes.c_ubyte * size).from_address(addr)
    weakref.finalize(buf, _libc.munmap, addr, size)
    return buf


def _create_memfd(size: int) -> int:
    fd = os.memfd_create("aioload-slab", os.MFD_CLOEXEC)
    try:
        # fallocate reserves the pages now, so running out of shared memory is a clean OSError
        # here and not a SIGBUS on first touch.
        os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


# How many tensors share a storage (torch's own count, private API); None where this torch has
# no such function, and then no slab is ever thought referenced (see _Slab.referenced).
_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


class _Slab:
    __slots__ = ("capacity", "cdata", "fd", "id", "own_refs", "own_views", "ptr", "tensor")

    def __init__(self, slab_id: int, capacity: int) -> None:
        self.id = slab_id
        self.capacity = capacity
        self.fd: int | None = _create_memfd(capacity)
        try:
            buf = _map_fd(self.fd, capacity, populate=True)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(buf, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()
        # The storage's address, taken once. Its Python object is not kept: a collate_fn that
        # keeps only a batch's ``untyped_storage()`` must count as a view (``referenced``).
        self.cdata = self.tensor.untyped_storage()._cdata
        self.own_views = self._views()
        self.own_refs = sys.getrefcount(self.tensor.untyped_storage())

    def _views(self) -> int:
        if _storage_use_count is None:
            return 0
        return _storage_use_count(self.cdata)

    def referenced(self) -> bool:
        """Whether a tensor in this process still views the slab: a batch's stacked tensors
        are views of it, and a user's collate_fn may keep one (a cache of the last good
        batch, say) after the batch was sent. Such a slab must never be written again."""
        if _storage_use_count is not None and _storage_use_count(self.cdata) > self.own_views:
            return True
        # A kept storage object (``batch.untyped_storage()``) adds nothing to that count: torch
        # keeps one Python object per storage, which holds no count of its own. Asked for it,
        # torch hands back that same object, whose Python references tell whether anyone
        # holds it.
        return sys.getrefcount(self.tensor.untyped_storage()) > self.own_refs

    def fit(self, used: int) -> None:
        """Give back to the kernel what lies past ``used`` (rounded up to a page), where that
        is most of the slab (NOTE [slab size]). The pages are freed for every process that
        maps the slab (MADV_REMOVE punches a hole in the memfd); the mapping keeps its
        length, and the slab is from now on only ``capacity`` bytes long, so nothing touches
        the hole again."""
        keep = _round_up(max(used, _MIN_SLAB), _PAGE)
        if used * _FIT_BELOW >= self.capacity or self.capacity - keep < _FIT_MIN_SAVING:
            return
        if _libc.madvise(self.ptr + keep, self.capacity - keep, _MADV_REMOVE) == 0:
            self.capacity = keep

    def take_fd(self) -> int | None:
        """The descriptor, once: it is sent to the parent with the first batch."""
        fd, self.fd = self.fd, None
        return fd


class _Arena:
    """Bump allocation inside one slab while a batch is being collated."""

    __slots__ = ("made_for_batch", "slab", "used")

    def __init__(self, slab: _Slab, *, made_for_batch: bool = False) -> None:
        self.slab = slab
        self.used = 0
        # Made by a LazyArena for this batch, so sized by its first tensor only: if the
        # batch spills out of it, it is dropped rather than kept idle (see encode_batch).
        self.made_for_batch = made_for_batch

    def alloc(self, nbytes: int) -> int | None:
        start = _round_up(self.used, ALIGN)
        if start + nbytes > self.slab.capacity:
            return None
        self.used = start + nbytes
        return start

    def view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.slab.tensor[offset : offset + nbytes].view(dtype)

    def holds(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return self.slab.ptr <= ptr < self.slab.ptr + self.slab.capacity


class LazyArena:
    """The arena of a batch being collated, before it has a slab: the slab is taken when the
    collate first stacks a tensor into it, not when the task starts.

    Taken late, the slab is more often one the parent has just freed. A worker is given
    ``prefetch_factor`` tasks at once, and while it fetches a batch's samples (half the
    batch's time on the image workload) the consumer usually drops the batch before the last.
    Taken at the start of the task, that slab was still in use, and one worker in two kept a
    third 9 MiB slab in its rotation: five slabs for two workers, whose writes no longer fit
    in the cache. The pool also reads the frees the parent has sent since the task began
    before it makes a slab (``WorkerSlabPool.take_in_frees``).

    Until the pool knows how big batches are (a worker's first batch), the slab is sized by the
    first tensor stacked, with room to spare for the batch's small leaves, and that tensor is
    stacked straight into it: without it the first batch would be stacked into fresh private
    memory (a page fault per page), and then copied into a new slab whose pages are all
    faulted in as well: nearly twice the time, paid by every worker's first batch of every
    pass. A batch with several large leaves may still not fit;
    encode_batch then moves it to a slab of the right size, as for any batch that outgrows
    its arena, and drops this one.
    """

    __slots__ = ("arena", "pool", "stacked")

    def __init__(self, pool: WorkerSlabPool) -> None:
        self.pool = pool
        self.arena: _Arena | None = None
        # The batch's leaves already stacked in its slab as its samples were fetched
        # (``_worker.stacking.fetch_stacking``): by the id of the first row, the rows (what
        # each sample now holds there) and the stacked tensor they are views of.
        self.stacked: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}

    def start(self, nbytes: int) -> _Arena | None:
        """The arena, its slab taken for ``nbytes`` on first use; None without shared memory
        (the collate then stacks as usual and the batch is sent by value)."""
        if self.arena is None:
            expected = self.pool.expected
            sized_by_this_tensor = expected < nbytes
            want = nbytes + max(_MIN_SLAB, nbytes // 16) if sized_by_this_tensor else expected
            try:
                slab = self.pool.acquire(want)
            except OSError:
                return None
            self.arena = _Arena(slab, made_for_batch=sized_by_this_tensor)
        return self.arena

    def stack(
        self,
        batch: list[torch.Tensor],
        *,
        collate_fn_map: dict[Any, Callable[..., Any]] | None = None,
    ) -> torch.Tensor:
        """torch's tensor collate, stacking straight into this arena's slab so each sample is
        copied once (NOTE [the arena of a collate]).

        torch's own ``collate_tensor_fn`` would, inside a worker, put every batch in a fresh
        shared memory segment; this is the step aioload replaces.
        """
        elem = batch[0]
        stacked = self.stacked
        if stacked:
            copied = stacked.pop(id(elem), None)
            if copied is not None:
                rows, whole = copied
                if len(batch) == len(rows) and all(map(operator.is_, batch, rows)):
                    return whole  # its samples were copied into it as they came
        if elem.is_nested or elem.layout != torch.strided:
            return _stack_privately(batch, collate_fn_map=collate_fn_map)
        nbytes = elem.numel() * len(batch) * elem.element_size()
        if (
            nbytes >= _ARENA_MIN_BYTES
            and elem.dtype in TORCH_DTYPES
            and elem.is_cpu
            and _stackable_alike(batch, elem.dtype)
        ):
            shape = (len(batch), *elem.shape)
            started = self.start(nbytes)
            offset = None if started is None else started.alloc(nbytes)
            if started is not None and offset is not None:
                out = started.view(offset, nbytes, elem.dtype).view(shape)
                return torch.stack(batch, 0, out=out)
        return torch.stack(batch, 0)


def settled_arena(arena: LazyArena | None) -> _Arena | None:
    """The arena a collate used, if it took a slab."""
    return None if arena is None else arena.arena


class WorkerSlabPool:
    """A worker's slabs: which are free, and how big the next batch probably is."""

    def __init__(self, max_idle: int) -> None:
        self.max_idle = max(1, max_idle)
        self.slabs: dict[int, _Slab] = {}
        self.free: list[int] = []
        self.dropped: list[int] = []
        # What the next batch probably needs: the largest of the last few (NOTE [slab size]).
        self.expected = 0
        self._recent: deque[int] = deque(maxlen=_RECENT_BATCHES)
        self._next_id = 0
        # Takes in the frees the parent has sent since the current task was read, from the
        # worker's socket, waiting up to the given seconds for one; set by a worker process
        # that reads its socket only between tasks. Called before a slab is made, so that one
        # freed a moment ago, or about to be, is reused instead.
        self.take_in_frees: Callable[[float], None] | None = None
        # How long this worker's last batch took to make (waits for a free left out): the
        # most it waits for a free, twice this (see _take_in_frees).
        self.batch_s = 0.0
        self.waited_s = 0.0
        self._waits_skipped = 0

    def acquire(self, min_bytes: int) -> _Slab:
        """The smallest free slab that holds ``min_bytes``, or a new one. Among slabs of one
        size, the one freed last: it is the likeliest to be still in the cache, and the
        others stay idle (a worker's batches are usually all one size, and with frees that
        arrive in bursts, taking the oldest would cycle through every slab)."""
        frees_taken_in = self.take_in_frees is None
        while True:
            best: int | None = None
            for pos, slab_id in enumerate(self.free):
                cap = self.slabs[slab_id].capacity
                if cap >= min_bytes and (
                    best is None or cap <= self.slabs[self.free[best]].capacity
                ):
                    best = pos
            if best is None:
                if frees_taken_in:
                    break
                frees_taken_in = True
                self._take_in_frees(min_bytes)
                continue
            slab = self.slabs[self.free.pop(best)]
            if not slab.referenced():
                return slab
            # Still viewed in this worker: retired, not reused. The parent is told (it unmaps
            # its side once its batches are gone); our mapping lives as long as the views do.
            self._destroy(slab.id)
        if len(self.free) >= self.max_idle:
            # Every free slab is too small for today's batches: retire the smallest.
            self.free.sort(key=lambda i: self.slabs[i].capacity)
            self._destroy(self.free.pop(0))
        capacity = _round_up(max(min_bytes, _MIN_SLAB), _PAGE)
        slab = _Slab(self._next_id, capacity)
        self._next_id += 1
        self.slabs[slab.id] = slab
        return slab

    def _take_in_frees(self, min_bytes: int) -> None:
        """Before a slab is made: read the frees the parent has sent, and wait a little for
        one if this worker already has two slabs of this size in use.

        Two slabs per worker are enough while the consumer drops each batch as it takes the
        next: one is the batch being made, the other the batch before it, held by the
        consumer or waiting its turn. The worker needs a third when it runs ahead of the
        others by more than a batch or so: the consumer still holds this worker's previous
        batch while it waits for another worker's, and this worker's next batch is already
        done. A third 9 MiB slab per worker is more resident memory than torch's loader
        needs, and a rotation that no longer fits in the cache, so every batch is written to
        memory cold. Waiting here costs nothing: this worker's batch would only wait its turn
        in the parent, and the free comes once the worker behind delivers. The wait also pulls
        the workers back in step, so that the next batches need no wait.

        A wait in vain (the consumer keeps batches: ``list(loader)``, a replay buffer) means
        slabs must be made; the next few are made without waiting."""
        assert self.take_in_frees is not None
        patience = 0.0
        if self._waits_skipped:
            self._waits_skipped -= 1
        elif min_bytes >= EAGER_FREE_BYTES:
            in_use = sum(1 for slab in self.slabs.values() if slab.capacity >= min_bytes)
            if in_use >= 2:
                # Long enough for the worker behind to finish the batch it is on, even when
                # it lost its core for a while (more processes than cores): one batch's time
                # was too short for such a worker, and the wait then in vain.
                patience = min(2 * self.batch_s + 0.001, _FREE_PATIENCE_MAX_S)
        if not patience:
            self.take_in_frees(0.0)
            return
        started = time.perf_counter()
        self.take_in_frees(patience)
        self.waited_s += time.perf_counter() - started
        if not any(self.slabs[i].capacity >= min_bytes for i in self.free):
            self._waits_skipped = _WAITS_SKIPPED_AFTER_IN_VAIN

    def batch_made(self, slab: _Slab, used: int) -> None:
        """A batch of ``used`` bytes was put in ``slab``: the next batches' size is guessed
        from it, and the slab fitted to it (NOTE [slab size])."""
        self._recent.append(used)
        self.expected = max(self._recent)
        slab.fit(used)

    def release(self, slab_id: int) -> None:
        # Idempotent: a slab listed twice in ``free`` could be handed to two live batches.
        if slab_id not in self.slabs or slab_id in self.free:
            return
        self.free.append(slab_id)
        while len(self.free) > self.max_idle:
            self._destroy(self.free.pop(0))

    def discard(self, slab_id: int) -> None:
        """Drop a slab that no batch holds, without keeping it idle (or one the parent could
        not map: ``FreeSlabs.forget``)."""
        if slab_id not in self.slabs:
            return
        if slab_id in self.free:
            self.free.remove(slab_id)
        self._destroy(slab_id)

    def _destroy(self, slab_id: int) -> None:
        slab = self.slabs.pop(slab_id)
        fd = slab.take_fd()
        if fd is not None:
            os.close(fd)
        self.dropped.append(slab_id)

    def take_dropped(self) -> list[int]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def arena(self) -> LazyArena:
        return LazyArena(self)


# NOTE [the arena of a collate]. aioload passes a batch's arena as an argument wherever it
# calls: ``WorkerStep.finish`` to the fetcher, the fetcher to ``_worker.stacking``. torch's
# collate cannot take one: it calls the tensor collate through its ``collate_fn_map``, with
# torch's own signature, from aioload's ``slab_collate`` and from any ``default_collate`` a
# user's ``collate_fn`` calls. So for the length of one collate, ``collating_into`` points the
# tensor entry of those two maps at the arena's ``stack``, and back at ``_stack_privately``
# after it: the arena is then found where torch's collate looks its functions up, and
# nowhere else. Only a worker process's main thread collates into slabs (thread workers and
# the calling process have no slabs), so nothing else sees the maps while they point there.


def _stack_privately(
    batch: list[torch.Tensor], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> torch.Tensor:
    """torch's tensor collate, as it stacks outside a worker: into private memory (see
    ``stack_tensors_privately``)."""
    elem = batch[0]
    if elem.is_nested or elem.layout != torch.strided:
        stacked: torch.Tensor = collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        return stacked  # (torch raises its own error for these first)
    return torch.stack(batch, 0)


def _stackable_alike(batch: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether every sample is a plain CPU tensor of ``dtype`` without grad, so that stacking
    into a buffer of that dtype gives what ``torch.stack`` would (it would promote mixed
    dtypes, and refuses ``out=`` for tensors that require grad)."""
    # A loop with early exits, identity tests (dtypes are singletons) and ``is_cpu`` rather
    # than comparing ``device`` objects (each access makes one): a third of the cost, which
    # is paid for every sample of every batch.
    plain = torch.Tensor
    for t in batch:
        if type(t) is not plain or t.dtype is not dtype or t.requires_grad or not t.is_cpu:
            return False
    return True


_SLAB_COLLATE_MAP: dict[Any, Callable[..., Any]] = {
    **default_collate_fn_map,
    torch.Tensor: _stack_privately,
}


def slab_collate(batch: Any) -> Any:
    """``default_collate`` with tensors stacked into the batch's slab, where it has one
    (``collating_into``), and privately elsewhere."""
    return collate(batch, collate_fn_map=_SLAB_COLLATE_MAP)


def collating_into(arena: LazyArena | None) -> None:
    """Point the tensor collate of ``slab_collate`` and of ``default_collate`` at ``arena``
    for the collate about to run; ``None`` afterwards (NOTE [the arena of a collate])."""
    stack = _stack_privately if arena is None else arena.stack
    _SLAB_COLLATE_MAP[torch.Tensor] = stack
    # A user's ``default_collate`` too, where this process is a worker whose map points at
    # aioload's (``stack_tensors_privately``); never where the map is the user's.
    current = default_collate_fn_map.get(torch.Tensor)
    if current is _stack_privately or getattr(current, "__func__", None) is LazyArena.stack:
        default_collate_fn_map[torch.Tensor] = stack


def collating_privately() -> LazyArena | None:
    """Point the tensor collate back at private memory for a collate whose batch is thrown
    away; returns the arena it pointed at, for ``collating_into`` afterwards."""
    arena: LazyArena | None = getattr(_SLAB_COLLATE_MAP[torch.Tensor], "__self__", None)
    collating_into(None)
    return arena


def stack_tensors_privately() -> None:
    """In a worker process: torch's ``default_collate``, wherever the user's code calls it,
    stacks tensors as it does outside workers (into the current slab where aioload collates).

    torch's ``collate_tensor_fn`` sees ``get_worker_info()`` (which aioload's workers set, as
    torch's do) and then stacks every batch into a fresh shared-memory segment, for torch's
    own queues to pass by descriptor. aioload sends batches in its slabs or by value, so that
    segment is waste: a ``shm_open``, ``ftruncate``, ``mmap`` and ``unlink`` and a page fault
    for every page of every batch, which aioload then copies again. It is also a leak: the
    segment's /dev/shm name lives between ``shm_open`` and ``unlink``, and a worker killed in
    between (a kill is something aioload heals from) leaves it there for good.

    A custom ``collate_fn`` that calls ``default_collate`` gets its tensors from
    ``default_collate_fn_map``, which this points at aioload's collate (the dict is looked up
    at each call), so they too are stacked straight into the batch's slab. Run only in
    processes that are aioload's workers: the parent's map is the user's."""
    default_collate_fn_map[torch.Tensor] = _stack_privately


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


# The weak references that watch live leases, kept here until their lease dies (a weak
# reference that is itself collected never calls back). Module-wide, as weakref.finalize's
# registry is: a lease outlives the mappings and the pool that made it.
# (By the reference's id: a weak reference hashes as its lease would, and a ctypes array
# cannot be hashed.)
_watching: dict[int, weakref.ref[Any]] = {}


def _on_death(lease: Any, on_release: Callable[[int], None], slab_id: int) -> None:
    """Call ``on_release(slab_id)`` once ``lease`` is gone. A weak reference with a callback,
    not ``weakref.finalize``: that is a dozen Python-level calls per batch (its registry, its
    info object, its atexit bookkeeping), paid by the parent for every batch it decodes, and
    the one thing it adds, a call at interpreter exit for leases still alive, only queues
    frees that nobody would send."""

    # (The registry is bound here, not looked up as a global when the lease dies: a lease
    # that lives until the interpreter's exit may die after this module's globals are gone.)
    def released(ref: weakref.ref[Any], watching: dict[int, weakref.ref[Any]] = _watching) -> None:
        watching.pop(id(ref), None)
        on_release(slab_id)

    ref = weakref.ref(lease, released)
    _watching[id(ref)] = ref


class SlabMappings:
    """The parent's mappings of one worker's slabs."""

    def __init__(self) -> None:
        self.maps: dict[int, ctypes.Array[ctypes.c_ubyte]] = {}

    def add(self, slab_id: int, fd: int, capacity: int) -> None:
        try:
            buf = _map_fd(fd, capacity, populate=False)
        finally:
            os.close(fd)
        self.maps[slab_id] = buf

    def drop(self, slab_ids: list[int]) -> None:
        # Dropping our reference unmaps the slab once no lease of it is alive any more.
        for slab_id in slab_ids:
            self.maps.pop(slab_id, None)

    def clear(self) -> None:
        self.maps.clear()

    def decode(
        self,
        slab_id: int,
        used: int,
        payload: bytes,
        descs: list[LeafDesc],
        on_release: Callable[[int], None],
    ) -> Any:
        if slab_id >= 0:
            # The lease is a ctypes array made for this batch over the used part of the slab,
            # and every leaf is made straight from it (torch.frombuffer, np.frombuffer), so
            # each holds the lease alive, and so does every view of a leaf: a tensor through
            # its storage's buffer export, a numpy array through its base (numpy collapses
            # view chains to the first object that is not an array, which is the lease). When
            # the last of them dies, the lease's finalizer sends the slab back to its worker.
            # Each tensor has a storage of its own bytes, as a batch from torch's loader has
            # (``torch.save`` of one leaf writes that leaf, not the batch), and no numpy or
            # torch array stands in between: fewer objects on the path the parent pays for
            # every batch.
            lease = (ctypes.c_ubyte * used).from_buffer(self.maps[slab_id])
            _on_death(lease, on_release, slab_id)
            leaves = [leaf_view(lease, desc) for desc in descs]
            del lease
        else:
            # Every array leaf is empty: nothing was put in a slab.
            leaves = [empty_leaf(desc) for desc in descs]
        return load_batch(payload, leaves)
