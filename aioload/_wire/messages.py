"""Every message between the engine and its workers, in one place: this module is the protocol.

Three groups, read top to bottom as one task travels:

1. Parent -> worker (over a process worker's socket; a Ray actor gets the same values as
   method arguments): :class:`Reset` starts a pass on a worker, :class:`Task` asks for one batch,
   :class:`FreeSlabs` hands back shared-memory slabs the consumer let go of.
2. Worker -> parent: exactly one :class:`Reply` per task. Its ``result`` says what came of it
   (a batch in a slab, a pickled batch, a batch by value, an error, or the end of an
   IterableDataset stream); the worker of an IterableDataset or of a Stateful dataset also says
   where its dataset stands after the task (``stream``), so a checkpoint taken after the batch
   is yielded resumes exactly there.
3. Backend -> engine: a backend turns replies into :class:`Answer` events (the batch decoded,
   stale passes' replies dropped) and reports a worker that died as :class:`WorkerLost`. The
   engine never sees transport details (slabs, sockets, object refs).

Worker-side results of the fetch step (:class:`Produced`, :class:`Failure`, :class:`StreamEnded`)
are shared by every backend's worker, so a local process and a Ray actor answer alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._named_tuple import NamedTuple

__all__ = [
    "AllSkipped",
    "Answer",
    "Batch",
    "Event",
    "Failed",
    "Failure",
    "FreeSlabs",
    "Outcome",
    "PickledBatch",
    "Produced",
    "Raised",
    "Reply",
    "Reset",
    "SetConcurrency",
    "SlabBatch",
    "StreamEnded",
    "StreamState",
    "Task",
    "ToWorker",
    "ValueBatch",
    "WorkerLost",
    "answer_to",
    "failed_in_setup",
    "outcome_of",
]

# -- parent -> worker -------------------------------------------------------------------------


class Reset(NamedTuple):
    """A new pass (``generation``) starts: make the fetcher from ``plan``. Tasks of older
    generations still queued are skipped."""

    generation: int
    plan: PassPlan


class Task(NamedTuple):
    """Fetch and collate the samples at ``indices``; answer with one :class:`Reply`."""

    task_id: int
    generation: int
    indices: Any
    # Slabs the consumer has let go of since this worker's last task, riding along (what
    # FreeSlabs says, without a frame of its own): the worker may reuse them.
    freed_slabs: tuple[int, ...] = ()


class FreeSlabs(NamedTuple):
    """The consumer has let go of these slabs' batches: the worker may reuse them. With
    ``forget``, the parent could not map them (a descriptor that never arrived): the worker
    must never use them again."""

    slab_ids: list[int]
    forget: bool = False


class SetConcurrency(NamedTuple):
    """worker_concurrency="auto": how many samples an async dataset's worker may fetch at once
    from now on (``_engine.tuning`` decides; tasks already gathering go on under the new
    count)."""

    concurrency: int


ToWorker = Reset | Task | FreeSlabs | SetConcurrency

# -- worker -> parent -------------------------------------------------------------------------


class StreamState(NamedTuple):
    """Where a worker's dataset stood after a task (torchdata's Stateful protocol): what its
    ``state_dict()`` and its iterator's returned, and how far an IterableDataset's stream had
    gone. Sent with every reply of an IterableDataset's worker, and of a map-style one whose
    dataset is Stateful, so that a checkpoint taken after the batch is yielded resumes there."""

    samples_seen: int
    # The dataset's state_dict(): None for a dataset without one (an IterableDataset is then
    # resumed by fast-forward), or one that is its own iterator (its state is iter_state).
    state: Any
    ended: bool
    # The state_dict() of the iterator iter(dataset) returned (an IterableDataset's), if it has
    # one; loaded after iter() on resume.
    iter_state: Any = None
    # iter(dataset) returned the dataset itself.
    iter_is_dataset: bool = False


class SlabBatch(NamedTuple):
    """A batch whose buffers are in a shared-memory slab (``_wire.slabs``). ``capacity`` is
    non-zero when the slab is new: its memfd rides on this frame."""

    slab_id: int
    capacity: int
    used: int
    payload: bytes
    leaves: Any


class PickledBatch(NamedTuple):
    """A batch sent by value over the socket (no shared memory to be had)."""

    payload: bytes


class ValueBatch(NamedTuple):
    """A batch carried by the transport itself (a Ray object)."""

    value: Any


class Failure(NamedTuple):
    """The task raised (or the worker's setup did); ``error`` carries type and traceback."""

    error: Any  # _worker.step.RemoteError


class StreamEnded(NamedTuple):
    """This worker's IterableDataset stream has run dry for this pass."""


class Reply(NamedTuple):
    """A worker's one answer to one task."""

    task_id: int
    generation: int
    result: SlabBatch | PickledBatch | ValueBatch | Failure | StreamEnded
    stream: StreamState | None
    # Seconds the worker spent on the task (fetch, collate, copy into shared memory).
    busy_s: float
    # Slabs the worker retired since its last reply: the parent unmaps them too.
    dropped_slabs: list[int]


class Produced(NamedTuple):
    """The fetch step's success, before the transport encodes it."""

    data: Any
    stream: StreamState | None
    # The shared-memory slab the batch was collated into, if any (process workers).
    arena: Any = None


# -- backend -> engine ------------------------------------------------------------------------


class Batch(NamedTuple):
    value: Any


class Failed(NamedTuple):
    """A worker's error: re-raised in the consumer with the worker's traceback."""

    error: Any  # _worker.step.RemoteError


class Raised(NamedTuple):
    """An exception raised as it is (in the calling process, or by the pin stage)."""

    error: BaseException


class AllSkipped(NamedTuple):
    """Every sample of the task was skipped (on_sample_error): nothing to yield, but the task
    is delivered in its turn, so its skip records and its position are recorded."""


Outcome = Batch | Failed | Raised | StreamEnded | AllSkipped


class Answer(NamedTuple):
    worker_id: int
    task_id: int
    outcome: Outcome
    stream: StreamState | None = None
    # The worker's seconds on the task, for stats (None: not measured).
    busy_s: float | None = None


class WorkerLost(NamedTuple):
    """A worker died (or was found gone). ``error`` is what the consumer sees if it is not
    replaced; the engine knows which tasks it held and decides whether to restart it."""

    worker_id: int
    error: BaseException


Event = Answer | WorkerLost


def answer_to(
    worker_id: int,
    reply: Reply,
    batch_value: Callable[[SlabBatch | PickledBatch | ValueBatch], Any],
) -> Answer:
    """A worker's reply as the engine sees it, whichever backend carried it (``outcome_of``)."""
    outcome = outcome_of(reply.result, batch_value)
    return Answer(worker_id, reply.task_id, outcome, reply.stream, reply.busy_s)


def outcome_of(result: Any, batch_value: Callable[[Any], Any]) -> Outcome:
    """What a worker's step made of a task, as the engine sees it: a ``Failure`` becomes
    ``Failed`` (re-raised in the consumer with the worker's traceback), an ended stream stays as
    it is, and anything else is a batch, whose value ``batch_value`` makes of it: only the
    backend that carried it knows how (views of a slab, an unpickled payload, a Ray object, a
    step's ``Produced`` in the calling process)."""
    if isinstance(result, Failure):
        return Failed(result.error)
    if isinstance(result, StreamEnded):
        return result
    return Batch(batch_value(result))


def failed_in_setup(answer: Answer) -> bool:
    """Whether ``answer`` says its worker's setup failed (``worker_init_fn``, an async
    dataset's context): every later task of that worker fails alike, so a backend that sees it
    is retired (no further pass runs on it)."""
    outcome = answer.outcome
    return isinstance(outcome, Failed) and bool(getattr(outcome.error, "from_init", False))


# -- a sequential sampler's batches -----------------------------------------------------------


class IndexRange:
    """The indices ``start, start + 1, ..., stop - 1``: a batch of torch's ``BatchSampler``
    over a ``SequentialSampler`` (``shuffle=False``, the loader's default), as its two bounds.

    torch's batch sampler makes a list of ``batch_size`` int objects for every batch, and a
    worker's task carries them pickled: for small samples, a visible part of the parent's
    work per batch, where the bounds cost next to nothing (docs/benchmark-notes.md, "The
    wire's small costs"; ``_engine.resume.batches_of`` makes these; ``_wire.packed`` sends
    them as two integers).
    A fetcher turns one back into the list torch's would have had (``as_list``) before the
    dataset or anything a user wrote sees it, so no dataset, collate or error message can tell
    the difference; a batch sampler of the user's that yields its own ``range`` objects is
    left as it is, as torch leaves it.
    """

    __slots__ = ("start", "stop")

    def __init__(self, start: int, stop: int) -> None:
        self.start = start
        self.stop = stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Any:
        return iter(range(self.start, self.stop))

    def __eq__(self, other: object) -> bool:
        return type(other) is IndexRange and self.start == other.start and self.stop == other.stop

    def __hash__(self) -> int:
        return hash((self.start, self.stop))

    def __repr__(self) -> str:
        # As the list it stands for: messages that name a batch's indices read as they did.
        return repr(self.as_list())

    def __reduce__(self) -> tuple[type[IndexRange], tuple[int, int]]:
        return IndexRange, (self.start, self.stop)

    def as_list(self) -> list[int]:
        return list(range(self.start, self.stop))


class PassPlan(NamedTuple):
    """One worker's instructions for one pass (epoch)."""

    epoch: int = 0
    # seed_per_sample's base seed; None when seed_per_sample is off.
    sample_seed: int | None = None
    # IterableDataset resume: samples this stream had yielded at the checkpoint. A Stateful
    # dataset (or iterator) goes on from its loaded state; any other stream is fast-forwarded
    # by drawing and dropping that many samples.
    samples_seen: int = 0
    # States to load (None: nothing to load), as StatefulDataLoader loads them: the dataset's
    # before iter(dataset) (a map-style dataset's before its first fetch), the iterator's after.
    dataset_state: Any = None
    iter_state: Any = None
    # The pass runs on kept workers, which go back to where the consumer's last batch from
    # each left its dataset (a pass left early may have gone further): to dataset_state, or,
    # where that is None, to the state the worker's dataset had when it began its first pass.
    rewind: bool = False
    # The stream had already run dry when the checkpoint was taken.
    ended: bool = False
    # Which stream this is for seed_per_sample on an IterableDataset: the global worker id
    # (rank * num_workers + worker id).
    stream_id: int = 0
    # An IterDataPipe's random pipes are seeded from this, the same in every worker (see
    # _worker.datapipes); None for any other dataset.
    shared_seed: int | None = None
