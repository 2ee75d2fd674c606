"""The shared-memory slab transport (aioload/_transport.py), end to end and in-process.

End-to-end tests run a real ``aioload.DataLoader`` with worker processes and compare what
arrives, bit for bit, with values the test computes again in the parent. In-process tests drive
``encode_batch`` / ``SlabMappings.decode`` directly, as the worker and the parent do.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import gc
import io
import math
import os
import pickle
import struct
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import default_collate

import aioload
from aioload._wire import encoding as _encoding
from aioload._wire import leaves as _leaves
from aioload._wire import slabs as _transport
from aioload._wire.messages import PickledBatch, Produced, SlabBatch, Task
from aioload._worker import main as _worker_main
from tests.leaks import ProcessTree, shm_entries, shm_leaks
from tests.scripts.datasets import FnDataset

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
    pytest.mark.filterwarnings("ignore:TypedStorage is deprecated"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor"),
]

NUM_WORKERS = 2
PREFETCH = 2
DTYPES = sorted(_leaves.TORCH_DTYPES, key=str)


def _pickles(dtype: torch.dtype) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pickle.loads(pickle.dumps(torch.zeros(2, dtype=dtype)))
        except Exception:
            return False
    return True


# What plain pickle (the fallback when there is no shared memory) can carry. torch's own pickle
# cannot load tensors of some dtypes the slab carries (float8, complex32, uint16-64 in torch 2.x).
PICKLABLE_DTYPES = [d for d in DTYPES if _pickles(d)]
UNPICKLABLE_DTYPES = [d for d in DTYPES if not _pickles(d)]

Point = collections.namedtuple("Point", ["x", "y"])


class Box:
    """A custom object: it is pickled, and the tensors inside it still go through the slab."""

    def __init__(self, tensor: torch.Tensor, array: np.ndarray[Any, Any], name: str) -> None:
        self.tensor = tensor
        self.array = array
        self.name = name


def _identity(x: Any) -> Any:
    return x


def _first(x: list[Any]) -> Any:
    return x[0]


# --------------------------------------------------------------------------------------------
# Deterministic samples (the parent recomputes them to get the expected values)
# --------------------------------------------------------------------------------------------


def _rand(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs and all), so the comparison is truly bitwise."""
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _numpy_leaves(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    structured = np.dtype([("a", "<i4"), ("b", "<f8"), ("c", "S3")])
    return {
        "bool": rng.integers(0, 2, (3, 4)).astype(np.bool_),
        "float16": rng.standard_normal(5).astype(np.float16),
        "float32": rng.standard_normal((2, 3)).astype(np.float32),
        "int8": rng.integers(-128, 128, 7).astype(np.int8),
        "uint64": rng.integers(0, 2**63, 4, dtype=np.uint64),
        "complex64": (rng.standard_normal(4) + 1j * rng.standard_normal(4)).astype(np.complex64),
        "complex128": rng.standard_normal(3) + 1j * rng.standard_normal(3),
        "big_endian": np.arange(i, i + 6, dtype=">i4"),
        "structured": np.array([(1, 2.5, b"ab"), (i, -1.0, b"xyz")], dtype=structured),
        "unicode": np.array(["ab", "cd\u00e9", "", f"w{i}"], dtype="<U4"),
        "datetime": np.array(["2024-01-01", "1970-01-01T00:00:01"], dtype="datetime64[ns]"),
        "fortran": np.asfortranarray(rng.standard_normal((3, 4)).astype(np.float32)),
        "stepped": rng.standard_normal((6, 6))[::2, 1::3],
        "reversed": np.arange(10.0 + i)[::-1],
        "broadcast": np.broadcast_to(np.arange(3), (4, 3)),
        "empty": np.empty((0, 3), dtype=np.int16),
        "zero_d": np.array(i, dtype=np.int64),
        "zero_d_float": np.array(3.5 + i),
    }


def full_sample(i: int, dtypes: list[torch.dtype] = DTYPES) -> dict[str, Any]:
    """Every leaf type and layout the transport has to handle, nested."""
    g = torch.Generator().manual_seed(1000 + i)
    shared = torch.arange(6.0) + i
    base = _rand(torch.int32, (8,), g)
    return {
        "tensors": {str(d): _rand(d, (3, 4), g) for d in dtypes},
        "zero_dim": {str(d): _rand(d, (), g) for d in dtypes},
        "empty": {str(d): _rand(d, (0, 3), g) for d in dtypes},
        "transposed": {str(d): _rand(d, (4, 3), g).t() for d in dtypes},
        "stepped": {str(d): _rand(d, (6, 5), g)[::2, 1::2] for d in dtypes},
        "expanded": (torch.arange(3.0) + i).expand(4, 3),
        "offset": _rand(torch.float32, (10,), g)[3:7],
        "channels_last": _rand(torch.float32, (2, 3, 4, 5), g).contiguous(
            memory_format=torch.channels_last
        ),
        "conj": _rand(torch.complex64, (3, 4), g).conj(),
        "conj_transposed": _rand(torch.complex128, (3, 4), g).t().conj(),
        "neg": torch._neg_view(torch.randn(5, generator=g, dtype=torch.float64)),
        # 100 to 300 KB, so that slabs of several sizes are made and reused.
        "big": _rand(torch.float32, (1000 * (1 + i % 3), 25), g),
        "numpy": _numpy_leaves(i),
        "np_scalars": [np.float32(1.5 + i), np.int64(i), np.bool_(i % 2 == 0)],
        "python": ["str", i, -1.5, float("nan"), None, b"\x00bytes", True, 2**70, 1 + 2j],
        "point": Point(torch.tensor([i, i + 1]), (np.arange(3) * i, "label")),
        "nested": (1, (2, [3, {"deep": torch.full((2,), float(i)), "list": [[], ()]}])),
        "objects": np.array([1, "a", None, torch.tensor([i])], dtype=object),
        "grad": torch.randn(3, generator=g).requires_grad_(),
        "param": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "sparse": torch.sparse_coo_tensor([[0, 2], [1, 0]], [float(i), 2.0], (3, 3)),
        "sparse_csr": torch.tensor([[0.0, i], [3.0, 0.0]]).to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.randn(4, generator=g), 0.1, 10, torch.quint8),
        "box": Box(torch.randn(3, 2, generator=g), np.arange(4) + i, f"box{i}"),
        "dup": [shared, shared, {"again": shared}],
        "views": [base, base[2:], base[::3]],
    }


def small_sample(i: int) -> dict[str, Any]:
    """A sample that default_collate accepts, with a value that identifies the index."""
    return {
        "img": torch.arange(3 * 16 * 16, dtype=torch.float32).reshape(3, 16, 16) + 1000 * i,
        "label": i,
        "pair": (torch.tensor([i, -i]), np.full(4, i, dtype=np.int16)),
    }


def collatable_sample(i: int, dtypes: list[torch.dtype] = DTYPES) -> dict[str, Any]:
    """Every dtype and layout, in a form default_collate accepts."""
    g = torch.Generator().manual_seed(2000 + i)
    rng = np.random.default_rng(i)
    return {
        "tensors": {str(d): _rand(d, (3,), g) for d in dtypes},
        "zero_dim": {str(d): _rand(d, (), g) for d in dtypes},
        "empty": torch.empty(0, 4),
        "transposed": _rand(torch.float64, (4, 3), g).t(),
        "stepped": _rand(torch.int16, (6, 5), g)[::2, ::2],
        "channels_last": _rand(torch.float32, (3, 4, 5), g)
        .unsqueeze(0)
        .contiguous(memory_format=torch.channels_last)[0],
        "conj": _rand(torch.complex64, (2, 3), g).conj(),
        "numpy": {
            "bool": rng.integers(0, 2, 3).astype(np.bool_),
            "float16": rng.standard_normal(4).astype(np.float16),
            "complex": rng.standard_normal(2) + 1j,
            "fortran": np.asfortranarray(rng.standard_normal((2, 3))),
        },
        "np_scalar": np.float64(i / 3),
        "label": i,
        "weight": i / 7,
        "name": f"s{i}",
        "point": Point(torch.tensor([i]), [torch.ones(2) * i, i]),
    }


# --------------------------------------------------------------------------------------------
# Comparison helpers
# --------------------------------------------------------------------------------------------


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor's values, in row-major order."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: Any, want: Any, path: str = "batch") -> None:
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: {got.shape} != {want.shape}"
        assert got.layout == want.layout, path
        assert got.requires_grad == want.requires_grad, path
        if want.is_quantized:
            assert (got.q_scale(), got.q_zero_point()) == (want.q_scale(), want.q_zero_point())
            got, want = got.int_repr(), want.int_repr()
        elif want.layout != torch.strided:
            got, want = got.to_dense(), want.to_dense()
        assert torch.equal(_raw(got), _raw(want)), f"{path}: values differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{path}: {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: {got.shape} != {want.shape}"
        if want.dtype.hasobject:
            for k, (a, b) in enumerate(zip(got.ravel(), want.ravel(), strict=True)):
                assert_same(a, b, f"{path}[{k}]")
        else:
            assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), (
                f"{path}: values differ"
            )
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys differ"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), f"{path}: length differs"
        for k, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}[{k}]")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got} != {want}"
    elif isinstance(want, Box):
        assert_same(vars(got), vars(want), f"{path}.__dict__")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def leaves(obj: Any) -> Iterator[Any]:
    """The tensors and numpy arrays of a nested batch (not inside custom objects)."""
    if isinstance(obj, torch.Tensor | np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from leaves(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from leaves(v)


def storage_ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def assert_one_lease(tensors: list[Any]) -> int:
    """The leaves of one batch lie in one slab mapping, next to each other (a lease of at most
    a few hundred bytes of alignment per leaf beyond their sizes), and each tensor's storage
    is its own bytes, not the whole lease. Returns where the lease starts."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    assert tensors
    spans = []
    for t in tensors:
        nbytes = t.untyped_storage().nbytes()
        assert storage_ptr(t) <= t.data_ptr() < storage_ptr(t) + max(nbytes, 1)
        assert nbytes == t.numel() * t.element_size(), "a leaf's storage is the whole lease"
        spans.append((storage_ptr(t), storage_ptr(t) + nbytes))
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    slack = _transport.ALIGN * len(spans)
    assert hi - lo <= sum(b - a for a, b in spans) + slack, "leaves of one batch are apart"
    return lo


def slab_mappings() -> int:
    """How many slab mappings this process holds."""
    with open("/proc/self/maps") as f:
        return sum("aioload-slab" in line for line in f)


@pytest.fixture
def mapped() -> Callable[[], int]:
    """How many slab mappings this test added. (Batches that other tests leave alive, e.g. in
    a failure's traceback, keep theirs.)"""
    gc.collect()
    base = slab_mappings()
    return lambda: slab_mappings() - base


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _check_writable(batch: Any) -> None:
    for leaf in leaves(batch):
        if isinstance(leaf, np.ndarray):
            if leaf.size and not leaf.dtype.hasobject:
                assert leaf.flags.writeable
                leaf[...] = leaf.copy()  # raises if read-only
        elif (
            leaf.layout == torch.strided
            and not leaf.requires_grad
            and not leaf.is_quantized
            and 0 not in leaf.stride()  # (a by-value expanded tensor stays expanded)
        ):
            leaf.copy_(leaf.clone())  # raises if read-only


def _expected_collated(fn: Callable[[int], Any], indices: range) -> Any:
    return default_collate([fn(i) for i in indices])


@contextlib.contextmanager
def batches(loader: aioload.DataLoader[Any]) -> Iterator[Any]:
    """An iterator over ``loader`` whose workers stop even when the test fails mid-epoch, so
    that a failure is not reported a second time by the leak check."""
    it: Any = iter(loader)
    try:
        yield it
    finally:
        it.close()


def drain(loader: aioload.DataLoader[Any]) -> list[Any]:
    with batches(loader) as it:
        return list(it)


# --------------------------------------------------------------------------------------------
# Round trips through a real loader
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch_size", "collate_fn"), [(None, _identity), (1, _first)], ids=["unbatched", "first"]
)
def test_round_trip_every_leaf_type(
    no_leaks: None, batch_size: int | None, collate_fn: Any
) -> None:
    n = 6
    loader = aioload.DataLoader(
        FnDataset(full_sample, n),
        batch_size=batch_size,
        collate_fn=collate_fn,
        num_workers=NUM_WORKERS,
        prefetch_factor=PREFETCH,
    )
    received = drain(loader)
    assert len(received) == n
    for i, got in enumerate(received):
        want = full_sample(i)
        assert_same(got, want)

        # Layout facts the transport promises to keep.
        for d in DTYPES:
            assert got["transposed"][str(d)].stride() == want["transposed"][str(d)].stride()
        assert got["channels_last"].is_contiguous(memory_format=torch.channels_last)
        assert got["numpy"]["fortran"].flags.f_contiguous
        assert not got["conj"].is_conj() and not got["neg"].is_neg()
        assert got["grad"].requires_grad and got["grad"].is_leaf
        # The same object twice stays one object.
        dup = got["dup"]
        assert dup[0] is dup[1] and dup[0] is dup[2]["again"]

        # Array leaves lie in one slab lease, each tensor with a storage of its own bytes (as
        # torch's loader gives); everything is writable.
        slab_leaves = [
            t
            for t in leaves(got)
            if isinstance(t, torch.Tensor)
            and t.layout == torch.strided
            and t.numel()
            and t.dtype in _leaves.TORCH_DTYPES
            and not t.requires_grad
            and type(t) is torch.Tensor
        ]
        assert_one_lease(slab_leaves)
        _check_writable(got)


def test_round_trip_default_collate(no_leaks: None) -> None:
    n, bs = 10, 3
    loader = aioload.DataLoader(
        FnDataset(collatable_sample, n), batch_size=bs, num_workers=NUM_WORKERS
    )
    batches = drain(loader)
    assert len(batches) == 4
    for k, got in enumerate(batches):
        want = _expected_collated(collatable_sample, range(k * bs, min(n, (k + 1) * bs)))
        assert_same(got, want)
        assert_one_lease([t for t in leaves(got) if t.numel()])
        _check_writable(got)


def test_round_trip_async_iteration(no_leaks: None) -> None:
    loader = aioload.DataLoader(
        FnDataset(full_sample, 4), batch_size=None, collate_fn=_identity, num_workers=NUM_WORKERS
    )

    async def collect() -> list[Any]:
        return [b async for b in loader]

    got = asyncio.run(collect())
    assert len(got) == 4
    for i, batch in enumerate(got):
        assert_same(batch, full_sample(i))


# --------------------------------------------------------------------------------------------
# Zero copy, reuse, independence, lifetime
# --------------------------------------------------------------------------------------------


def test_zero_copy_and_slab_reuse(no_leaks: None) -> None:
    n_batches, bs = 50, 4
    loader = aioload.DataLoader(
        FnDataset(small_sample, n_batches * bs),
        batch_size=bs,
        num_workers=NUM_WORKERS,
        prefetch_factor=PREFETCH,
    )
    with batches(loader) as it:
        bases: set[int] = set()
        for k in range(n_batches):
            batch = next(it)
            assert_same(batch, _expected_collated(small_sample, range(k * bs, (k + 1) * bs)))
            base = assert_one_lease(leaves(batch))
            bases.add(base)
            # Scribble over the batch before letting it go: the worker must rewrite every byte.
            for t in leaves(batch):
                t.fill_(-1)
            del batch, t
        with pytest.raises(StopIteration):
            next(it)
    bound = PREFETCH * NUM_WORKERS + NUM_WORKERS + 2
    assert len(bases) <= bound, f"{len(bases)} distinct slabs for {n_batches} batches"


def test_batches_are_independent_and_writable(no_leaks: None) -> None:
    bs = 2
    loader = aioload.DataLoader(FnDataset(small_sample, 8 * bs), batch_size=bs, num_workers=2)
    with batches(loader) as it:
        b0, b1 = next(it), next(it)
        spans = []
        for b in (b0, b1):
            lo = min(t.data_ptr() for t in leaves(b))
            hi = max(t.data_ptr() + t.numel() * t.element_size() for t in leaves(b))
            spans.append((lo, hi))
        assert spans[0][1] <= spans[1][0] or spans[1][1] <= spans[0][0], "batches overlap"
        for t in leaves(b0):
            t.fill_(7)
        assert_same(b1, _expected_collated(small_sample, range(bs, 2 * bs)))
        rest = list(it)
        for k, b in enumerate(rest, start=2):
            assert_same(b, _expected_collated(small_sample, range(k * bs, (k + 1) * bs)))
    assert all(bool((t == 7).all()) for t in leaves(b0))


def test_kept_batches_are_never_overwritten(no_leaks: None, mapped: Callable[[], int]) -> None:
    n_batches, bs = 40, 2
    loader = aioload.DataLoader(
        FnDataset(small_sample, n_batches * bs), batch_size=bs, num_workers=NUM_WORKERS
    )
    kept = drain(loader)  # every batch stays alive: the pools must grow, never overwrite
    assert len(kept) == n_batches
    for k, batch in enumerate(kept):
        assert_same(batch, _expected_collated(small_sample, range(k * bs, (k + 1) * bs)))
    assert len({b["img"].data_ptr() for b in kept}) == n_batches
    assert mapped() >= n_batches
    del kept, batch
    gc.collect()
    assert mapped() == 0, "slabs stay mapped after every batch died"


def numpy_sample(i: int) -> dict[str, Any]:
    return {"a": np.full((64, 64), i, dtype=np.float32), "f": np.asfortranarray(np.eye(8) * i)}


def test_kept_numpy_batches_are_never_overwritten(no_leaks: None) -> None:
    # Batches whose only array leaves are numpy arrays (no tensor keeps the lease alive).
    n = 40
    loader = aioload.DataLoader(
        FnDataset(numpy_sample, n), batch_size=None, collate_fn=_identity, num_workers=NUM_WORKERS
    )
    kept = drain(loader)
    for i, batch in enumerate(kept):
        assert_same(batch, numpy_sample(i), f"batch {i}")


def test_batch_of_epoch_one_survives_epoch_two(no_leaks: None) -> None:
    bs, n = 2, 16
    loader = aioload.DataLoader(
        FnDataset(small_sample, n),
        batch_size=bs,
        num_workers=NUM_WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=True,
    )
    try:
        with batches(loader) as it:
            kept = next(it)
            rest = list(it)
        del rest, it
        want = _expected_collated(small_sample, range(bs))
        for _epoch in range(2):
            for k, batch in enumerate(loader):
                assert_same(batch, _expected_collated(small_sample, range(k * bs, (k + 1) * bs)))
            del batch
            assert_same(kept, want)
    finally:
        loader.shutdown()


# --------------------------------------------------------------------------------------------
# Leaks over many epochs
# --------------------------------------------------------------------------------------------


def _worker_fds() -> dict[int, int]:
    return {p.pid: p.num_fds() for p in psutil.Process().children() if p.is_running()}


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_no_shm_mapping_or_fd_growth_over_50_epochs(
    no_leaks: None, mapped: Callable[[], int], persistent: bool
) -> None:
    # /dev/shm is the machine's: only entries this process tree made count (tests/leaks.py).
    shm_before = shm_entries()
    tree = ProcessTree()

    def new_shm() -> list[str]:
        tree.observe()
        return shm_leaks(shm_before, tree.pids)

    bs, n = 2, 8
    loader = aioload.DataLoader(
        FnDataset(small_sample, n),
        batch_size=bs,
        num_workers=NUM_WORKERS,
        prefetch_factor=PREFETCH,
        persistent_workers=persistent,
    )
    want = [_expected_collated(small_sample, range(k, k + bs)) for k in range(0, n, bs)]

    def epoch() -> None:
        with batches(loader) as it:
            for k, batch in enumerate(it):
                assert_same(batch, want[k])
                if k == 0:
                    # Mid-epoch, with batches in flight: still nothing in /dev/shm.
                    assert new_shm() == []
        assert k == len(want) - 1

    try:
        epoch()
        gc.collect()
        fds_after_one = num_fds()
        workers_after_one = _worker_fds() if persistent else {}
        for _ in range(49):
            epoch()
        gc.collect()
        assert num_fds() - fds_after_one <= 2, f"{fds_after_one} -> {num_fds()} descriptors"
        assert new_shm() == [], "slabs must never appear in /dev/shm"
        if persistent:
            workers = _worker_fds()
            assert workers.keys() == workers_after_one.keys()
            for pid, count in workers.items():
                assert count - workers_after_one[pid] <= 2, "descriptor growth in a worker"
            # Each worker keeps at most prefetch_factor + 1 idle slabs, plus the busy ones.
            assert mapped() <= NUM_WORKERS * (2 * PREFETCH + 1)
        else:
            assert mapped() == 0
    finally:
        loader.shutdown()
    gc.collect()
    assert mapped() == 0


# --------------------------------------------------------------------------------------------
# Fallback to pickle
# --------------------------------------------------------------------------------------------


def _enospc(size: int) -> int:
    raise OSError(errno.ENOSPC, "No space left on device (aioload test)")


def test_no_shared_memory_at_all_falls_back_to_pickle(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch, mapped: Callable[[], int]
) -> None:
    # Forked workers inherit the patch.
    monkeypatch.setattr(_transport, "_create_memfd", _enospc)
    n = 5
    sample = functools.partial(full_sample, dtypes=PICKLABLE_DTYPES)
    loader = aioload.DataLoader(
        FnDataset(sample, n),
        batch_size=None,
        collate_fn=_identity,
        num_workers=NUM_WORKERS,
        multiprocessing_context="fork",
    )
    received = drain(loader)
    assert len(received) == n
    for i, got in enumerate(received):
        assert_same(got, sample(i))
        _check_writable(got)
    assert mapped() == 0, "the batches were expected to come by value"


def test_no_shared_memory_default_collate_falls_back_to_pickle(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch, mapped: Callable[[], int]
) -> None:
    monkeypatch.setattr(_transport, "_create_memfd", _enospc)
    n, bs = 12, 3
    sample = functools.partial(collatable_sample, dtypes=PICKLABLE_DTYPES)
    loader = aioload.DataLoader(
        FnDataset(sample, n),
        batch_size=bs,
        num_workers=NUM_WORKERS,
        multiprocessing_context="fork",
    )
    batches = drain(loader)
    assert len(batches) == n // bs
    for k, got in enumerate(batches):
        assert_same(got, _expected_collated(sample, range(k * bs, (k + 1) * bs)))
    assert mapped() == 0


def unpicklable_sample(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {str(d): _rand(d, (4, 4), g) for d in UNPICKLABLE_DTYPES}


@pytest.mark.skipif(not UNPICKLABLE_DTYPES, reason="torch pickles every slab dtype")
def test_no_shared_memory_unpicklable_dtypes_fall_back(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The slab carries these dtypes; the by-value fallback must too, although torch's own pickle
    # cannot load them.
    monkeypatch.setattr(_transport, "_create_memfd", _enospc)
    loader = aioload.DataLoader(
        FnDataset(unpicklable_sample, 2),
        batch_size=None,
        collate_fn=_identity,
        num_workers=NUM_WORKERS,
        multiprocessing_context="fork",
    )
    got = drain(loader)
    assert len(got) == 2
    for i, batch in enumerate(got):
        assert_same(batch, unpicklable_sample(i))


def _first_memfd_only() -> Callable[[int], int]:
    real = _transport._create_memfd
    calls = [0]

    def create(size: int) -> int:
        calls[0] += 1
        if calls[0] > 1:
            _enospc(size)
        return real(size)

    return create


@pytest.mark.parametrize(
    ("batch_size", "collate_fn"), [(2, None), (None, _identity)], ids=["default", "identity"]
)
def test_pool_that_cannot_grow_falls_back_to_pickle(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch, batch_size: int | None, collate_fn: Any
) -> None:
    # Each worker gets one slab; keeping every batch then needs more, which fails: those
    # batches must come by value, and the kept ones must stay intact.
    monkeypatch.setattr(_transport, "_create_memfd", _first_memfd_only())
    n = 16
    kwargs: dict[str, Any] = {} if collate_fn is None else {"collate_fn": collate_fn}
    loader = aioload.DataLoader(
        FnDataset(small_sample, n),
        batch_size=batch_size,
        num_workers=NUM_WORKERS,
        multiprocessing_context="fork",
        **kwargs,
    )
    kept = drain(loader)
    bs = batch_size or 1
    assert len(kept) == n // bs
    for k, got in enumerate(kept):
        want = (
            _expected_collated(small_sample, range(k * bs, (k + 1) * bs))
            if batch_size
            else small_sample(k)
        )
        assert_same(got, want, f"batch {k}")


# --------------------------------------------------------------------------------------------
# In-process: encode in "the worker", decode in "the parent"
# --------------------------------------------------------------------------------------------


@pytest.fixture
def pool() -> Iterator[_transport.WorkerSlabPool]:
    pool = _transport.WorkerSlabPool(max_idle=3)
    yield pool
    for slab in pool.slabs.values():
        fd = slab.take_fd()
        if fd is not None:
            os.close(fd)


class Transfer:
    """One worker's slabs as the parent sees them."""

    def __init__(self, pool: _transport.WorkerSlabPool) -> None:
        self.pool = pool
        self.mappings = _transport.SlabMappings()
        self.released: list[int] = []

    def send(self, batch: Any, arena: Any = None) -> tuple[_encoding.EncodedBatch, Any]:
        enc = _encoding.encode_batch(batch, self.pool, arena)
        slab_id = -1
        if enc.slab is not None:
            slab_id = enc.slab.id
            if enc.new_slab:
                fd = enc.slab.take_fd()
                assert fd is not None
                self.mappings.add(slab_id, fd, enc.slab.capacity)
        out = self.mappings.decode(slab_id, enc.used, enc.payload, enc.leaves, self.released.append)
        return enc, out

    def collate_in_arena(self, samples: list[Any]) -> tuple[Any, Any]:
        """The collated batch, and the arena it was stacked into (None: it took no slab)."""
        lazy = self.pool.arena()
        _transport.collating_into(lazy)
        try:
            return _transport.slab_collate(samples), _transport.settled_arena(lazy)
        finally:
            _transport.collating_into(None)


def test_encode_decode_in_process(no_leaks: None, pool: _transport.WorkerSlabPool) -> None:
    transfer = Transfer(pool)
    for i in range(3):
        enc, got = transfer.send(full_sample(i))
        assert_same(got, full_sample(i))
        assert enc.slab is not None and enc.used <= enc.slab.capacity
        assert all(off % _transport.ALIGN == 0 for _, off, *_ in enc.leaves)
        del got
        gc.collect()
        assert transfer.released == [enc.slab.id]
        pool.release(transfer.released.pop())
    # Batches 0-2 grow (their "big" leaf grows); batch 3 is the size of batch 0 and reuses.
    slabs = len(pool.slabs)
    _, got = transfer.send(full_sample(3))
    assert_same(got, full_sample(3))
    assert len(pool.slabs) == slabs, "a released slab that fits must be reused"


def test_all_empty_leaves_need_no_slab(no_leaks: None, pool: _transport.WorkerSlabPool) -> None:
    transfer = Transfer(pool)
    batch = {"t": torch.empty(0, 3, dtype=torch.float16), "n": np.empty((2, 0)), "s": "x"}
    enc, got = transfer.send(batch)
    assert enc.slab is None and not pool.slabs
    assert_same(got, batch)
    # A collate stacks nothing into the arena: it takes no slab.
    pool.expected = 1024
    _, arena = transfer.collate_in_arena([batch])
    assert arena is None and not pool.slabs
    # An arena with a slab: the slab goes straight back to the pool.
    arena = pool.arena().start(1024)
    assert arena is not None
    enc, got = transfer.send(batch, arena)
    assert enc.slab is None and pool.free == [arena.slab.id]
    assert_same(got, batch)


def test_acquire_takes_the_smallest_free_slab_that_fits(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    page = _transport._PAGE
    sizes = [4 * _transport._MIN_SLAB, _transport._MIN_SLAB, 2 * _transport._MIN_SLAB]
    slabs = [pool.acquire(size) for size in sizes]
    assert [s.capacity for s in slabs] == sizes
    assert all(s.capacity % page == 0 for s in slabs)
    for s in slabs:
        pool.release(s.id)
    assert pool.acquire(_transport._MIN_SLAB + 1) is slabs[2]
    assert pool.acquire(1) is slabs[1]
    assert pool.acquire(1) is slabs[0]
    fresh = pool.acquire(1)
    assert fresh not in slabs and fresh.capacity == _transport._MIN_SLAB


def test_acquire_takes_the_slab_freed_last_among_one_size(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    """The warmest slab: the one freed last. The others stay idle instead of taking turns."""
    slabs = [pool.acquire(_transport._MIN_SLAB) for _ in range(3)]
    for s in (slabs[1], slabs[0], slabs[2]):
        pool.release(s.id)
    assert pool.acquire(1) is slabs[2]
    pool.release(slabs[2].id)
    assert pool.acquire(1) is slabs[2]
    assert pool.acquire(1) is slabs[0]


def test_a_slab_still_viewed_in_the_worker_is_retired_not_reused(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    """A collate_fn of the user's own may keep a tensor default_collate stacked into the slab
    (or a view of it) after the batch went out: that slab must never be written again."""
    slab = pool.acquire(_transport._MIN_SLAB)
    kept = _transport._Arena(slab).view(0, 64, torch.int32)[2:5]  # a view of a view
    pool.release(slab.id)
    again = pool.acquire(_transport._MIN_SLAB)
    assert again is not slab and slab.id not in pool.slabs
    assert pool.take_dropped() == [slab.id]  # the parent is told to let go of it too
    kept.fill_(7)  # still mapped, and still ours
    assert bool((kept == 7).all())
    # Nothing views the new one once its batch is gone: it is reused.
    batch_view = _transport._Arena(again).view(0, 64, torch.int32)
    del batch_view
    pool.release(again.id)
    assert pool.acquire(_transport._MIN_SLAB) is again


def test_idle_slabs_beyond_the_limit_are_retired(
    no_leaks: None, pool: _transport.WorkerSlabPool, mapped: Callable[[], int]
) -> None:
    # In this process, each slab is mapped once by "the worker" and once by "the parent".
    transfer = Transfer(pool)
    kept = [transfer.send(torch.full((1000,), float(i)))[1] for i in range(5)]
    assert len(pool.slabs) == 5 and mapped() == 5 + 5
    for slab_id in list(pool.slabs):
        pool.release(slab_id)
    assert len(pool.free) == pool.max_idle == 3
    dropped = pool.take_dropped()
    assert len(dropped) == 2 and pool.take_dropped() == []
    assert all(slab_id not in pool.slabs for slab_id in dropped)
    # The parent forgets retired slabs, but a batch it still holds keeps its mapping.
    transfer.mappings.drop(dropped)
    gc.collect()
    assert mapped() == 3 + 5
    for i, t in enumerate(kept):
        assert torch.equal(t, torch.full((1000,), float(i)))
    del kept, t
    gc.collect()
    assert mapped() == 3 + 3, "a retired slab stays mapped after its last batch died"
    transfer.mappings.clear()
    gc.collect()
    assert mapped() == 3 + 0


# Stacks smaller than this are not stacked into the arena (they are copied when encoded).
ARENA_MIN = getattr(_transport, "_ARENA_MIN_BYTES", 0)


def arena_sample(i: int) -> dict[str, Any]:
    per_sample = ARENA_MIN // 4 + 1  # big enough to be stacked into the arena alone
    return {
        "img": (torch.arange(per_sample, dtype=torch.float32) * i).reshape(1, -1),
        "np": np.full((per_sample // 2, 2), i, dtype=np.float32),
        "pair": (torch.full((per_sample,), i, dtype=torch.int32), i),
        "label": i,
        "tiny": torch.tensor([i, -i]),
    }


def test_slab_collate_stacks_straight_into_the_arena(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    transfer = Transfer(pool)
    samples = [arena_sample(i) for i in range(4)]
    want = default_collate(samples)

    # The first batch has no size estimate: its slab is made for the first tensor stacked,
    # and these samples' other large leaves do not fit there; the batch moves to a slab of
    # the right size, and the first one is dropped, not kept idle.
    collated, made = transfer.collate_in_arena(samples)
    assert made is not None and made.holds(collated["img"])
    enc, got = transfer.send(collated, made)
    assert_same(got, want)
    first_slab = enc.slab
    assert first_slab is not None and first_slab is not made.slab
    assert list(pool.slabs) == [first_slab.id] and pool.take_dropped() == [made.slab.id]
    assert pool.expected >= enc.used
    del got, collated
    gc.collect()
    pool.release(transfer.released.pop())

    # The second batch of the same size is stacked into the arena and not copied again.
    collated, arena = transfer.collate_in_arena(samples)
    assert arena.slab is first_slab
    big = [collated["img"], collated["np"], collated["pair"][0]]
    assert all(arena.holds(t) for t in big)
    enc, got = transfer.send(collated, arena)
    assert enc.slab is first_slab, "a batch of the same size must not spill"
    assert len(pool.slabs) == 1
    offsets = {desc[1] for desc in enc.leaves}
    for t in big:
        assert t.data_ptr() - first_slab.ptr in offsets, "an in-arena leaf was copied"
    assert_same(got, want)


def test_a_first_batch_is_stacked_into_a_slab_made_for_it(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    # Before the pool knows how big batches are: the slab is made for the first tensor the
    # collate stacks, with room for the small leaves (labels here), so the batch is copied
    # once, and that slab serves the batches after it.
    per_sample = ARENA_MIN // 4 + 1
    samples = [(torch.full((per_sample,), float(i)), i) for i in range(4)]
    transfer = Transfer(pool)
    assert pool.expected == 0
    for _ in range(2):
        collated, arena = transfer.collate_in_arena(samples)
        assert arena is not None and arena.holds(collated[0])
        enc, got = transfer.send(collated, arena)
        assert enc.slab is arena.slab and len(pool.slabs) == 1
        assert enc.leaves[0][1] == collated[0].data_ptr() - arena.slab.ptr, "copied again"
        assert_same(got, default_collate(samples))
        del got, collated
        gc.collect()
        pool.release(transfer.released.pop())


def test_a_first_batch_without_large_tensors_makes_no_slab_early(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    samples = [torch.tensor([i, i + 1]) for i in range(8)]
    collated, arena = Transfer(pool).collate_in_arena(samples)
    assert arena is None and not pool.slabs
    assert torch.equal(collated, default_collate(samples))


def test_too_small_arena_spills_into_a_bigger_slab(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    transfer = Transfer(pool)
    n = 10
    small_len = max(16, ARENA_MIN // 4 // n + 1)  # stacked: at least ARENA_MIN bytes
    pool.expected = small_len * 4 * n + _transport.ALIGN  # the arena fits "small" only
    big_len = 4 * max(pool.expected, _transport._MIN_SLAB) // 4
    samples = [
        {
            "small": torch.full((small_len,), float(i)),
            "big": torch.arange(float(big_len)) * i,
            "label": i,
        }
        for i in range(n)
    ]
    want = default_collate(samples)
    collated, arena = transfer.collate_in_arena(samples)
    small_slab = arena.slab
    assert arena.holds(collated["small"]), "what fits is stacked into the arena"
    assert not arena.holds(collated["big"])
    enc, got = transfer.send(collated, arena)
    assert enc.slab is not None and enc.slab is not small_slab
    assert enc.slab.capacity >= enc.used and small_slab.id in pool.free
    assert_same(got, want)
    assert pool.expected >= enc.used

    # Now that the pool knows the size, the next batch fits the arena.
    del got
    gc.collect()
    pool.release(transfer.released.pop())
    collated, arena = transfer.collate_in_arena(samples)
    assert arena.slab is enc.slab
    assert arena.holds(collated["small"]) and arena.holds(collated["big"])
    enc2, got = transfer.send(collated, arena)
    assert enc2.slab is enc.slab
    assert_same(got, want)


@pytest.mark.parametrize("kind", ["tensor", "numpy", "mixed"])
def test_release_fires_after_the_last_leaf_dies(
    no_leaks: None, pool: _transport.WorkerSlabPool, kind: str
) -> None:
    transfer = Transfer(pool)

    def leaf(i: int) -> Any:
        if kind == "tensor" or (kind == "mixed" and i % 2 == 0):
            return torch.full((100,), float(i))
        return np.full((100,), float(i))

    enc, got = transfer.send([leaf(0), {"b": leaf(1), "c": (leaf(2), "x")}, leaf(3)])
    assert enc.slab is not None
    parts = [got[0], got[1]["b"], got[1]["c"][0], got[2]]
    del got
    gc.collect()
    while parts:
        assert transfer.released == [], f"released while {len(parts)} leaves are alive"
        parts.pop(0)
        gc.collect()
    assert transfer.released == [enc.slab.id]


def test_views_derived_from_a_leaf_keep_the_batch(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    transfer = Transfer(pool)
    enc, got = transfer.send({"t": torch.arange(10), "n": np.arange(10), "m": torch.ones(3)})
    derived = [got["t"][2:], torch.from_numpy(got["n"])[::2], got["m"].numpy()]
    del got
    gc.collect()
    while derived:
        assert transfer.released == []
        derived.pop()
        gc.collect()
    assert transfer.released == [enc.slab.id]


def test_numpy_leaf_with_strides_not_multiple_of_itemsize(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    # A field of a packed structured array: int32 values 5 bytes apart.
    packed = np.zeros(100, dtype=[("a", "<i4"), ("b", "u1")])
    packed["a"] = np.arange(100)
    field = packed["a"]
    assert field.strides == (5,)
    batch = [field, -np.arange(100, dtype=np.int32)]
    _, got = Transfer(pool).send(batch)
    assert_same(got, batch)


def _lone_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 5, generator=g, dtype=torch.float64)
    return {
        "contiguous": base.clone(),
        "transposed": base.t(),  # dense, not contiguous: its strides travel
        "gaps": base[:, ::2],  # not dense: made contiguous
        "offset": base.reshape(-1)[3:],  # a view with a storage offset
        "empty": torch.empty(0, 4, dtype=torch.int16),
        "scalar": torch.tensor(5, dtype=torch.uint8),
        "conj": torch.randn(4, generator=g, dtype=torch.complex64).conj(),
        "neg": torch._neg_view(torch.randn(4, generator=g)),
        # Not slab leaves: pickled with the batch, as before.
        "grad": torch.randn(3, generator=g).requires_grad_(),
        "parameter": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "sparse": torch.eye(3).to_sparse(),
    }


@pytest.mark.parametrize("kind", list(_lone_tensors()))
def test_a_lone_tensor_batch_round_trips(
    no_leaks: None, pool: _transport.WorkerSlabPool, kind: str
) -> None:
    # A batch that is one tensor skips the pickler (its payload is always the same); it must
    # arrive exactly as any other batch does, layout included, with or without an arena.
    want = _lone_tensors()[kind]
    transfer = Transfer(pool)
    _, got = transfer.send(want)
    assert_same(got, want)
    pool.expected = 1 << 16
    arena = pool.arena().start(1 << 16)
    _, got_via_arena = transfer.send(want, arena)
    assert_same(got_via_arena, want)
    for received in (got, got_via_arena):
        if kind == "transposed":
            assert received.stride() == want.stride()
        elif want.layout == torch.strided:
            assert received.is_contiguous()


def test_a_lone_tensor_stacked_into_the_arena_stays_there(
    no_leaks: None, pool: _transport.WorkerSlabPool
) -> None:
    per_sample = ARENA_MIN // 4 + 1
    samples = [torch.full((per_sample,), float(i)) for i in range(3)]
    pool.expected = 3 * per_sample * 4 + _transport.ALIGN
    transfer = Transfer(pool)
    collated, arena = transfer.collate_in_arena(samples)
    assert arena.holds(collated)
    enc, got = transfer.send(collated, arena)
    assert enc.slab is arena.slab and enc.leaves[0][1] == collated.data_ptr() - arena.slab.ptr
    assert_same(got, default_collate(samples))


def test_the_lone_tensor_payload_is_what_the_pickler_makes() -> None:
    for t in (torch.zeros(3), torch.ones(2, 2, dtype=torch.int64)):
        buf = io.BytesIO()
        _leaves._LeafCollector(buf).dump(t)
        assert _leaves.collect_leaves(t) == (buf.getvalue(), [t])


@pytest.mark.parametrize("odd", ["dtype", "grad", "subclass"])
def test_slab_collate_of_unlike_samples_matches_default_collate(
    no_leaks: None, pool: _transport.WorkerSlabPool, odd: str
) -> None:
    # An arena-sized batch with one sample unlike the first is not stacked into the slab:
    # torch.stack promotes mixed dtypes, keeps grad, keeps a subclass; the slab would not.
    per_sample = ARENA_MIN // 4 + 1
    samples = [torch.full((per_sample,), float(i)) for i in range(4)]
    if odd == "dtype":
        samples[2] = samples[2].double()
    elif odd == "grad":
        samples[2] = samples[2].requires_grad_()
    else:
        samples[2] = torch.nn.Parameter(samples[2], requires_grad=False)
    pool.expected = 4 * per_sample * 8 + _transport.ALIGN
    transfer = Transfer(pool)
    collated, arena = transfer.collate_in_arena(samples)
    want = default_collate(samples)
    assert arena is None, "nothing is stacked into the slab, so none is taken"
    assert collated.dtype == want.dtype and collated.requires_grad == want.requires_grad
    assert torch.equal(collated.detach(), want.detach())


def test_worker_channel_reads_without_waiting_and_stays_blocking() -> None:
    import socket

    from aioload._wire.channel import ChannelClosed, WorkerChannel, encode_frame

    ours, theirs = socket.socketpair()
    with ours, theirs:
        channel = WorkerChannel(ours)
        assert channel.fill(wait=False) == 0  # nothing there: no wait, no error
        assert ours.getblocking(), "a read that must not wait leaves the socket blocking"
        frame = encode_frame(Task(1, 0, [1, 2]))
        theirs.sendall(frame)
        assert channel.fill(wait=False) == len(frame)
        assert channel.has_frame() and channel.pop() == Task(1, 0, [1, 2])
        assert ours.getblocking()
        theirs.close()
        with pytest.raises(ChannelClosed):
            channel.fill(wait=False)


class _FakeChannel:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any, fds: list[int] | None = None) -> None:
        for fd in fds or []:
            os.close(os.dup(fd))
        self.sent.append(message)


def _fake_worker(pool: _transport.WorkerSlabPool, batch: Any) -> Any:
    """A worker's task handling, without the process and the socket."""
    step: Any = object.__new__(_worker_main.WorkerStep)
    step.slabs = pool
    step.config = SimpleNamespace(worker_id=0, slab_collate=True, dataset_kind=0)
    step.iterable = False
    step.init_error = None
    step.fetch_error = None
    step.iteration_end = False
    step.point = None
    step.fetcher = SimpleNamespace(
        fetch=lambda indices, arena: _transport.slab_collate(batch), point=lambda: None
    )
    worker: Any = object.__new__(_worker_main._ProcessWorker)
    worker.slabs = pool
    worker.step = step
    worker.channel = _FakeChannel()
    return worker


def test_worker_falls_back_when_a_spill_cannot_get_a_slab(
    no_leaks: None, pool: _transport.WorkerSlabPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool.expected = 256
    arena = pool.arena().start(256)
    assert arena is not None
    slab_id = arena.slab.id
    monkeypatch.setattr(_transport, "_create_memfd", _enospc)
    batch = torch.arange(1 << 15, dtype=torch.float64)  # 256 KiB: spills, and no slab for it
    worker = _fake_worker(pool, [])
    worker._answer(Task(0, 0, []), Produced(batch, None, arena), 0.0)
    (message,) = worker.channel.sent
    assert isinstance(message.result, PickledBatch)
    # The arena's slab is free exactly once: two entries would hand it to two batches at once.
    assert pool.free.count(slab_id) == 1, f"free list {pool.free}"


def test_worker_falls_back_when_the_arena_cannot_get_a_slab(
    no_leaks: None, pool: _transport.WorkerSlabPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pool knows the batch size but has no free slab (the consumer keeps them all) and
    # cannot make one: the batch must still arrive, by value.
    samples = [arena_sample(i) for i in range(4)]
    pool.expected = 1 << 20
    monkeypatch.setattr(_transport, "_create_memfd", _enospc)
    worker = _fake_worker(pool, samples)
    worker._run(Task(0, 0, [0, 1, 2, 3]))
    (message,) = worker.channel.sent
    assert isinstance(message.result, (PickledBatch, SlabBatch)), f"got {message.result!r}"


def test_worker_falls_back_when_the_first_batch_cannot_get_a_slab(
    no_leaks: None, pool: _transport.WorkerSlabPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A first batch's slab is made during the collate: without shared memory the collate
    # stacks as usual and the batch arrives by value, not as a collate error.
    samples = [arena_sample(i) for i in range(4)]
    assert pool.expected == 0
    monkeypatch.setattr(_transport, "_create_memfd", _enospc)
    worker = _fake_worker(pool, samples)
    worker._run(Task(0, 0, [0, 1, 2, 3]))
    (message,) = worker.channel.sent
    assert isinstance(message.result, PickledBatch), f"got {message.result!r}"
    assert not pool.slabs


def _collate_and_report_sharing(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A user's collate_fn that calls default_collate, and says where its result lives."""
    stacked = default_collate(batch)
    return {"data": stacked, "shared": torch.tensor(stacked.is_shared())}


def test_default_collate_in_a_custom_collate_uses_no_shared_memory_segment(
    no_leaks: None,
) -> None:
    # torch's workers stack default_collate's tensors into a fresh /dev/shm segment per batch
    # (checked here, so the probe is known to see it); aioload's send batches in their slabs,
    # so they stack as outside a worker, and the parent's map stays torch's.
    dataset = FnDataset(lambda i: torch.full((64,), float(i)), 8)
    common: dict[str, Any] = {
        "batch_size": 4,
        "num_workers": 1,
        "collate_fn": _collate_and_report_sharing,
    }
    torch_batches = list(torch.utils.data.DataLoader(dataset, **common))
    assert all(bool(b["shared"]) for b in torch_batches)
    got = drain(aioload.DataLoader(dataset, **common))
    assert [bool(b["shared"]) for b in got] == [False, False]
    for want, batch in zip(torch_batches, got, strict=True):
        assert torch.equal(batch["data"], want["data"])
    assert torch.utils.data._utils.collate.default_collate_fn_map[torch.Tensor] is (
        torch.utils.data._utils.collate.collate_tensor_fn
    )
