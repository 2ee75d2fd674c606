"""A worker's map-style batch, each large tensor of a sample copied into the batch's slab as
soon as the dataset returns it.

torch's worker fetches all of a batch's samples, then stacks them: a batch of 64 images of
150 KB is first 9 MiB of samples, each freshly allocated by the dataset, then 9 MiB of
batch. Both are written and then read from memory, since together (and with the other
worker's) they no longer fit in the cache. Copied into its row of the slab the moment it
arrives, a sample can be freed before the next one is fetched, and the next one is made in
the same, still-cached bytes: per batch, one sample's worth of temporary memory instead of
a batch's worth (docs/benchmark-notes.md, "Copying samples as they come").

What the collate makes of the batch does not change. Each sample keeps its structure, with
its large tensors replaced by their rows (views of the slab); ``default_collate`` then runs as
usual, and when it comes to stack a leaf whose samples are exactly those rows, in order, the
stacked tensor is already there (``_wire.slabs.LazyArena.stack`` takes it from the arena's
``stacked``). Only ``default_collate`` (aioload's slab collate) is done this
way; a user's ``collate_fn`` gets the samples as the dataset returned them. Under the
sample-error policy (``_worker.fetch.Fetcher._gather_stacking``) a skipped sample takes no row.

A sample's layout is learned from the batch's first one: a plain tensor or numpy array, or a
tuple, list or dict (exactly those types, as ``default_collate`` treats them) with such among
its items. An array's row is a tensor, as ``default_collate`` would have made of it. Only
leaves of at least ``_MIN_ROW_BYTES`` are copied at once: below that the copy costs more in
Python than the cache saves. Should a later sample differ (another type, shape, dtype, length
or keys), the batch goes on as before: the rest of its samples are fetched as they are,
nothing is taken as already stacked, the arrays copied so far are handed to the collate as
arrays again (views of their rows), and the collate does what it always did, raising torch's
own error where shapes differ. The rows already copied hold the same values as the samples
they replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from .._wire import slabs as _transport
from .._wire.leaves import TORCH_DTYPES

__all__ = ["fetch_stacking"]

# A tensor leaf is copied into its row as it arrives only from this size. The copy costs
# more per sample in Python (a check, a row, ``copy_``) than ``torch.stack``'s loop, and the
# cache it saves matters only for large samples: below this size the cost won or nothing
# was gained (the measurements: docs/benchmark-notes.md, "Copying samples as they come").
_MIN_ROW_BYTES = 128 << 10

_Tensor = torch.Tensor
_strided = torch.strided


def _plain(t: Any) -> bool:
    """Whether ``t`` is a tensor that ``torch.stack`` would stack into the slab."""
    return (
        type(t) is _Tensor
        and t.dtype in TORCH_DTYPES
        and t.layout is _strided
        and not t.is_nested
        and not t.requires_grad
        and t.is_cpu
    )


# numpy dtypes as torch.from_numpy makes them (None: it cannot), filled as they are met.
_TORCH_DTYPE_OF: dict[np.dtype[Any], torch.dtype | None] = {}


def _torch_dtype_of(dtype: np.dtype[Any]) -> torch.dtype | None:
    """The dtype ``torch.as_tensor`` gives an array of ``dtype``, if it can be stacked in a
    slab (not: objects, strings, another byte order)."""
    if dtype not in _TORCH_DTYPE_OF:
        try:
            made: torch.dtype | None = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        except (TypeError, ValueError, RuntimeError):
            made = None
        _TORCH_DTYPE_OF[dtype] = made if made in TORCH_DTYPES else None
    return _TORCH_DTYPE_OF[dtype]


class _Leaf:
    """One large tensor position of the samples (the sample itself, an index or a key), and
    the rows of the slab its samples are copied into."""

    __slots__ = ("dtype", "key", "region", "rows", "shape")

    def __init__(self, key: Any, first: torch.Tensor, region: torch.Tensor) -> None:
        self.key = key
        self.dtype = first.dtype
        self.shape: tuple[int, ...] = first.shape
        self.region = region
        self.rows = region.unbind(0)

    def take(self, value: Any, position: int) -> Any:
        """``value`` copied into row ``position``, and the row; ``_UNLIKE`` if it is not a
        tensor like the first sample's (nothing is copied then)."""
        # Whether ``value`` stacks under the rows made for the first sample (its dtype and
        # shape). Written out here, not called: this runs for every sample.
        if not (
            type(value) is _Tensor
            and value.dtype is self.dtype
            and value.layout is _strided
            and not value.is_nested
            and value.shape == self.shape
            and not value.requires_grad
            and value.is_cpu
        ):
            return _UNLIKE
        row = self.rows[position]
        row.copy_(value)
        return row

    def as_sampled(self, row: torch.Tensor) -> Any:
        """What a copied sample would have been, for a collate that cannot take the stacked
        leaf (the samples were unlike): the row, which is such a tensor."""
        return row


class _ArrayLeaf(_Leaf):
    """A numpy array position. Its rows are tensors: ``default_collate`` turns each array
    into a tensor (``torch.as_tensor``) and stacks those, so a sample holding the row gets
    the same batch."""

    __slots__ = ("np_dtype", "np_region")

    def __init__(self, key: Any, first: np.ndarray[Any, Any], region: torch.Tensor) -> None:
        self.key = key
        self.np_dtype = first.dtype
        self.shape = first.shape
        self.region = region
        self.rows = region.unbind(0)
        self.np_region = region.numpy()

    def take(self, value: Any, position: int) -> Any:
        if type(value) is not np.ndarray or value.dtype != self.np_dtype:
            return _UNLIKE
        if value.shape != self.shape:
            return _UNLIKE
        np.copyto(self.np_region[position], value, casting="no")
        return self.rows[position]

    def as_sampled(self, row: torch.Tensor) -> Any:
        # An array again (a view of the row): the collate then does with the samples what
        # it does with arrays, and gives torch's result or error.
        return row.numpy()


def _large(value: Any) -> Any:
    """The dtype to stack ``value`` in if it is a tensor or array large enough to copy as it
    comes, else None."""
    if type(value) is _Tensor:
        if _plain(value) and value.numel() * value.element_size() >= _MIN_ROW_BYTES:
            return value.dtype
    elif type(value) is np.ndarray and value.nbytes >= _MIN_ROW_BYTES:
        return _torch_dtype_of(value.dtype)
    return None


class _Layout:
    """What every sample of the batch must be, learned from the first: its type, its length
    (a tuple or list) or keys (a dict), and its large tensors and arrays."""

    __slots__ = ("arrays", "keys", "kind", "leaves", "length")

    def __init__(self, first: Any) -> None:
        self.kind = type(first)
        self.length = len(first) if self.kind is tuple or self.kind is list else 0
        # (A set, not ``first.keys()``: that view would keep the first sample alive.)
        self.keys = set(first) if self.kind is dict else None
        self.leaves: list[_Leaf] = []
        self.arrays = False

    def large_leaves(self, first: Any) -> list[tuple[Any, Any, torch.dtype]]:
        """The positions of ``first`` (``None`` for the sample itself) holding tensors or
        arrays large enough to copy as they come, with each one and the dtype of its rows;
        none for a type this module leaves alone."""
        items: list[tuple[Any, Any]]
        if self.kind is _Tensor or self.kind is np.ndarray:
            items = [(None, first)]
        elif self.kind is tuple or self.kind is list:
            items = list(enumerate(first))
        elif self.kind is dict:
            items = list(first.items())
        else:
            return []
        found = []
        for key, value in items:
            dtype = _large(value)
            if dtype is not None:
                found.append((key, value, dtype))
        return found

    def add(self, key: Any, first: Any, region: torch.Tensor) -> None:
        if type(first) is np.ndarray:
            self.leaves.append(_ArrayLeaf(key, first, region))
            self.arrays = True
        else:
            self.leaves.append(_Leaf(key, first, region))

    def copy_in(self, sample: Any, position: int) -> Any:
        """``sample`` with its large tensors and arrays copied into row ``position`` and
        replaced by those rows; ``_UNLIKE`` if it is not laid out as the first (the sample
        is unchanged then, though some of its leaves may have been copied)."""
        leaves = self.leaves
        kind = self.kind
        if kind is _Tensor or kind is np.ndarray:
            return leaves[0].take(sample, position)  # the sample is the leaf
        if type(sample) is not kind:
            return _UNLIKE
        if kind is dict:
            if sample.keys() != self.keys:
                return _UNLIKE
        elif len(sample) != self.length:
            return _UNLIKE
        parts = dict(sample) if kind is dict else list(sample)
        for leaf in leaves:
            row = leaf.take(sample[leaf.key], position)
            if row is _UNLIKE:
                return _UNLIKE
            parts[leaf.key] = row
        return tuple(parts) if kind is tuple else parts

    def as_sampled(self, copied: Any) -> Any:
        """A sample ``copy_in`` made, as the collate must see it when the batch's samples
        turned out unlike (``_Leaf.as_sampled``)."""
        if not self.arrays:
            return copied
        leaves = self.leaves
        if self.kind is np.ndarray:
            return leaves[0].as_sampled(copied)
        parts = dict(copied) if self.kind is dict else list(copied)
        for leaf in leaves:
            parts[leaf.key] = leaf.as_sampled(parts[leaf.key])
        return tuple(parts) if self.kind is tuple else parts


_UNLIKE: Any = object()
_END: Any = object()


def fetch_stacking(
    fetch: Callable[[Any], Any],
    indices: Any,
    arena: _transport.LazyArena,
    passed_over: type | None = None,
) -> list[Any]:
    """The samples named by ``indices`` (each fetched with ``fetch``), their large tensors
    copied into the slab of ``arena`` as they come (see the module's notes).

    ``fetch`` may return an instance of ``passed_over`` in a sample's place (the sample-error
    policy's mark of a skipped sample): it is kept in its place and takes no row, and the
    collate, which is given the other samples, finds the rows of those only."""
    try:
        count = len(indices)
    except TypeError:
        count = 0
    remaining = iter(indices)
    if count < 2:
        return [fetch(index) for index in remaining]
    first = fetch(next(remaining))
    if type(first) is passed_over or (
        # (A sparse tensor has no nbytes: it is left to the collate, which says what it needs.)
        type(first) is _Tensor and first.layout is _strided and first.nbytes < _MIN_ROW_BYTES
    ):
        # (A small tensor, the commonest sample, has nothing to copy as it comes: told
        # before any layout is made for it.)
        return [first, *[fetch(index) for index in remaining]]
    layout = _Layout(first)
    for key, leaf, dtype in layout.large_leaves(first):
        nbytes = leaf.nbytes if type(leaf) is np.ndarray else leaf.numel() * leaf.element_size()
        nbytes *= count
        started = arena.start(nbytes)
        offset = None if started is None else started.alloc(nbytes)
        if started is None or offset is None:
            break  # no room (or no shared memory): this leaf and the rest are stacked later
        region = started.view(offset, nbytes, dtype).view((count, *leaf.shape))
        layout.add(key, leaf, region)
    if not layout.leaves:
        # (A list, not a generator, after the first: a generator costs more per sample.)
        return [first, *[fetch(index) for index in remaining]]
    samples: list[Any] = []
    sample = first
    del first, leaf  # only ``sample`` holds the sample now: it is freed as the next comes
    position = 0  # the next row
    # A sample that is its one leaf (a tensor or an array, the commonest) goes straight to
    # that leaf's ``take``, which is what ``copy_in`` would call: one call less per sample.
    kind = layout.kind
    copy_in = layout.leaves[0].take if kind is _Tensor or kind is np.ndarray else layout.copy_in
    while True:
        if type(sample) is passed_over:
            samples.append(sample)
        else:
            copied = copy_in(sample, position)
            if copied is _UNLIKE:
                # Not laid out as the first: the rest as they come, stacked as usual.
                return _as_sampled(layout, samples, passed_over, sample, fetch, remaining)
            samples.append(copied)
            position += 1
        # Let go of the sample before the next is made, so that it can be made in its memory.
        sample = None
        index = next(remaining, _END)
        if index is _END:
            break
        sample = fetch(index)
        if len(samples) == count:
            # More indices than len() said: the rest as they come, stacked as usual.
            return _as_sampled(layout, samples, passed_over, sample, fetch, remaining)
    if len(samples) == count:
        # Rows past ``position`` (samples passed over) are not part of the stacked leaf.
        for leaf in layout.leaves:
            rows = leaf.rows[:position]
            arena.stacked[id(rows[0])] = (rows, leaf.region[:position])
    return samples


def _as_sampled(
    layout: _Layout,
    copied: list[Any],
    passed_over: type | None,
    sample: Any,
    fetch: Callable[[Any], Any],
    remaining: Iterator[Any],
) -> list[Any]:
    """The batch's samples when not all are laid out as the first: those copied so far, as
    the collate must see them (``_Layout.as_sampled``), ``sample``, and the rest as they come,
    to be stacked as usual."""
    samples = [s if type(s) is passed_over else layout.as_sampled(s) for s in copied]
    samples.append(sample)
    samples += [fetch(index) for index in remaining]
    return samples
