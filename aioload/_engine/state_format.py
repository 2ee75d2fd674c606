"""Reading a checkpoint: ``load_state_dict``'s parser, and its checks against the loader.

A state is plain data that anyone can edit, so every field is checked before anything is
loaded: its type (an integer is an ``int`` and not a ``bool``; no floats, so no NaN), its
range, its nesting, the keys each level has (no missing one, no unknown one), and then, in
``check_fit``, what it says against the loader it goes into (a position past the pass's last
batch, a worker past its last stream). A state that does not fit is refused with a
``ValueError`` that names the field: it never resumes somewhere else, or yields nothing.

The writer is ``resume.PassProgress.as_dict`` (with the keys the loader adds); the formats read
are ``resume.FORMATS``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import torch

from .._named_tuple import NamedTuple
from ..stats import SkippedSample
from .resume import (
    FORMATS,
    PassProgress,
    SamplerPoint,
    StreamPoint,
    YieldedPositions,
)

__all__ = ["ParsedState", "check_fit", "decode_rng", "parse_state"]

# Seeds (the workers' base seed, seed_per_sample's, the shard's shuffle seed) and epochs are
# drawn or counted as torch's non-negative int64; anything beyond cannot have been saved.
_SEED_LIMIT = 2**63

# The keys of each level of a state, by format (format /1: no sampler, no worker seed, a
# stream's dataset state under has_state/state).
_TOP = frozenset(
    {
        "format",
        "epoch",
        "rng",
        "sample_seed",
        "iterable",
        "drew_base_seed",
        "yielded_prefix",
        "yielded_extra",
        "streams",
        "next_worker",
        "skipped",
        "in_progress",
        "num_workers",
        "shard_seed",
    }
)
_KEYS = {
    "top": (_TOP, _TOP | {"sampler", "worker_seed"}),
    "stream": (
        frozenset({"samples_seen", "has_state", "state", "ended"}),
        frozenset({"samples_seen", "ended", "dataset_state", "iter_state", "iter_is_dataset"}),
    ),
}
# Absent from states saved before they existed.
_OPTIONAL = frozenset({"skipped", "sample_seed", "worker_seed", "shard_seed"})

# Keys of torchdata's StatefulDataLoader state (single- and multi-process iterators).
_TORCHDATA_KEYS = ("_snapshot", "_num_yielded", "_sampler_iter_state", "_iterator_finished")


class ParsedState(NamedTuple):
    progress: PassProgress
    in_progress: bool
    num_workers: int
    shard_seed: int | None


def parse_state(state: Any) -> ParsedState:
    """A state from ``state_dict()`` (any format in ``FORMATS``), checked field by field on its
    own; ``check_fit`` checks it against the loader."""
    version_1 = _format(state) == FORMATS[0]
    data: Mapping[str, Any] = state
    _keys(data, _KEYS["top"][0 if version_1 else 1], "the state")
    rng = _mapping(_field(data, "rng", "state"), "'rng'")
    _keys(rng, frozenset({"torch", "generators"}), "'rng'", optional=frozenset())
    generators = _field(rng, "generators", "'rng'")
    if not isinstance(generators, list):
        raise _corrupt("'rng'/'generators'", "is not a list")
    iterable = _flag(data, "iterable")
    streams = _streams(data, version_1, iterable)
    yielded = _yielded(data)
    next_worker = _count(data, "next_worker")
    if next_worker >= len(streams):
        raise _corrupt(
            "'next_worker'", f"is {next_worker}, but the state has {len(streams)} stream(s)"
        )
    sampler = None if version_1 else _sampler_point(_field(data, "sampler", "state"))
    if sampler is not None and iterable:
        raise _corrupt(
            "'sampler'", "holds a sampler state, but the state is of an iterable dataset"
        )
    # (Read in this order, so that a state with several faults names the same one first.)
    epoch = _count(data, "epoch", limit=_SEED_LIMIT)
    decoded = _decoded_rng(rng, generators)
    sample_seed = _seed(data, "sample_seed")
    drew_base_seed = _flag(data, "drew_base_seed")
    skipped = _skipped(data.get("skipped", []))
    worker_seed = None if version_1 else _seed(data, "worker_seed")
    progress = PassProgress(
        epoch, decoded, sample_seed, iterable, len(streams), drew_base_seed, worker_seed
    )
    progress.yielded = yielded
    progress.streams = streams
    progress.next_worker = next_worker
    progress.skipped = skipped
    progress.sampler = sampler
    in_progress = _flag(data, "in_progress")
    if version_1 and not in_progress:
        # Format /1 kept nothing of the workers' datasets between passes.
        progress.streams = [StreamPoint() for _ in streams]
    return ParsedState(
        progress, in_progress, _count(data, "num_workers"), _seed(data, "shard_seed")
    )


def _decoded_rng(rng: Mapping[str, Any], generators: list[Any]) -> dict[str, Any]:
    return {
        "torch": decode_rng(_field(rng, "torch", "'rng'"), "'rng'/'torch'"),
        "generators": [
            decode_rng(value, f"'rng'/'generators'[{index}]")
            for index, value in enumerate(generators)
        ],
    }


def _streams(data: Mapping[str, Any], version_1: bool, iterable: bool) -> list[StreamPoint]:
    streams_data = _field(data, "streams", "state")
    if not isinstance(streams_data, list) or not streams_data:
        raise _corrupt("'streams'", "is not a non-empty list")
    return [
        _stream_point(point, f"'streams'[{index}]", version_1, iterable)
        for index, point in enumerate(streams_data)
    ]


def _yielded(data: Mapping[str, Any]) -> YieldedPositions:
    prefix = _count(data, "yielded_prefix")
    extra_data = _field(data, "yielded_extra", "state")
    if not isinstance(extra_data, list) or not all(
        type(p) is int and p > prefix for p in extra_data
    ):
        raise _corrupt("'yielded_extra'", "is not a list of positions beyond 'yielded_prefix'")
    if len(set(extra_data)) != len(extra_data):
        raise _corrupt("'yielded_extra'", "lists a position twice")
    return YieldedPositions(prefix, set(extra_data))


def check_fit(parsed: ParsedState, *, iterable: bool, batches: int | None) -> None:
    """What a parsed state says, against the loader it is loaded into: its kind of dataset, and
    (``batches``: how many the loader's passes have, where its sampler has a length) positions
    within a pass. A map-style pass has ``batches`` batches; a state at ``batches`` is one taken
    after the last of them, which resumes to an empty rest of the pass."""
    progress = parsed.progress
    if progress.iterable != iterable:
        raise ValueError(
            "aioload: the state's 'iterable' says it was saved for a"
            f"{'n iterable' if progress.iterable else ' map-style'} dataset, this loader has "
            f"a{'n iterable' if iterable else ' map-style'} one"
        )
    if iterable or batches is None:
        return
    yielded = progress.yielded
    if yielded.prefix > batches:
        raise ValueError(
            f"aioload: the state's 'yielded_prefix' is {yielded.prefix}, past the end of this "
            f"loader's pass ({batches} batches): it was saved by a loader with another "
            "dataset, sampler or batch size"
        )
    beyond = sorted(position for position in yielded.extra if position >= batches)
    if beyond:
        raise ValueError(
            f"aioload: the state's 'yielded_extra' holds position {beyond[0]}, past the end of "
            f"this loader's pass ({batches} batches): it was saved by a loader with another "
            "dataset, sampler or batch size"
        )


# -- the fields ----------------------------------------------------------------------------------


def _format(state: Any) -> str:
    if not isinstance(state, Mapping):
        raise ValueError(
            "aioload: load_state_dict expects a state from aioload.DataLoader.state_dict() "
            f"(a dict), but got a {type(state).__name__}"
        )
    found = state.get("format")
    if found in FORMATS:
        return str(found)
    if found is None and any(key in state for key in _TORCHDATA_KEYS):
        raise ValueError(
            "aioload: this is a state of torchdata's StatefulDataLoader; aioload.DataLoader "
            "has a state format of its own and cannot continue a pass from it. Start the "
            "epoch over (or finish it with StatefulDataLoader), then checkpoint with "
            "aioload (see docs/migrating.md)"
        )
    if found is None:
        raise ValueError(
            "aioload: load_state_dict expects a state from aioload.DataLoader.state_dict(); "
            "this one has no 'format' key"
        )
    raise ValueError(
        f"aioload: unknown state format {found!r}; this aioload reads {', '.join(FORMATS)} "
        "(a state from a newer aioload?)"
    )


def _keys(
    data: Mapping[str, Any],
    allowed: frozenset[str],
    where: str,
    optional: frozenset[str] = _OPTIONAL,
) -> None:
    """No key beyond ``allowed`` (a state edited, or from another program), none missing."""
    unknown = sorted(str(key) for key in data if key not in allowed)
    if unknown:
        raise _corrupt(where, f"has unknown key(s) {', '.join(map(repr, unknown))}")
    missing = sorted(allowed - set(data) - optional)
    if missing:
        raise ValueError(f"aioload: corrupt state: {where} has no {missing[0]!r} key")


def _stream_point(data: Any, where: str, version_1: bool, iterable: bool) -> StreamPoint:
    data = _mapping(data, where)
    _keys(data, _KEYS["stream"][0 if version_1 else 1], where, optional=frozenset())
    if version_1:  # the dataset's state, loaded before iter()
        state = data.get("state") if _flag(data, "has_state", where) else None
        point = StreamPoint(_count(data, "samples_seen", where), state, _flag(data, "ended", where))
    else:
        point = StreamPoint(
            samples_seen=_count(data, "samples_seen", where),
            dataset_state=_field(data, "dataset_state", where),
            ended=_flag(data, "ended", where),
            iter_state=_field(data, "iter_state", where),
            iter_is_dataset=_flag(data, "iter_is_dataset", where),
        )
    if not iterable:
        # A map-style dataset has no stream: nothing drawn, no end, no iterator.
        for key, value in (
            ("samples_seen", point.samples_seen),
            ("ended", point.ended),
            ("iter_state", point.iter_state),
            ("iter_is_dataset", point.iter_is_dataset),
        ):
            if value not in (0, False, None) or type(value) is float:
                raise _corrupt(
                    f"{where}/{key!r}", f"is {value!r}, but the state is of a map-style dataset"
                )
    return point


def _sampler_point(data: Any) -> SamplerPoint | None:
    if data is None:
        return None
    data = _mapping(data, "'sampler'")
    _keys(data, frozenset({"state", "iter_state"}), "'sampler'", optional=frozenset())
    return SamplerPoint(data["state"], data["iter_state"])


def _skipped(data: Any) -> list[SkippedSample]:
    if not isinstance(data, list):
        raise _corrupt("'skipped'", "is not a list")
    records = []
    for index, record in enumerate(data):
        where = f"'skipped'[{index}]"
        record = _mapping(record, where)
        _keys(record, frozenset({"index", "error", "worker", "tries"}), where, frozenset())
        if not isinstance(record["error"], str):
            raise _corrupt(f"{where}/'error'", f"is {record['error']!r}, not text")
        worker = record["worker"]
        if worker is not None and (type(worker) is not int or worker < 0):
            raise _corrupt(f"{where}/'worker'", f"is {worker!r}, not a worker id or None")
        _count(record, "tries", where)
        records.append(SkippedSample.from_dict(dict(record)))
    return records


def decode_rng(value: Any, where: str) -> torch.Tensor:
    """An RNG state as torch takes it, from base64 text (this format), a byte tensor (format
    /1, or a state that went through torch.save) or a list of bytes."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise _corrupt(where, "is not base64 text") from None
        state = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
    elif isinstance(value, torch.Tensor):
        state = value
    elif isinstance(value, list) and all(type(b) is int and 0 <= b < 256 for b in value):
        state = torch.tensor(value, dtype=torch.uint8)
    else:
        raise _corrupt(where, f"is a {type(value).__name__}, not an RNG state (base64 text)")
    if state.dtype != torch.uint8 or state.dim() != 1:
        raise _corrupt(where, "is not an RNG state (a 1-d byte tensor)")
    try:
        torch.Generator().set_state(state)
    except RuntimeError as exc:
        raise _corrupt(where, f"is not a torch RNG state ({exc})") from None
    return state.clone()


def _corrupt(where: str, what: str) -> ValueError:
    return ValueError(f"aioload: corrupt state: {where} {what}")


def _field(data: Mapping[str, Any], key: str, where: str) -> Any:
    try:
        return data[key]
    except KeyError:
        raise ValueError(f"aioload: corrupt state: {where} has no {key!r} key") from None


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _corrupt(where, f"is a {type(value).__name__}, not a dict")
    return value


def _name(key: str, where: str) -> str:
    return f"{key!r}" if where == "state" else f"{where}/{key!r}"


def _count(
    data: Mapping[str, Any], key: str, where: str = "state", limit: int | None = None
) -> int:
    value = _field(data, key, where)
    if type(value) is not int or value < 0 or (limit is not None and value >= limit):
        raise _corrupt(_name(key, where), f"is {value!r}, not a non-negative integer")
    return value


def _flag(data: Mapping[str, Any], key: str, where: str = "state") -> bool:
    value = _field(data, key, where)
    if type(value) is not bool:
        raise _corrupt(_name(key, where), f"is {value!r}, not True or False")
    return value


def _seed(data: Mapping[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is not None and (type(value) is not int or not 0 <= value < _SEED_LIMIT):
        raise _corrupt(f"{key!r}", f"is {value!r}, not a seed (an integer in [0, 2**63)) or None")
    return value
