"""Resume as torchdata's StatefulDataLoader users expect it: exact at every boundary of a pass,
with the Stateful protocol (``state_dict()``/``load_state_dict()`` on datasets, the iterators
they return, samplers and batch samplers), and a state that ``json.dumps`` takes.

Every check compares with an uninterrupted run of an identical loader over three epochs: the
interrupted run's batches, then the resumed loader's, must be exactly those. States travel
through ``json.dumps``/``json.loads``, as a JSON checkpoint would take them. Without a
``generator=``, the shuffle draws from torch's global RNG, which the resumed run restores with
the checkpoint (as docs/resume.md asks); with one, the global RNG is left as the new process
has it.
"""

from __future__ import annotations

import base64
import json
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aioload

from ..scripts.stateful import (
    Counting,
    CursorStream,
    DiesOnce,
    EpochStream,
    RngBatchSampler,
    RngMap,
    RngSampler,
    SelfIterating,
)

# A dataset that is its own iterator: its tests run on worker processes only.
ONE_STREAM = pytest.mark.processes_only(
    "a dataset that is its own iterator is one stream, which thread workers refuse to share "
    "(a TypeError: docs/threads.md); each worker process has its own copy"
)

Make = Callable[[], aioload.DataLoader[Any]]
Epochs = list[list[Any]]

EPOCHS = 3
# Where the interrupted run takes its checkpoint: in the middle of the second pass, after its
# last batch (before the pass has ended), after it has ended, right after iter() on it, and
# before the first pass.
BOUNDARIES = ["mid-epoch", "end-of-epoch", "between-epochs", "after-iter", "before-first-pass"]


def _rows(batch: Any) -> Any:
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


def _shutdown(loader: aioload.DataLoader[Any]) -> None:
    shutdown = getattr(loader, "shutdown", None)  # (torchdata's loader has none)
    if shutdown is not None:
        shutdown()


def _uninterrupted(make: Make, seed_global: bool) -> Epochs:
    if seed_global:
        torch.manual_seed(0)
    loader = make()
    epochs = [[_rows(batch) for batch in loader] for _ in range(EPOCHS)]
    _shutdown(loader)
    return epochs


def _interrupted(
    make: Make, boundary: str, batches: int, restore_rng: bool, make_resumed: Make | None = None
) -> Epochs:
    """The epochs of a run checkpointed at ``boundary`` (``batches``: the second pass's length)
    and resumed by a fresh loader (in what stands for a new process), ``make_resumed``'s if
    given."""
    if restore_rng:
        torch.manual_seed(0)
    loader = make()
    got: Epochs = []
    open_pass: list[Any] | None = None
    if boundary != "before-first-pass":
        stop = {"mid-epoch": 2, "end-of-epoch": batches, "after-iter": 0}.get(boundary)
        for epoch in range(2):
            iterator = iter(loader)
            rows: list[Any] = []
            got.append(rows)
            if epoch == 1 and stop is not None:
                open_pass = rows
                for _ in range(stop):
                    rows.append(_rows(next(iterator)))
                break
            rows.extend(_rows(batch) for batch in iterator)
        del iterator
    state = json.loads(json.dumps(loader.state_dict()))
    rng = torch.get_rng_state()
    _shutdown(loader)
    del loader

    torch.manual_seed(1234)  # the new process's global RNG is elsewhere
    resumed = (make_resumed or make)()
    resumed.load_state_dict(state)
    if restore_rng:
        torch.set_rng_state(rng)
    if open_pass is not None:
        open_pass.extend(_rows(batch) for batch in resumed)
    while len(got) < EPOCHS:
        got.append([_rows(batch) for batch in resumed])
    _shutdown(resumed)
    return got


# -- the boundary x setting matrix -----------------------------------------------------------

# (dataset kind, num_workers, generator=, persistent_workers)
SETTINGS = [
    ("map", 0, False, False),
    ("map", 0, True, False),
    ("map", 2, False, False),
    ("map", 2, True, False),
    ("map", 2, False, True),
    ("map", 2, True, True),
    ("iterable", 0, False, False),
    ("iterable", 2, False, False),
    ("iterable", 2, False, True),
]


def _setting_id(setting: tuple[str, int, bool, bool]) -> str:
    kind, workers, generator, persistent = setting
    return "-".join(
        [kind, f"nw{workers}"] + ["generator"] * generator + ["persistent"] * persistent
    )


def _maker(setting: tuple[str, int, bool, bool], worker_method: str | None = None) -> Make:
    """The setting's loader (with ``worker_method`` if given; else the cell's)."""
    kind, workers, generator, persistent = setting

    def make() -> aioload.DataLoader[Any]:
        extra: dict[str, Any] = {}
        if workers:
            extra = {"num_workers": workers, "persistent_workers": persistent}
        if worker_method is not None:
            extra["worker_method"] = worker_method
        if kind == "iterable":
            return aioload.DataLoader(EpochStream(12), batch_size=2, **extra)
        return rng_map(7 if generator else None, **extra)

    return make


def rng_map(seed: int | None, **kwargs: Any) -> aioload.DataLoader[Any]:
    """A shuffled map-style dataset with a random draw of its own in each worker's copy, 3
    samples a batch; shuffled by a generator seeded with ``seed`` (None: torch's global one)."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return aioload.DataLoader(RngMap(12), batch_size=3, shuffle=True, generator=generator, **kwargs)


_references: dict[str, Epochs] = {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize(
    ("kind", "num_workers", "generator", "persistent"),
    SETTINGS,
    ids=[_setting_id(setting) for setting in SETTINGS],
)
def test_exact_resume_at_every_boundary(
    kind: str,
    num_workers: int,
    generator: bool,
    persistent: bool,
    boundary: str,
    worker_method: str,
) -> None:
    setting = (kind, num_workers, generator, persistent)
    make = _maker(setting)
    with_generator = generator
    key = f"{worker_method}-{_setting_id(setting)}"
    if key not in _references:
        _references[key] = _uninterrupted(make, seed_global=not with_generator)
    reference = _references[key]
    assert reference[0] != reference[1]  # the epochs differ, so a repeated one shows
    got = _interrupted(make, boundary, len(reference[1]), restore_rng=not with_generator)
    assert got == reference


@pytest.mark.own_worker_method("takes the state under one worker method, resumes under the other")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("boundary", ["mid-epoch", "between-epochs"])
@pytest.mark.parametrize(
    ("kind", "num_workers", "generator", "persistent"),
    [setting for setting in SETTINGS if setting[1]],
    ids=[_setting_id(setting) for setting in SETTINGS if setting[1]],
)
@pytest.mark.parametrize(
    ("first", "second"), [("multiprocessing", "thread"), ("thread", "multiprocessing")]
)
def test_a_state_resumes_under_the_other_worker_method(
    kind: str,
    num_workers: int,
    generator: bool,
    persistent: bool,
    boundary: str,
    first: str,
    second: str,
) -> None:
    """Stateful datasets, each worker's state its own: a state taken with worker processes
    resumes exactly with worker threads, and the other way round; both methods give the same
    batches."""

    def maker(method: str) -> Make:
        return _maker((kind, num_workers, generator, persistent), worker_method=method)

    reference = _uninterrupted(maker(first), seed_global=not generator)
    assert _uninterrupted(maker(second), seed_global=not generator) == reference
    got = _interrupted(
        maker(first), boundary, len(reference[1]), not generator, make_resumed=maker(second)
    )
    assert got == reference


# -- the Stateful protocol, piece by piece -----------------------------------------------------


def _check(make: Make, boundary: str = "mid-epoch", seed_global: bool = False) -> None:
    reference = _uninterrupted(make, seed_global)
    assert _interrupted(make, boundary, len(reference[1]), restore_rng=seed_global) == reference


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("boundary", ["mid-epoch", "between-epochs"])
def test_an_iterators_state_is_loaded_after_iter(num_workers: int, boundary: str) -> None:
    """A dataset whose iterator has the state: the iterator's state goes in after ``iter()``,
    as StatefulDataLoader loads it, so nothing is yielded twice and no worker fails."""
    _check(
        lambda: aioload.DataLoader(CursorStream(12), batch_size=2, num_workers=num_workers),
        boundary,
    )


@ONE_STREAM
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("boundary", ["mid-epoch", "between-epochs"])
def test_a_self_iterating_datasets_state_is_loaded_after_iter(
    num_workers: int, boundary: str
) -> None:
    """A dataset that is its own iterator (``iter()`` starts it over): its state goes in after
    ``iter()`` too."""
    _check(
        lambda: aioload.DataLoader(SelfIterating(12), batch_size=2, num_workers=num_workers),
        boundary,
    )


def _sampler_loader(kind: str, workers: int) -> aioload.DataLoader[Any]:
    data = list(range(20))
    if kind == "sampler":
        return aioload.DataLoader(data, batch_size=3, sampler=RngSampler(20), num_workers=workers)
    if kind == "batch-sampler":
        sampler: Any = RngBatchSampler(20, 3)
    else:  # torch's own BatchSampler over a Stateful sampler
        sampler = torch.utils.data.BatchSampler(RngSampler(20), 3, drop_last=True)
    return aioload.DataLoader(data, batch_sampler=sampler, num_workers=workers)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["sampler", "batch-sampler", "torch-batch-sampler"])
@pytest.mark.parametrize("boundary", ["mid-epoch", "between-epochs"])
def test_samplers_with_their_own_rng_resume_in_their_second_epoch(
    kind: str, num_workers: int, boundary: str
) -> None:
    _check(lambda: _sampler_loader(kind, num_workers), boundary)


@pytest.mark.processes_only("the worker dies by SIGKILL")
@pytest.mark.timeout(60)
def test_a_replaced_worker_goes_on_from_its_predecessors_dataset_state(tmp_path: Path) -> None:
    """A worker that dies is replaced on the state its dataset had after its last answer: the
    pass (and a checkpoint taken after the replacement) gives the batches a run without the
    death gives."""
    marker = tmp_path / "died"

    def make() -> aioload.DataLoader[Any]:
        return aioload.DataLoader(
            DiesOnce(24, at=13, marker=str(marker)),
            batch_size=3,
            num_workers=2,
            max_worker_restarts=1,
        )

    marker.touch()  # no death: the reference
    reference = [_rows(batch) for batch in make()]
    marker.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the replacement's warning
        assert [_rows(batch) for batch in make()] == reference
        assert marker.exists()

        marker.unlink()
        loader = make()
        iterator = iter(loader)
        got = [_rows(next(iterator)) for _ in range(6)]  # the death was at batch 4
        state = json.loads(json.dumps(loader.state_dict()))
        del iterator
        resumed = make()
        resumed.load_state_dict(state)
        assert got + [_rows(batch) for batch in resumed] == reference


@pytest.mark.timeout(60)
def test_out_of_order_delivery_keeps_each_workers_state() -> None:
    """With ``in_order=False`` the remaining batches come in completion order, but each worker's
    dataset goes on from the state after the last batch it delivered: its fetch count runs
    0, 1, 2, ... across the interruption, and every index comes exactly once."""

    def make() -> aioload.DataLoader[Any]:
        return aioload.DataLoader(Counting(40), batch_size=2, num_workers=2, in_order=False)

    loader = make()
    iterator = iter(loader)
    rows = [next(iterator) for _ in range(5)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    rows += list(resumed)
    samples = [tuple(int(x[i]) for x in batch) for batch in rows for i in range(len(batch[0]))]
    assert sorted(index for index, _, _ in samples) == list(range(40))
    for worker in (0, 1):
        counts = [count for _, w, count in samples if w == worker]
        assert sorted(counts) == list(range(len(counts)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop", [0, 2])
def test_kept_workers_after_a_break_resume_exactly(stop: int) -> None:
    """A pass left early (``break``) on kept workers: they had fetched batches that were never
    received. The next pass starts them from what was received, so a checkpoint in it (right
    after ``iter()``, or two batches in) names exactly what they hold."""

    def make() -> aioload.DataLoader[Any]:
        return rng_map(1, num_workers=2, persistent_workers=True)

    def run(checkpoint: bool) -> Epochs:
        loader = make()
        iterator = iter(loader)
        epochs: Epochs = [[_rows(next(iterator))]]  # and break
        iterator = iter(loader)
        rows = [_rows(next(iterator)) for _ in range(stop)]
        if checkpoint:
            state = json.loads(json.dumps(loader.state_dict()))
            del iterator
            _shutdown(loader)
            loader = make()
            loader.load_state_dict(state)
            iterator = iter(loader)
        epochs.append(rows + [_rows(batch) for batch in iterator])
        epochs.append([_rows(batch) for batch in loader])
        _shutdown(loader)
        return epochs

    assert run(checkpoint=True) == run(checkpoint=False)


class _HeldOnce(torch.utils.data.Dataset[int]):
    """Worker 1's first fetch waits until ``release`` is set."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.held = False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        info = torch.utils.data.get_worker_info()
        with self.lock:
            hold = info is not None and info.id == 1 and not self.held
            self.held = self.held or hold
        if hold:
            self.release.wait(30)
        return index


class _ReleasingSampler(torch.utils.data.Sampler[int]):
    """A shuffle that sets ``release`` a moment after its second pass begins (once the
    loader's next pass has started its workers on it)."""

    def __init__(self, n: int, release: threading.Event) -> None:
        self.inner = torch.utils.data.RandomSampler(
            range(n), generator=torch.Generator().manual_seed(5)
        )
        self.release = release
        self.passes = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        self.passes += 1
        if self.passes == 2:
            timer = threading.Timer(0.3, self.release.set)
            timer.daemon = True
            timer.start()
        yield from self.inner


@pytest.mark.own_worker_method("a worker held by an Event of this process: thread workers")
@pytest.mark.timeout(60)
def test_an_answer_of_a_pass_left_early_is_not_taken_for_the_next_ones() -> None:
    """A pass left early (``break``) on kept workers, while worker 1 is still fetching its
    first batch: that batch, answered once the next pass has begun, is not one of its batches
    (it was, under the same task number, before the thread backend dropped a left pass's
    answers)."""

    def run(held: bool) -> list[list[int]]:
        dataset = _HeldOnce(24)
        if not held:
            dataset.held = True
        sampler = _ReleasingSampler(24, dataset.release)
        loader = aioload.DataLoader(
            dataset,
            batch_size=3,
            sampler=sampler,
            num_workers=2,
            persistent_workers=True,
            worker_method="thread",
        )
        iterator = iter(loader)
        next(iterator)  # worker 0's; and break
        del iterator
        second = [batch.tolist() for batch in loader]
        _shutdown(loader)
        return second

    reference = run(held=False)
    assert sorted(i for batch in reference for i in batch) == list(range(24))
    assert run(held=True) == reference


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_async_for_resumes_as_for_does(kind: str, num_workers: int) -> None:
    """The same checkpoint under ``async for``: the batches ``for`` gives, before and after."""
    import anyio

    make = _maker((kind, num_workers, False, False))
    reference = _uninterrupted(make, seed_global=True)

    async def interrupted() -> Epochs:
        torch.manual_seed(0)
        loader = make()
        got: Epochs = [[_rows(batch) async for batch in loader]]
        async with aiter(loader) as iterator:
            got.append([_rows(await anext(iterator)) for _ in range(2)])
            state = json.loads(json.dumps(loader.state_dict()))
            rng = torch.get_rng_state()
        torch.manual_seed(1234)
        resumed = make()
        resumed.load_state_dict(state)
        torch.set_rng_state(rng)
        got[1] += [_rows(batch) async for batch in resumed]
        got.append([_rows(batch) async for batch in resumed])
        return got

    assert anyio.run(interrupted) == reference


@pytest.mark.timeout(60)
def test_per_worker_dataset_states_need_the_same_num_workers() -> None:
    """A Stateful dataset's state is per worker: mid-pass it loads only into as many workers
    (StatefulDataLoader refuses any change too). A state with no worker state in it (between
    passes on fresh workers) loads into any num_workers, as a plain map-style one does."""
    loader = aioload.DataLoader(RngMap(12), batch_size=3, num_workers=2)
    state = _state_after(loader, 2)
    other = aioload.DataLoader(RngMap(12), batch_size=3, num_workers=3)
    with pytest.raises(ValueError, match=r"num_workers=2.*num_workers=3"):
        other.load_state_dict(state)

    list(loader)  # to the end of a pass: the next one starts on fresh workers
    between = loader.state_dict()
    other.load_state_dict(between)
    assert sorted(row // 1000 for batch in other for row in batch.tolist()) == list(range(12))


@pytest.mark.no_local_workers("no loader is iterated")
def test_snapshot_every_n_steps_is_accepted() -> None:
    for value in (1, 10, 0, None):
        loader = aioload.DataLoader(list(range(4)), snapshot_every_n_steps=value)
        assert loader.snapshot_every_n_steps == value
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="snapshot_every_n_steps"):
            aioload.DataLoader(list(range(4)), snapshot_every_n_steps=bad)  # type: ignore[arg-type]


# -- the state's format ----------------------------------------------------------------------


def _state_after(loader: aioload.DataLoader[Any], batches: int = 1) -> dict[str, Any]:
    """``loader``'s state once ``batches`` batches of a pass are taken (the pass then dropped)."""
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    state = loader.state_dict()
    del iterator
    return state


def _mid_pass_state(**extra: Any) -> dict[str, Any]:
    return _state_after(aioload.DataLoader(list(range(12)), batch_size=3, shuffle=True, **extra))


@pytest.mark.no_local_workers("num_workers=0: the state's format")
def test_the_state_is_json() -> None:
    state = _mid_pass_state(generator=torch.Generator().manual_seed(3))
    text = json.dumps(state)
    assert json.loads(text) == state
    assert isinstance(state["rng"]["torch"], str)


def _as_format_1(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as aioload wrote it before the format took JSON: RNG states as byte tensors,
    a stream's dataset state under ``has_state``/``state``, no sampler or worker seed."""
    old = {k: v for k, v in state.items() if k not in ("sampler", "worker_seed")}
    old["format"] = "aioload.DataLoader/1"

    def tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    old["rng"] = {
        "torch": tensor(state["rng"]["torch"]),
        "generators": [tensor(text) for text in state["rng"]["generators"]],
    }
    old["streams"] = [
        {
            "samples_seen": point["samples_seen"],
            "has_state": point["dataset_state"] is not None,
            "state": point["dataset_state"],
            "ended": point["ended"],
        }
        for point in state["streams"]
    ]
    return old


@pytest.mark.no_local_workers("num_workers=0: the state's format")
def test_states_of_the_previous_format_still_load() -> None:
    def make() -> aioload.DataLoader[Any]:
        return aioload.DataLoader(
            list(range(12)), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5)
        )

    reference = [batch.tolist() for batch in make()]
    loader = make()
    iterator = iter(loader)
    got = [next(iterator).tolist() for _ in range(2)]
    state = _as_format_1(loader.state_dict())
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    assert got + [batch.tolist() for batch in resumed] == reference


def _without(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.pop(key)


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.__setitem__(key, value)


@pytest.mark.no_local_workers("num_workers=0: refused states")
@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_set("format", "aioload.DataLoader/9"), r"unknown state format 'aioload\.DataLoader/9'"),
        (_without("format"), "has no 'format' key"),
        (_without("epoch"), "state has no 'epoch' key"),
        (_set("epoch", -1), "'epoch' is -1"),
        (_set("in_progress", "yes"), "'in_progress' is 'yes'"),
        (_set("streams", []), "'streams' is not a non-empty list"),
        (_set("yielded_extra", [0]), "'yielded_extra'"),
        (lambda state: state["rng"].__setitem__("torch", "not base64!"), "'torch' is not base64"),
        (lambda state: state["rng"].__setitem__("torch", "AAAA"), "'torch' is not a torch RNG"),
        (lambda state: state["rng"]["generators"].append(7), r"'generators'\[1\] is a int"),
        (lambda state: state["streams"].__setitem__(0, 3), r"'streams'\[0\] is a int"),
        (lambda state: state.clear(), "has no 'format' key"),
    ],
)
def test_an_unreadable_state_names_what_is_wrong(
    corrupt: Callable[[dict[str, Any]], None], message: str
) -> None:
    state = json.loads(json.dumps(_mid_pass_state(generator=torch.Generator())))
    corrupt(state)
    loader = aioload.DataLoader(
        list(range(12)), batch_size=3, shuffle=True, generator=torch.Generator()
    )
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)


@pytest.mark.no_local_workers("refused before any worker starts")
def test_a_torchdata_state_is_named_as_such() -> None:
    state = {"_snapshot": {}, "_steps_since_snapshot": 0, "_iterator_finished": False}
    with pytest.raises(ValueError, match="torchdata's StatefulDataLoader"):
        aioload.DataLoader(list(range(4))).load_state_dict(state)


@pytest.mark.no_local_workers("num_workers=0: refused states")
def test_a_state_for_another_kind_of_sampler_or_dataset_is_refused() -> None:
    state = _state_after(aioload.DataLoader(list(range(20)), batch_size=3, sampler=RngSampler(20)))
    with pytest.raises(ValueError, match="sampler"):
        aioload.DataLoader(list(range(20)), batch_size=3).load_state_dict(state)

    state = _state_after(aioload.DataLoader(RngMap(6), batch_size=3))
    with pytest.raises(ValueError, match="has no load_state_dict"):
        aioload.DataLoader(list(range(6)), batch_size=3).load_state_dict(state)
