"""The answer most batches get, packed with ``struct`` instead of pickled.

A worker answers every task with a :class:`~aioload._wire.messages.Reply`, and for a batch of plain
tensors (what ``default_collate`` makes of tensor samples, a tuple of them, a dict of them)
that reply is always the same shape: a :class:`~aioload._wire.messages.SlabBatch` whose leaves are
contiguous tensors in the slab. The parent reads one per batch, and unpickling it was about a
seventh of the parent's CPU per batch on the ``tiny`` workload (py-spy: ``load_frame`` and the
class lookups it makes, ``Reply``, ``SlabBatch`` and a ``torch.dtype`` by name). Unpacking the
same fields with one ``struct`` call and building the named tuples directly takes about half
as long, and less of the code a cold cache must fetch after each wake-up
(docs/benchmark-notes.md, "The wire's small costs").

Anything else (a numpy leaf, a strided leaf, a dtype not in ``_DTYPES``, a stream position,
slabs the worker dropped, any other result) is pickled as before: the packed form is an
optimisation of one common message, never a second protocol to keep in step. A pickle frame
starts with pickle's ``PROTO`` opcode (``0x80``), a packed one with ``MARKER``.

The other way, every batch costs the parent a :class:`~aioload._wire.messages.Task`, and a batch of
a megabyte or more a :class:`~aioload._wire.messages.FreeSlabs` when the consumer drops it. A task's
indices can be anything a sampler yields (ints, numpy ints, keys of any kind), so they stay
pickled, but as a plain tuple of the task's fields after ``TASK_MARKER``: pickling the named
tuple itself adds a reference to its class (written by the parent, looked up by the worker) and
a call of its ``__getnewargs__`` to both ends' work. A sequential sampler's batch is an
:class:`~aioload._wire.messages.IndexRange`: its task is integers only, ``RANGE_TASK_MARKER`` and one
``struct``. Slab ids are ints: ``FREE_MARKER`` and a ``struct`` array of them.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import torch

from .messages import FreeSlabs, IndexRange, Reply, SlabBatch, Task

MARKER = 0x01
TASK_MARKER = 0x02
FREE_MARKER = 0x03
RANGE_TASK_MARKER = 0x04
_TASK_MARKER_BYTE = bytes([TASK_MARKER])
_FREE_MARKER_BYTE = bytes([FREE_MARKER])

# marker, task_id, generation, the IndexRange's start and stop; then the freed slab ids
_RANGE_TASK = struct.Struct("<Bqqqq")

# marker, task_id, generation, slab_id, capacity, used, busy_s, leaf count, payload bytes
_HEAD = struct.Struct("<BqqqqqdHI")
# a leaf's offset in the slab, dtype (index in _DTYPES), number of dimensions; then its shape
_LEAF = struct.Struct("<qBB")

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODES: dict[torch.dtype, int] = {dtype: code for code, dtype in enumerate(_DTYPES)}
_MAX_DIMS = 255
_MAX_LEAVES = 0xFFFF  # the head's leaf count is an unsigned short


# _LEAF and a shape of each number of dimensions, as one struct: made once per number.
_LEAF_WITH_SHAPE: dict[int, struct.Struct] = {}


def _leaf_struct(ndim: int) -> struct.Struct:
    found = _LEAF_WITH_SHAPE.get(ndim)
    if found is None:
        found = _LEAF_WITH_SHAPE[ndim] = struct.Struct(f"{_LEAF.format}{ndim}q")
    return found


def pack_reply(message: Any) -> bytes | None:
    """``message`` packed, or None when it is not a reply this form carries (it is pickled)."""
    if type(message) is not Reply:
        return None
    result = message.result
    if type(result) is not SlabBatch or message.stream is not None or message.dropped_slabs:
        return None
    leaves = result.leaves
    if len(leaves) > _MAX_LEAVES:
        return None
    parts: list[bytes] = [b"", result.payload]
    for kind, offset, dtype, shape, strides in leaves:
        code = _DTYPE_CODES.get(dtype)
        ndim = len(shape)
        if kind != "t" or strides is not None or code is None or ndim > _MAX_DIMS:
            return None
        parts.append(_leaf_struct(ndim).pack(offset, code, ndim, *shape))
    parts[0] = _HEAD.pack(
        MARKER,
        message.task_id,
        message.generation,
        result.slab_id,
        result.capacity,
        result.used,
        message.busy_s,
        len(leaves),
        len(result.payload),
    )
    return b"".join(parts)


def unpack_reply(frame: memoryview) -> Reply:
    """The :class:`Reply` that :func:`pack_reply` packed into ``frame``."""
    _, task_id, generation, slab_id, capacity, used, busy_s, n_leaves, n_payload = (
        _HEAD.unpack_from(frame)
    )
    pos = _HEAD.size + n_payload
    payload = bytes(frame[_HEAD.size : pos])
    leaves = []
    for _ in range(n_leaves):
        offset, code, ndim = _LEAF.unpack_from(frame, pos)
        pos += _LEAF.size
        shape: tuple[int, ...] = struct.unpack_from(f"<{ndim}q", frame, pos) if ndim else ()
        pos += 8 * ndim
        leaves.append(("t", offset, _DTYPES[code], shape, None))
    return Reply(
        task_id,
        generation,
        SlabBatch(slab_id, capacity, used, payload, leaves),
        None,
        busy_s,
        [],
    )


def pack_to_worker(message: Any) -> bytes | None:
    """A :class:`Task` as ``TASK_MARKER`` and the pickled tuple of its fields (one whose
    indices are an :class:`~aioload._wire.messages.IndexRange` as ``RANGE_TASK_MARKER`` and its fields
    as integers), a :class:`FreeSlabs` as ``FREE_MARKER`` and its slab ids; None for any other
    message (it is pickled)."""
    kind = type(message)
    if kind is Task:
        indices = message.indices
        if type(indices) is IndexRange:
            freed = message.freed_slabs
            return _RANGE_TASK.pack(
                RANGE_TASK_MARKER, message.task_id, message.generation, indices.start, indices.stop
            ) + (struct.pack(f"<{len(freed)}q", *freed) if freed else b"")
        # (Slicing a named tuple gives a plain tuple of its fields.)
        return _TASK_MARKER_BYTE + pickle.dumps(message[:], protocol=pickle.HIGHEST_PROTOCOL)
    if kind is FreeSlabs and not message.forget:
        ids = message.slab_ids
        return _FREE_MARKER_BYTE + struct.pack(f"<{len(ids)}q", *ids)
    return None


def unpack_to_worker(frame: memoryview) -> Task | FreeSlabs:
    """The message that :func:`pack_to_worker` packed into ``frame``."""
    marker = frame[0]
    if marker == RANGE_TASK_MARKER:
        _, task_id, generation, start, stop = _RANGE_TASK.unpack_from(frame)
        n_freed = (len(frame) - _RANGE_TASK.size) // 8
        return Task(
            task_id,
            generation,
            IndexRange(start, stop),
            struct.unpack_from(f"<{n_freed}q", frame, _RANGE_TASK.size) if n_freed else (),
        )
    with frame[1:] as body:
        if marker == TASK_MARKER:
            return Task._make(pickle.loads(body))
        return FreeSlabs(list(struct.unpack(f"<{len(body) // 8}q", body)))
