"""Turning a task's indices into a batch: the one fetch step that workers and the calling
process (``num_workers=0``) share.

It does what torch's fetchers do (``__getitems__`` or one ``__getitem__`` per index, or
``next()`` on an IterableDataset's iterator, then ``collate_fn``), plus two things torch's
cannot:

- ``seed_per_sample``: each sample is fetched with the ``random``, torch and numpy RNGs seeded
  from ``(base_seed, epoch, sample index)``, so random augmentations depend on the sample and
  the epoch only, not on which worker fetched it, in what order, or whether the run was
  resumed;
- resume, with torchdata's Stateful protocol: a worker's dataset (and an IterableDataset's
  iterator) is restored from its own ``state_dict`` (a stream without one is fast-forwarded)
  before the pass starts, and its state after every batch is reported (``point``) so that a
  checkpoint can name exactly what was yielded.

What a pass needs to know up front arrives as a ``PassPlan``, one per worker and pass.

Bad samples are handled here too, under a ``SamplePolicy`` (``on_sample_error``,
``sample_retries``): each sample is fetched on its own, retried with an exponential backoff,
and then raised or skipped. A batch with skipped samples leaves the fetch as ``WithSkips``
(the shorter batch, or ``NO_BATCH`` when nothing survived, plus one ``SkippedSample`` record
per loss). The wrapper travels inside the batch's answer, so the worker loop and the answer
message need not know about it; the orchestrator unwraps it and records the skips when the
batch is delivered, which is what makes the cap and resume exact.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import random
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._named_tuple import NamedTuple
from .._wire import slabs as _transport
from .._wire.messages import AllSkipped, Batch, IndexRange, PassPlan, StreamState
from . import stacking as _stacking
from .info import reseed_rng, thread_worker_rng

if TYPE_CHECKING:
    from ..stats import SkippedSample

__all__ = [
    "NO_BATCH",
    "BaseFetcher",
    "Fetcher",
    "IndexRange",
    "PassPlan",
    "RngStates",
    "SamplePolicy",
    "WithSkips",
    "is_stateful",
    "sample_seed",
]


# -- bad samples -------------------------------------------------------------------------------

# The first retry waits this long, each later one twice as long as the one before, up to the cap.
RETRY_BACKOFF_S = 0.05
RETRY_BACKOFF_CAP_S = 5.0


def retry_delay(retry: int) -> float:
    """Seconds to wait before retry number ``retry`` (0 for the first)."""
    return float(min(RETRY_BACKOFF_S * (2**retry), RETRY_BACKOFF_CAP_S))


class SamplePolicy(NamedTuple):
    """What to do with a sample whose fetch fails: ``on_sample_error`` and ``sample_retries``.

    It reaches workers inside their ``WorkerConfig``, so a callable ``on_error`` runs in the
    worker that fetched the sample (in the calling process with ``num_workers=0``).

    (This and the engine's other internal records are NamedTuples, not dataclasses: a
    dataclass costs about 0.5 ms to define, a NamedTuple about 0.06, and a dozen of them were
    half of what ``aioload.DataLoader`` cost to import, paid by every program's first batch.)"""

    # "raise", "skip", or a callable (index, exception) -> "raise" | "skip".
    on_error: str | Callable[[Any, BaseException], str] = "raise"
    retries: int = 0

    @property
    def active(self) -> bool:
        """Whether fetches go sample by sample under the policy. The default ("raise", no
        retries) keeps torch's fetch exactly, at no cost."""
        return self.on_error != "raise" or self.retries > 0

    @property
    def may_skip(self) -> bool:
        return self.on_error != "raise"

    def skips(self, index: Any, error: BaseException) -> bool:
        """Whether the sample named ``index`` is skipped for ``error`` (else it is raised)."""
        decision = self.on_error
        if callable(decision):
            decision = decision(index, error)
            if decision not in ("raise", "skip"):
                raise ValueError(
                    "on_sample_error callable must return 'raise' or 'skip', "
                    f"but returned {decision!r} for index {index!r}"
                )
        return decision == "skip"


_NO_POLICY = SamplePolicy()


class _NoBatch:
    """Every sample of a task was skipped: there is no batch, and nothing is yielded."""

    def __repr__(self) -> str:
        return "NO_BATCH"

    def __reduce__(self) -> str:
        return "NO_BATCH"  # pickled by name: the one instance in every process


NO_BATCH: Any = _NoBatch()


class WithSkips:
    """A batch some of whose samples were skipped, with one record per skipped sample."""

    __slots__ = ("batch", "skipped")

    def __init__(self, batch: Any, skipped: list[SkippedSample]) -> None:
        self.batch = batch
        self.skipped = skipped

    def __reduce__(self) -> tuple[Any, ...]:
        return (WithSkips, (self.batch, self.skipped))


def take_skips(outcome: Any) -> tuple[list[SkippedSample], Any]:
    """Unwrap a task's outcome (``_wire.messages.Outcome``): its skip records, and the shorter
    ``Batch``, or ``AllSkipped`` when no sample survived."""
    value = getattr(outcome, "value", None)  # only a Batch has one
    if type(value) is not WithSkips:
        return [], outcome

    if value.batch is NO_BATCH:
        return value.skipped, AllSkipped()
    return value.skipped, Batch(value.batch)


def _describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _record(index: Any, error: BaseException, tries: int) -> SkippedSample:
    # Imported here: _worker.main imports this module (and the report's types wait for the
    # first skip, _engine.counters).
    from ..stats import SkippedSample
    from .info import get_worker_info

    info = get_worker_info()
    return SkippedSample(
        index=index,
        error=_describe_error(error),
        worker=None if info is None else info.id,
        tries=tries,
    )


class _Failed:
    """A sample that was skipped, in the place it would have had in its batch."""

    __slots__ = ("record",)

    def __init__(self, record: SkippedSample) -> None:
        self.record = record


class Gathered:
    """One task's samples under an active policy: the keys they were fetched by, the samples
    (a ``_Failed`` where one was skipped), for ``collate``."""

    __slots__ = ("failed", "keys", "opaque", "samples")

    def __init__(
        self, keys: list[Any], samples: Any, opaque: bool = False, failed: int | None = None
    ) -> None:
        self.keys = keys
        self.samples = samples
        # How many samples were skipped (None: not counted, look at each).
        self.failed = failed
        # Collated as it is, with no policy: a batched fetch's result that is not one sample
        # per key, or an async fetch without a policy (kept only to name unsendable samples).
        self.opaque = opaque


def gathered_batch(keys: list[Any], data: Any) -> Gathered:
    """What a dataset's ``__getitems__`` returned, as a ``Gathered``."""
    if isinstance(data, list) and len(data) == len(keys):
        return Gathered(keys, data)
    return Gathered(keys, data, opaque=True)


def _unsendable_error(blamed: list[tuple[int, Any, Any, Exception]]) -> Exception:
    """An error of the pickling error's type naming each sample that cannot be sent."""
    from .info import get_worker_info

    info = get_worker_info()
    where = f"DataLoader worker {info.id}" if info is not None else "the worker"
    named = "; ".join(
        f"index {key!r} ({type(sample).__module__}.{type(sample).__qualname__}): "
        f"{_describe_error(exc)}"
        for _, key, sample, exc in blamed
    )
    message = (
        f"{len(blamed)} sample(s) cannot be sent from {where} to the main process: {named}. "
        "Return picklable samples, or pass on_sample_error='skip' to skip them"
    )
    kind = type(blamed[0][3])
    try:
        return kind(message)
    except Exception:
        return TypeError(message)


_MASK64 = (1 << 64) - 1


def sample_seed(base_seed: int, epoch: int, index: Any) -> int:
    """A 64-bit seed for one sample, from what identifies it: never from the worker or the
    order of fetching. Integer indices (nearly all) take a fast path; other keys are hashed
    through their repr, which is stable across processes (``hash()`` of a str is not)."""
    head = struct.pack("<QQ", base_seed & _MASK64, epoch & _MASK64)
    if isinstance(index, int) and -(1 << 63) <= index < (1 << 63):
        key = head + struct.pack("<q", index)
    else:
        key = head + repr(index).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def _seed_all(seed: int) -> None:
    rng = thread_worker_rng()
    if rng is not None:
        # A worker thread (worker_method="thread"): the process-wide generators are every
        # thread's, and a seed put there would be another thread's draw. The sample's seed
        # goes into this worker's own generators (``get_worker_info().rng``) instead.
        reseed_rng(rng, seed)
        return
    random.seed(seed)
    # The CPU generator only: torch.manual_seed also walks every accelerator backend, which
    # costs about 100 us a call, ten times the rest of this function. Dataset code in a
    # worker draws from the CPU generator; a dataset that draws CUDA randomness per sample
    # is not covered.
    torch.default_generator.manual_seed(seed)
    # numpy's legacy global RNG takes 32 bits; fold the 64 in rather than drop half.
    np.random.seed((seed ^ (seed >> 32)) & 0xFFFF_FFFF)


class RngStates:
    """A snapshot of the global ``random``, torch (CPU) and numpy RNG states. Put back after a
    seeded fetch in the calling process (with ``num_workers=0``, seed_per_sample must not
    reseed the user's own training RNGs), and swapped in and out around each step of an async
    sample's coroutine."""

    __slots__ = ("numpy", "python", "torch")

    def __init__(self) -> None:
        self.python = random.getstate()
        self.torch = torch.get_rng_state()
        self.numpy = np.random.get_state()

    def install(self) -> None:
        random.setstate(self.python)
        torch.set_rng_state(self.torch)
        np.random.set_state(self.numpy)

    def same_as(self, other: RngStates) -> bool:
        """Whether ``other`` holds the same states (nothing was drawn in between)."""
        mine: Any = self.numpy  # (a tuple: the legacy form np.random.get_state() returns)
        theirs: Any = other.numpy
        return (
            self.python == other.python
            and torch.equal(self.torch, other.torch)
            and mine[0] == theirs[0]
            and bool((mine[1] == theirs[1]).all())
            and tuple(mine[2:]) == tuple(theirs[2:])
        )


class FetchSpec(NamedTuple):
    """What every fetcher of one worker is made from, pass after pass: the dataset and how its
    samples become batches. Built once where the worker is set up (``WorkerStep``, or
    ``InlineBackend`` for the calling process); each pass adds its ``PassPlan``."""

    dataset_kind: int
    dataset: Any
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    policy: SamplePolicy | None = None


class BaseFetcher:
    """What the sync and the async fetcher share: the dataset and how to batch it, the pass's
    plan, the seed of a sample, and where an IterableDataset's stream stands."""

    def __init__(self, spec: FetchSpec, plan: PassPlan) -> None:
        dataset, collate_fn, auto_collation = spec.dataset, spec.collate_fn, spec.auto_collation
        drop_last, policy = spec.drop_last, spec.policy
        self.iterable = spec.dataset_kind == 1
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.plan = plan
        self.seeded = plan.sample_seed is not None
        self.samples_seen = 0
        self.ended = plan.ended
        # torchdata's Stateful protocol: the dataset's state_dict()/load_state_dict(), and
        # (an IterableDataset's) those of the iterator iter(dataset) returns, once it is made.
        self.dataset_stateful = is_stateful(dataset)
        self.iter_stateful = False
        self.stream: Any = None
        self.policy = policy if policy is not None else _NO_POLICY
        # The keys, samples and skip records of the batch collated last, kept in a worker
        # until the worker has sent it (``forget``): a batch that cannot be sent is then
        # blamed on the samples that cannot be (``drop_unsendable``). Nothing is sent from the
        # calling process, so nothing is kept there.
        from .info import get_worker_info  # (_worker.main imports this module)

        self.keep_last = get_worker_info() is not None
        self._last: tuple[Sequence[Any], list[Any], list[SkippedSample]] | None = None
        if not self.iterable:
            # A map-style dataset's checkpointed state goes in before its first fetch.
            self.load_dataset_state()

    # -- checkpoints (torchdata's Stateful protocol) -------------------------------------------

    def load_dataset_state(self) -> None:
        """Load the plan's dataset state (an IterableDataset's before ``iter(dataset)``)."""
        if self.plan.dataset_state is not None:
            _load_state(self.dataset, self.plan.dataset_state, "dataset")

    def opened(self, stream: Any) -> bool:
        """``stream`` (what ``iter(dataset)`` just returned) is this pass's: its checkpointed
        state goes in now, after ``iter()``, as StatefulDataLoader loads it. Returns whether
        the stream resumes from loaded states (else it is fast-forwarded)."""
        self.stream = stream
        self.iter_stateful = is_stateful(stream)
        if self.plan.iter_state is not None:
            _load_state(stream, self.plan.iter_state, "dataset's iterator")
        return self.plan.dataset_state is not None or self.plan.iter_state is not None

    def point(self) -> StreamState | None:
        """Where the dataset stands now (after the task just run), for a checkpoint: None for
        a map-style dataset that is not Stateful."""
        if self.iterable:
            stream = self.stream
            same = stream is self.dataset
            return StreamState(
                self.samples_seen,
                self.dataset.state_dict() if self.dataset_stateful and not same else None,
                self.ended,
                stream.state_dict() if self.iter_stateful else None,
                same,
            )
        if self.dataset_stateful:
            return StreamState(0, self.dataset.state_dict(), False)
        return None

    def seed_of(self, key: Any) -> int:
        """seed_per_sample's seed for the sample named ``key`` in this pass."""
        assert self.plan.sample_seed is not None
        return sample_seed(self.plan.sample_seed, self.plan.epoch, key)

    # -- an IterableDataset's stream under the sample-error policy ------------------------------

    def lost_draw(self, error: Exception) -> _Failed:
        """The stream's next element failed with ``error`` and the policy skips it. It was
        drawn, and lost: the stream has moved past it (a generator that raised is finished,
        and its next draw ends the stream), so it counts as seen, and its record (named by
        its position) takes its place in the batch."""
        position = self.samples_seen
        self.samples_seen += 1
        return _Failed(_record(position, error, 1))

    def drawn_batch(self, samples: list[Any], wanted: int, end: type[Exception]) -> Gathered:
        """The batch of the ``samples`` just drawn (``wanted`` were asked for; a ``_Failed``
        where one was skipped), each named by its stream position. Fewer than wanted: the
        stream ran dry, and is done. Raises ``end`` when there is nothing to yield: no sample
        at all, or too few under ``drop_last``."""
        ran_dry = len(samples) < wanted
        if ran_dry or not samples:
            self.ended = True
        if not samples or (ran_dry and self.drop_last):
            raise end
        # Each sample drawn, kept or skipped, moved the stream on by one.
        first = self.samples_seen - len(samples)
        return Gathered(list(range(first, self.samples_seen)), samples)

    # -- bad samples: collate what survived, blame a failed collate or send on its samples ---

    def _collate_list(self, samples: list[Any]) -> Any:
        return self.collate_fn(samples if self.auto_collation else samples[0])

    def remember(self, keys: Sequence[Any], samples: Any, skipped: list[SkippedSample]) -> None:
        if self.keep_last and isinstance(samples, list) and len(samples) == len(keys):
            self._last = (keys, samples, skipped)

    def forget(self) -> None:
        """The batch has been sent (or failed for good): its samples need not be kept."""
        self._last = None

    def collate_gathered(self, gathered: Gathered) -> Any:
        """Collate a task's samples under the policy: the skipped ones left out, a failed
        collate blamed on the samples that cannot be collated alone (a sample error), or
        raised as it is when none can be blamed (a batch error)."""
        if gathered.opaque:
            batch = self.collate_fn(gathered.samples)
            whole = gathered.samples if self.auto_collation else [gathered.samples]
            self.remember(gathered.keys, whole, [])
            return batch
        keys: list[Any] = gathered.keys
        samples: list[Any] = gathered.samples
        skipped: list[SkippedSample] = []
        if gathered.failed != 0:
            keys, samples = [], []
            for key, sample in zip(gathered.keys, gathered.samples, strict=True):
                if type(sample) is _Failed:
                    skipped.append(sample.record)
                else:
                    keys.append(key)
                    samples.append(sample)
        if not samples:
            return WithSkips(NO_BATCH, skipped)
        try:
            batch = self._collate_list(samples)
        except Exception as error:
            if not self.policy.may_skip:
                raise
            keys, samples, batch = self._collate_blaming(keys, samples, skipped, error)
        self.remember(keys, samples, skipped)
        return WithSkips(batch, skipped) if skipped else batch

    def _collate_blaming(
        self,
        keys: list[Any],
        samples: list[Any],
        skipped: list[SkippedSample],
        error: Exception,
    ) -> tuple[list[Any], list[Any], Any]:
        """``collate_fn`` failed on these samples. A sample is to blame when a batch of it
        alone cannot be collated either; the policy decides about each such sample. The
        survivors are collated again, and a failure then is the collate's own (raised)."""
        blamed: list[tuple[int, Any, Exception]] = []
        # Not into the worker's shared-memory slab: these one-sample batches are thrown away.
        arena = _transport.collating_privately()
        try:
            for position, (key, sample) in enumerate(zip(keys, samples, strict=True)):
                try:
                    self._collate_list([sample])
                except Exception as exc:
                    blamed.append((position, key, exc))
        finally:
            _transport.collating_into(arena)
        if not blamed:
            raise error
        for _, key, failure in blamed:
            if not self.policy.skips(key, failure):
                raise failure
            skipped.append(_record(key, failure, 1))
        dropped = {position for position, _, _ in blamed}
        keys = [key for position, key in enumerate(keys) if position not in dropped]
        samples = [sample for position, sample in enumerate(samples) if position not in dropped]
        if not samples:
            return keys, samples, NO_BATCH
        return keys, samples, self._collate_list(samples)

    def drop_unsendable(self, error: Exception) -> Any:
        """The batch collated last could not be sent to the main process (pickled): blame the
        samples that cannot be pickled alone.

        With the policy saying "raise" (the default), raise an error of the pickling error's
        type that names their indices and types. With "skip", return the batch of the other
        samples (a ``WithSkips``), to be sent instead. Raises ``error`` itself when no single
        sample is to blame (the collate's result is what cannot be sent)."""
        last, self._last = self._last, None
        if last is None:
            raise error
        keys, samples, skipped = last
        blamed: list[tuple[int, Any, Any, Exception]] = []
        for position, (key, sample) in enumerate(zip(keys, samples, strict=True)):
            try:
                pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                blamed.append((position, key, sample, exc))
        if not blamed:
            raise error
        if not all(self.policy.skips(key, exc) for _, key, _, exc in blamed):
            raise _unsendable_error(blamed) from error
        skipped = [*skipped, *(_record(key, exc, 1) for _, key, _, exc in blamed)]
        dropped = {position for position, _, _, _ in blamed}
        keys = [key for position, key in enumerate(keys) if position not in dropped]
        samples = [sample for position, sample in enumerate(samples) if position not in dropped]
        if not samples:
            return WithSkips(NO_BATCH, skipped)
        batch = self._collate_list(samples)
        self.remember(keys, samples, skipped)
        return WithSkips(batch, skipped)


class Fetcher(BaseFetcher):
    """torch's map-style and iterable fetchers in one, with per-sample seeding and
    resumable streams. ``fetch`` raises StopIteration when an iterable stream is done."""

    def __init__(
        self, spec: FetchSpec, plan: PassPlan, *, in_calling_process: bool = False
    ) -> None:
        super().__init__(spec, plan)
        dataset, collate_fn, auto_collation = spec.dataset, spec.collate_fn, spec.auto_collation
        self.restore_rng = self.seeded and in_calling_process
        # default_collate's samples are copied into the slab as they come (aioload._worker.stacking),
        # where there is a slab: in a worker, collating with aioload's own default_collate.
        self.stacking = (
            _stacking.fetch_stacking
            if collate_fn is _transport.slab_collate and auto_collation
            else None
        )
        # Looked up once per pass (a fetcher is made for each), after the dataset's state was
        # loaded, rather than for every batch: a dataset without one pays for an
        # AttributeError raised and caught on each lookup.
        self.getitems = getattr(dataset, "__getitems__", None) if auto_collation else None
        self.policy_active = self.policy.active
        # Whether a map-style batch's indices reach the dataset one at a time (never as the
        # list): no ``__getitems__``, no policy (which names every key), auto-collation.
        self.item_by_item = (
            not self.iterable and auto_collation and not self.getitems and not self.policy_active
        )
        if self.iterable and not self.ended:
            self.load_dataset_state()
            if self.opened(iter(dataset)):
                self.samples_seen = plan.samples_seen
            else:
                # Fast-forward: draw (seeded as before) and drop what the checkpointed run had
                # already yielded, so the stream and its count are where they were.
                saved = RngStates() if self.restore_rng else None
                try:
                    for _ in range(plan.samples_seen):
                        self._pass_over_sample()
                except StopIteration:
                    self.ended = True  # shorter than it was: nothing is left to yield
                finally:
                    if saved is not None:
                        saved.install()

    def fetch(self, indices: Any, arena: _transport.LazyArena | None = None) -> Any:
        """The batch of ``indices``; with ``arena`` (a worker with shared memory), the large
        tensors of a map-style batch's samples are copied into its slab as they come
        (``_worker.stacking``). The collate finds the arena where torch's collate looks
        it up (NOTE [the arena of a collate] in ``_wire.slabs``)."""
        if type(indices) is IndexRange:
            # Where each index reaches the dataset on its own, as an int, a range gives the
            # same ints one at a time, without a list of them all kept for the batch.
            indices = range(indices.start, indices.stop) if self.item_by_item else indices.as_list()
        if self.iterable:
            return self._fetch_iterable(indices)
        saved = RngStates() if self.restore_rng else None
        try:
            if self.policy_active:
                return self.collate_gathered(self._gather_map(indices, arena))
            return self._fetch_map(indices, arena)
        finally:
            if saved is not None:
                saved.install()

    # -- map-style ---------------------------------------------------------------------------

    def _fetch_map(self, indices: Any, arena: _transport.LazyArena | None) -> Any:
        dataset = self.dataset
        if self.auto_collation:
            getitems = self.getitems
            if getitems:
                if self.seeded:
                    # One call for the whole batch: seeded once, from its first index (the
                    # batch's composition does not depend on the worker either).
                    self._seed(indices[0] if len(indices) else 0)
                data = getitems(indices)
            elif self.stacking is not None and arena is not None:
                fetch = self._seeded_item if self.seeded else dataset.__getitem__
                data = self.stacking(fetch, indices, arena)
            elif self.seeded:
                data = []
                for index in indices:
                    self._seed(index)
                    data.append(dataset[index])
            else:
                data = [dataset[index] for index in indices]
        else:
            if self.seeded:
                self._seed(indices)
            data = dataset[indices]
        batch = self.collate_fn(data)
        if self.keep_last:
            # Kept until the batch is sent: a sample that cannot be sent is then named. (A
            # range of keys is kept as it is: only a batch that cannot be sent reads it.)
            if self.auto_collation:
                self.remember(indices if type(indices) is range else list(indices), data, [])
            else:
                self.remember([indices], [data], [])
        return batch

    def _seed(self, index: Any) -> None:
        _seed_all(self.seed_of(index))

    def _seeded_item(self, index: Any) -> Any:
        self._seed(index)
        return self.dataset[index]

    def _gather_map(self, indices: Any, arena: _transport.LazyArena | None) -> Gathered:
        """The task's samples under the policy, each on its own (retried, then raised or
        skipped). A dataset's ``__getitems__`` is tried first; if it fails, the batch's
        samples are fetched one by one with ``dataset[index]``, so only the bad ones are lost.
        """
        keys = list(indices) if self.auto_collation else [indices]
        getitems = self.getitems
        if getitems:
            if self.seeded:
                self._seed(keys[0] if keys else 0)
            try:
                return gathered_batch(keys, getitems(indices))
            except Exception:
                pass  # one by one, below
        if self.stacking is not None and arena is not None:
            return self._gather_stacking(keys, arena)
        # One try around the whole loop, not one per sample: when nothing fails (the usual
        # case), this costs what torch's own list comprehension does. A failure leaves the
        # loop with ``key`` naming the sample; it is retried or skipped, and the loop goes on
        # from the next key.
        dataset = self.dataset
        samples: list[Any] = []
        append = samples.append
        remaining = iter(keys)
        failed = 0
        key: Any = None
        while True:
            try:
                if self.seeded:
                    for key in remaining:
                        self._seed(key)
                        append(dataset[key])
                else:
                    for key in remaining:
                        append(dataset[key])
                break
            except Exception as exc:
                sample = self._retry(key, exc)
                failed += type(sample) is _Failed
                append(sample)
        return Gathered(keys, samples, failed=failed)

    def _gather_stacking(self, keys: list[Any], arena: _transport.LazyArena) -> Gathered:
        """``_gather_map``'s loop, each sample's large tensors copied into the slab as it
        comes (``_worker.stacking``); a skipped sample takes no row."""
        dataset = self.dataset
        seeded = self.seeded
        failed = 0

        def fetch_one(key: Any) -> Any:
            nonlocal failed
            try:
                if seeded:
                    self._seed(key)
                return dataset[key]
            except Exception as exc:
                sample = self._retry(key, exc)
                failed += type(sample) is _Failed
                return sample

        assert self.stacking is not None
        samples = self.stacking(fetch_one, keys, arena, _Failed)
        return Gathered(keys, samples, failed=failed)

    def _retry(self, key: Any, error: Exception) -> Any:
        """Sample ``key`` failed its first try with ``error``: retry it ``policy.retries`` times
        with a growing pause (this worker has nothing else to do meanwhile), then raise or
        skip it as the policy says."""
        tries = 1
        while tries <= self.policy.retries:
            time.sleep(retry_delay(tries - 1))
            tries += 1
            if self.seeded:
                self._seed(key)
            try:
                return self.dataset[key]
            except Exception as exc:
                error = exc
        if self.policy.skips(key, error):
            return _Failed(_record(key, error, tries))
        raise error

    # -- iterable ----------------------------------------------------------------------------

    def _next_sample(self) -> Any:
        if self.seeded:
            # An IterableDataset has no index: a sample is named by its stream and its
            # position in it, which do not depend on timing (but do on the sharding).
            self._seed((self.plan.stream_id, self.samples_seen))
        sample = next(self.stream)
        self.samples_seen += 1
        return sample

    def _pass_over_sample(self) -> None:
        """Draw and drop one sample of a resumed stream. One that fails was skipped (or
        raised) when it was first drawn: it is passed over here too."""
        try:
            self._next_sample()
        except StopIteration:
            raise
        except Exception:
            if not self.policy.may_skip:
                raise
            self.samples_seen += 1

    def _draw(self) -> Any:
        """The stream's next sample under the policy: a ``_Failed`` when it is skipped. There
        are no retries here: an iterator cannot be asked for the same element again."""
        try:
            return self._next_sample()
        except StopIteration:
            raise
        except Exception as exc:
            # (The failed draw did not count: samples_seen is still its position.)
            if not self.policy.skips(self.samples_seen, exc):
                raise
            return self.lost_draw(exc)

    def _fetch_iterable_policy(self, indices: Any) -> Any:
        wanted = len(indices) if self.auto_collation else 1
        samples: list[Any] = []
        with contextlib.suppress(StopIteration):
            while len(samples) < wanted:
                samples.append(self._draw())
        return self.collate_gathered(self.drawn_batch(samples, wanted, StopIteration))

    def _fetch_iterable(self, indices: Any) -> Any:
        if self.ended:
            raise StopIteration
        saved = RngStates() if self.restore_rng else None
        try:
            if self.policy.active:
                return self._fetch_iterable_policy(indices)
            if self.auto_collation:
                data = []
                for _ in indices:
                    try:
                        data.append(self._next_sample())
                    except StopIteration:
                        self.ended = True
                        break
                if not data or (self.drop_last and len(data) < len(indices)):
                    self.ended = True
                    raise StopIteration
            else:
                try:
                    data = self._next_sample()
                except StopIteration:
                    self.ended = True
                    raise
        finally:
            if saved is not None:
                saved.install()
        batch = self.collate_fn(data)
        if self.keep_last:
            # Named by stream position, as a skipped element is.
            if self.auto_collation:
                first = self.samples_seen - len(data)
                self.remember(list(range(first, self.samples_seen)), data, [])
            else:
                self.remember([self.samples_seen - 1], [data], [])
        return batch


def is_stateful(obj: Any) -> bool:
    """torchdata's ``Stateful`` protocol: ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _load_state(target: Any, state: Any, what: str) -> None:
    if not is_stateful(target):
        raise ValueError(
            f"aioload: the checkpoint holds a state for the {what} ({type(target).__name__}), "
            "which has no state_dict()/load_state_dict(): resume with the same dataset"
        )
    target.load_state_dict(state)
