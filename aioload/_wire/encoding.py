"""A worker's batch encoded for the parent: its array leaves in a slab, the rest pickled.

Leaves that the collate already stacked into the batch's arena (``_wire.slabs``) stay where
they are; others are copied once. If the arena's slab is too small, every leaf moves to a
bigger slab and the pool remembers the size for the next batch, so the steady state copies
each sample once.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from .leaves import LeafDesc, collect_leaves, dense_strides
from .slabs import ALIGN, WorkerSlabPool, _Arena, _round_up, _Slab

__all__ = ["EncodedBatch", "encode_batch"]

# (leaf, its shape, bytes, whether it is in the arena already, strides or None)
_Prepared = tuple[Any, tuple[int, ...], int, bool, tuple[int, ...] | None]


class EncodedBatch:
    """What crosses the pipe for one batch (the array bytes are already in the slab)."""

    __slots__ = ("leaves", "new_slab", "payload", "slab", "used")

    def __init__(self) -> None:
        self.payload = b""
        self.leaves: list[LeafDesc] = []
        self.slab: _Slab | None = None
        self.new_slab = False
        self.used = 0


def encode_batch(batch: Any, pool: WorkerSlabPool, arena: _Arena | None) -> EncodedBatch:
    """Move the array leaves of ``batch`` into a slab and pickle the rest (see the module's
    notes)."""
    encoded = EncodedBatch()
    encoded.payload, leaves = collect_leaves(batch)
    prepared, total, extra = _prepare(leaves, arena)

    if total == 0:
        if arena is not None:
            pool.release(arena.slab.id)
        encoded.leaves = [
            _describe(leaf, shape, 0, strides) for leaf, shape, _, _, strides in prepared
        ]
        return encoded

    if arena is not None and _round_up(arena.used, ALIGN) + extra <= arena.slab.capacity:
        target = arena
    else:
        # Acquire first: if that fails (no shared memory), the caller still owns the arena's
        # slab and releases it exactly once.
        target = _Arena(pool.acquire(total))
        if arena is not None and arena.made_for_batch:
            pool.discard(arena.slab.id)  # too small for this pool's batches: not kept idle
        elif arena is not None:
            pool.release(arena.slab.id)
        if extra != total:  # some leaves were in the arena: they move too
            prepared = [
                (leaf, shape, nbytes, False, strides)
                for leaf, shape, nbytes, _, strides in prepared
            ]

    _place(prepared, target, encoded.leaves)
    slab = target.slab
    pool.batch_made(slab, target.used)
    encoded.slab = slab
    encoded.used = target.used
    encoded.new_slab = slab.fd is not None
    return encoded


def _prepare(leaves: list[Any], arena: _Arena | None) -> tuple[list[_Prepared], int, int]:
    """Each leaf as it will be copied (contiguous, or with the strides of a dense layout),
    whether it is in ``arena`` already, and the bytes of all leaves and of those that are
    not, each rounded up to ``ALIGN``."""
    prepared: list[_Prepared] = []
    extra = 0
    total = 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.is_conj() or leaf.is_neg():
                leaf = leaf.resolve_conj().resolve_neg()
            shape: tuple[int, ...] = tuple(leaf.shape)
            if leaf.is_contiguous():
                strides: tuple[int, ...] | None = None
            elif dense_strides(shape, tuple(leaf.stride())):
                strides = tuple(leaf.stride())
            else:
                leaf = leaf.contiguous()
                strides = None
            nbytes = leaf.nbytes
            in_arena = arena is not None and strides is None and nbytes > 0 and arena.holds(leaf)
        else:
            shape = leaf.shape
            if leaf.flags.c_contiguous:
                strides = None
            elif (
                leaf.itemsize
                and all(s % leaf.itemsize == 0 for s in leaf.strides)
                and dense_strides(shape, tuple(s // leaf.itemsize for s in leaf.strides))
            ):
                strides = tuple(leaf.strides)
            else:
                leaf = np.ascontiguousarray(leaf)
                strides = None
            nbytes = leaf.nbytes
            in_arena = False
        prepared.append((leaf, shape, nbytes, in_arena, strides))
        rounded = _round_up(nbytes, ALIGN)
        total += rounded
        if not in_arena:
            extra += rounded
    return prepared, total, extra


def _place(prepared: list[_Prepared], target: _Arena, described: list[LeafDesc]) -> None:
    """Copy into ``target`` each leaf not in it already, and describe every leaf."""
    slab = target.slab
    for leaf, shape, nbytes, in_arena, strides in prepared:
        if in_arena:
            offset = leaf.data_ptr() - slab.ptr
        else:
            got = target.alloc(nbytes)
            assert got is not None, "slab sized for the batch ran out of room"
            offset = got
            if nbytes and strides is None and isinstance(leaf, torch.Tensor):
                # A contiguous tensor (made one above): one memmove, where views of the slab
                # and copy_ would make three tensors first. Bytes are bytes: the dtype is the
                # same.
                ctypes.memmove(slab.ptr + offset, leaf.data_ptr(), nbytes)
            else:
                _copy_into(target, offset, nbytes, leaf, strides)
        described.append(_describe(leaf, shape, offset, strides))


def _describe(
    leaf: Any, shape: tuple[int, ...], offset: int, strides: tuple[int, ...] | None
) -> LeafDesc:
    return ("t" if isinstance(leaf, torch.Tensor) else "n", offset, leaf.dtype, shape, strides)


def _copy_into(
    arena: _Arena, offset: int, nbytes: int, leaf: Any, strides: tuple[int, ...] | None
) -> None:
    if nbytes == 0:
        return
    raw = arena.slab.tensor[offset : offset + nbytes]
    if isinstance(leaf, torch.Tensor):
        dst = raw.view(leaf.dtype)
        dst = dst.as_strided(leaf.shape, strides) if strides is not None else dst.view(leaf.shape)
        dst.copy_(leaf)
    else:
        flat = raw.numpy().view(leaf.dtype)
        if strides is not None:
            dst_np = np.lib.stride_tricks.as_strided(flat, leaf.shape, strides)
        else:
            dst_np = flat.reshape(leaf.shape)
        np.copyto(dst_np, leaf, casting="no")
