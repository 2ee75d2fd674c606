"""The samplers ``shuffle=True`` builds: torch's ``RandomSampler`` and ``BatchSampler`` (these are
subclasses, so ``isinstance`` checks hold, and the orders are torch's own, drawn by torch's
code at the same points from the same generators), whose iterators carry their own state.

A framework that rebuilds the loader from its ``batch_sampler`` (accelerate's ``prepare()``
with ``use_stateful_dataloader=True`` makes a torchdata ``StatefulDataLoader`` of it) then
resumes exactly: it asks the iterator for ``state_dict()`` after each batch and loads it into
a fresh iterator, as it does with torchdata's own stateful samplers. With torch's stateless
samplers it could only iterate the sampler anew, and skip, drawing another order.

The state of a ``RandomSampler`` iteration is where its order was drawn from (the seed it drew
from torch's global RNG, or its ``generator``'s state before the order) and how many indices
it has yielded: loading it draws the same order again and skips those. The batch sampler's is
the samples it has drawn and its sampler iterator's state. Both are plain data (RNG states as
base64 text), so a JSON checkpoint takes them.

aioload's own ``state_dict()`` does not use them: its engine records the RNG states a pass
drew from and replays them (``_engine.resume``), which also replays the draws from torch's
global RNG an uninterrupted run makes; these iterators say so with ``replayed``.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils.data

__all__ = ["RandomSampler", "is_replayed", "loader_generators", "use_stateful_shuffle"]


def use_stateful_shuffle(loader: Any, generator: torch.Generator | None) -> None:
    """Replace the ``RandomSampler`` torch's ``__init__`` built for ``shuffle=True`` over a
    map-style dataset by this one, with the same arguments, and rebuild the batch sampler over
    it. They are set past torch's guard on these attributes, which is there for users changing
    them after construction.

    The batch sampler stays torch's own class (Lightning treats any other as a custom batch
    sampler, and rebuilds the loader around it rather than its sampler); its
    ``state_dict()``/``load_state_dict()`` are the sampler's: torch's batching draws the
    sampler's indices one by one, so the sampler's position is the batch sampler's."""
    if loader._dataset_kind != 0:  # (an IterableDataset: torch refuses shuffle)
        return
    sampler = RandomSampler(loader.dataset, generator=generator)
    object.__setattr__(loader, "sampler", sampler)
    if loader.batch_size is not None:
        batches = torch.utils.data.BatchSampler(sampler, loader.batch_size, loader.drop_last)
        batches.state_dict = sampler.state_dict  # type: ignore[attr-defined]
        batches.load_state_dict = sampler.load_state_dict  # type: ignore[attr-defined]
        object.__setattr__(loader, "batch_sampler", batches)


def is_replayed(obj: Any) -> bool:
    """Whether ``obj`` is this sampler (aioload's engine replays it instead)."""
    return isinstance(obj, RandomSampler)


class RandomSampler(torch.utils.data.RandomSampler):
    """torch's ``RandomSampler``, with ``state_dict()``/``load_state_dict()``: the state of its
    latest iteration (where its order was drawn from, how many indices it yielded), and, once
    loaded, where its next iteration starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._latest: _RandomSamplerIterator | None = None
        self._loaded: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[int]:
        loaded, self._loaded = self._loaded, None
        self._latest = _RandomSamplerIterator(self, loaded)
        return self._latest

    def state_dict(self) -> dict[str, Any]:
        if self._loaded is not None:
            return dict(self._loaded)
        if self._latest is not None:
            return self._latest.state_dict()
        return {"start": None, "yielded": 0}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        start, yielded = state["start"], state["yielded"]
        if type(yielded) is not int or yielded < 0:
            raise ValueError(f"aioload: RandomSampler state 'yielded' is {yielded!r}")
        if start is not None and not (
            isinstance(start, Mapping)
            and (type(start.get("seed")) is int or isinstance(start.get("generator"), str))
        ):
            raise ValueError(f"aioload: RandomSampler state 'start' is {start!r}")
        self._loaded = {"start": None if start is None else dict(start), "yielded": yielded}


class _RandomSamplerIterator:
    """One pass of a ``RandomSampler``: torch's own iteration, begun (its seed drawn, as torch
    draws it) on the first ``next()``; or, from a loaded state, that iteration drawn again from
    where it was drawn and the indices it had yielded skipped."""

    def __init__(self, sampler: RandomSampler, loaded: dict[str, Any] | None) -> None:
        self.sampler = sampler
        self.yielded = 0
        # Where the order is drawn from: {"seed": int} (drawn from torch's global RNG) or
        # {"generator": base64 state} (the sampler's generator before the order); None until
        # the first next().
        self.start: dict[str, Any] | None = None
        self.order: Iterator[int] | None = None
        self.loaded = loaded

    def __iter__(self) -> _RandomSamplerIterator:
        return self

    def __next__(self) -> int:
        if self.order is None:
            loaded, self.loaded = self.loaded, None
            self._begin(None if loaded is None else loaded["start"])
            if loaded is not None and loaded["start"] is not None:
                for _ in range(loaded["yielded"]):
                    next(self)
        assert self.order is not None
        index = next(self.order)
        self.yielded += 1
        return index

    def _begin(self, start: dict[str, Any] | None) -> None:
        sampler = self.sampler
        generator = sampler.generator
        if start is None:
            if generator is None:
                # torch's draw, at torch's point (the first next()).
                start = {"seed": int(torch.empty((), dtype=torch.int64).random_().item())}
            else:
                start = {"generator": _encode(generator.get_state())}
        if "seed" in start:
            generator = torch.Generator()
            generator.manual_seed(start["seed"])
        else:
            if generator is None:
                raise ValueError(
                    "aioload: the RandomSampler state was drawn from a generator, and this "
                    "sampler has none (generator=None)"
                )
            generator.set_state(_decode(start["generator"]))
        self.start = start
        # torch's own iteration over that generator: the same order torch draws.
        order = torch.utils.data.RandomSampler(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=generator,
        )
        self.order = iter(order)

    def state_dict(self) -> dict[str, Any]:
        if self.loaded is not None:  # loaded, not begun
            return dict(self.loaded)
        return {"start": None if self.start is None else dict(self.start), "yielded": self.yielded}


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(bytes(state.numpy().tobytes())).decode("ascii")


def _decode(text: Any) -> torch.Tensor:
    if isinstance(text, torch.Tensor):
        return text
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The random generators the sampler order is drawn from (the loader's, and any the
    samplers hold), each once."""
    found: list[torch.Generator] = []
    candidates = [loader.generator, loader.sampler, loader.batch_sampler]
    candidates += [getattr(loader.batch_sampler, "sampler", None)]
    for candidate in candidates:
        generator = (
            candidate
            if isinstance(candidate, torch.Generator)
            else getattr(candidate, "generator", None)
        )
        if isinstance(generator, torch.Generator) and all(g is not generator for g in found):
            found.append(generator)
    return found
