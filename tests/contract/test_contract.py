"""The backend contract: what every worker backend must do, each case run over every backend
kind (the ``backend`` fixture, conftest.py) and under ``for`` and ``async for`` on asyncio and
trio (``mode``), with torch's DataLoader as the oracle wherever torch has the behaviour.

The cases: batches in sampler order however the workers' answers come; ``in_order=False``;
exactly once when a worker is lost or hangs and is replaced; ``timeout``; resuming from a
``state_dict()``; an IterableDataset sharded by ``get_worker_info()``; ``worker_init_fn``;
persistent workers; and a dataset's error.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader as TorchLoader

import aioload
from tests.contract.conftest import LATE_S, Backend, seeded
from tests.contract.datasets import FailsAt, Where, record_init
from tests.helpers import run_on
from tests.scripts.datasets import Sharded

# torch's own check, against this machine's cores: the fake and threads fork no process.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

Stop = Callable[[int, Any], bool]


def drain(loader: Any, mode: str, stop: Stop | None = None) -> list[Any]:
    """One pass over ``loader`` with ``for`` or ``async for`` (``mode``): its batches, up to
    and including the one for which ``stop(k, batch)`` is true."""
    if mode == "for":
        out: list[Any] = []
        for batch in loader:
            out.append(batch)
            if stop is not None and stop(len(out) - 1, batch):
                break
        return out

    async def run() -> list[Any]:
        got: list[Any] = []
        async for batch in loader:
            got.append(batch)
            if stop is not None and stop(len(got) - 1, batch):
                break
        return got

    result: list[Any] = run_on(mode, run)
    return result


def indices(batches: list[Any]) -> list[list[int]]:
    """Each batch's sample indices (``Where``'s first column), in the order they came."""
    return [batch[:, 0].tolist() for batch in batches]


def column(batches: list[Any], which: int) -> list[list[int]]:
    return [batch[:, which].tolist() for batch in batches]


@functools.cache
def torch_order(
    n: int, seed: int | None = None, num_workers: int = 0, epochs: int = 1
) -> list[list[list[int]]]:
    """torch's batches of ``Where(n)`` (their indices), two a batch, shuffled from ``seed``
    where given; with workers, persistent over ``epochs``."""
    loader = TorchLoader(
        Where(n),
        batch_size=2,
        shuffle=seed is not None,
        generator=None if seed is None else seeded(seed),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
    try:
        return [indices(list(loader)) for _ in range(epochs)]
    finally:
        _stop_workers(loader._iterator)


def _stop_workers(iterator: Any) -> None:
    """Stop torch's workers now, not when the collector gets to them (no_leaks counts them)."""
    getattr(iterator, "_shutdown_workers", lambda: None)()


@functools.cache
def torch_sharded(stop: int, num_workers: int) -> list[list[int]]:
    return [batch.tolist() for batch in TorchLoader(Sharded(stop), 2, num_workers=num_workers)]


@functools.cache
def torch_error(num_workers: int) -> tuple[type[BaseException], str]:
    """What torch raises for ``FailsAt(12, bad=5)``, and its message's first line."""
    it = iter(TorchLoader(FailsAt(12, bad=5), batch_size=2, num_workers=num_workers))
    try:
        list(it)
    except Exception as exc:
        return type(exc), str(exc).splitlines()[0]
    finally:
        _stop_workers(it)
    raise AssertionError("torch's loader raised nothing")


def replacements(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "replaced it with a new worker" in str(w.message)]


def test_batches_come_in_sampler_order(backend: Backend, mode: str) -> None:
    # Batch 0 is answered only after worker 1 has started batch 3 (so answered batch 1):
    # the engine reorders what comes early. One worker (num_workers=0) has no one to overtake.
    loader = backend.loader(Where(24), late=(0, 3))
    got = drain(loader, mode)
    assert indices(got) == torch_order(24)[0]
    # Batch k is made by worker k % num_workers, as torch deals them.
    expected = [k % backend.num_workers if backend.num_workers else -1 for k in range(12)]
    assert [batch[0] for batch in column(got, 1)] == expected
    for fake in backend.fakes:
        assert fake.made[0].answered[0] != 0, "the script put batch 0 last"
        assert fake.clock is not None and fake.clock.now == LATE_S, "an hour, in no time"


def test_in_order_false_yields_what_is_ready_first(backend: Backend, mode: str) -> None:
    # Batch 0 waits until the consumer has had a batch: only a loader that yields what is
    # ready without waiting for batch 0 can give it one (the wait's bound would otherwise end
    # it, and batch 0 would come first).
    loader = backend.loader(Where(24), late=(0, "consumed"), in_order=False)

    def consumed(_k: int, _batch: Any) -> bool:
        backend.signal("consumed")
        return False

    got = indices(drain(loader, mode, consumed))
    expected = torch_order(24)[0]
    assert sorted(got) == expected, "every batch exactly once"
    if backend.num_workers:
        assert got[0] != expected[0]
    else:
        # No effect with num_workers=0, as in torch.
        assert got == expected


def test_a_lost_worker_loses_and_repeats_nothing(backend: Backend, mode: str) -> None:
    backend.skip_unless_workers("lose")
    # The worker handed batch 5 (worker 1) dies; its replacement gets what it held.
    loader = backend.loader(Where(24), kill=5, max_worker_restarts=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = drain(loader, mode)
    assert indices(got) == torch_order(24)[0]
    (replaced,) = replacements(caught)
    assert "new worker 1" in replaced
    if backend.own_processes:
        pids = {pid for batch in got for _, worker, pid in batch.tolist() if worker == 1}
        assert len(pids) == 2, "worker 1's batches came from the dead one and its replacement"


def test_a_hung_worker_is_replaced_and_nothing_repeats(backend: Backend, mode: str) -> None:
    backend.skip_unless_workers("replace")
    # The timeout counts the replacement's start too, and a Ray actor takes seconds to start:
    # more than this case's timeout, so a healed Ray pass times out again while the new actor
    # starts ("starting (node not known yet)").
    backend.skip_if_ray("a replacement Ray actor starts slower than the 2 s timeout")
    # Batch 0 never comes, the first time: past the timeout its worker is replaced, and the
    # replacement makes it.
    loader = backend.loader(Where(12), hang=0, timeout=2.0, max_worker_restarts=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = drain(loader, mode)
    assert indices(got) == torch_order(12)[0]
    (replaced,) = replacements(caught)
    assert "new worker 0" in replaced


def test_a_hung_worker_hits_the_timeout(backend: Backend, mode: str) -> None:
    if backend.kind == "inline":
        # torch's single-process iterator refuses a timeout (a bare assert); so does ours.
        with pytest.raises(AssertionError):
            list(TorchLoader(Where(4), timeout=0.5))
        with pytest.raises(AssertionError):
            drain(backend.loader(Where(4), timeout=0.5), mode)
        return
    loader = backend.loader(Where(12), hang=0, timeout=0.5)
    with pytest.raises(aioload.DataLoaderTimeoutError) as info:
        drain(loader, mode)
    assert isinstance(info.value, RuntimeError)  # what torch raises
    assert str(info.value).startswith("DataLoader timed out after 0.5 seconds")


def test_a_state_dict_mid_epoch_resumes_with_exactly_the_rest(backend: Backend, mode: str) -> None:
    whole = indices(drain(backend.loader(Where(24), shuffle=True, generator=seeded()), mode))
    assert whole == torch_order(24, seed=7)[0]

    first = backend.loader(Where(24), shuffle=True, generator=seeded())
    state: dict[str, Any] = {}

    def checkpoint(k: int, _batch: Any) -> bool:
        if k == 4:
            state.update(first.state_dict())
        return k == 4

    head = indices(drain(first, mode, checkpoint))
    resumed = backend.loader(Where(24), shuffle=True, generator=seeded())
    resumed.load_state_dict(state)
    tail = indices(drain(resumed, mode))
    assert (len(head), head + tail) == (5, whole)


def test_an_iterable_dataset_is_sharded_by_worker_info(backend: Backend, mode: str) -> None:
    got = [batch.tolist() for batch in drain(backend.loader(Sharded(11)), mode)]
    assert sorted(i for batch in got for i in batch) == list(range(11)), "every item once"
    assert got == torch_sharded(11, backend.num_workers)


def _inits(log: Path) -> list[tuple[int, int, int]]:
    """The ``worker_init_fn`` calls logged: (id given, id of get_worker_info(), pid)."""
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text().splitlines()]
    return sorted((int(a), int(b), int(c)) for a, b, c in rows)


def test_worker_init_fn_runs_once_per_worker_with_its_id(backend: Backend, mode: str) -> None:
    log = backend.folder / "inits"
    loader = backend.loader(Where(12), worker_init_fn=functools.partial(record_init, log))
    got = drain(loader, mode)
    assert indices(got) == torch_order(12)[0]
    inits = _inits(log)
    if not backend.num_workers:
        # torch calls no worker_init_fn with num_workers=0, and neither do we.
        assert inits == []
        return
    assert [(given, info) for given, info, _ in inits] == [(0, 0), (1, 1)]
    pid_of = {given: pid for given, _, pid in inits}
    for _, worker, pid in (sample for batch in got for sample in batch.tolist()):
        assert pid == pid_of[worker], "each sample made by the worker that was initialised"
    if not backend.own_processes:
        assert set(pid_of.values()) == {os.getpid()}


def test_persistent_workers_serve_every_epoch(backend: Backend, mode: str) -> None:
    if not backend.num_workers:
        with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
            TorchLoader(Where(4), persistent_workers=True)
        with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
            backend.loader(Where(4), persistent_workers=True)
        return
    log = backend.folder / "inits"
    loader = backend.loader(
        Where(24),
        shuffle=True,
        generator=seeded(),
        persistent_workers=True,
        worker_init_fn=functools.partial(record_init, log),
    )
    epochs = [drain(loader, mode) for _ in range(2)]
    assert [indices(epoch) for epoch in epochs] == torch_order(24, 7, num_workers=2, epochs=2)
    # The same workers served both epochs: set up once each, and (where a worker is a process
    # of its own) each epoch's samples made by the same pids.
    inits = _inits(log)
    assert [given for given, _, _ in inits] == [0, 1]
    pids = [{tuple(sample[1:]) for batch in epoch for sample in batch.tolist()} for epoch in epochs]
    assert pids[0] == pids[1] == {(given, pid) for given, _, pid in inits}
    for fake in backend.fakes:
        assert len(fake.made) == 1 and fake.made[0].started_passes == 2


def test_a_dataset_error_keeps_its_type_and_the_workers_traceback(
    backend: Backend, mode: str
) -> None:
    loader = backend.loader(FailsAt(12, bad=5))
    with pytest.raises(Exception) as info:
        drain(loader, mode)
    kind, first_line = torch_error(backend.num_workers)
    assert type(info.value) is kind is KeyError
    message = str(info.value)
    assert message.splitlines()[0] == first_line
    if backend.num_workers:
        # torch's wrapping: "Caught KeyError in DataLoader worker process 0.", then the
        # worker's own traceback, down to the line that raised.
        assert "Original Traceback (most recent call last)" in message
        assert 'raise KeyError(f"sample {index} is missing")' in message
