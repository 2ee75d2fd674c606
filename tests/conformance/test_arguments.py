"""Argument validation: the same exception type and message as torch, for every bad argument."""

from __future__ import annotations

import inspect
import multiprocessing
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, SequentialSampler

import aioload
from tests.scripts.datasets import Sharded

from .conftest import Reference, TorchDataLoader, outcome
from .datasets import Indices

MAP = Indices(10)
ITERABLE = Sharded(10)
SAMPLER = SequentialSampler(range(10))
BATCHES = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)

# Each case: (dataset, keyword arguments) that torch's constructor refuses.
INVALID: dict[str, tuple[Any, dict[str, Any]]] = {
    "negative num_workers": (MAP, {"num_workers": -1}),
    "negative timeout": (MAP, {"timeout": -1}),
    "prefetch_factor without workers": (MAP, {"prefetch_factor": 2}),
    "negative prefetch_factor": (MAP, {"num_workers": 2, "prefetch_factor": -1}),
    "persistent_workers without workers": (MAP, {"persistent_workers": True}),
    "sampler and shuffle": (MAP, {"sampler": SAMPLER, "shuffle": True}),
    "batch_sampler and batch_size": (MAP, {"batch_sampler": BATCHES, "batch_size": 2}),
    "batch_sampler and shuffle": (MAP, {"batch_sampler": BATCHES, "shuffle": True}),
    "batch_sampler and sampler": (MAP, {"batch_sampler": BATCHES, "sampler": SAMPLER}),
    "batch_sampler and drop_last": (MAP, {"batch_sampler": BATCHES, "drop_last": True}),
    "batch_size None and drop_last": (MAP, {"batch_size": None, "drop_last": True}),
    "zero batch_size": (MAP, {"batch_size": 0}),
    "negative batch_size": (MAP, {"batch_size": -3}),
    "float batch_size": (MAP, {"batch_size": 2.5}),
    "bool batch_size": (MAP, {"batch_size": True}),
    "non-bool drop_last": (MAP, {"drop_last": "yes"}),
    "unknown start method": (MAP, {"num_workers": 1, "multiprocessing_context": "threads"}),
    "start method of a wrong type": (MAP, {"num_workers": 1, "multiprocessing_context": 7}),
    "start method without workers": (MAP, {"multiprocessing_context": "spawn"}),
    "iterable with shuffle": (ITERABLE, {"shuffle": True}),
    "iterable with sampler": (ITERABLE, {"sampler": SAMPLER}),
    "iterable with batch_sampler": (ITERABLE, {"batch_sampler": BATCHES}),
}


def _construct(loader_cls: type[Any], dataset: Any, kwargs: dict[str, Any]) -> Any:
    def build() -> Any:
        return loader_cls(dataset, **kwargs)

    return build


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_arguments_raise_torchs_error(
    case: str, loader_cls: type[Any], reference: Reference
) -> None:
    dataset, kwargs = INVALID[case]
    got = reference.run(lambda cls: outcome(_construct(cls, dataset, kwargs)))
    expected = reference(lambda cls: outcome(_construct(cls, dataset, kwargs)))
    assert got.raised is not None, f"{case}: constructed without an error"
    assert expected.raised is not None
    assert got.raised.type is expected.raised.type
    assert got.raised.message == expected.raised.message


def test_timeout_without_workers_is_refused_when_iterating(
    loader_cls: type[Any], reference: Reference
) -> None:
    """torch accepts timeout>0 with num_workers=0 at construction and refuses it at iter()."""

    def scenario(cls: type[Any]) -> tuple[Any, Any]:
        loader = cls(MAP, timeout=2)
        return outcome(lambda: None), outcome(lambda: iter(loader))

    built, iterated = reference.run(scenario)
    expected_built, expected_iterated = reference(scenario)
    assert built.raised is None and expected_built.raised is None
    assert iterated.raised is not None and expected_iterated.raised is not None
    assert iterated.raised.type is expected_iterated.raised.type
    assert iterated.raised.message == expected_iterated.raised.message


# torch's iterator fails in __init__ and then again in __del__ (no _shutdown attribute yet).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_prefetch_factor_zero_with_workers(
    loader_cls: type[Any], is_aioload: bool, reference: Reference
) -> None:
    """DEVIATION (prefetch-factor-zero): torch accepts ``prefetch_factor=0`` with workers and
    fails inside its iterator (an ``AssertionError`` with no message); aioload refuses it at
    construction with a ``ValueError`` worded like torch's other prefetch_factor errors."""

    def scenario(cls: type[Any]) -> tuple[Any, Any]:
        built = outcome(lambda: cls(MAP, num_workers=1, prefetch_factor=0))
        if built.raised is not None:
            return built, None
        return built, outcome(lambda: iter(built.value))

    built, iterated = reference.run(scenario)
    torch_built, torch_iterated = reference(scenario)
    assert torch_built.raised is None
    assert torch_iterated is not None and torch_iterated.raised is not None
    assert torch_iterated.raised.type is AssertionError
    if is_aioload:
        assert built.raised is not None and iterated is None
        assert built.raised.type is ValueError
        assert built.raised.message == (
            "prefetch_factor option should be positive when num_workers > 0"
        )


@pytest.mark.parametrize(
    "attr, value",
    [
        ("batch_size", 3),
        ("batch_sampler", None),
        ("sampler", None),
        ("drop_last", True),
        ("dataset", None),
        ("persistent_workers", True),
    ],
)
def test_locked_attributes_cannot_be_set_after_init(
    attr: str, value: Any, loader_cls: type[Any], reference: Reference
) -> None:
    def scenario(cls: type[Any]) -> Any:
        loader = cls(MAP, batch_size=2)
        return outcome(lambda: setattr(loader, attr, value))

    got = reference.run(scenario)
    expected = reference(scenario)
    assert got.raised is not None and expected.raised is not None
    # The message names the class: torch's says "DataLoader", and so does aioload's (same name).
    assert (got.raised.type, got.raised.message) == (expected.raised.type, expected.raised.message)


def test_unlocked_attributes_can_be_set(loader_cls: type[Any]) -> None:
    loader = loader_cls(MAP, batch_size=2, num_workers=1)
    loader.num_workers = 0
    loader.collate_fn = list
    loader.timeout = 0
    assert loader.num_workers == 0
    assert [b for b in loader][:2] == [[0, 1], [2, 3]]


def _usable_cpus() -> int:
    """The CPUs torch's worker-count check counts: ``torch._utils.cpu_count()`` from torch
    2.12 on, the same count (the affinity mask, else ``os.cpu_count()``) written out before."""
    count = getattr(torch._utils, "cpu_count", None)
    if count is not None:
        return int(count() or 1)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def test_too_many_workers_warns_like_torch(loader_cls: type[Any], reference: Reference) -> None:
    """torch warns at construction when num_workers exceeds the usable CPUs."""
    many = _usable_cpus() + 3

    def scenario(cls: type[Any]) -> Any:
        return outcome(lambda: cls(MAP, num_workers=many))

    got = reference.run(scenario)
    expected = reference(scenario)
    assert got.raised is None
    assert any("worker processes in total" in text for text in expected.warnings)
    assert got.warnings == expected.warnings


def test_valid_start_methods_are_accepted(loader_cls: type[Any]) -> None:
    for method in ("fork", "spawn", "forkserver"):
        loader = loader_cls(MAP, num_workers=1, multiprocessing_context=method)
        assert loader.multiprocessing_context is multiprocessing.get_context(method) or (
            loader.multiprocessing_context._name == method
        )
    context = multiprocessing.get_context("spawn")
    assert loader_cls(MAP, num_workers=1, multiprocessing_context=context)


def test_positional_arguments_mean_the_same(loader_cls: type[Any]) -> None:
    """Code that passes torch's arguments by position gets the same meaning."""
    torch_params = list(inspect.signature(TorchDataLoader.__init__).parameters.values())
    ours = list(inspect.signature(loader_cls.__init__).parameters.values())
    positional = [p.name for p in torch_params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in ours if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    for theirs in torch_params[1:]:
        mine = next(p for p in ours if p.name == theirs.name)
        assert mine.kind == theirs.kind, theirs.name
        assert mine.default == theirs.default, theirs.name
    loader = loader_cls(MAP, 4, False, None, None, 0, None, False, True)
    assert loader.batch_size == 4 and loader.drop_last is True
    assert [len(b) for b in loader] == [4, 4]


def test_public_attributes_match_torch(loader_cls: type[Any], reference: Reference) -> None:
    def scenario(cls: type[Any]) -> dict[str, Any]:
        generator = torch.Generator()
        loader = cls(
            MAP,
            batch_size=3,
            shuffle=True,
            num_workers=2,
            drop_last=True,
            generator=generator,
            persistent_workers=True,
            in_order=False,
            timeout=5,
        )
        return {
            "batch_size": loader.batch_size,
            "drop_last": loader.drop_last,
            "num_workers": loader.num_workers,
            "prefetch_factor": loader.prefetch_factor,
            "persistent_workers": loader.persistent_workers,
            "in_order": loader.in_order,
            "timeout": loader.timeout,
            "pin_memory": loader.pin_memory,
            "sampler": type(loader.sampler).__name__,
            "batch_sampler": type(loader.batch_sampler).__name__,
            "generator_kept": loader.generator is generator,
            "sampler_generator_kept": loader.sampler.generator is generator,
            "collate_fn": loader.collate_fn,
            "dataset_kept": loader.dataset is MAP,
            "auto_collation": loader._auto_collation,
            "len": len(loader),
        }

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got["dataset_kept"] and got["generator_kept"]


def test_is_a_torch_dataloader(loader_cls: type[Any]) -> None:
    assert issubclass(loader_cls, TorchDataLoader)
    assert loader_cls[int] is not None  # generic like torch's: DataLoader[int] in annotations
    assert isinstance(aioload.DataLoader(MAP), TorchDataLoader)


def test_accepts_every_argument_of_the_installed_torch() -> None:
    """aioload's DataLoader takes every argument the installed torch's takes, of the same kind
    and with the same default: an argument a future torch adds fails here until it is added."""
    ours = inspect.signature(aioload.DataLoader.__init__).parameters
    theirs = inspect.signature(TorchDataLoader.__init__).parameters
    missing = [name for name in theirs if name not in ours]
    assert missing == [], f"torch {torch.__version__}'s DataLoader takes {missing}; aioload's not"
    differ = [
        name
        for name, param in theirs.items()
        if (ours[name].kind, ours[name].default) != (param.kind, param.default)
    ]
    assert differ == [], f"not as torch {torch.__version__} has them: {differ}"
    # In torch's order, so that positional calls mean the same (see the test above).
    assert [name for name in ours if name in theirs] == list(theirs)


def test_declared_torch_range_is_the_tested_one() -> None:
    """pyproject.toml's torch requirement spans exactly the releases `make test-compat` runs:
    from the first of tools/compat/releases.txt to the last one's minor series."""
    root = Path(__file__).resolve().parents[2]
    releases = [
        line.split("#", 1)[0].strip()
        for line in (root / "tools" / "compat" / "releases.txt").read_text().splitlines()
    ]
    versions = [tuple(int(part) for part in r.split("+")[0].split(".")) for r in releases if r]
    assert versions == sorted(versions)
    first, last = versions[0], versions[-1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    torch_requirements = [d for d in project["dependencies"] if d.startswith("torch")]
    floor = ".".join(map(str, first[:2])) if first[2] == 0 else ".".join(map(str, first))
    assert torch_requirements == [f"torch>={floor},<{last[0]}.{last[1] + 1}"]
