"""Turning a task's indices into a batch: the one fetch step that workers and the calling
process (``num_workers=0``) share.

It does what torch's fetchers do (``__getitems__`` or one ``__getitem__`` per index, or
``next()`` on an IterableDataset's iterator, then ``collate_fn``), plus two things torch's
cannot:

- ``seed_per_sample``: each sample is fetched with the ``random``, torch and numpy RNGs seeded
  from ``(base_seed, epoch, sample index)``, so random augmentations depend on the sample and
  the epoch only, not on which worker fetched it, in what order, or whether the run was
  resumed;
- resume of an IterableDataset: a worker's stream is restored from the dataset's own
  ``state_dict`` (or fast-forwarded) before the pass starts, and its state after every batch is
  reported so that a checkpoint can name exactly what was yielded.

What a pass needs to know up front arrives as a ``PassPlan``, one per worker and pass.
"""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["BaseFetcher", "Fetcher", "PassPlan", "RngStates", "sample_seed"]


@dataclass(frozen=True)
class PassPlan:
    """One worker's instructions for one pass (epoch)."""

    epoch: int = 0
    # seed_per_sample's base seed; None when seed_per_sample is off.
    sample_seed: int | None = None
    # IterableDataset resume: samples this stream had yielded at the checkpoint. With
    # has_state, dataset_state is loaded before iter(dataset) and the stream goes on from
    # there; without, the stream is fast-forwarded by drawing and dropping that many samples.
    samples_seen: int = 0
    has_state: bool = False
    dataset_state: Any = None
    # The stream had already run dry when the checkpoint was taken.
    ended: bool = False
    # Which stream this is for seed_per_sample on an IterableDataset: the global worker id
    # (rank * num_workers + worker id).
    stream_id: int = 0
    # An IterDataPipe's random pipes are seeded from this, the same in every worker (see
    # _datapipes); None for any other dataset.
    shared_seed: int | None = None


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


class BaseFetcher:
    """What the sync and the async fetcher share: the dataset and how to batch it, the pass's
    plan, the seed of a sample, and where an IterableDataset's stream stands."""

    def __init__(
        self,
        dataset_kind: int,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Any,
        drop_last: bool,
        plan: PassPlan,
    ) -> None:
        self.iterable = dataset_kind == 1
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.plan = plan
        self.seeded = plan.sample_seed is not None
        self.samples_seen = 0
        self.ended = plan.ended
        # Whether the dataset can report its position (only asked of iterable datasets).
        self.stateful = self.iterable and _has_state_dict(dataset)
        self.stream: Any = None

    def state(self) -> Any:
        """The dataset's state now (after the batch just fetched), for a checkpoint."""
        return self.dataset.state_dict() if self.stateful else None

    def seed_of(self, key: Any) -> int:
        """seed_per_sample's seed for the sample named ``key`` in this pass."""
        assert self.plan.sample_seed is not None
        return sample_seed(self.plan.sample_seed, self.plan.epoch, key)


class Fetcher(BaseFetcher):
    """torch's map-style and iterable fetchers in one, with per-sample seeding and
    resumable streams. ``fetch`` raises StopIteration when an iterable stream is done."""

    def __init__(
        self,
        dataset_kind: int,
        dataset: Any,
        auto_collation: bool,
        collate_fn: Any,
        drop_last: bool,
        plan: PassPlan,
        *,
        in_calling_process: bool = False,
    ) -> None:
        super().__init__(dataset_kind, dataset, auto_collation, collate_fn, drop_last, plan)
        self.restore_rng = self.seeded and in_calling_process
        if self.iterable and not self.ended:
            if plan.has_state:
                dataset.load_state_dict(plan.dataset_state)
                self.stream = iter(dataset)
                self.samples_seen = plan.samples_seen
            else:
                self.stream = iter(dataset)
                # Fast-forward: draw (seeded as before) and drop what the checkpointed run had
                # already yielded, so the stream and its count are where they were.
                saved = RngStates() if self.restore_rng else None
                try:
                    for _ in range(plan.samples_seen):
                        self._next_sample()
                except StopIteration:
                    self.ended = True  # shorter than it was: nothing is left to yield
                finally:
                    if saved is not None:
                        saved.install()

    def fetch(self, indices: Any) -> Any:
        if self.iterable:
            return self._fetch_iterable(indices)
        saved = RngStates() if self.restore_rng else None
        try:
            return self._fetch_map(indices)
        finally:
            if saved is not None:
                saved.install()

    # -- map-style ---------------------------------------------------------------------------

    def _fetch_map(self, indices: Any) -> Any:
        dataset = self.dataset
        if self.auto_collation:
            getitems = getattr(dataset, "__getitems__", None)
            if getitems:
                if self.seeded:
                    # One call for the whole batch: seeded once, from its first index (the
                    # batch's composition does not depend on the worker either).
                    self._seed(indices[0] if len(indices) else 0)
                data = getitems(indices)
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
        return self.collate_fn(data)

    def _seed(self, index: Any) -> None:
        _seed_all(self.seed_of(index))

    # -- iterable ----------------------------------------------------------------------------

    def _next_sample(self) -> Any:
        if self.seeded:
            # An IterableDataset has no index: a sample is named by its stream and its
            # position in it, which do not depend on timing (but do on the sharding).
            self._seed((self.plan.stream_id, self.samples_seen))
        sample = next(self.stream)
        self.samples_seen += 1
        return sample

    def _fetch_iterable(self, indices: Any) -> Any:
        if self.ended:
            raise StopIteration
        saved = RngStates() if self.restore_rng else None
        try:
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
        return self.collate_fn(data)


def _has_state_dict(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )
