"""What lies between a loader's passes, and the plan of each: ``PassPlanner``.

One ``PassPlanner`` per ``DataLoader`` owns everything that outlives a pass: the next epoch's
number, seed_per_sample's base seed, the latest pass's ``PassProgress`` (what ``state_dict()``
reports while it runs), a loaded state waiting for the next pass, the kept workers
(``BackendKeeper``) and their base seed, an IterDataPipe's shared seeds, the latest pass's
counters (``stats()``) and ``worker_method="auto"``'s choice. The loader hands it its
arguments as they are now (``PassArguments``) and asks it for a pass, a state or an epoch; the
engine gets from it a ``PassSetup``, and updates the ``PassProgress`` in it as batches are
yielded. Nothing else holds or writes this state.

Each pass is planned in one order (docs/architecture.md, "A pass planned"): the epoch is
numbered, the loaded state (if any) is taken, the kind of pass is decided (``PassKind``), the
pass draws its randomness or replays it (``_engine/pass_start.py``, one function per kind),
and the backend is chosen (fresh or kept).
"""

from __future__ import annotations

import copy
import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._backends.base import BackendKeeper, WorkerSpec
from .._backends.choice import BackendChoice, choose_backend
from .._named_tuple import NamedTuple
from .._worker.datapipes import SharedSeeds, is_datapipe, is_iter_datapipe, reseed, shard_in_process
from .counters import PassStats
from .orchestrator import Orchestrator, PassSetup, track_pass
from .pass_start import (
    PassContext,
    PassKind,
    PassStart,
    kept_points,
    next_points,
    start_at_boundary,
    start_fresh,
    start_mid_pass,
    start_on_kept_workers,
)
from .resume import FORMAT, PassProgress, SamplerStack, YieldedPositions, generator_states
from .setup import (
    PassArguments,
    auto_worker_method,
    draw_base_seed,
    fit_state,
    hang_watch,
    prefetch_depth,
    single_process_timeout_error,
    skip_cap,
    worker_spec,
)

if TYPE_CHECKING:
    from .pinning import Transfer

__all__ = ["LoadedState", "PassPlanner", "pass_kind"]


class LoadedState(NamedTuple):
    """A state ``load_state_dict()`` took, waiting for the next pass."""

    progress: PassProgress
    # Taken in the middle of a pass (else between passes: it names the next one).
    mid_pass: bool


def pass_kind(loaded: LoadedState | None, reuse_workers: bool) -> PassKind:
    """Which kind of pass starts next. (A loaded state retires the kept workers, so a resumed
    pass never runs on them.)"""
    if loaded is not None:
        return PassKind.RESUMED_MID_PASS if loaded.mid_pass else PassKind.RESUMED_AT_BOUNDARY
    return PassKind.ON_KEPT_WORKERS if reuse_workers else PassKind.FRESH


class PassPlanner:
    """The one owner of what lies between a loader's passes: it plans each pass
    (``start_pass``), gives the state (``state_dict``) and takes it (``load_state_dict``)."""

    def __init__(self, workers: BackendKeeper) -> None:
        # Which workers a pass runs on: fresh ones, or (persistent_workers) those kept.
        self.workers = workers
        # The counters of the newest pass (kept after it ends, for stats()).
        self.stats: PassStats | None = None
        # The number the next pass gets (set_epoch, or one more than the last pass).
        self.next_epoch = 0
        # seed_per_sample's base seed: the first pass's base seed, kept for the loader's life
        # so that every epoch (and a resumed run) seeds sample i the same way.
        self.sample_seed: int | None = None
        # The latest pass, as state_dict() reports it; and a loaded state waiting for the next
        # pass to pick it up.
        self.latest: PassProgress | None = None
        self.loaded: LoadedState | None = None
        # The base seed of the kept workers (persistent_workers), for a state taken between
        # passes: a resumed run starts its workers with it.
        self.pool_seed: int | None = None
        # An IterDataPipe's per-pass shuffle seed, shared by the workers (and the ranks).
        self.shared_seeds = SharedSeeds()
        # worker_method="auto"'s trial, run once (its report, with the choice as "value").
        self.method_choice: dict[str, Any] | None = None
        # One pass starts at a time. Two threads that call iter() on one loader at once
        # would both find no pass on the kept workers (each becomes the current one only at
        # its end), and then both run on them: the one whose task generation is older saw
        # its epoch end empty, quietly. In turn, the later one supersedes the earlier.
        self._starting = threading.Lock()
        # worker_method="auto": held while its one trial runs (in the thread that makes a
        # pass's workers, which two passes may do at once).
        self._choosing = threading.Lock()

    # -- epochs and checkpoints ----------------------------------------------------------------

    def set_epoch(self, epoch: int, arguments: PassArguments) -> None:
        """``DataLoader.set_epoch``: number the next pass ``epoch``."""
        loaded = self.loaded
        if loaded is not None and loaded.progress.epoch != epoch and loaded.mid_pass:
            # Asked for another epoch than the checkpoint's: start that epoch from its first
            # batch, rather than mix the checkpoint's order with another epoch's seeds.
            warnings.warn(
                f"aioload: set_epoch({epoch}) after load_state_dict() of a state in the middle "
                f"of epoch {loaded.progress.epoch}: the loaded position is dropped",
                UserWarning,
                stacklevel=3,
            )
            self.loaded = None
        self._number_next_pass(epoch, arguments)

    def _number_next_pass(self, epoch: int, arguments: PassArguments) -> None:
        self.next_epoch = epoch
        # A sampler the user passed with set_epoch (a DistributedSampler of their own) is told
        # too; the shard sampler is set each pass (_plan).
        set_sampler_epoch = getattr(arguments.sampler, "set_epoch", None)
        if arguments.shard_sampler is None and callable(set_sampler_epoch):
            set_sampler_epoch(epoch)

    def state_dict(self, arguments: PassArguments) -> dict[str, Any]:
        """``DataLoader.state_dict()``: a loaded state not yet used, else the running pass,
        else the next pass, as it will start."""
        loaded = self.loaded
        if loaded is not None:
            progress, in_progress = loaded.progress, loaded.mid_pass
        elif self.latest is not None and not self.latest.finished:
            progress, in_progress = self.latest, True
        else:
            progress, in_progress = self._next_pass_progress(arguments), False
        state = progress.as_dict()
        shard_sampler = arguments.shard_sampler
        state.update(
            format=FORMAT,
            in_progress=in_progress,
            num_workers=arguments.num_workers,
            shard_seed=None if shard_sampler is None else int(shard_sampler.seed),
        )
        # A copy: the Stateful objects' states must not change under a checkpoint kept in
        # memory (or written by another thread) while iteration goes on.
        return copy.deepcopy(state)

    def _next_pass_progress(self, arguments: PassArguments) -> PassProgress:
        """The state between passes: the next pass, as it will start."""
        reusable = arguments.num_workers > 0 and self.workers.reusable(arguments.num_workers)
        iterable = arguments.dataset_kind == 1
        progress = PassProgress(
            epoch=self.next_epoch,
            rng={
                "torch": torch.get_rng_state(),
                "generators": generator_states(arguments.generators),
            },
            sample_seed=self.sample_seed,
            iterable=iterable,
            num_streams=max(1, arguments.num_workers),
            drew_base_seed=not reusable,
            worker_seed=self.pool_seed if reusable else None,
        )
        progress.streams = next_points(
            arguments.num_workers, arguments.dataset, self.latest, reusable
        )
        if not iterable:
            progress.sampler = SamplerStack(arguments.index_sampler).state_now()
        return progress

    def load_state_dict(self, state: Any, arguments: PassArguments) -> None:
        """``DataLoader.load_state_dict()``: check ``state`` against the loader now, and keep
        it for the next pass."""
        from .state_format import parse_state  # (only a loaded state needs it)

        parsed = parse_state(state)
        progress = parsed.progress
        in_progress = parsed.in_progress
        fit_state(arguments, parsed)
        if arguments.shard_sampler is not None and parsed.shard_seed is not None:
            arguments.shard_sampler.seed = parsed.shard_seed
        if progress.sample_seed is not None:
            self.sample_seed = progress.sample_seed
        if not in_progress:
            progress.yielded = YieldedPositions()
            progress.next_worker = 0
        skipped = sum(point.samples_seen for point in progress.streams if not point.has_state)
        if skipped and in_progress:
            warnings.warn(
                f"aioload: {type(arguments.dataset).__name__} has no state_dict()/"
                f"load_state_dict(), so it is resumed by fast-forward: its streams re-read and "
                f"drop the {skipped} sample(s) they had yielded. Define both methods to resume "
                "without re-reading.",
                UserWarning,
                stacklevel=3,
            )
        self._number_next_pass(progress.epoch, arguments)
        self.loaded = LoadedState(progress, in_progress)
        # NOTE: kept workers have drawn from their RNGs since they started, so the resumed
        # pass starts fresh ones, seeded as the state says (as StatefulDataLoader does); a
        # pass still running on the kept ones is served out.
        kept = self.workers.kept
        if kept is not None:
            kept.retire()

    # -- a pass ----------------------------------------------------------------------------------

    def start_pass(
        self, arguments: PassArguments, transfer: Transfer | None, async_for: bool
    ) -> Orchestrator:
        """One pass: its plan, its backend (made on its first next()), and its engine.
        ``arguments.num_workers`` is this pass's count when it returns (``"auto"`` may choose
        it per pass)."""
        with self._starting:
            return self._start_pass(arguments, transfer, async_for)

    def _start_pass(
        self, arguments: PassArguments, transfer: Transfer | None, async_for: bool
    ) -> Orchestrator:
        setup, backend = self._plan(arguments, transfer, async_for)
        stats = self.stats = PassStats(
            max(1, arguments.num_workers),
            in_process=arguments.num_workers == 0,
            auto_collation=arguments.auto_collation,
        )
        # One list, appended to as batches are delivered: stats() and state_dict() read it.
        stats.skipped = setup.progress.skipped
        stats.method_choice = self.method_choice
        if arguments.tuner is not None:
            # "auto": the pass feeds its counters to the controller (also stats()["tuning"]).
            from .pass_tuning import PassTuning  # (imported only with a controller to feed)

            setup = setup._replace(tuning=PassTuning(arguments.tuner, stats))
        setup = setup._replace(hang=hang_watch(arguments, stats))
        engine = Orchestrator(backend.make, setup, owns_backend=backend.owned, stats=stats)
        track_pass(engine)  # a forked child's copy of it raises, saying so
        if backend.owned:
            # Also on garbage collection of an abandoned pass (``break``, ``del``) and at exit.
            weakref.finalize(engine, engine.owned.close)
        else:
            self.workers.current_pass = weakref.ref(engine)
        return engine

    def _plan(
        self, arguments: PassArguments, transfer: Transfer | None, async_for: bool
    ) -> tuple[PassSetup, BackendChoice]:
        """The one place a pass is described: its number, its kind, its randomness (drawn or
        replayed, ``_engine.pass_start``), its workers and its settings."""
        epoch = self.next_epoch
        self.next_epoch = epoch + 1
        if arguments.shard_sampler is not None:
            arguments.shard_sampler.set_epoch(epoch)
        loaded, self.loaded = self.loaded, None
        reuse_workers = arguments.num_workers > 0 and self.workers.reusable(arguments.num_workers)
        if arguments.tuner is not None:
            self._tune_workers(arguments, loaded, reuse_workers)
        start = self._start(pass_kind(loaded, reuse_workers), arguments, epoch, loaded)
        self.sample_seed = start.sample_seed
        self.latest = start.progress
        if arguments.num_workers > 0 and not reuse_workers:
            self.pool_seed = start.base_seed  # the workers this pass starts
        if start.shared_seed is not None:
            # The calling process's copy too, as torch seeds it (what num_workers=0 reads).
            reseed(arguments.dataset, start.shared_seed)
        if arguments.num_workers == 0 and is_datapipe(arguments.dataset):
            shard_in_process(arguments.dataset, arguments.world_size, arguments.rank)
        if arguments.num_workers == 0 and arguments.timeout != 0:
            refusal = single_process_timeout_error()
            if refusal is not None:
                raise refusal
        backend = self._backend(arguments, start.base_seed, async_for)
        setup = PassSetup(
            batches=start.batches,
            num_workers=max(1, arguments.num_workers),
            prefetch=prefetch_depth(arguments),
            in_order=arguments.in_order,
            timeout=arguments.timeout,
            max_worker_restarts=arguments.max_worker_restarts,
            progress=start.progress,
            plans=start.plans,
            traits=backend.traits,
            transfer=transfer,
            iterable_len=arguments.iterable_len,
            dataset=arguments.dataset,
            skip_cap=skip_cap(arguments),
        )
        return setup, backend

    def _tune_workers(
        self, arguments: PassArguments, loaded: LoadedState | None, reuse_workers: bool
    ) -> None:
        """num_workers="auto" with an IterableDataset: each worker holds its own stream, so
        the count is chosen for the whole pass, here (from the last pass's measurements), and
        held while persistent workers are kept or a checkpoint's streams are resumed."""
        tuner = arguments.tuner
        hold: int | None = None
        if reuse_workers:
            hold = arguments.num_workers
        elif loaded is not None and loaded.mid_pass and tuner.per_pass_workers:
            hold = len(loaded.progress.streams)
        tuner.begin_pass(hold, starting=not reuse_workers)
        if tuner.per_pass_workers and tuner.workers.auto:
            arguments.num_workers = tuner.pass_workers()

    def _start(
        self, kind: PassKind, arguments: PassArguments, epoch: int, loaded: LoadedState | None
    ) -> PassStart:
        """The pass's randomness and plans, by its kind."""
        generator = arguments.generator
        ctx = PassContext(
            epoch=epoch,
            dataset=arguments.dataset,
            index_sampler=arguments.index_sampler,
            generators=arguments.generators,
            draw_base_seed=lambda: draw_base_seed(generator),
            draw_shared_seed=(
                (lambda: self.shared_seeds.draw(generator))
                if is_iter_datapipe(arguments.dataset)
                else None
            ),
            iterable=arguments.dataset_kind == 1,
            num_streams=max(1, arguments.num_workers),
            rank=arguments.rank,
            starts_workers=arguments.num_workers > 0,
            seed_per_sample=arguments.seed_per_sample,
            sample_seed=self.sample_seed,
        )
        if kind is PassKind.ON_KEPT_WORKERS:
            kept = kept_points(arguments.num_workers, self.latest, reusable=True)
            return start_on_kept_workers(ctx, kept, self.pool_seed)
        if kind is PassKind.FRESH:
            return start_fresh(ctx)
        assert loaded is not None
        if kind is PassKind.RESUMED_AT_BOUNDARY:
            return start_at_boundary(ctx, loaded.progress)
        return start_mid_pass(ctx, loaded.progress)

    def _backend(
        self, arguments: PassArguments, base_seed: int | None, async_for: bool
    ) -> BackendChoice:
        """The pass's backend: what its workers run, and on which (fresh or kept) workers."""
        spec = worker_spec(arguments)
        choose_method: Callable[[WorkerSpec], str] | None = None
        if spec.worker_method == "auto":
            # Chosen once, when the loader's first pass with workers makes them (in a thread
            # under `async for`: the trial takes a fraction of a second, which the loop must
            # not wait out), and kept. Until then the report is an empty dict, which stats()
            # leaves out.
            if arguments.num_workers == 0:  # (the calling process: no workers to choose for)
                spec = spec._replace(worker_method="multiprocessing")
            elif self.method_choice:
                spec = spec._replace(worker_method=str(self.method_choice["value"]))
            else:
                if self.method_choice is None:
                    self.method_choice = {}  # (filled in place by the one trial)
                choose_method = functools.partial(
                    _decide_method, self.method_choice, self._choosing
                )
        return choose_backend(
            spec,
            keeper=self.workers,
            base_seed=base_seed,
            workers=arguments.workers,
            async_for=async_for,
            choose_method=choose_method,
        )


def _decide_method(choice: dict[str, Any], choosing: threading.Lock, spec: WorkerSpec) -> str:
    """worker_method="auto": the trial's choice, made once per loader (the report filled in
    place; two passes that make their workers at once wait for the one trial)."""
    with choosing:
        if not choice:
            choice.update(auto_worker_method(spec))
    return str(choice["value"])
