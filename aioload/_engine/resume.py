"""What a checkpoint records about a pass (``_engine.pass_start`` starts a pass from it).

A pass is reproducible from what it drew its order from, the epoch number, the state of each
Stateful object it runs, and what had been *yielded* to the consumer. Batches that were
prefetched, in flight or sitting in the reorder buffer do not count: on resume they are fetched
again. So the orchestrator updates a ``PassProgress`` at the one point where a batch leaves it,
and the loader turns the latest one into ``state_dict()``.

- The sampler order. A sampler built from torch's RNGs is replayed: the RNG states the pass drew
  from are recorded, the sampler is run again from them, and the positions (batch numbers in
  sampler order) already yielded are skipped. A Stateful sampler (torchdata's protocol:
  ``state_dict()`` and ``load_state_dict()`` on the sampler, or on the iterator ``iter()``
  returns) is asked for its state after every batch drawn, and a resumed pass loads the state
  it had after the last batch yielded and goes on from there, as StatefulDataLoader does. With
  ``in_order=False`` the yielded positions are not a prefix; they are kept as a prefix plus the
  few beyond it, so the state stays small.
- Each worker's dataset (``StreamPoint``). A Stateful dataset, or the iterator an
  IterableDataset's ``iter()`` returns, reports its state with every batch; the state after the
  last batch *yielded* from each worker is kept, and a resumed worker loads it: the dataset's
  before ``iter(dataset)``, the iterator's after, as StatefulDataLoader does. An IterableDataset
  with neither is fast-forwarded by the number of samples each stream had yielded.
- Between passes, the state names the next pass: its epoch, its generators' states, the
  sampler's state, and the state each worker's dataset starts it with (the finished pass's,
  where the workers live on: ``num_workers=0`` or ``persistent_workers``).

The state is plain data (ints, strings, lists, dicts; RNG states as base64 text), so it goes
through ``json.dumps`` and ``torch.load(weights_only=True)`` alike. What the user's Stateful
objects return is kept as they return it.
"""

from __future__ import annotations

import base64
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import BatchSampler, SequentialSampler

from .._named_tuple import NamedTuple
from .._wire.messages import IndexRange, StreamState
from .._worker.fetch import is_stateful
from .samplers import is_replayed

if TYPE_CHECKING:
    from ..stats import SkippedSample

__all__ = [
    "FORMAT",
    "PassProgress",
    "SamplerPoint",
    "SamplerStack",
    "SamplerTrack",
    "StreamPoint",
    "YieldedPositions",
    "batches_of",
    "generator_states",
    "numbered_batches",
    "set_generator_states",
]

FORMAT = "aioload.DataLoader/2"
# Every format load_state_dict reads: /1 kept RNG states as byte tensors and had no sampler,
# worker seed or iterator states.
FORMATS = ("aioload.DataLoader/1", FORMAT)


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
    """Where one worker's dataset stood after its last yielded batch (or at the pass's start,
    before any): the state of its Stateful dataset and of the iterator ``iter(dataset)``
    returned, and, for an IterableDataset, the samples its stream had drawn and whether it had
    run dry. ``None`` for a state: nothing to load (not Stateful, or untouched)."""

    # (A plain class, not a dataclass: see _worker.fetch.SamplePolicy on what they cost to define.)
    __slots__ = ("dataset_state", "ended", "iter_is_dataset", "iter_state", "samples_seen")

    def __init__(
        self,
        samples_seen: int = 0,
        dataset_state: Any = None,
        ended: bool = False,
        iter_state: Any = None,
        iter_is_dataset: bool = False,
    ) -> None:
        self.samples_seen = samples_seen
        self.dataset_state = dataset_state
        self.ended = ended
        self.iter_state = iter_state
        # iter(dataset) returned the dataset itself: its state is iter_state (torchdata keeps
        # it there, and loads it after iter()).
        self.iter_is_dataset = iter_is_dataset

    @classmethod
    def of(cls, stream: StreamState) -> StreamPoint:
        return cls(
            stream.samples_seen,
            stream.state,
            stream.ended,
            stream.iter_state,
            stream.iter_is_dataset,
        )

    @property
    def has_state(self) -> bool:
        return self.dataset_state is not None or self.iter_state is not None

    def carried(self) -> StreamPoint:
        """What the worker's dataset starts the next pass with: its own state (the iterator's,
        where it is its own iterator), loaded before the next ``iter(dataset)``."""
        state = self.iter_state if self.iter_is_dataset else self.dataset_state
        return StreamPoint(dataset_state=state)

    def __eq__(self, other: object) -> bool:
        if type(other) is not StreamPoint:
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"StreamPoint(samples_seen={self.samples_seen!r}, "
            f"dataset_state={self.dataset_state!r}, ended={self.ended!r}, "
            f"iter_state={self.iter_state!r}, iter_is_dataset={self.iter_is_dataset!r})"
        )

    def copy(self) -> StreamPoint:
        return StreamPoint(
            self.samples_seen,
            self.dataset_state,
            self.ended,
            self.iter_state,
            self.iter_is_dataset,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "samples_seen": self.samples_seen,
            "ended": self.ended,
            "dataset_state": self.dataset_state,
            "iter_state": self.iter_state,
            "iter_is_dataset": self.iter_is_dataset,
        }


# -- the sampler's state (torchdata's Stateful protocol) -----------------------------------------


class SamplerPoint(NamedTuple):
    """A Stateful sampler's state: its own ``state_dict()``, and its iterator's."""

    state: Any
    iter_state: Any

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "iter_state": self.iter_state}


class SamplerStack:
    """The sampler a pass draws its batches from, as torchdata's protocol sees it: the object
    whose ``state_dict()`` describes it (the loader's batch sampler; for torch's own
    ``BatchSampler``, the sampler inside it, which this class then batches as torch's does),
    and the iterator its ``iter()`` returns, which may be Stateful too."""

    def __init__(self, index_sampler: Iterable[Any]) -> None:
        self.index_sampler = index_sampler
        # torch's BatchSampler (that exact type) is batched here, over its sampler's own
        # iterator, so that iterator's state can be asked for (torchdata's BatchSampler does
        # the same). Its sequential fast path (``batches_of``) has nothing to ask.
        exact = type(index_sampler) is BatchSampler
        # torch's sequential batches, as bounds: nothing there has a state.
        self.fast = exact and _sequential(index_sampler)  # type: ignore[arg-type]
        self.batching = exact and not self.fast
        self.target: Any = index_sampler.sampler if self.batching else index_sampler  # type: ignore[attr-defined]
        # aioload's own RandomSampler (shuffle=True) has a state for frameworks that rebuild
        # the loader; the engine replays it from the RNG states it records instead (see
        # _engine.samplers), which also replays its draws from torch's global RNG.
        self.target_stateful = is_stateful(self.target) and not is_replayed(self.target)
        self.iterator: Any = None
        self.iter_stateful = False

    @property
    def stateful(self) -> bool:
        return self.target_stateful or self.iter_stateful

    def state_now(self) -> SamplerPoint | None:
        """The sampler's state between passes (no iterator), if it is Stateful."""
        return SamplerPoint(self.target.state_dict(), None) if self.target_stateful else None

    def point(self) -> SamplerPoint:
        return SamplerPoint(
            self.target.state_dict() if self.target_stateful else None,
            self.iterator.state_dict() if self.iter_stateful else None,
        )

    def load(self, point: SamplerPoint | None) -> None:
        """Load the sampler's own state; its iterator's is loaded after ``iter()``."""
        if point is not None and point.state is not None:
            if not self.target_stateful:
                raise ValueError(
                    f"aioload: the state holds a sampler state, but {type(self.target).__name__}"
                    " has no state_dict()/load_state_dict(); build the loader with the same "
                    "sampler"
                )
            self.target.load_state_dict(point.state)

    def batches(self, point: SamplerPoint | None) -> Iterator[Any]:
        """``iter()`` of the batch sampler (its iterator's checkpointed state loaded)."""
        if self.fast:
            return batches_of(self.index_sampler)
        if self.batching:
            return self._batched(point)
        self._opened(iter(self.target), point)
        return self.iterator  # type: ignore[no-any-return]

    def _opened(self, iterator: Any, point: SamplerPoint | None) -> None:
        self.iterator = iterator
        self.iter_stateful = iterator is not self.target and is_stateful(iterator)
        if point is not None and point.iter_state is not None:
            if not is_stateful(iterator):
                raise ValueError(
                    "aioload: the state holds the state of the sampler's iterator, but "
                    f"{type(iterator).__name__} has no state_dict()/load_state_dict(); build "
                    "the loader with the same sampler"
                )
            iterator.load_state_dict(point.iter_state)

    def _batched(self, point: SamplerPoint | None) -> Iterator[list[Any]]:
        # torch's BatchSampler.__iter__, with the sampler's iterator kept: a generator, so the
        # sampler is iter()'d, and its attributes read, when the first batch is asked for.
        batch_sampler: Any = self.index_sampler
        self._opened(iter(self.target), point)
        sampler_iter = self.iterator
        size = batch_sampler.batch_size
        if batch_sampler.drop_last:
            args = [sampler_iter] * size
            for batch_droplast in zip(*args, strict=False):
                yield [*batch_droplast]
        else:
            batch = [*itertools.islice(sampler_iter, size)]
            while batch:
                yield batch
                batch = [*itertools.islice(sampler_iter, size)]


class SamplerTrack:
    """A Stateful sampler's states through one pass, by position: the state after each batch
    drawn is kept until the batches before it have been yielded."""

    __slots__ = ("points", "stack")

    def __init__(self, stack: SamplerStack, start: int, initial: SamplerPoint) -> None:
        self.stack = stack
        # (position, state after drawing it); the first entry is the state before ``start``.
        self.points: deque[tuple[int, SamplerPoint]] = deque([(start - 1, initial)])

    def drawn(self, position: int, yielded: YieldedPositions) -> None:
        self.points.append((position, self.stack.point()))
        last = yielded.prefix - 1
        points = self.points
        while len(points) > 1 and points[1][0] <= last:
            points.popleft()

    def at(self, prefix: int) -> SamplerPoint:
        """The state after drawing position ``prefix - 1`` (the last yielded of the prefix)."""
        found = self.points[0][1]
        for position, point in self.points:
            if position > prefix - 1:
                break
            found = point
        return found


# -- a pass as a checkpoint sees it ---------------------------------------------------------------


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
        "sampler",
        "sampler_track",
        "skipped",
        "streams",
        "worker_seed",
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
        # The base seed of the workers the pass runs on (None without workers).
        worker_seed: int | None = None,
    ) -> None:
        self.epoch = epoch
        self.rng = rng
        self.sample_seed = sample_seed
        self.iterable = iterable
        self.num_streams = num_streams
        self.drew_base_seed = drew_base_seed
        self.worker_seed = worker_seed
        # What the pass goes on to record (set by who makes it: a pass's start, a parsed
        # checkpoint). The batch positions yielded so far.
        self.yielded = YieldedPositions()
        # Where each worker's dataset stands after its last yielded batch.
        self.streams = [StreamPoint() for _ in range(num_streams)]
        # IterableDataset, in order: the worker the next batch was (or will be) asked of.
        self.next_worker = 0
        self.finished = False
        # Samples skipped (on_sample_error) in delivered batches: a resumed pass carries them
        # on, and its count and its max_skipped cap continue from them.
        self.skipped: list[SkippedSample] = []
        # A Stateful sampler's state where the pass stands (a loaded or between-pass state).
        self.sampler: SamplerPoint | None = None
        # A running pass's Stateful sampler, state by position (``sampler`` is then unused).
        self.sampler_track: SamplerTrack | None = None

    def __repr__(self) -> str:
        return (
            f"PassProgress(epoch={self.epoch!r}, yielded={len(self.yielded)}, "
            f"streams={self.streams!r}, next_worker={self.next_worker!r}, "
            f"finished={self.finished!r}, skipped={len(self.skipped)})"
        )

    def sampler_point(self) -> SamplerPoint | None:
        track = self.sampler_track
        if track is not None:
            return track.at(self.yielded.prefix) if track.stack.stateful else None
        return self.sampler

    def as_dict(self) -> dict[str, Any]:
        sampler = self.sampler_point()
        return {
            "epoch": self.epoch,
            "rng": {
                "torch": encode_rng(self.rng["torch"]),
                "generators": [encode_rng(state) for state in self.rng["generators"]],
            },
            "sample_seed": self.sample_seed,
            "worker_seed": self.worker_seed,
            "iterable": self.iterable,
            "drew_base_seed": self.drew_base_seed,
            "yielded_prefix": self.yielded.prefix,
            "yielded_extra": sorted(self.yielded.extra),
            "streams": [point.as_dict() for point in self.streams],
            "next_worker": self.next_worker,
            "skipped": [record.as_dict() for record in self.skipped],
            "sampler": None if sampler is None else sampler.as_dict(),
        }


def encode_rng(state: Any) -> str:
    """An RNG state (a byte tensor) as base64 text. (Loaded states are kept decoded.)"""
    if isinstance(state, str):
        return state
    return base64.b64encode(bytes(state.numpy().tobytes())).decode("ascii")


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


def _sequential(batch_sampler: BatchSampler) -> bool:
    return (
        type(batch_sampler.sampler) is SequentialSampler
        and type(batch_sampler.batch_size) is int
        and batch_sampler.batch_size > 0
    )


def batches_of(index_sampler: Iterable[Any]) -> Iterator[Any]:
    """``iter(index_sampler)``; for torch's own ``BatchSampler`` over its own
    ``SequentialSampler`` (exactly those types: a subclass may change either's order), the
    same batches as ``IndexRange`` bounds instead of lists of ints (see ``IndexRange``)."""
    if type(index_sampler) is BatchSampler and _sequential(index_sampler):
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
            # (A list, or the sequential sampler's IndexRange, is asked nothing more: this runs
            # for every batch.)
            if (
                type(indices) is not list
                and type(indices) is not IndexRange
                and hasattr(indices, "__next__")
            ):
                indices = list(indices)
            yield position, indices
