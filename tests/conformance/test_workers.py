"""Worker processes: get_worker_info(), seeds, worker_init_fn, persistent workers and start
methods, as torch gives them."""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
from typing import Any

import pytest
import torch

from .conftest import Reference, outcome, thread_deviation
from .datasets import HoldsEvent, Versioned, WorkerReport, mark_worker

# What a sample reports that must match torch's exactly (pids differ from run to run).
COMPARABLE = (
    "index",
    "worker_id",
    "num_workers",
    "seed",
    "initial_seed",
    "dataset_type",
    "dataset_is_self",
    "torch",
    "random",
    "numpy",
    "init_mark",
)


def _samples(loader: Any) -> list[dict[str, Any]]:
    """Every sample of one pass (batch_size=None keeps them unbatched); ``where``: the process
    and thread that fetched it."""
    return [
        {**{key: sample[key] for key in COMPARABLE}, "where": (sample["pid"], sample["thread"])}
        for sample in loader
    ]


def _comparable(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: sample[key] for key in COMPARABLE} for sample in samples]


def _report_loader(cls: type[Any], **kwargs: Any) -> Any:
    kwargs.setdefault("generator", torch.Generator().manual_seed(99))
    return cls(WorkerReport(8), batch_size=None, num_workers=2, **kwargs)


def test_worker_info_seeds_and_draws(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """For the same generator seed: which worker fetches which index, each worker's id,
    num_workers, seed (base_seed + id) and dataset copy, and its torch, random and numpy draws
    are torch's."""

    def scenario(cls: type[Any]) -> list[dict[str, Any]]:
        return _samples(_report_loader(cls))

    got = reference.run(scenario)
    expected = reference(scenario)
    assert _comparable(got) == _comparable(expected)
    # What users rely on, whatever the loader:
    assert {s["worker_id"] for s in got} == {0, 1}
    assert all(s["num_workers"] == 2 and s["dataset_is_self"] for s in got)
    assert all(s["dataset_type"] == "WorkerReport" for s in got)
    seeds = {s["worker_id"]: s["seed"] for s in got}
    assert seeds[1] == seeds[0] + 1  # base_seed + worker_id
    assert all(s["initial_seed"] == s["seed"] for s in got)  # torch is seeded with it
    # Two workers, neither of them the consumer (its process, or with threads its thread).
    workers = {s["where"] for s in got}
    assert len(workers) == 2 and (os.getpid(), threading.get_ident()) not in workers


def test_same_seed_same_draws_new_seed_new_draws(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """Workers' random draws are reproducible for one generator seed and change with it."""

    def scenario(cls: type[Any]) -> list[Any]:
        runs = [
            _samples(_report_loader(cls, generator=torch.Generator().manual_seed(seed)))
            for seed in (5, 5, 6)
        ]
        return [_comparable(run) for run in runs]

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got[0] == got[1]
    assert [s["torch"] for s in got[0]] != [s["torch"] for s in got[2]]


def test_global_seed_drives_worker_seeds(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """Without a generator, the base seed is drawn from torch's global RNG, as in torch."""

    def scenario(cls: type[Any]) -> list[dict[str, Any]]:
        torch.manual_seed(31337)
        return _comparable(_samples(_report_loader(cls, generator=None)))

    got = reference.run(scenario)
    assert got == reference(scenario)
    seeds = {s["worker_id"]: s["seed"] for s in got}
    assert seeds[1] == seeds[0] + 1


def test_worker_init_fn_runs_in_each_worker_after_seeding(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    def scenario(cls: type[Any]) -> list[dict[str, Any]]:
        return _comparable(_samples(_report_loader(cls, worker_init_fn=mark_worker)))

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert {s["init_mark"] for s in got} == {"init-0-of-2", "init-1-of-2"}


def test_get_worker_info_is_none_in_the_calling_process(loader_cls: type[Any]) -> None:
    loader = loader_cls(WorkerReport(3), batch_size=None, num_workers=0)
    samples = list(loader)
    assert [s["worker_id"] for s in samples] == [-1, -1, -1]
    assert all(s["pid"] == os.getpid() for s in samples)
    assert torch.utils.data.get_worker_info() is None


def test_persistent_workers_across_epochs(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """Persistent workers keep their processes and RNG state from epoch to epoch (the draws go
    on, they do not repeat), and the shuffle moves on, as in torch."""

    def scenario(cls: type[Any]) -> dict[str, Any]:
        loader = cls(
            WorkerReport(8),
            batch_size=2,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(3),
        )
        epochs = []
        pids = []
        for _ in range(3):
            batches = list(loader)
            epochs.append(
                [[b[key].tolist() for key in ("index", "torch", "seed")] for b in batches]
            )
            pids.append(
                sorted(
                    {
                        where
                        for b in batches
                        for where in zip(b["pid"].tolist(), b["thread"].tolist(), strict=True)
                    }
                )
            )
        del loader
        return {"epochs": epochs, "same_pids": pids[0] == pids[1] == pids[2]}

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got["same_pids"]
    assert got["epochs"][0] != got["epochs"][1] != got["epochs"][2]


def test_fork_by_name_and_by_context(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """``multiprocessing_context`` as a start method's name or as a context object."""

    def scenario(cls: type[Any]) -> list[Any]:
        by_name = _report_loader(cls, multiprocessing_context="fork", worker_init_fn=mark_worker)
        by_object = _report_loader(cls, multiprocessing_context=multiprocessing.get_context("fork"))
        return [_comparable(_samples(by_name)), _comparable(_samples(by_object))]

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert {s["init_mark"] for s in got[0]} == {"init-0-of-2", "init-1-of-2"}


# A spawned worker imports torch afresh (about 1 s on an idle machine, far more under load):
# one worker, one pass per start method. spawn is named; forkserver is made the default start
# method and no multiprocessing_context is given, as under Python 3.14, where forkserver
# becomes Linux's default: so this case stands for a 3.14 user's loader that names none.
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawn_and_forkserver(
    method: str,
    loader_cls: type[Any],
    reference: Reference,
    request: pytest.FixtureRequest,
    stop_mp_helpers: None,
) -> None:
    """The dataset, worker_init_fn and seeds reach a worker started by spawn or forkserver as
    they do under torch; under the forkserver default the worker is the fork server's child,
    not this process's."""
    if thread_deviation(request, "thread workers start no process: no start method applies"):
        pytest.skip("thread workers start no process")

    def scenario(cls: type[Any]) -> dict[str, Any]:
        previous = multiprocessing.get_start_method(allow_none=True)
        if method == "forkserver":
            multiprocessing.set_start_method("forkserver", force=True)
        try:
            loader = cls(
                WorkerReport(3),
                batch_size=None,
                num_workers=1,
                multiprocessing_context="spawn" if method == "spawn" else None,
                worker_init_fn=mark_worker,
                generator=torch.Generator().manual_seed(99),
            )
            samples = list(loader)
            del loader
        finally:
            multiprocessing.set_start_method(previous, force=True)
        return {
            "samples": _comparable(samples),
            "children_of_this_process": all(s["ppid"] == os.getpid() for s in samples),
        }

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert {s["init_mark"] for s in got["samples"]} == {"init-0-of-1"}
    assert got["children_of_this_process"] is (method == "spawn")


def test_dataset_holding_a_multiprocessing_event_under_spawn(
    loader_cls: type[Any],
    reference: Reference,
    request: pytest.FixtureRequest,
    stop_mp_helpers: None,
) -> None:
    """A dataset may hold objects of the loader's multiprocessing context (an Event here):
    torch hands the dataset to Process(args=...), where inheritance is allowed."""

    def scenario(cls: type[Any]) -> Any:
        context = multiprocessing.get_context("spawn")
        event = context.Event()
        event.set()
        loader = cls(
            HoldsEvent(event), batch_size=None, num_workers=1, multiprocessing_context=context
        )
        return outcome(lambda: list(loader))

    got = reference.run(scenario)
    expected = reference(scenario)
    assert expected.raised is None and expected.value == [True, True]
    assert got.raised is None, got.raised
    assert got.value == expected.value


def test_num_workers_set_between_passes_of_persistent_workers(
    loader_cls: type[Any], reference: Reference, no_leaks: None
) -> None:
    """``loader.num_workers`` may be set between passes, as torch allows: every pass still
    gives every sample once, in order (torch keeps its pool; aioload starts one of the new
    size)."""

    def scenario(cls: type[Any]) -> dict[str, Any]:
        loader = cls(WorkerReport(12), batch_size=2, num_workers=2, persistent_workers=True)
        passes = []
        for count in (2, 1, 3, 0, 2):
            loader.num_workers = count
            passes.append([i for b in loader for i in b["index"].tolist()])
        del loader
        return {"passes": passes}

    got = reference.run(scenario)
    assert got == reference(scenario)
    assert got["passes"] == [list(range(12))] * 5


def test_a_second_pass_on_persistent_workers(
    loader_cls: type[Any], is_aioload: bool, reference: Reference, no_leaks: None
) -> None:
    """DEVIATION (one-pass-on-persistent-workers): with ``persistent_workers``, torch's second
    ``iter(loader)`` resets its one iterator and returns it again: both names are one pass,
    which the second goes on with. aioload's second ``iter()`` is a pass of its own, which
    takes the workers over; the first raises at its next ``next()`` (``RuntimeError``, saying
    so) rather than share them. Either way every sample comes once, from the newer pass."""

    def scenario(cls: type[Any]) -> dict[str, Any]:
        loader = cls(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True)
        first = iter(loader)
        taken = next(first).tolist()
        second = iter(loader)
        rest = [b.tolist() for b in second]
        again = outcome(functools.partial(next, first))
        del first, second, loader
        return {"taken": taken, "rest": rest, "again": again}

    got = reference.run(scenario)
    expected = reference(scenario)
    assert expected["taken"] == [0, 1]
    if not is_aioload:
        # torch: the second iter() restarted the one pass, which the loop drew to its end.
        assert expected["rest"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert expected["again"].raised is not None
        assert expected["again"].raised.type is StopIteration
        return
    assert got["taken"] == expected["taken"] and got["rest"] == expected["rest"]
    assert got["again"].raised is not None and got["again"].raised.type is RuntimeError
    assert "a newer pass over this loader" in got["again"].raised.message


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_changes_to_the_dataset_between_epochs(
    persistent_workers: bool,
    loader_cls: type[Any],
    reference: Reference,
    request: pytest.FixtureRequest,
    no_leaks: None,
) -> None:
    """Workers fetch from the copy they were started with: a change the main process makes
    between epochs reaches new workers, and not persistent ones (torch's rule). DEVIATION
    (thread workers): there is no copy, every thread fetches from the one dataset object, so
    a change reaches persistent workers too."""

    def scenario(cls: type[Any]) -> list[list[int]]:
        dataset = Versioned()
        loader = cls(dataset, batch_size=2, num_workers=1, persistent_workers=persistent_workers)
        first = [b.tolist() for b in loader]
        dataset.version = 1
        return [first, [b.tolist() for b in loader]]

    got = reference.run(scenario)
    shared = thread_deviation(request, "thread workers share the dataset object")
    assert got[0] == [[0, 0], [0, 0]]
    assert got[1] == ([[0, 0], [0, 0]] if persistent_workers and not shared else [[1, 1], [1, 1]])
    if not shared:
        assert got == reference(scenario)
