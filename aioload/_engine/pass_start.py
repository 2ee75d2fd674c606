"""How a pass starts, by its kind: its randomness drawn (or replayed), its numbered batches, and
each worker's plan.

There are four kinds of pass (``PassKind``), and each has one function here:

- ``start_fresh``: a pass on new workers (or in the calling process). It draws its sampler
  order and its workers' base seed from the loader's generators, as torch's iterator does.
- ``start_on_kept_workers``: ``persistent_workers``' next pass. The workers live on, so no base
  seed is drawn; they are rewound to what the last pass yielded.
- ``start_at_boundary``: the first pass after ``load_state_dict()`` of a state taken between
  passes. It draws from the generators' recorded states as the pass would have.
- ``start_mid_pass``: the first pass after ``load_state_dict()`` of a state taken in the
  middle of a pass. It replays that pass's draws and leaves out the batches it had yielded.

Every kind draws in torch's order (``_draw``): ``iter(sampler)``, then the base seed, then
sampling, with the RNG states taken just before recorded in the pass's ``PassProgress``, so
that the pass is replayable. A resumed pass draws from the recorded states; torch's global RNG
is the caller's: if it is where the recorded pass started (the caller restored it with the
checkpoint, taken between passes), the pass moves it on as the interrupted run's did; anywhere
else (a caller's RNG restored in the middle of a pass is already past the pass's draws), it is
given back untouched (``_replaying``).
"""

from __future__ import annotations

import contextlib
import copy
import enum
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .._named_tuple import NamedTuple
from .._wire.messages import PassPlan
from .._worker.fetch import is_stateful
from .resume import (
    PassProgress,
    SamplerPoint,
    SamplerStack,
    SamplerTrack,
    StreamPoint,
    YieldedPositions,
    batches_of,
    generator_states,
    numbered_batches,
    set_generator_states,
)

__all__ = [
    "PassContext",
    "PassKind",
    "PassStart",
    "kept_points",
    "live_point",
    "next_points",
    "start_at_boundary",
    "start_fresh",
    "start_mid_pass",
    "start_on_kept_workers",
]


class PassKind(enum.Enum):
    """What a pass starts from; it decides which of this module's functions starts it."""

    FRESH = "new workers, or the calling process"
    ON_KEPT_WORKERS = "persistent workers' next pass"
    RESUMED_AT_BOUNDARY = "a state taken between passes"
    RESUMED_MID_PASS = "a state taken in the middle of a pass"


class PassContext(NamedTuple):
    """What a pass's start reads: of the loader's arguments, and of what it keeps between
    passes (``_engine.passes.PassPlanner``)."""

    epoch: int
    dataset: Any
    index_sampler: Iterable[Any]
    # The loader's generators (the sampler's, as ``_engine.samplers.loader_generators``).
    generators: list[torch.Generator]
    draw_base_seed: Callable[[], int]
    # An IterDataPipe's shuffle seed, shared by the workers; None for any other dataset.
    draw_shared_seed: Callable[[], int] | None
    iterable: bool
    # Worker streams (1 in the calling process), and the rank (each stream's id).
    num_streams: int
    rank: int
    # num_workers > 0 (else the dataset is fetched in the calling process).
    starts_workers: bool
    seed_per_sample: bool
    # seed_per_sample's base seed, kept for the loader's life (None before the first pass).
    sample_seed: int | None


class PassStart(NamedTuple):
    """What a pass draws when it starts: its numbered batches, base seed and progress."""

    # (sampler position, indices); positions a resumed pass had already yielded left out.
    batches: Iterator[tuple[int, Any]]
    # The workers' base seed; None when the pass reuses persistent workers.
    base_seed: int | None
    # seed_per_sample's base seed for the loader's life (the first pass's base seed).
    sample_seed: int | None
    progress: PassProgress
    plans: list[PassPlan]
    # An IterDataPipe's shuffle seed for this pass, the same in every worker (see _worker.datapipes).
    shared_seed: int | None = None


# -- the four kinds ---------------------------------------------------------------------------


def start_fresh(ctx: PassContext) -> PassStart:
    """A pass on new workers, or in the calling process: everything drawn now."""
    progress = _progress(ctx, _current_rng(ctx), drew_base_seed=True)
    draw = _draw(ctx, draws_seed=True, loaded=None, iter_point=None)
    batches = _numbered(draw, progress, start=0, skip=None)
    if not ctx.starts_workers:
        # NOTE [ The calling process's dataset and the process's generators ]
        # Its state at the pass's start is taken after the pass drew (from the same
        # process-wide generators the dataset may draw from), where the first fetch finds it.
        progress.streams = [live_point(ctx.dataset)]
    return _started(ctx, progress, draw, batches, load=False)


def start_on_kept_workers(
    ctx: PassContext, kept: list[StreamPoint] | None, worker_seed: int | None
) -> PassStart:
    """``persistent_workers``' next pass: no base seed drawn. The kept workers load ``kept``,
    where the last pass left them (or go back to their first state where that had none:
    ``PassPlan.rewind``): after a pass left early (``break``) they had fetched batches nobody
    received; a worker started late may have skipped the last pass's start, where a resumed
    pass gave it its state."""
    progress = _progress(ctx, _current_rng(ctx), drew_base_seed=False)
    draw = _draw(ctx, draws_seed=False, loaded=None, iter_point=None)
    batches = _numbered(draw, progress, start=0, skip=None)
    progress.worker_seed = worker_seed
    if kept is not None:
        progress.streams = [point.copy() for point in kept]
    return _started(ctx, progress, draw, batches, load=kept is not None, rewind=True)


def start_at_boundary(ctx: PassContext, resume: PassProgress) -> PassStart:
    """The pass a state taken between passes names: drawn from the generators' states it
    recorded, as that pass would have drawn; each worker's dataset loads its saved state."""
    in_caller = not ctx.starts_workers
    if in_caller:
        # NOTE [ The calling process's dataset and the process's generators ]
        # With num_workers=0 the dataset draws from the same process-wide generators as the
        # pass itself, so the order of the two must be an uninterrupted run's: a state taken
        # between passes held the dataset as it stood before the next pass drew, so it is
        # loaded before this pass draws (and not again at the first fetch).
        _load_in_caller(ctx.dataset, resume.streams[0])
    progress = _progress(ctx, resume.rng, drew_base_seed=resume.drew_base_seed)
    with _replaying(ctx, resume.rng, keep_callers=True):
        draw = _draw(ctx, resume.drew_base_seed, _sampler_of(ctx, resume), iter_point=None)
        batches = _numbered(draw, progress, start=0, skip=None)
        draw = _seeded(ctx, draw, resume)
    progress.streams = [point.copy() for point in resume.streams]
    start = _started(ctx, progress, draw, batches, load=True)
    if in_caller:
        progress.streams = [live_point(ctx.dataset)]
        start.plans[0] = start.plans[0]._replace(dataset_state=None)
    return start


def start_mid_pass(ctx: PassContext, resume: PassProgress) -> PassStart:
    """The rest of a pass checkpointed in its middle: its draws replayed from the recorded
    states, the positions it had yielded left out (an IterableDataset's streams go on from
    their saved states instead), its skipped samples carried on."""
    progress = _progress(ctx, resume.rng, drew_base_seed=resume.drew_base_seed)
    # A pass checkpointed in the calling process before its first batch: its dataset had drawn
    # nothing yet, and would have found the generators where the pass's own draws left them
    # (torchdata's state holds them there, in the state of the iterator torch's single-process
    # iterator makes at iter()). The resumed pass leaves them there.
    keep_callers = ctx.starts_workers or bool(len(resume.yielded))
    loaded = _sampler_of(ctx, resume)
    start, skip = 0, None
    if ctx.iterable:
        # Positions mean nothing to an IterableDataset; only the count goes on.
        progress.yielded = YieldedPositions(len(resume.yielded))
        start = len(resume.yielded)
    else:
        progress.yielded = resume.yielded.copy()
        skip = resume.yielded
        if loaded is not None:
            # A Stateful sampler goes on from its loaded state: its batches are numbered from
            # the first position not in the yielded prefix.
            start = resume.yielded.prefix
    with _replaying(ctx, resume.rng, keep_callers):
        draw = _draw(ctx, resume.drew_base_seed, loaded, iter_point=loaded)
        batches = _numbered(draw, progress, start, skip)
        draw = _seeded(ctx, draw, resume)
    progress.streams = [point.copy() for point in resume.streams]
    if len(resume.streams) == ctx.num_streams:
        progress.next_worker = resume.next_worker
    # The skips so far go on: the list, its count and the cap.
    progress.skipped = list(resume.skipped)
    return _started(ctx, progress, draw, batches, load=True)


# -- what every kind does ---------------------------------------------------------------------


class _Draw(NamedTuple):
    """A pass's draws: its sampler's batches (not yet numbered), and its seeds."""

    raw: Iterator[Any]
    stack: SamplerStack | None
    # The Stateful sampler's state before the pass's first batch (None: an IterableDataset).
    initial: SamplerPoint | None
    shared_seed: int | None
    base_seed: int | None


def _current_rng(ctx: PassContext) -> dict[str, Any]:
    """The RNG states a pass draws from, taken just before it draws (so it can be replayed)."""
    return {"torch": torch.get_rng_state(), "generators": generator_states(ctx.generators)}


def _progress(ctx: PassContext, rng: dict[str, Any], drew_base_seed: bool) -> PassProgress:
    return PassProgress(
        epoch=ctx.epoch,
        rng=rng,
        sample_seed=None,
        iterable=ctx.iterable,
        num_streams=ctx.num_streams,
        drew_base_seed=drew_base_seed,
    )


def _sampler_of(ctx: PassContext, resume: PassProgress) -> SamplerPoint | None:
    """The Stateful sampler's state a resumed pass loads (an IterableDataset has none)."""
    return None if ctx.iterable else resume.sampler


@contextlib.contextmanager
def _replaying(ctx: PassContext, rng: dict[str, Any], keep_callers: bool) -> Iterator[None]:
    """Draw from the recorded RNG states; then give torch's global RNG back to the caller
    (``keep_callers``) unless it was where the recorded pass started."""
    callers_rng = torch.get_rng_state() if keep_callers else None
    try:
        torch.set_rng_state(rng["torch"])
        set_generator_states(ctx.generators, rng["generators"])
        yield
    finally:
        if callers_rng is not None and not torch.equal(callers_rng, rng["torch"]):
            torch.set_rng_state(callers_rng)


def _draw(
    ctx: PassContext, draws_seed: bool, loaded: SamplerPoint | None, iter_point: SamplerPoint | None
) -> _Draw:
    """The pass's draws, in torch's order: ``iter(sampler)`` (a Stateful sampler's state
    ``loaded`` first, its iterator's ``iter_point`` after), then the base seed."""
    stack = None if ctx.iterable else SamplerStack(ctx.index_sampler)
    if stack is not None:
        stack.load(loaded)
    initial = stack.point() if stack is not None else None
    if loaded is not None:
        initial = loaded
    # NOTE: an IterDataPipe's shared seed is drawn where torch's iterator draws it: before the
    # sampler when a new iterator starts, after it when persistent workers are reused, and once
    # more after the base seed when workers start (torch's iterator resets itself once as it
    # starts them). So a loader seeded like torch's draws alike.
    shared = ctx.draw_shared_seed
    shared_seed = shared() if shared is not None and draws_seed else None
    raw = stack.batches(iter_point) if stack is not None else batches_of(ctx.index_sampler)
    if shared is not None and not draws_seed:
        shared_seed = shared()
    base_seed = ctx.draw_base_seed() if draws_seed else None
    if shared is not None and draws_seed and ctx.starts_workers:
        shared()
    return _Draw(raw, stack, initial, shared_seed, base_seed)


def _numbered(
    draw: _Draw, progress: PassProgress, start: int, skip: YieldedPositions | None
) -> Iterator[tuple[int, Any]]:
    """The pass's numbered batches, its first one drawn now (``_primed``), a Stateful
    sampler's state tracked batch by batch."""
    raw = draw.raw
    if draw.stack is not None and not draw.stack.fast:
        assert draw.initial is not None
        progress.sampler_track = SamplerTrack(draw.stack, start, draw.initial)
        raw = _tracked(raw, progress.sampler_track, progress.yielded, start)
    return numbered_batches(_primed(raw), skip, start)


def _seeded(ctx: PassContext, draw: _Draw, resume: PassProgress) -> _Draw:
    """A resumed pass starts new workers, whether or not the recorded pass drew a seed: where
    it did not (it had reused its workers), they get the recorded workers' seed, or one drawn
    without moving the RNGs the next passes draw from."""
    if draw.base_seed is not None:
        return draw
    if resume.worker_seed is not None:
        return draw._replace(base_seed=resume.worker_seed)
    saved_rng = torch.get_rng_state()
    saved = generator_states(ctx.generators)
    base_seed = ctx.draw_base_seed()
    set_generator_states(ctx.generators, saved)
    torch.set_rng_state(saved_rng)
    return draw._replace(base_seed=base_seed)


def _started(
    ctx: PassContext,
    progress: PassProgress,
    draw: _Draw,
    batches: Iterator[tuple[int, Any]],
    load: bool,
    rewind: bool = False,
) -> PassStart:
    """The pass's seeds recorded, and each worker's plan: from the stream it starts at, which
    it loads with ``load``."""
    base_seed = draw.base_seed
    sample_seed = ctx.sample_seed if ctx.sample_seed is not None else base_seed
    progress.sample_seed = sample_seed if ctx.seed_per_sample else None
    if base_seed is not None:
        progress.worker_seed = base_seed
    if len(progress.streams) != ctx.num_streams:
        # A map-style state with another num_workers (the loader checked it holds no
        # dataset states): the workers start untouched.
        progress.streams = [StreamPoint() for _ in range(ctx.num_streams)]
    plans = [
        PassPlan(
            epoch=ctx.epoch,
            sample_seed=progress.sample_seed,
            samples_seen=point.samples_seen,
            dataset_state=point.dataset_state if load else None,
            iter_state=point.iter_state if load else None,
            rewind=rewind,
            ended=point.ended,
            stream_id=ctx.rank * ctx.num_streams + worker_id,
            shared_seed=draw.shared_seed,
        )
        for worker_id, point in enumerate(progress.streams)
    ]
    return PassStart(batches, base_seed, sample_seed, progress, plans, draw.shared_seed)


def _load_in_caller(dataset: Any, point: StreamPoint) -> None:
    """Load the state a loaded checkpoint holds of the calling process's dataset now."""
    if point.dataset_state is not None:
        dataset.load_state_dict(point.dataset_state)


def _tracked(
    raw: Iterator[Any], track: SamplerTrack, yielded: YieldedPositions, start: int
) -> Iterator[Any]:
    """The sampler's batches, its state taken after each one drawn (only if it turns out
    Stateful: its iterator is known once the first batch is drawn)."""
    position = start
    for indices in raw:
        if not track.stack.stateful:
            # Not Stateful after all: the rest passes through untouched.
            yield indices
            yield from raw
            return
        track.drawn(position, yielded)
        position += 1
        yield indices


_NOTHING: Any = object()


def _primed(sampler_iter: Iterator[Any]) -> Iterator[Any]:
    """Take the sampler's first batch now, so that the random draws a sampler makes when it
    starts (torch's make them on the first next()) happen at the pass's start."""
    first = next(sampler_iter, _NOTHING)
    if first is _NOTHING:
        return iter(())
    return itertools.chain((first,), sampler_iter)


# -- where each worker's dataset starts a pass ------------------------------------------------


def live_point(dataset: Any) -> StreamPoint:
    """The state of the dataset in this process, if it is Stateful (and can say)."""
    if not is_stateful(dataset):
        return StreamPoint()
    try:
        state = dataset.state_dict()
    except Exception:
        # (A dataset that is its own iterator may know its state only once iterated.)
        return StreamPoint()
    return StreamPoint(dataset_state=copy.deepcopy(state))


def kept_points(
    num_workers: int, latest: PassProgress | None, reusable: bool
) -> list[StreamPoint] | None:
    """Where kept workers stand: as the last pass left them (what it yielded)."""
    if reusable and latest is not None and len(latest.streams) == num_workers:
        return [point.carried() for point in latest.streams]
    return None


def next_points(
    num_workers: int, dataset: Any, latest: PassProgress | None, reusable: bool
) -> list[StreamPoint]:
    """Where each worker's dataset starts the next pass: in this process
    (``num_workers=0``), as the dataset is now; on kept workers, as the last pass left
    them; on fresh workers, untouched."""
    if num_workers == 0:
        return [live_point(dataset)]
    kept = kept_points(num_workers, latest, reusable)
    return kept if kept is not None else [StreamPoint() for _ in range(num_workers)]
