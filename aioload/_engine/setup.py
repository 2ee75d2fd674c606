"""How a ``DataLoader`` is set up: its arguments checked and normalised once, when it is built,
and each pass described from them (``pass_engine``).

``loader.py`` keeps the class, its public methods and its documentation; what it does with its
arguments is here, as functions of the values (at construction) or of the loader as a
``LoaderView`` (each pass: the attributes a pass reads, checked by type against
``DataLoader``). Nothing here imports the loader.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed
import torch.utils.data
from torch.utils.data import DistributedSampler, IterableDataset
from torch.utils.data._utils.collate import default_collate

from .._backends.base import BackendKeeper, WorkerSpec
from .._backends.choice import BackendChoice, WorkerFactory, choose_backend
from .._worker.async_detect import is_async_dataset
from .._worker.datapipes import SharedSeeds, is_datapipe, is_iter_datapipe, reseed, shard_in_process
from .._worker.fetch import SamplePolicy, is_stateful
from ..stats import PassStats, SkipCap
from .hang import NO_HANG_REPORT, HangWatch
from .orchestrator import Orchestrator, PassSetup, track_pass
from .pinning import Transfer
from .resume import (
    PassProgress,
    SamplerStack,
    StreamPoint,
    begin_pass,
    check_generator_count,
    generator_states,
    live_point,
    next_points,
    start_points,
)
from .samplers import loader_generators
from .state_format import ParsedState, check_fit
from .tuning import PassTuning, auto_arguments, usable_cores

__all__ = [
    "LoaderView",
    "Resolved",
    "check_extras",
    "check_worker_method",
    "fit_state",
    "next_pass_progress",
    "pass_engine",
    "resolve_arguments",
    "shard_index_sampler",
    "torch_only_arguments",
]

# -- construction --------------------------------------------------------------------------


class Resolved(NamedTuple):
    """What ``DataLoader.__init__`` settles before torch's ``__init__`` sees the arguments."""

    rank: int
    world_size: int
    # shard="auto": this rank's shard of the default sampler (private; see DataLoader).
    shard_sampler: DistributedSampler[Any] | None
    # The "auto" controller (docs/tuning.md), where an argument is "auto".
    tuner: Any
    # The integers torch sees (and the workers are built with); "auto" resolved.
    num_workers: int
    prefetch_factor: int | None
    worker_concurrency: int


def resolve_arguments(
    dataset: Any,
    *,
    shard: str,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
    generator: torch.Generator | None,
    num_workers: int | str,
    prefetch_factor: int | str | None,
    worker_concurrency: int | str,
    max_memory: float | None,
) -> Resolved:
    """``shard`` (the rank, and the shard sampler: a collective where it shuffles) and the
    ``"auto"`` arguments, before torch validates the rest."""
    if shard not in ("auto", "none"):
        raise ValueError(f"shard option should be 'auto' or 'none', but got shard={shard!r}")
    # By default (shard="none") every rank iterates the whole dataset, as with torch's
    # DataLoader, and nothing here talks to the other ranks: a loader built on one rank alone
    # neither blocks nor drops data. With shard="auto", asked for, each rank iterates its own
    # shard of the default sampler under torch.distributed. The shard is private and applies
    # at iteration time only: the public ``sampler`` and ``batch_sampler`` describe the whole
    # dataset, as torch's do, because frameworks read them to shard the data themselves
    # (accelerate's prepare() wraps ``batch_sampler``; Lightning builds a DistributedSampler
    # of ``dataset``). A sampler the user passes (such as a framework's DistributedSampler)
    # is theirs, and left alone: no second shard. The rank is read here (no collective);
    # shard="auto" with shuffle agrees on the shuffle seed here, a collective every rank
    # must join.
    rank, world_size = distributed_rank()
    shard_sampler: DistributedSampler[Any] | None = None
    if (
        shard == "auto"
        and world_size > 1
        and sampler is None
        and batch_sampler is None
        and not isinstance(dataset, IterableDataset)
    ):
        shard_sampler = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=bool(shuffle),
            seed=shared_shuffle_seed(generator) if shuffle else 0,
            drop_last=drop_last,
        )
    # num_workers / prefetch_factor / worker_concurrency "auto" (docs/tuning.md): torch sees
    # the integers the workers are built with, and the controller keeps the rest.
    auto = auto_arguments(
        num_workers,
        prefetch_factor,
        worker_concurrency,
        max_memory,
        iterable=isinstance(dataset, IterableDataset),
        is_async=is_async_dataset(dataset, int(isinstance(dataset, IterableDataset))),
    )
    resolved: tuple[Any, Any, Any] = (num_workers, prefetch_factor, worker_concurrency)
    if auto is not None:
        resolved = (auto.num_workers, auto.prefetch_factor, auto.worker_concurrency)
    elif worker_concurrency == "auto":
        # A sync dataset fetches one sample at a time: "auto" has only 1 to choose from.
        resolved = (num_workers, prefetch_factor, 1)
    # (Typed as torch takes them; torch and check_worker_concurrency validate them.)
    return Resolved(
        rank,
        world_size,
        shard_sampler,
        auto.controller if auto is not None else None,
        *resolved,
    )


class Extras(NamedTuple):
    """aioload's own arguments, checked (after torch's), as the loader keeps them."""

    device: torch.device | None
    worker_concurrency: int
    snapshot_every_n_steps: int | None
    hang_report_after: float | None


def check_extras(
    dataset: Any,
    dataset_kind: int,
    *,
    num_workers: int,
    prefetch_factor: int | None,
    device: str | torch.device | None,
    max_worker_restarts: Any,
    workers: Any,
    worker_concurrency: int,
    worker_init_fn: Any,
    on_sample_error: Any,
    max_skipped: Any,
    sample_retries: Any,
    snapshot_every_n_steps: Any,
    hang_report_after: Any,
) -> Extras:
    """Check the arguments torch does not take (or takes, and fails on later), each with a
    message that says what a valid value is."""
    if prefetch_factor == 0 and num_workers > 0:
        # torch accepts 0 here and then fails inside its iterator; fail early and clearly.
        raise ValueError("prefetch_factor option should be positive when num_workers > 0")
    # (stacklevel: the warning points at the user's DataLoader(...) call.)
    checked_device = check_device(device, stacklevel=4)
    if not isinstance(max_worker_restarts, int) or max_worker_restarts < 0:
        raise ValueError("max_worker_restarts option should be a non-negative integer")
    if max_worker_restarts and num_workers == 0:
        raise ValueError("max_worker_restarts option needs num_workers > 0")
    if max_worker_restarts and isinstance(dataset, IterableDataset):
        raise ValueError(
            "max_worker_restarts is not supported with an IterableDataset: a replacement "
            "worker would start its iterator over, so samples would repeat"
        )
    if workers is not None and not isinstance(workers, WorkerFactory):
        raise TypeError(
            f"workers option should be None (local processes) or aioload.RayWorkers, but "
            f"got workers={workers!r}"
        )
    concurrency = check_worker_concurrency(
        worker_concurrency, dataset, dataset_kind, worker_init_fn
    )
    check_sample_errors(on_sample_error, max_skipped, sample_retries)
    return Extras(
        checked_device,
        concurrency,
        check_snapshot_steps(snapshot_every_n_steps),
        check_hang_report_after(hang_report_after),
    )


def check_worker_method(
    worker_method: Any, dataset: Any, num_workers: int, workers: Any, seed_per_sample: bool
) -> str:
    """``worker_method``: torch's ``WorkerInfo.worker_method`` values, or "auto". Thread
    workers share the process-wide generators, so ``seed_per_sample`` cannot seed them per
    sample there: it is said at once (``docs/threads.md``), not found in the results."""
    if worker_method not in ("multiprocessing", "thread", "auto"):
        raise ValueError(
            "worker_method option should be 'multiprocessing', 'thread' or 'auto', but got "
            f"worker_method={worker_method!r}"
        )
    if worker_method != "multiprocessing" and workers is not None:
        raise ValueError(
            f"worker_method={worker_method!r} runs local workers; workers={workers!r} runs "
            "them elsewhere: pass one or the other"
        )
    if worker_method != "multiprocessing" and num_workers > 0 and is_datapipe(dataset):
        # A DataPipe is sharded and reseeded in place in each worker (torch's workers each
        # have a copy): one object shared by threads cannot be.
        raise ValueError(
            f"worker_method={worker_method!r} does not support DataPipes: each worker shards "
            "and reseeds its own copy of the pipe, and thread workers share one; use "
            "worker_method='multiprocessing'"
        )
    if worker_method != "multiprocessing" and seed_per_sample:
        warnings.warn(
            f"aioload: with worker_method={worker_method!r}, thread workers share the "
            "process-wide random, numpy and torch generators, so seed_per_sample seeds each "
            "sample's get_worker_info().rng (random_generator, torch_generator, "
            "numpy_generator) instead of them; draw from those for per-sample randomness "
            "(docs/threads.md)",
            UserWarning,
            stacklevel=3,
        )
    return str(worker_method)


def shard_index_sampler(
    shard_sampler: DistributedSampler[Any] | None, batch_size: int | None, drop_last: bool
) -> Iterable[Any] | None:
    """This rank's batches (or indices, without automatic batching), in the shape torch's
    ``_index_sampler`` has; None without a shard."""
    if shard_sampler is None:
        return None
    if batch_size is None:
        return shard_sampler
    return torch.utils.data.BatchSampler(shard_sampler, batch_size, drop_last)


@functools.cache
def torch_parameters() -> frozenset[str]:
    """The arguments the installed torch's DataLoader takes."""
    return frozenset(inspect.signature(torch.utils.data.DataLoader.__init__).parameters)


def torch_only_arguments(**arguments: Any) -> dict[str, Any]:
    """Those of ``arguments`` that the installed torch's DataLoader takes (``in_order`` came
    with torch 2.6; ``pin_memory_device`` is deprecated from 2.9, and may go)."""
    accepted = torch_parameters()
    return {name: value for name, value in arguments.items() if name in accepted}


def single_process_timeout_error() -> AssertionError | None:
    """What torch's single-process iterator raises for ``timeout > 0``: a bare ``assert`` up to
    torch 2.9 (no message), an AssertionError that says why from 2.10 on, nothing under
    ``python -O`` where that assert is stripped."""
    arguments = torch_single_process_timeout_refusal()
    return None if arguments is None else AssertionError(*arguments)


@functools.cache
def torch_single_process_timeout_refusal() -> tuple[Any, ...] | None:
    """The arguments of torch's refusal, asked of torch on an empty loader (with a generator of
    its own: the iterator draws a seed, which must not come from the global RNG)."""
    nothing: Any = []
    probe: torch.utils.data.DataLoader[Any]
    probe = torch.utils.data.DataLoader(nothing, timeout=1, generator=torch.Generator())
    try:
        iter(probe)
    except AssertionError as error:
        return error.args
    return None


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) under an initialized torch.distributed, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def shared_shuffle_seed(generator: torch.Generator | None) -> int:
    """One shuffle seed for every rank: each rank draws (so all ranks use their RNGs alike),
    and rank 0's draw is broadcast. A collective: every rank builds its loader, as with
    DistributedSampler."""
    drawn = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    shared: list[Any] = [drawn]
    torch.distributed.broadcast_object_list(shared, src=0)
    return int(shared[0])


def _is_int_at_least(value: Any, low: int) -> bool:
    """An integer (not a bool, which Python counts as one) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_worker_concurrency(
    worker_concurrency: int, dataset: Any, dataset_kind: int, worker_init_fn: Any
) -> int:
    """Validate ``worker_concurrency`` (and an async ``worker_init_fn``) against the dataset:
    concurrency comes from an async dataset's coroutines, which a sync dataset has none of."""
    if not _is_int_at_least(worker_concurrency, 1):
        raise ValueError(
            "worker_concurrency option should be a positive integer, but got "
            f"worker_concurrency={worker_concurrency!r}"
        )
    is_async = is_async_dataset(dataset, dataset_kind)
    if worker_concurrency > 1 and not is_async:
        raise ValueError(
            f"worker_concurrency={worker_concurrency} needs an async dataset (`async def "
            "__getitem__`, `async def __getitems__` or `__aiter__`); "
            f"{type(dataset).__name__} is synchronous, so each worker fetches one sample at a "
            "time (use more workers, or make the dataset async)"
        )
    if inspect.iscoroutinefunction(worker_init_fn) and not is_async:
        raise ValueError(
            "an async worker_init_fn needs an async dataset: it is awaited on the event loop "
            f"an async dataset's worker runs, and {type(dataset).__name__} is synchronous"
        )
    return worker_concurrency


def check_snapshot_steps(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(
            "snapshot_every_n_steps option should be None or a non-negative integer, but got "
            f"snapshot_every_n_steps={value!r}"
        )
    return value


def check_hang_report_after(value: Any) -> float | None:
    """None, or a positive number of seconds (``inf`` included: never)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise ValueError(
            "hang_report_after option should be None or a positive number of seconds, but "
            f"got hang_report_after={value!r}"
        )
    return float(value)


def check_sample_errors(on_sample_error: Any, max_skipped: Any, sample_retries: Any) -> None:
    if not (on_sample_error in ("raise", "skip") or callable(on_sample_error)):
        raise ValueError(
            "on_sample_error option should be 'raise', 'skip' or a callable "
            "(index, exception) -> 'raise' | 'skip', but got "
            f"on_sample_error={on_sample_error!r}"
        )
    if max_skipped is not None:
        if isinstance(max_skipped, bool) or not isinstance(max_skipped, (int, float)):
            valid = False
        elif isinstance(max_skipped, float):
            valid = 0.0 < max_skipped < 1.0
        else:
            valid = max_skipped >= 0
        if not valid:
            raise ValueError(
                "max_skipped option should be None, a non-negative integer (a count) or a "
                f"float in (0, 1) (a fraction of the pass's samples), but got "
                f"max_skipped={max_skipped!r}"
            )
        if on_sample_error == "raise":
            raise ValueError(
                "max_skipped caps skipped samples, but on_sample_error='raise' skips none: "
                "pass on_sample_error='skip' (or a callable) with it"
            )
    if not _is_int_at_least(sample_retries, 0):
        raise ValueError(
            "sample_retries option should be a non-negative integer, but got "
            f"sample_retries={sample_retries!r}"
        )


def check_device(device: str | torch.device | None, stacklevel: int = 3) -> torch.device | None:
    """Validate ``device`` now, with a clear error, rather than in the middle of a pass.

    Where no accelerator is usable (a CPU-only build, or a CUDA build on a machine without a
    GPU or driver), an accelerator ``device`` goes the way torch takes ``pin_memory=True``
    there: one warning, and batches stay on the CPU, so one script runs on both machines. An
    accelerator that is there but is not the one named, or a device index past the last, is
    an error."""
    if device is None:
        return None
    resolved = torch.device(device)
    if resolved.type == "cpu":
        return None
    if not torch.accelerator.is_available():
        warnings.warn(
            f"aioload: 'device' argument is set as {str(device)!r} but no accelerator is "
            "found, then batches stay on the CPU.",
            UserWarning,
            stacklevel=stacklevel,
        )
        return None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"aioload: device={str(device)!r} needs CUDA, but the accelerator here is "
                f"{torch.accelerator.current_accelerator()}."
            )
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        elif resolved.index >= torch.cuda.device_count():
            raise RuntimeError(
                f"aioload: device={str(device)!r} does not exist: "
                f"{torch.cuda.device_count()} CUDA device(s) are visible."
            )
        return resolved
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != resolved.type:
        raise RuntimeError(
            f"aioload: device={str(device)!r} is not available here "
            f"(current accelerator: {accelerator})."
        )
    return resolved


# -- each pass -----------------------------------------------------------------------------


class LoaderView(Protocol):
    """What a pass reads of its ``DataLoader`` (and, for the next pass, writes back): the
    arguments as they are now (torch's may be changed after construction, and are read at
    each pass, as torch does) and the loader's state between passes."""

    dataset: Any
    _dataset_kind: int
    collate_fn: Any
    drop_last: bool
    worker_init_fn: Any
    num_workers: int
    prefetch_factor: int | None
    multiprocessing_context: Any
    generator: Any
    sampler: Any
    pin_memory: bool
    pin_memory_device: str
    timeout: float
    in_order: bool
    _IterableDataset_len_called: Any
    _rank: int
    _world_size: int
    worker_concurrency: int
    on_sample_error: Any
    sample_retries: int
    max_skipped: int | float | None
    seed_per_sample: bool
    max_worker_restarts: int
    hang_report_after: float | None
    device: torch.device | None
    workers: WorkerFactory | None
    worker_method: str
    _method_choice: dict[str, Any] | None
    _workers: BackendKeeper
    _tuner: Any
    _shard_sampler: DistributedSampler[Any] | None
    _shared_seeds: SharedSeeds
    _next_epoch: int
    _pending_resume: PassProgress | None
    _pending_in_progress: bool
    _latest_pass: PassProgress | None
    _sample_seed: int | None
    _pool_seed: int | None
    _pass_stats: PassStats | None

    @property
    def _auto_collation(self) -> bool: ...

    @property
    def _index_sampler(self) -> Any: ...

    def _pool_reusable(self) -> bool: ...

    def _transfer(self) -> Transfer | None: ...


def worker_spec(loader: LoaderView) -> WorkerSpec:
    """What the pass's workers run, from the loader's arguments as they are now."""
    return WorkerSpec(
        dataset=loader.dataset,
        dataset_kind=loader._dataset_kind,
        auto_collation=loader._auto_collation,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        worker_init_fn=loader.worker_init_fn,
        num_workers=loader.num_workers,
        prefetch_factor=prefetch_depth(loader),
        multiprocessing_context=loader.multiprocessing_context,
        # Stack straight into the shared-memory slab when the collate is torch's default.
        slab_collate=loader.collate_fn is default_collate,
        rank=loader._rank,
        world_size=loader._world_size,
        worker_concurrency=loader.worker_concurrency,
        sample_policy=SamplePolicy(loader.on_sample_error, loader.sample_retries),
        worker_method=loader.worker_method,
    )


def skip_cap(loader: LoaderView) -> SkipCap | None:
    """max_skipped for a pass; a fraction is of the sampler's length (an IterableDataset's
    ``len``, where it has one)."""
    if loader.max_skipped is None:
        return None
    total: int | None = None
    if isinstance(loader.max_skipped, float):
        try:
            total = len(loader.dataset if loader._dataset_kind == 1 else loader.sampler)
        except TypeError:
            total = None
    return SkipCap(loader.max_skipped, total)


def hang_watch(loader: LoaderView, stats: PassStats) -> HangWatch:
    """A pass's hang report, from ``hang_report_after`` as it is now (None or inf: none)."""
    after = loader.hang_report_after
    if after is None or after == math.inf:
        return NO_HANG_REPORT
    return HangWatch(after, stats, in_order=loader.in_order)


def draw_shared_seed(loader: LoaderView) -> int:
    """An IterDataPipe's shuffle seed for a pass, shared by every worker (and rank)."""
    return loader._shared_seeds.draw(loader.generator)


def prefetch_depth(loader: LoaderView) -> int:
    """Batches in flight per worker for the next pass. Read at each pass, as torch does:
    ``num_workers`` may be changed after construction (it is not a locked attribute), and
    then ``prefetch_factor`` is stale. Torch ignores it without workers (one batch at a
    time in the calling process) and uses it as is with them; ``None`` there (a loader
    built with ``num_workers=0``) makes torch's iterator fail with a TypeError, where we
    take 1 rather than fail."""
    if loader.num_workers == 0:
        return 1
    return loader.prefetch_factor or 1


def draw_base_seed(loader: LoaderView) -> int:
    # Exactly torch's draw, at the same point (after iter(sampler), before any sampling),
    # so a loader built with the same generator or global seed sees the same sequence.
    return int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())


def pass_engine(loader: LoaderView, offload_inline: bool) -> Orchestrator:
    """One pass: its setup, its backend (made on its first next()), and its engine."""
    setup, backend = pass_setup(loader, offload_inline)
    loader._pass_stats = PassStats(
        max(1, loader.num_workers),
        in_process=loader.num_workers == 0,
        auto_collation=loader._auto_collation,
    )
    # One list, appended to as batches are delivered: stats() and state_dict() read it.
    loader._pass_stats.skipped = setup.progress.skipped
    loader._pass_stats.method_choice = loader._method_choice
    if loader._tuner is not None:
        # "auto": the pass feeds its counters to the controller (also stats()["tuning"]).
        setup = setup._replace(tuning=PassTuning(loader._tuner, loader._pass_stats))
    setup = setup._replace(hang=hang_watch(loader, loader._pass_stats))
    engine = Orchestrator(backend.make, setup, owns_backend=backend.owned, stats=loader._pass_stats)
    track_pass(engine)  # a forked child's copy of it raises, saying so
    if backend.owned:
        # Also on garbage collection of an abandoned pass (``break``, ``del``) and at exit.
        weakref.finalize(engine, engine.owned.close)
    else:
        loader._workers.current_pass = weakref.ref(engine)
    return engine


def begin_tuned_pass(loader: LoaderView, resume: PassProgress | None, reuse_workers: bool) -> None:
    """num_workers="auto" with an IterableDataset: each worker holds its own stream, so
    the count is chosen for the whole pass, here (from the last pass's measurements), and
    held while persistent workers are kept or a checkpoint's streams are resumed."""
    tuner = loader._tuner
    assert tuner is not None
    hold: int | None = None
    if reuse_workers:
        hold = loader.num_workers
    elif resume is not None and loader._pending_in_progress and tuner.per_pass_workers:
        hold = len(resume.streams)
    tuner.begin_pass(hold, starting=not reuse_workers)
    if tuner.per_pass_workers and tuner.workers.auto:
        loader.num_workers = tuner.pass_workers()


def pass_setup(loader: LoaderView, offload_inline: bool) -> tuple[PassSetup, BackendChoice]:
    """The one place a pass is described: its number, its randomness (drawn or replayed,
    see ``_engine.resume.begin_pass``), its workers and its settings."""
    transfer = loader._transfer()
    epoch = loader._next_epoch
    loader._next_epoch = epoch + 1
    if loader._shard_sampler is not None:
        loader._shard_sampler.set_epoch(epoch)
    resume, loader._pending_resume = loader._pending_resume, None
    reuse_workers = loader._pool_reusable()
    if loader._tuner is not None:
        begin_tuned_pass(loader, resume, reuse_workers)
    in_progress = resume is not None and loader._pending_in_progress
    in_caller = loader.num_workers == 0
    # NOTE [ The calling process's dataset and the process's generators ]
    # With num_workers=0 the dataset draws from the same process-wide generators (torch's,
    # random's, numpy's) as the pass itself (its base seed, its sampler's order), so the order
    # of the two must be an uninterrupted run's: a state taken between passes held the
    # dataset as it stood before the next pass drew, so it is loaded before this pass draws
    # (and not again at the first fetch); and the dataset's state at the start of a pass is
    # taken after the pass drew, where the first fetch finds it.
    preloaded = resume is not None and not in_progress and in_caller
    if preloaded:
        assert resume is not None
        load_in_caller(loader.dataset, resume.streams[0])
    points, load_points = start_points(
        loader.num_workers, loader.dataset, loader._latest_pass, resume, reuse_workers
    )
    start = begin_pass(
        epoch=epoch,
        resume=resume,
        in_progress=in_progress,
        reuse_workers=reuse_workers,
        index_sampler=loader._index_sampler,
        generators=loader_generators(loader),
        draw_base_seed=lambda: draw_base_seed(loader),
        sample_seed=loader._sample_seed,
        seed_per_sample=loader.seed_per_sample,
        iterable=loader._dataset_kind == 1,
        num_streams=max(1, loader.num_workers),
        rank=loader._rank,
        draw_shared_seed=(
            (lambda: draw_shared_seed(loader)) if is_iter_datapipe(loader.dataset) else None
        ),
        starts_workers=loader.num_workers > 0,
        points=points,
        load_points=load_points,
        worker_seed=loader._pool_seed if reuse_workers else None,
    )
    if in_caller and not in_progress:
        start.progress.streams = [live_point(loader.dataset)]
        if preloaded:
            start.plans[0] = start.plans[0]._replace(dataset_state=None)
    loader._sample_seed = start.sample_seed
    loader._latest_pass = start.progress
    if loader.num_workers > 0 and not reuse_workers:
        loader._pool_seed = start.base_seed  # the workers this pass starts
    if start.shared_seed is not None:
        # The calling process's copy too, as torch seeds it (what num_workers=0 reads).
        reseed(loader.dataset, start.shared_seed)
    if loader.num_workers == 0 and is_datapipe(loader.dataset):
        shard_in_process(loader.dataset, loader._world_size, loader._rank)

    if loader.num_workers == 0 and loader.timeout != 0:
        refusal = single_process_timeout_error()
        if refusal is not None:
            raise refusal
    spec = worker_spec(loader)
    if spec.worker_method == "auto":
        spec = spec._replace(worker_method=auto_worker_method(loader, spec))
    backend = choose_backend(
        spec,
        keeper=loader._workers,
        base_seed=start.base_seed,
        workers=loader.workers,
        async_front=offload_inline,
    )

    setup = PassSetup(
        batches=start.batches,
        num_workers=max(1, loader.num_workers),
        prefetch=prefetch_depth(loader),
        in_order=loader.in_order,
        timeout=loader.timeout,
        max_worker_restarts=loader.max_worker_restarts,
        progress=start.progress,
        plans=start.plans,
        traits=backend.traits,
        transfer=transfer,
        iterable_len=loader._IterableDataset_len_called,
        dataset=loader.dataset,
        skip_cap=skip_cap(loader),
    )
    return setup, backend


def load_in_caller(dataset: Any, point: StreamPoint) -> None:
    """Load the state a loaded checkpoint holds of the calling process's dataset (taken
    between passes) now."""
    if point.dataset_state is not None:
        dataset.load_state_dict(point.dataset_state)


def auto_worker_method(loader: LoaderView, spec: WorkerSpec) -> str:
    """worker_method="auto": chosen once, before the loader's first pass with workers, by a
    short trial (``_backends.method_choice.choose_worker_method``), and kept (``stats()["tuning"]``
    reports it with its figures)."""
    if loader.num_workers == 0:
        return "multiprocessing"  # (the calling process: no workers to choose for)
    if loader._method_choice is None:
        from .._backends.method_choice import choose_worker_method

        loader._method_choice = choose_worker_method(spec, usable_cores())
    return str(loader._method_choice["value"])


def fit_state(loader: LoaderView, parsed: ParsedState) -> None:
    """Check that a loaded state fits ``loader`` (``load_state_dict``), now rather than when
    the next pass starts, which would drop it; a map-style dataset's streams are redealt to
    ``loader``'s workers where their number changed and they hold no state."""
    progress = parsed.progress
    in_progress = parsed.in_progress
    iterable = loader._dataset_kind == 1
    check_fit(parsed, iterable=iterable, batches=pass_length(loader))
    streams = max(1, loader.num_workers)
    tuner = loader._tuner
    if iterable and in_progress and tuner is not None and tuner.per_pass_workers:
        # num_workers="auto": the resumed pass runs a worker per saved stream.
        streams = len(progress.streams) if tuner.workers.auto else streams
    if len(progress.streams) != streams:
        if iterable and in_progress:
            raise ValueError(
                f"aioload: the state was saved with num_workers={parsed.num_workers}; an "
                "IterableDataset's streams are per worker, so resume it with the same number"
            )
        if any(point.has_state for point in progress.streams):
            raise ValueError(
                f"aioload: the state holds the state_dict() of each of the "
                f"{len(progress.streams)} workers' copies of {type(loader.dataset).__name__}"
                f" (saved with num_workers={parsed.num_workers}); they load only into a "
                f"loader with as many workers, and this one has num_workers="
                f"{loader.num_workers}"
            )
        progress.streams = [StreamPoint() for _ in range(streams)]
        progress.next_worker = 0
    if any(point.dataset_state is not None for point in progress.streams) and not (
        is_stateful(loader.dataset)
    ):
        raise ValueError(
            f"aioload: the state holds a state_dict() of the dataset, but "
            f"{type(loader.dataset).__name__} has no load_state_dict(); build the loader "
            "with the same dataset"
        )
    if progress.sampler is not None and progress.sampler.state is not None and not iterable:
        stack = SamplerStack(loader._index_sampler)
        if not stack.target_stateful:
            raise ValueError(
                "aioload: the state holds a state_dict() of the sampler, but "
                f"{type(stack.target).__name__} has no load_state_dict(); build the loader "
                "with the same sampler"
            )
    # Checked now: a mismatch found when the next pass starts would drop the state.
    check_generator_count(progress.rng["generators"], loader_generators(loader))


def pass_length(loader: LoaderView) -> int | None:
    """How many batches a map-style pass has (None: the sampler has no length)."""
    try:
        return len(loader._index_sampler)
    except (TypeError, NotImplementedError):
        return None


def next_pass_progress(loader: LoaderView) -> PassProgress:
    """The state between passes (``state_dict()``): the next pass, as it will start."""
    reusable = loader._pool_reusable()
    iterable = loader._dataset_kind == 1
    return PassProgress(
        epoch=loader._next_epoch,
        rng={
            "torch": torch.get_rng_state(),
            "generators": generator_states(loader_generators(loader)),
        },
        sample_seed=loader._sample_seed,
        iterable=iterable,
        num_streams=max(1, loader.num_workers),
        drew_base_seed=not reusable,
        streams=next_points(loader.num_workers, loader.dataset, loader._latest_pass, reusable),
        worker_seed=loader._pool_seed if reusable else None,
        sampler=None if iterable else SamplerStack(loader._index_sampler).state_now(),
    )
