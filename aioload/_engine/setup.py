"""How a ``DataLoader`` is set up: its arguments checked and normalised once, when it is built,
and what each pass reads of them (``PassArguments``) made into what the pass runs: its workers'
``WorkerSpec``, its skip cap and its hang report.

``loader.py`` keeps the class, its public methods and its documentation; what it does with its
arguments is here, as functions of the values (at construction) or of a ``PassArguments`` (each
pass). ``_engine/passes.py`` plans the passes. Nothing here imports the loader.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed
import torch.utils.data
from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset
from torch.utils.data._utils.collate import default_collate

from .._backends.base import WorkerSpec
from .._backends.choice import WorkerFactory
from .._named_tuple import NamedTuple
from .._worker.async_detect import is_async_dataset
from .._worker.datapipes import is_datapipe
from .._worker.fetch import SamplePolicy, is_stateful
from .counters import PassStats, SkipCap
from .hang import NO_HANG_REPORT, HangWatch
from .measure import usable_cores
from .resume import SamplerStack, StreamPoint, check_generator_count

if TYPE_CHECKING:
    from .pass_tuning import AutoArguments as AutoChoice
    from .state_format import ParsedState

__all__ = [
    "AutoArguments",
    "ExtraArguments",
    "PassArguments",
    "Resolved",
    "ShardArguments",
    "check_extras",
    "check_worker_method",
    "fit_state",
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


class ShardArguments(NamedTuple):
    """The arguments ``shard="auto"`` builds this rank's sampler from."""

    shard: str
    shuffle: bool | None
    sampler: Any
    batch_sampler: Any
    drop_last: bool
    generator: torch.Generator | None


class AutoArguments(NamedTuple):
    """The arguments that may be ``"auto"`` (docs/tuning.md), and the memory bound."""

    num_workers: int | str
    prefetch_factor: int | str | None
    worker_concurrency: int | str
    max_memory: float | None


def resolve_arguments(dataset: Any, sharding: ShardArguments, auto: AutoArguments) -> Resolved:
    """``shard`` (the rank, and the shard sampler: a collective where it shuffles) and the
    ``"auto"`` arguments, before torch validates the rest."""
    shard = sharding.shard
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
        sharding.shard == "auto"
        and world_size > 1
        and sharding.sampler is None
        and sharding.batch_sampler is None
        and not isinstance(dataset, IterableDataset)
    ):
        shard_sampler = DistributedSampler(
            dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=bool(sharding.shuffle),
            seed=shared_shuffle_seed(sharding.generator) if sharding.shuffle else 0,
            drop_last=sharding.drop_last,
        )
    # num_workers / prefetch_factor / worker_concurrency "auto" (docs/tuning.md): torch sees
    # the integers the workers are built with, and the controller keeps the rest.
    chosen = _auto_choice(auto, dataset)
    resolved: tuple[Any, Any, Any] = (
        auto.num_workers,
        auto.prefetch_factor,
        auto.worker_concurrency,
    )
    if chosen is not None:
        resolved = (chosen.num_workers, chosen.prefetch_factor, chosen.worker_concurrency)
    elif auto.worker_concurrency == "auto":
        # A sync dataset fetches one sample at a time: "auto" has only 1 to choose from.
        resolved = (auto.num_workers, auto.prefetch_factor, 1)
    # (Typed as torch takes them; torch and check_worker_concurrency validate them.)
    return Resolved(
        rank,
        world_size,
        shard_sampler,
        chosen.controller if chosen is not None else None,
        *resolved,
    )


def _auto_choice(auto: AutoArguments, dataset: Any) -> AutoChoice | None:
    """``pass_tuning.auto_arguments``'s check and choice; None when there is nothing to tune.

    NOTE: the controller's modules (``pass_tuning``, ``tuning``) are imported only when a loader
    has an ``"auto"`` value or a ``max_memory``: nothing else in a pass runs them, and their
    import counted in the time to a default loader's first batch. Without any of those,
    ``auto_arguments`` checks nothing and returns None, so this returns None before it."""
    values = (auto.num_workers, auto.prefetch_factor, auto.worker_concurrency)
    if auto.max_memory is None and not any(isinstance(value, str) for value in values):
        return None
    from .pass_tuning import auto_arguments

    iterable = isinstance(dataset, IterableDataset)
    return auto_arguments(
        *values,
        auto.max_memory,
        iterable=iterable,
        is_async=is_async_dataset(dataset, int(iterable)),
    )


class Extras(NamedTuple):
    """aioload's own arguments, checked (after torch's), as the loader keeps them."""

    device: torch.device | None
    worker_concurrency: int
    snapshot_every_n_steps: int | None
    hang_report_after: float | None


class ExtraArguments(NamedTuple):
    """aioload's own arguments that ``check_extras`` checks, as the user passed them."""

    device: str | torch.device | None
    max_worker_restarts: Any
    workers: Any
    worker_concurrency: int
    worker_init_fn: Any
    on_sample_error: Any
    max_skipped: Any
    sample_retries: Any
    snapshot_every_n_steps: Any
    hang_report_after: Any


def check_extras(
    dataset: Any,
    dataset_kind: int,
    num_workers: int,
    prefetch_factor: int | None,
    extras: ExtraArguments,
) -> Extras:
    """Check the arguments torch does not take (or takes, and fails on later), each with a
    message that says what a valid value is."""
    if prefetch_factor == 0 and num_workers > 0:
        # torch accepts 0 here and then fails inside its iterator; fail early and clearly.
        raise ValueError("prefetch_factor option should be positive when num_workers > 0")
    # (stacklevel: the warning points at the user's DataLoader(...) call.)
    checked_device = check_device(extras.device, stacklevel=4)
    if not isinstance(extras.max_worker_restarts, int) or extras.max_worker_restarts < 0:
        raise ValueError("max_worker_restarts option should be a non-negative integer")
    if extras.max_worker_restarts and num_workers == 0:
        raise ValueError("max_worker_restarts option needs num_workers > 0")
    if extras.max_worker_restarts and isinstance(dataset, IterableDataset):
        raise ValueError(
            "max_worker_restarts is not supported with an IterableDataset: a replacement "
            "worker would start its iterator over, so samples would repeat"
        )
    if extras.workers is not None and not isinstance(extras.workers, WorkerFactory):
        raise TypeError(
            f"workers option should be None (local processes) or aioload.RayWorkers, but "
            f"got workers={extras.workers!r}"
        )
    concurrency = check_worker_concurrency(
        extras.worker_concurrency, dataset, dataset_kind, extras.worker_init_fn
    )
    check_sample_errors(extras.on_sample_error, extras.max_skipped, extras.sample_retries)
    return Extras(
        checked_device,
        concurrency,
        check_snapshot_steps(extras.snapshot_every_n_steps),
        check_hang_report_after(extras.hang_report_after),
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
    if worker_method == "thread" and num_workers > 0 and is_datapipe(dataset):
        # A DataPipe is sharded and reseeded in place in each worker (torch's workers each
        # have a copy): one object shared by threads cannot be. ("auto" takes processes.)
        raise ValueError(
            f"worker_method={worker_method!r} does not support DataPipes: each worker shards "
            "and reseeds its own copy of the pipe, and thread workers share one; use "
            "worker_method='multiprocessing'"
        )
    # ("auto" needs no warning: a dataset that draws from the global generators gets
    # processes, one that draws from its worker's rng threads, and either way each sample is
    # seeded as documented.)
    if worker_method == "thread" and seed_per_sample:
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


# (eq=False: passes' arguments are never compared, and each method a dataclass makes costs
# the first batch of a fresh process part of a millisecond.)
@dataclass(eq=False)
class PassArguments:
    """What a pass reads of its ``DataLoader``: the arguments as they are when the pass starts
    (torch's may be changed after construction, and are read at each pass, as torch does).
    The loader makes one for each pass, and for ``state_dict()``/``load_state_dict()``; a
    pass changes none of it but ``num_workers`` (``"auto"``, once per pass: see
    ``_engine.passes.PassPlanner.tune_workers``)."""

    dataset: Any
    dataset_kind: int
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    worker_init_fn: Any
    num_workers: int
    prefetch_factor: int | None
    multiprocessing_context: Any
    generator: Any
    # The loader's generators, and the sampler any fraction of max_skipped is of.
    generators: list[torch.Generator]
    sampler: Any
    # What the pass draws its indices from (``DataLoader._index_sampler``).
    index_sampler: Any
    timeout: float
    in_order: bool
    # torch's IterableDataset length warning: len(dataloader) as reported.
    iterable_len: Any
    rank: int
    world_size: int
    worker_concurrency: int
    on_sample_error: Any
    sample_retries: int
    max_skipped: int | float | None
    seed_per_sample: bool
    max_worker_restarts: int
    hang_report_after: float | None
    workers: WorkerFactory | None
    worker_method: str
    # The "auto" controller, if any; shard="auto"'s sampler, if any.
    tuner: Any
    shard_sampler: DistributedSampler[Any] | None


def worker_spec(loader: PassArguments) -> WorkerSpec:
    """What the pass's workers run, from the loader's arguments as they are now."""
    return WorkerSpec(
        dataset=loader.dataset,
        dataset_kind=loader.dataset_kind,
        auto_collation=loader.auto_collation,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
        worker_init_fn=loader.worker_init_fn,
        num_workers=loader.num_workers,
        prefetch_factor=prefetch_depth(loader),
        multiprocessing_context=loader.multiprocessing_context,
        # Stack straight into the shared-memory slab when the collate is torch's default.
        slab_collate=loader.collate_fn is default_collate,
        rank=loader.rank,
        world_size=loader.world_size,
        worker_concurrency=loader.worker_concurrency,
        sample_policy=SamplePolicy(loader.on_sample_error, loader.sample_retries),
        worker_method=loader.worker_method,
    )


def skip_cap(loader: PassArguments) -> SkipCap | None:
    """max_skipped for a pass; a fraction is of the sampler's length (an IterableDataset's
    ``len``, where it has one)."""
    if loader.max_skipped is None:
        return None
    total: int | None = None
    if isinstance(loader.max_skipped, float):
        try:
            total = len(loader.dataset if loader.dataset_kind == 1 else loader.sampler)
        except TypeError:
            total = None
    return SkipCap(loader.max_skipped, total)


def hang_watch(loader: PassArguments, stats: PassStats) -> HangWatch:
    """A pass's hang report, from ``hang_report_after`` as it is now (None or inf: none)."""
    after = loader.hang_report_after
    if after is None or after == math.inf:
        return NO_HANG_REPORT
    return HangWatch(after, stats, in_order=loader.in_order)


def prefetch_depth(loader: PassArguments) -> int:
    """Batches in flight per worker for the next pass. Read at each pass, as torch does:
    ``num_workers`` may be changed after construction (it is not a locked attribute), and
    then ``prefetch_factor`` is stale. Torch ignores it without workers (one batch at a
    time in the calling process) and uses it as is with them; ``None`` there (a loader
    built with ``num_workers=0``) makes torch's iterator fail with a TypeError, where we
    take 1 rather than fail."""
    if loader.num_workers == 0:
        return 1
    return loader.prefetch_factor or 1


def draw_base_seed(generator: torch.Generator | None) -> int:
    # Exactly torch's draw, at the same point (after iter(sampler), before any sampling),
    # so a loader built with the same generator or global seed sees the same sequence.
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def auto_worker_method(spec: WorkerSpec) -> dict[str, Any]:
    """worker_method="auto" (``spec``'s): a short trial (``_backends.method_choice.choose_worker_method``),
    run once, when the loader's first pass with workers makes them; its report
    (``stats()["tuning"]``) holds the choice as ``"value"``, and the loader keeps it."""
    from .._backends.method_choice import choose_worker_method

    return choose_worker_method(spec, usable_cores())


def fit_state(loader: PassArguments, parsed: ParsedState) -> None:
    """Check that a loaded state fits ``loader`` (``load_state_dict``), now rather than when
    the next pass starts, which would drop it; a map-style dataset's streams are redealt to
    ``loader``'s workers where their number changed and they hold no state."""
    progress = parsed.progress
    in_progress = parsed.in_progress
    from .state_format import check_fit  # (only a loaded state needs it)

    iterable = loader.dataset_kind == 1
    check_fit(parsed, iterable=iterable, batches=pass_length(loader))
    streams = max(1, loader.num_workers)
    tuner = loader.tuner
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
        stack = SamplerStack(loader.index_sampler)
        if not stack.target_stateful:
            raise ValueError(
                "aioload: the state holds a state_dict() of the sampler, but "
                f"{type(stack.target).__name__} has no load_state_dict(); build the loader "
                "with the same sampler"
            )
    # Checked now: a mismatch found when the next pass starts would drop the state.
    check_generator_count(progress.rng["generators"], loader.generators)


def pass_length(loader: PassArguments) -> int | None:
    """How many batches a map-style pass has, where its sampler says so and can be trusted to
    (None: the sampler has no length, or it is the user's own). torch lets a sampler's
    ``__len__`` be an estimate (a bucketing sampler's often is) and iterates past it; a state
    taken past that length must still load, so only torch's own samplers bound it."""
    sampler = loader.index_sampler
    if not _exact_length(sampler):
        return None
    try:
        return len(sampler)
    except (TypeError, NotImplementedError):
        return None


def _exact_length(sampler: Any) -> bool:
    # torch's samplers (and aioload's, in their place) count exactly what they yield; a
    # BatchSampler's count is its sampler's.
    if not type(sampler).__module__.startswith(("torch.utils.data", "aioload.")):
        return False
    inner = getattr(sampler, "sampler", None) if isinstance(sampler, BatchSampler) else None
    return inner is None or _exact_length(inner)
