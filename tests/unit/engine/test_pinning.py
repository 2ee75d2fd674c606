"""The pin / host-to-device stage, on CPU.

No accelerator here, so the stage's thread, ordering, errors and shutdown are driven through a
CPU Transfer swapped in for the real one (``aioload.loader.make_transfer``). The CUDA path
itself is covered by tests/gpu/, which run where a GPU is.
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch

import aioload
import aioload.loader
from aioload._backends.process import WorkerPool
from aioload._engine.pinning import PinTransfer, Transfer, make_transfer, torch_pin_plan
from tests.helpers import ignore_fork_in_threads, wait_until, within
from tests.scripts.datasets import Numbers

pytestmark = pytest.mark.timeout(60)

# These check what a machine without an accelerator does (the installed torch's warning, plain
# batches, device= warned about and left on the CPU). On a machine with one, that path is not
# taken: tests/gpu/ covers it.
cpu_only_path = pytest.mark.skipif(
    torch.accelerator.is_available(),
    reason="checks the no-accelerator path, and this machine has an accelerator "
    "(tests/gpu/ covers the accelerator path)",
)


class Marking(Transfer):
    """Stands in for pin + copy: clones the batch, notes the thread and how deep the stage
    got, and can fail on a chosen batch."""

    def __init__(self, fail_on: int | None = None, delay: float = 0.0) -> None:
        self.threads: set[str] = set()
        self.setup_thread: str | None = None
        self.fail_on = fail_on
        self.delay = delay
        self.active = 0
        self.seen = 0
        self.lock = threading.Lock()

    def setup(self) -> None:
        self.setup_thread = threading.current_thread().name

    def run(self, batch: Any) -> Any:
        self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        first = int(batch[0, 0])
        if self.fail_on is not None and first == self.fail_on:
            raise ValueError(f"transfer failed on batch starting at {first}")
        self.seen += 1
        return ("moved", batch.clone())

    def handover(self, result: Any) -> Any:
        tag, batch = result
        assert tag == "moved"
        return batch


@pytest.fixture
def marking(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Marking]]:
    made: list[Marking] = []
    holder: dict[str, Any] = {}

    def fake(pin_memory: bool, device: torch.device | None) -> Transfer:
        transfer = holder.get("next") or Marking()
        made.append(transfer)
        return transfer

    monkeypatch.setattr(aioload.loader, "make_transfer", fake)
    yield made


def _pin_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "aioload-pin"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("in_order", [True, False])
def test_stage_keeps_order_and_runs_in_its_own_thread(
    marking: list[Marking], num_workers: int, in_order: bool, no_leaks: None
) -> None:
    loader = aioload.DataLoader(
        Numbers(40), batch_size=4, num_workers=num_workers, in_order=in_order
    )
    firsts = [int(b[0, 0]) for b in loader]
    if in_order:
        assert firsts == list(range(0, 40, 4))
    else:
        assert sorted(firsts) == list(range(0, 40, 4))
    (transfer,) = marking
    assert transfer.threads == {"aioload-pin"}
    assert transfer.setup_thread == "aioload-pin"
    assert transfer.seen == 10
    assert not _pin_threads(), "the stage's thread must not outlive the pass"


def test_stage_errors_reach_the_consumer_in_order(
    marking: list[Marking], monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    failing = Marking(fail_on=8)

    monkeypatch.setattr(aioload.loader, "make_transfer", lambda pin, device: failing)
    loader = aioload.DataLoader(Numbers(20), batch_size=4, num_workers=2)
    got: list[Any] = []
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        except ValueError as exc:
            assert "starting at 8" in str(exc)
            got.append("error")
            continue
        got.append(int(batch[0, 0]))
    assert got == [0, 4, "error", 12, 16]


def test_stage_depth_is_bounded_by_prefetch_factor(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    pending: list[int] = []
    original_submit = aioload._engine.pinning.PinStage.submit

    def submit(self: aioload._engine.pinning.PinStage, outcome: Any) -> None:
        original_submit(self, outcome)
        pending.append(self.pending)

    monkeypatch.setattr(aioload._engine.pinning.PinStage, "submit", submit)
    monkeypatch.setattr(aioload.loader, "make_transfer", lambda pin, device: Marking())
    loader = aioload.DataLoader(Numbers(64), batch_size=2, num_workers=2, prefetch_factor=3)
    for _ in loader:
        time.sleep(0.002)  # a consumer slower than the stage
    assert max(pending) <= 3


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_stage_under_async_for(marking: list[Marking], backend: str, no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(24), batch_size=4, num_workers=2)

    async def main() -> list[int]:
        return [int(b[0, 0]) async for b in loader]

    assert anyio.run(main, backend=backend) == list(range(0, 24, 4))
    assert not _pin_threads()


def test_stage_thread_stops_on_break_and_del(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    monkeypatch.setattr(aioload.loader, "make_transfer", lambda pin, device: Marking(delay=0.05))
    loader = aioload.DataLoader(Numbers(200), batch_size=2, num_workers=2)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    import gc

    gc.collect()
    # The stage thread ends once the pass is collected; wait for that, not for a time.
    assert wait_until(lambda: not _pin_threads()), f"stage threads left: {_pin_threads()}"


@pytest.mark.asyncio
async def test_stage_thread_stops_on_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aioload.loader, "make_transfer", lambda pin, device: Marking(delay=0.05))
    loader = aioload.DataLoader(Numbers(200, delay=0.01), batch_size=2, num_workers=2)
    it = aiter(loader)

    async def consume() -> None:
        async for _ in it:
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await it.aclose()  # type: ignore[attr-defined]
    assert not _pin_threads()


def test_timeout_passes_through_the_stage(marking: list[Marking], no_leaks: None) -> None:
    loader = aioload.DataLoader(Numbers(8, delay=1.0), batch_size=4, num_workers=1, timeout=0.3)
    with pytest.raises(aioload.DataLoaderTimeoutError, match=r"timed out after 0.3 seconds"):
        next(iter(loader))


@cpu_only_path
def test_pin_memory_without_accelerator_warns_and_yields_plain_batches(
    no_leaks: None,
) -> None:
    with warnings.catch_warnings(record=True) as ours_said:
        warnings.simplefilter("always")
        ignore_fork_in_threads()
        ours = list(aioload.DataLoader(Numbers(10), batch_size=3, num_workers=2, pin_memory=True))
    with warnings.catch_warnings(record=True) as torch_said:
        warnings.simplefilter("always")
        ignore_fork_in_threads()
        ref = list(torch.utils.data.DataLoader(Numbers(10), batch_size=3, pin_memory=True))
    # What the installed torch says ("no accelerator is found" from torch 2.9; nothing before).
    assert [str(w.message) for w in ours_said] == [str(w.message) for w in torch_said]
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    assert not any(b.is_pinned() for b in ours)
    plan = torch_pin_plan(True, "")
    assert not plan.pin
    assert make_transfer(plan, None) is None


@cpu_only_path
def test_device_argument_validation() -> None:
    """No accelerator: device= is warned about once, at construction, and batches stay on the
    CPU, as torch does with pin_memory=True (so one script runs on both kinds of machine)."""
    for device in ("cuda", torch.device("cuda", 0)):
        with pytest.warns(UserWarning, match=r"'device' argument is set as .* no accelerator"):
            loader = aioload.DataLoader(Numbers(4), batch_size=2, device=device)
        assert loader.device is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert all(b.device.type == "cpu" for b in loader)
    with pytest.raises(RuntimeError):
        aioload.DataLoader(Numbers(), device="not-a-device")
    for device in (None, "cpu", torch.device("cpu")):
        loader = aioload.DataLoader(Numbers(4), batch_size=2, device=device)
        assert loader.device is None
        assert all(b.device.type == "cpu" for b in loader)


class Custom:
    def __init__(self, value: int) -> None:
        self.value = value
        self.pinned = False

    def pin_memory(self) -> Custom:
        out = Custom(self.value)
        out.pinned = True
        return out


def test_pin_transfer_honours_custom_pin_memory_methods() -> None:
    result = PinTransfer(None).run({"a": [Custom(1), Custom(2)], "b": "text"})
    assert [c.pinned for c in result["a"]] == [True, True]
    assert result["b"] == "text"


@pytest.mark.parametrize("persistent", [False, True])
def test_stage_wakes_the_orchestrator(
    persistent: bool, monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    # Each batch through the stage must reach the consumer when the stage is done with it,
    # not when the orchestrator's health-check wait runs out. Counted, not timed: the pool's
    # poll checks health once a health-check period, and with the stage slower than the
    # workers, a batch the stage did not announce would leave the orchestrator waiting that
    # long, and the poll after it would check.
    checks: list[int] = []
    check_health = WorkerPool._check_health

    def counted(pool: WorkerPool) -> None:
        checks.append(1)
        check_health(pool)

    monkeypatch.setattr(WorkerPool, "_check_health", counted)
    # Longer than any wait of the pass for a worker's batch (a hang guard, scaled).
    monkeypatch.setattr("aioload._backends.process._HEALTH_CHECK_S", within(5))
    monkeypatch.setattr(aioload.loader, "make_transfer", lambda plan, device: Marking(delay=0.02))
    loader = aioload.DataLoader(
        Numbers(24), batch_size=4, num_workers=2, persistent_workers=persistent
    )
    try:
        for _ in range(2):
            assert len(list(loader)) == 6
            assert checks == []
    finally:
        loader.shutdown()
