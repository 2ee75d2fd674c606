"""A batch as a pickle with its array leaves taken out, and those leaves as they cross.

A batch travels as a pickle whose array leaves (tensors, numpy arrays) are replaced by
persistent ids pointing into its slab (``_wire.slabs``). Everything else in the batch is
pickled as usual, so any structure that pickles still works; only its arrays go faster. This
module says which leaves travel in a slab (``slab_tensor``), takes them out of a batch
(``collect_leaves``), describes each (``LeafDesc``), and makes the parent's view of each
(``leaf_view``) and the batch around them (``load_batch``). For when no shared memory can be
had, ``dumps_by_value`` pickles a batch whole.
"""

from __future__ import annotations

import ctypes
import io
import math
import pickle
from typing import Any, cast

import numpy as np
import torch

from .channel import CachedUnpickler

__all__ = [
    "LONE_LEAF_PAYLOAD",
    "TORCH_DTYPES",
    "LeafDesc",
    "collect_leaves",
    "dense_strides",
    "dumps_by_value",
    "empty_leaf",
    "leaf_view",
    "load_batch",
    "slab_tensor",
]

# Array dtypes that can be reinterpreted from raw bytes. Anything else is pickled.
TORCH_DTYPES: frozenset[torch.dtype] = frozenset(
    d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex32,
        torch.complex64,
        torch.complex128,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None),
        getattr(torch, "float8_e5m2fnuz", None),
        getattr(torch, "float8_e8m0fnu", None),
    )
    if d is not None
)

_STRIDED = torch.strided

# ("t", offset, dtype, shape, strides-or-None) for tensors; ("n", ...) for numpy arrays.
LeafDesc = tuple[str, int, Any, tuple[int, ...], tuple[int, ...] | None]


def slab_tensor(obj: torch.Tensor) -> bool:
    """Whether a plain tensor travels in the slab (else it is pickled with the batch)."""
    # (``is_cpu`` and an identity test: ``obj.device`` would make a device object, and layouts
    # are singletons. This runs for every leaf of every batch.)
    return bool(
        obj.is_cpu
        and obj.layout is _STRIDED
        and obj.dtype in TORCH_DTYPES
        and not obj.requires_grad
        and not obj.is_quantized
        and not obj.is_nested
    )


class _LeafCollector(pickle.Pickler):
    """Pickles a batch with its array leaves taken out (they go into the slab)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.leaves: list[torch.Tensor | np.ndarray[Any, Any]] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor:
            if not slab_tensor(obj):
                return None
        elif kind is np.ndarray:
            if obj.dtype.hasobject:
                return None
        else:
            return None
        key = id(obj)
        index = self._seen.get(key)
        if index is None:
            index = self._seen[key] = len(self.leaves)
            self.leaves.append(obj)
        return index


def collect_leaves(batch: Any) -> tuple[bytes, list[torch.Tensor | np.ndarray[Any, Any]]]:
    """The batch pickled with its array leaves taken out, and those leaves."""
    if type(batch) is torch.Tensor and slab_tensor(batch):
        # A lone tensor (what default_collate makes of tensor samples): its pickle is always
        # the same few bytes, so no pickler is made for it.
        return LONE_LEAF_PAYLOAD, [batch]
    buf = io.BytesIO()
    pickler = _LeafCollector(buf)
    pickler.dump(batch)
    return buf.getvalue(), pickler.leaves


def _lone_leaf_payload() -> bytes:
    buf = io.BytesIO()
    _LeafCollector(buf).dump(torch.empty(0))
    return buf.getvalue()


# What _LeafCollector makes of any batch that is one slab tensor: a reference to leaf 0.
LONE_LEAF_PAYLOAD = _lone_leaf_payload()


def dense_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a strided layout covers exactly numel elements with no gaps or overlaps (any
    permutation of a contiguous layout, e.g. channels_last)."""
    dims = sorted((st, sz) for st, sz in zip(strides, shape, strict=True) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


class _ByValuePickler(pickle.Pickler):
    """Pickles a batch whole, for when no shared memory can be had. torch's own tensor pickling
    cannot load some dtypes the slabs carry (complex32, float8, uint16/32/64), so those tensors
    travel as raw bytes; everything else pickles as usual."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and obj.dtype in TORCH_DTYPES
            and not obj.requires_grad
        ):
            flat = obj.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
            return _tensor_from_bytes, (flat.numpy().tobytes(), obj.dtype, tuple(obj.shape))
        return NotImplemented


def dumps_by_value(batch: Any) -> bytes:
    buf = io.BytesIO()
    _ByValuePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(batch)
    return buf.getvalue()


class _LeafLoader(CachedUnpickler):
    def __init__(self, file: io.BytesIO, leaves: list[Any]) -> None:
        super().__init__(file)
        self.leaves = leaves

    def persistent_load(self, pid: Any) -> Any:
        return self.leaves[pid]


def leaf_view(lease: ctypes.Array[ctypes.c_ubyte], desc: LeafDesc) -> Any:
    """One array leaf of a batch: a view of ``lease`` (an empty leaf needs no memory)."""
    kind, offset, dtype, shape, strides = desc
    count = math.prod(shape)  # (1 for a 0-d leaf's empty shape)
    if count == 0:
        return empty_leaf(desc)
    if kind == "t":
        flat = torch.frombuffer(lease, dtype=dtype, count=count, offset=offset)
        if strides is not None:
            return flat.as_strided(shape, strides)
        # (A 1-d leaf is already in shape; a view costs more than the frombuffer.)
        return flat if len(shape) == 1 else flat.view(shape)
    flat_np = np.frombuffer(cast(Any, lease), dtype=dtype, count=count, offset=offset)
    if strides is not None:
        return np.lib.stride_tricks.as_strided(flat_np, shape, strides)
    return flat_np.reshape(shape)


def empty_leaf(desc: LeafDesc) -> Any:
    kind, _offset, dtype, shape, _strides = desc
    return torch.empty(shape, dtype=dtype) if kind == "t" else np.empty(shape, dtype=dtype)


def load_batch(payload: bytes, leaves: list[Any]) -> Any:
    """The batch pickled as ``payload``, with ``leaves`` (the parent's views) in place."""
    if payload == LONE_LEAF_PAYLOAD:
        # The batch is its one tensor (what default_collate makes of tensor samples).
        return leaves[0]
    return _LeafLoader(io.BytesIO(payload), leaves).load()
