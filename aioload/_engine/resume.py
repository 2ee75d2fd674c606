"""What a checkpoint records about a pass, and how a pass picks up from one.

A pass is reproducible from three things: the RNG states from which its sampler order (and the
base seed) were drawn, the epoch number, and what had been *yielded* to the consumer. Batches
that were prefetched, in flight or sitting in the reorder buffer do not count: on resume they
are fetched again. So the orchestrator updates a ``PassProgress`` at the one point where a batch
leaves it, and the loader turns the latest one into ``state_dict()``.

- Map-style: the sampler is re-created from the recorded RNG states and run again, and the
  positions (batch numbers in sampler order) already yielded are skipped. With
  ``in_order=False`` the yielded positions are not a prefix; they are kept as a prefix plus the
  few beyond it, so the state stays small.
- IterableDataset: each worker's stream is restored on its own. A dataset with
  ``state_dict``/``load_state_dict`` reports its state after every batch; the state of the last
  batch *yielded* from each worker is kept. Other datasets are fast-forwarded by the number of
  samples each stream had yielded.

The state is plain data (ints, lists, dicts, byte tensors), loadable with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import BatchSampler, SequentialSampler

from .._wire.messages import IndexRange, PassPlan
from ..stats import SkippedSample

__all__ = [
    "FORMAT",
    "PassProgress",
    "PassStart",
    "StreamPoint",
    "YieldedPositions",
    "batches_of",
    "begin_pass",
    "numbered_batches",
]

FORMAT = "aioload.DataLoader/1"


class YieldedPositions:
    """The batch positions (in sampler order) of a pass that have been yielded."""

    __slots__ = ("extra", "prefix")

    def __init__(self, prefix: int = 0, extra: set[int] | None = None) -> None:
        self.prefix = prefix  # every position below this one was yielded
        self.extra: set[int] = set(extra or ())  # and these, above it

    def add(self, position: int) -> None:
        if position == self.prefix:
            self.prefix += 1
            while self.prefix in self.extra:
                self.extra.remove(self.prefix)
                self.prefix += 1
        elif position > self.prefix:
            self.extra.add(position)

    def __contains__(self, position: int) -> bool:
        return position < self.prefix or position in self.extra

    def __len__(self) -> int:
        return self.prefix + len(self.extra)

    def copy(self) -> YieldedPositions:
        return YieldedPositions(self.prefix, self.extra)


class StreamPoint:
    """Where one worker's IterableDataset stream stood after its last yielded batch."""

    # (A plain class, not a dataclass: see _worker.fetch.SamplePolicy on what they cost to define.)
    __slots__ = ("ended", "has_state", "samples_seen", "state")

    def __init__(
        self,
        samples_seen: int = 0,
        has_state: bool = False,
        state: Any = None,
        ended: bool = False,
    ) -> None:
        self.samples_seen = samples_seen
        self.has_state = has_state
        self.state = state
        self.ended = ended

    def __eq__(self, other: object) -> bool:
        if type(other) is not StreamPoint:
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"StreamPoint(samples_seen={self.samples_seen!r}, has_state={self.has_state!r}, "
            f"state={self.state!r}, ended={self.ended!r})"
        )

    def copy(self) -> StreamPoint:
        return StreamPoint(self.samples_seen, self.has_state, self.state, self.ended)

    def as_dict(self) -> dict[str, Any]:
        return {
            "samples_seen": self.samples_seen,
            "has_state": self.has_state,
            "state": self.state,
            "ended": self.ended,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StreamPoint:
        return cls(
            samples_seen=int(data["samples_seen"]),
            has_state=bool(data["has_state"]),
            state=data["state"],
            ended=bool(data["ended"]),
        )


class PassProgress:
    """One pass as a checkpoint sees it. The orchestrator updates it as batches are yielded;
    the loader holds it (not the orchestrator, which may be gone) for ``state_dict()``."""

    # (A plain class, not a dataclass: see _worker.fetch.SamplePolicy on what they cost to define.)
    __slots__ = (
        "drew_base_seed",
        "epoch",
        "finished",
        "iterable",
        "next_worker",
        "num_streams",
        "rng",
        "sample_seed",
        "skipped",
        "streams",
        "yielded",
    )

    def __init__(
        self,
        epoch: int,
        # RNG states taken just before the pass drew its sampler order and base seed.
        rng: dict[str, Any],
        sample_seed: int | None,
        iterable: bool,
        num_streams: int,
        # Whether the pass drew a base seed from those RNGs (it does not when it reuses a
        # persistent pool): a replay must draw exactly as the original did.
        drew_base_seed: bool = True,
        yielded: YieldedPositions | None = None,
        streams: list[StreamPoint] | None = None,
        # IterableDataset, in order: the worker the next batch was (or will be) asked of.
        next_worker: int = 0,
        finished: bool = False,
        # Samples skipped (on_sample_error) in delivered batches: a resumed pass carries them
        # on, and its count and its max_skipped cap continue from them.
        skipped: list[SkippedSample] | None = None,
    ) -> None:
        self.epoch = epoch
        self.rng = rng
        self.sample_seed = sample_seed
        self.iterable = iterable
        self.num_streams = num_streams
        self.drew_base_seed = drew_base_seed
        self.yielded = yielded if yielded is not None else YieldedPositions()
        self.streams = streams if streams else [StreamPoint() for _ in range(num_streams)]
        self.next_worker = next_worker
        self.finished = finished
        self.skipped = skipped if skipped is not None else []

    def __repr__(self) -> str:
        return (
            f"PassProgress(epoch={self.epoch!r}, yielded={len(self.yielded)}, "
            f"streams={self.streams!r}, next_worker={self.next_worker!r}, "
            f"finished={self.finished!r}, skipped={len(self.skipped)})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "rng": self.rng,
            "sample_seed": self.sample_seed,
            "iterable": self.iterable,
            "drew_base_seed": self.drew_base_seed,
            "yielded_prefix": self.yielded.prefix,
            "yielded_extra": sorted(self.yielded.extra),
            "streams": [point.as_dict() for point in self.streams],
            "next_worker": self.next_worker,
            "skipped": [record.as_dict() for record in self.skipped],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PassProgress:
        streams = [StreamPoint.from_dict(point) for point in data["streams"]]
        return cls(
            epoch=int(data["epoch"]),
            rng=data["rng"],
            sample_seed=None if data["sample_seed"] is None else int(data["sample_seed"]),
            iterable=bool(data["iterable"]),
            num_streams=len(streams),
            drew_base_seed=bool(data["drew_base_seed"]),
            yielded=YieldedPositions(
                int(data["yielded_prefix"]), {int(p) for p in data["yielded_extra"]}
            ),
            streams=streams,
            next_worker=int(data["next_worker"]),
            # (Absent from states saved before skipping existed.)
            skipped=[SkippedSample.from_dict(record) for record in data.get("skipped", ())],
        )


def generator_states(generators: list[torch.Generator]) -> list[torch.Tensor]:
    return [generator.get_state() for generator in generators]


def check_generator_count(states: list[Any], generators: list[torch.Generator]) -> None:
    if len(states) != len(generators):
        raise ValueError(
            f"aioload: the state was saved with {len(states)} random generator(s) in the "
            f"sampler, this loader has {len(generators)}; build it with the same arguments"
        )


def set_generator_states(generators: list[torch.Generator], states: list[Any]) -> None:
    check_generator_count(states, generators)
    for generator, state in zip(generators, states, strict=True):
        generator.set_state(state)


# -- how a pass starts: its randomness, drawn (or replayed) in one place -----------------------


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


def begin_pass(
    *,
    epoch: int,
    resume: PassProgress | None,
    in_progress: bool,
    reuse_workers: bool,
    index_sampler: Iterable[Any],
    generators: list[torch.Generator],
    draw_base_seed: Callable[[], int],
    sample_seed: int | None,
    seed_per_sample: bool,
    iterable: bool,
    num_streams: int,
    rank: int,
    draw_shared_seed: Callable[[], int] | None = None,
    starts_workers: bool = False,
) -> PassStart:
    """Draw a pass's randomness, or replay a checkpointed pass's, and plan what it skips.

    The pass's randomness is drawn here, at its start, and nowhere else: the sampler's order
    (torch's samplers draw on their first next(), hence the priming) and the base seed, in
    torch's order (iter(sampler), then the base seed, then sampling). Recording the RNG states
    just before makes the pass replayable; a resumed pass replays them, and then gives the
    caller back their own global RNG untouched.
    """
    # A pass draws a base seed unless it reuses persistent workers; a replayed pass draws from
    # the recorded RNGs exactly as the original did (workers it must start anyway get their
    # seed from the caller's RNG afterwards).
    replay_draw = resume.drew_base_seed if resume is not None else not reuse_workers
    snapshot: dict[str, Any] = (
        resume.rng
        if resume is not None
        else {"torch": torch.get_rng_state(), "generators": generator_states(generators)}
    )
    callers_rng = torch.get_rng_state() if resume is not None else None
    try:
        if resume is not None:
            torch.set_rng_state(snapshot["torch"])
            set_generator_states(generators, snapshot["generators"])
        # An IterDataPipe's shared seed is drawn where torch's iterator draws it: before the
        # sampler when a new iterator starts, after it when persistent workers are reused,
        # and once more after the base seed when workers start (torch's iterator resets
        # itself once as it starts them). So a loader seeded like torch's draws alike.
        shared_seed: int | None = None
        if draw_shared_seed is not None and replay_draw:
            shared_seed = draw_shared_seed()
        sampler_iter = batches_of(index_sampler)
        if draw_shared_seed is not None and not replay_draw:
            shared_seed = draw_shared_seed()
        base_seed = draw_base_seed() if replay_draw else None
        if draw_shared_seed is not None and replay_draw and starts_workers:
            draw_shared_seed()
        sampler_iter = _primed(sampler_iter)
        if base_seed is None and not reuse_workers:
            # Workers must start, but the replayed pass drew no seed (it had reused its
            # workers): draw one without moving the generators the next passes' order comes
            # from. (A draw from the global RNG is undone with the caller's RNG below.)
            saved = generator_states(generators)
            base_seed = draw_base_seed()
            set_generator_states(generators, saved)
    finally:
        if callers_rng is not None:
            torch.set_rng_state(callers_rng)
    if reuse_workers:
        base_seed = None
    if sample_seed is None and base_seed is not None:
        sample_seed = base_seed

    progress = PassProgress(
        epoch=epoch,
        rng=snapshot,
        sample_seed=sample_seed if seed_per_sample else None,
        iterable=iterable,
        num_streams=num_streams,
        drew_base_seed=replay_draw,
    )
    skip: YieldedPositions | None = None
    if resume is not None and in_progress:
        if iterable:
            progress.streams = [point.copy() for point in resume.streams]
            progress.next_worker = resume.next_worker
            # Positions mean nothing to an IterableDataset; only the count goes on.
            progress.yielded = YieldedPositions(len(resume.yielded))
        else:
            progress.yielded = resume.yielded.copy()
            skip = resume.yielded
        # The skips so far go on: the list, its count and the cap.
        progress.skipped = list(resume.skipped)
    plans = [
        PassPlan(
            epoch=epoch,
            sample_seed=progress.sample_seed,
            samples_seen=point.samples_seen,
            has_state=point.has_state,
            dataset_state=point.state,
            ended=point.ended,
            stream_id=rank * num_streams + worker_id,
            shared_seed=shared_seed,
        )
        for worker_id, point in enumerate(progress.streams)
    ]
    start = len(progress.yielded) if iterable else 0
    return PassStart(
        batches=numbered_batches(sampler_iter, skip, start),
        base_seed=base_seed,
        sample_seed=sample_seed,
        progress=progress,
        plans=plans,
        shared_seed=shared_seed,
    )


def batches_of(index_sampler: Iterable[Any]) -> Iterator[Any]:
    """``iter(index_sampler)``; for torch's own ``BatchSampler`` over its own
    ``SequentialSampler`` (exactly those types: a subclass may change either's order), the
    same batches as ``IndexRange`` bounds instead of lists of ints (see ``IndexRange``)."""
    if (
        type(index_sampler) is BatchSampler
        and type(index_sampler.sampler) is SequentialSampler
        and type(index_sampler.batch_size) is int
        and index_sampler.batch_size > 0
    ):
        return _sequential_batches(index_sampler)
    return iter(index_sampler)


def _sequential_batches(batch_sampler: BatchSampler) -> Iterator[IndexRange]:
    # A generator, as torch's BatchSampler.__iter__ is: the sampler's attributes and the
    # dataset's length are read when the first batch is asked for, as torch reads them.
    size = batch_sampler.batch_size
    sampler = batch_sampler.sampler
    assert isinstance(sampler, SequentialSampler)
    count = len(sampler.data_source)  # what SequentialSampler.__iter__ reads
    stop = count - count % size if batch_sampler.drop_last else count
    for start in range(0, stop, size):
        yield IndexRange(start, min(start + size, count))


def numbered_batches(
    sampler_iter: Iterator[Any], skip: YieldedPositions | None, start: int
) -> Iterator[tuple[int, Any]]:
    """Number the sampler's batches; on resume, leave out those already yielded.

    A batch sampler may yield each batch's indices as an iterator (a generator, ``iter(...)``),
    which torch's fetcher reads once. Here it is read into a list: the batch is counted, sent
    to a worker (a generator does not pickle) and, if that worker is lost, sent again."""
    for position, indices in enumerate(sampler_iter, start):
        if skip is None or position not in skip:
            if type(indices) is not list and hasattr(indices, "__next__"):
                indices = list(indices)
            yield position, indices


_NOTHING: Any = object()


def _primed(sampler_iter: Iterator[Any]) -> Iterator[Any]:
    """Take the sampler's first batch now, so that the random draws a sampler makes when it
    starts (torch's make them on the first next()) happen at the pass's start."""
    first = next(sampler_iter, _NOTHING)
    if first is _NOTHING:
        return iter(())
    return itertools.chain((first,), sampler_iter)
