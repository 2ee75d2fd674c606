"""Crafted checkpoints: a state edited by hand (or by another program), or saved by a loader
with other arguments, is refused by ``load_state_dict`` with a ValueError that names the field
at fault, before anything is loaded. Before these checks, a ``yielded_prefix`` past the end of
the pass was accepted and the resumed pass yielded nothing at all, silently.

Each case starts from a real state (a map-style pass after 2 of its 4 batches, or an iterable
one), changes one thing, and loads it into a loader built like the one that saved it.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

import aioload

pytestmark = pytest.mark.no_local_workers(
    "states refused or loaded by loaders that start no worker"
)


State = dict[str, Any]
N, BATCH = 12, 3  # 4 batches a pass


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(N))


def _map_loader() -> aioload.DataLoader[Any]:
    return aioload.DataLoader(list(range(N)), batch_size=BATCH, shuffle=True)


def _iterable_loader() -> aioload.DataLoader[Any]:
    return aioload.DataLoader(_Stream(), batch_size=BATCH)


def _mid_pass(make: Callable[[], aioload.DataLoader[Any]]) -> State:
    loader = make()
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    state: State = json.loads(json.dumps(loader.state_dict()))
    return state


def _set(path: str, value: Any) -> Callable[[State], None]:
    """Set the field at ``path`` ("a/b/0/c") to ``value``."""

    def change(state: State) -> None:
        *parents, last = path.split("/")
        node: Any = state
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return change


def _drop(key: str) -> Callable[[State], None]:
    return lambda state: state.pop(key)


# (case, how the state is changed, the field the message must name)
MAP_CASES: list[tuple[str, Callable[[State], None], str]] = [
    ("prefix one past the end", _set("yielded_prefix", 5), "'yielded_prefix'"),
    ("prefix far past the end", _set("yielded_prefix", 10**12), "'yielded_prefix'"),
    ("extra position past the end", _set("yielded_extra", [4]), "'yielded_extra'"),
    ("extra position twice", _set("yielded_extra", [3, 3]), "'yielded_extra'"),
    ("prefix a bool", _set("yielded_prefix", True), "'yielded_prefix'"),
    ("prefix NaN", _set("yielded_prefix", math.nan), "'yielded_prefix'"),
    ("epoch negative", _set("epoch", -1), "'epoch'"),
    ("epoch a bool", _set("epoch", True), "'epoch'"),
    ("epoch past int64", _set("epoch", 2**70), "'epoch'"),
    ("next worker past the streams", _set("next_worker", 1), "'next_worker'"),
    ("a key missing", _drop("drew_base_seed"), "'drew_base_seed'"),
    ("an unknown key", _set("resume_at", 3), "'resume_at'"),
    ("in_progress a string", _set("in_progress", "yes"), "'in_progress'"),
    ("rng a list", _set("rng", []), "'rng'"),
    ("rng with an unknown key", _set("rng/numpy", "x"), "'numpy'"),
    ("rng not base64", _set("rng/torch", "!!"), "'torch'"),
    ("streams a dict", _set("streams", {}), "'streams'"),
    ("a stream a list", _set("streams/0", []), "'streams'[0]"),
    ("a stream with an unknown key", _set("streams/0/cursor", 1), "'cursor'"),
    ("a map-style stream that ended", _set("streams/0/ended", True), "'ended'"),
    ("a map-style stream that drew", _set("streams/0/samples_seen", 5), "'samples_seen'"),
    ("a map-style stream's iterator", _set("streams/0/iter_state", {"i": 1}), "'iter_state'"),
    ("samples_seen negative", _set("streams/0/samples_seen", -1), "'samples_seen'"),
    ("sampler a list", _set("sampler", []), "'sampler'"),
    ("sampler missing a key", _set("sampler", {"state": None}), "'iter_state'"),
    ("a skipped record without fields", _set("skipped", [{"index": 1}]), "'skipped'[0]"),
    (
        "a skipped record's worker negative",
        _set("skipped", [{"index": 1, "error": "E", "worker": -3, "tries": 1}]),
        "'worker'",
    ),
    (
        "a skipped record's tries a float",
        _set("skipped", [{"index": 1, "error": "E", "worker": None, "tries": 1.5}]),
        "'tries'",
    ),
    ("worker seed negative", _set("worker_seed", -1), "'worker_seed'"),
    ("worker seed past int64", _set("worker_seed", 2**64), "'worker_seed'"),
    ("sample seed a float", _set("sample_seed", 1.5), "'sample_seed'"),
    ("shard seed a bool", _set("shard_seed", True), "'shard_seed'"),
    ("num_workers negative", _set("num_workers", -1), "'num_workers'"),
    ("num_workers a float", _set("num_workers", 2.0), "'num_workers'"),
    ("an iterable state", _set("iterable", True), "'iterable'"),
]

ITERABLE_CASES: list[tuple[str, Callable[[State], None], str]] = [
    # (Its streams drew samples, which a map-style dataset's never do.)
    ("marked map-style", _set("iterable", False), "'samples_seen'"),
    ("a sampler state", _set("sampler", {"state": {"i": 1}, "iter_state": None}), "'sampler'"),
    ("next worker negative", _set("next_worker", -1), "'next_worker'"),
    ("ended a number", _set("streams/0/ended", 1), "'ended'"),
]


def _refused(make: Callable[[], aioload.DataLoader[Any]], change: Any, field: str) -> None:
    state = _mid_pass(make)
    make().load_state_dict(copy.deepcopy(state))  # the state as saved loads
    change(state)
    with pytest.raises(ValueError, match=re.escape(field)):
        make().load_state_dict(state)


@pytest.mark.parametrize(("case", "change", "field"), MAP_CASES, ids=[c[0] for c in MAP_CASES])
def test_a_crafted_map_style_state_is_refused_naming_the_field(
    case: str, change: Callable[[State], None], field: str
) -> None:
    _refused(_map_loader, change, field)


@pytest.mark.parametrize(
    ("case", "change", "field"), ITERABLE_CASES, ids=[c[0] for c in ITERABLE_CASES]
)
def test_a_crafted_iterable_state_is_refused_naming_the_field(
    case: str, change: Callable[[State], None], field: str
) -> None:
    _refused(_iterable_loader, change, field)


def test_a_state_of_the_other_kind_of_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'iterable'.*map-style one"):
        _map_loader().load_state_dict(_mid_pass(_iterable_loader))
    with pytest.raises(ValueError, match=r"'iterable'.*iterable one"):
        _iterable_loader().load_state_dict(_mid_pass(_map_loader))


def test_a_state_from_a_loader_with_fewer_batches_is_refused() -> None:
    """Saved after the 4th of 6 batches, loaded where a pass has 4: the position does not fit
    (before, the resumed pass yielded nothing)."""
    loader = aioload.DataLoader(list(range(18)), batch_size=3)
    iterator = iter(loader)
    for _ in range(5):
        next(iterator)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="'yielded_prefix' is 5, past the end"):
        aioload.DataLoader(list(range(12)), batch_size=3).load_state_dict(state)


def test_a_state_after_the_last_batch_still_loads() -> None:
    """The one position at the end that is real: the last batch yielded, the pass not yet
    ended. The resumed pass has nothing left, and the next one is whole."""
    loader = aioload.DataLoader(list(range(N)), batch_size=BATCH)
    iterator = iter(loader)
    for _ in range(N // BATCH):
        next(iterator)
    state = loader.state_dict()
    assert state["yielded_prefix"] == N // BATCH
    resumed = aioload.DataLoader(list(range(N)), batch_size=BATCH)
    resumed.load_state_dict(state)
    assert list(resumed) == []
    assert torch.cat(list(resumed)).tolist() == list(range(N))


class _EstimatedLength(torch.utils.data.Sampler[int]):
    """A user's sampler whose ``__len__`` is an estimate, short of what it yields (as a
    bucketing sampler's often is): torch iterates past it."""

    def __iter__(self) -> Any:
        return iter(range(40))

    def __len__(self) -> int:
        return 10


def test_a_state_past_a_users_estimated_length_loads_and_resumes_exactly() -> None:
    """Only torch's own samplers bound a state's positions: a user's ``__len__`` may be an
    estimate, and a state taken past it is a real one."""

    def make() -> aioload.DataLoader[Any]:
        return aioload.DataLoader(
            list(range(40)), sampler=_EstimatedLength(), batch_size=2, num_workers=2
        )

    loader = make()
    iterator = iter(loader)
    taken = [next(iterator).tolist() for _ in range(12)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    rest = [batch.tolist() for batch in resumed]
    assert [x for batch in taken + rest for x in batch] == list(range(40))
