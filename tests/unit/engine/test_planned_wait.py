"""NOTE [a wait that ended as it was cancelled] (``_engine/sleep.py``): under asyncio, anyio
leaves a task alone whose awaited future is already done when it delivers a scope's
cancellation, so a wait that ends in the same turn as ``scope.cancel()`` must still let the
cancellation through before a batch is taken."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from aioload._backends.base import Waitable
from aioload._engine import sleep
from aioload._engine.sleep import PlannedWait


class _DoneAtOnce:
    """A waiter whose wait ends at once, as when the answer came in the same turn."""

    async def wait(self, descriptor: Any, timeout: float) -> bool:
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        done.set_result(True)
        return await done  # a done future: the task does not go round the loop


def _planned() -> PlannedWait:
    wait = PlannedWait(_DoneAtOnce())  # type: ignore[arg-type]
    wait.waitable, wait.seconds = Waitable(descriptor=None, budget=1.0, work=None), 1.0
    return wait


def test_a_wait_that_ends_in_the_turn_of_a_cancel_lets_the_cancellation_through() -> None:
    async def main() -> list[str]:
        reached = []
        with anyio.CancelScope() as scope:
            scope.cancel()  # as a loop body does, between two batches
            await _planned().perform()
            reached.append("past the wait")  # where the batch would be taken
        return reached

    assert asyncio.run(main()) == []


def test_without_a_cancelled_scope_the_wait_costs_no_extra_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    turns = []
    real = asyncio.sleep

    async def counting(delay: float) -> None:
        turns.append(delay)
        await real(delay)

    monkeypatch.setattr(sleep.asyncio, "sleep", counting)

    async def main() -> bool:
        with anyio.CancelScope():
            return await _planned().perform()

    assert asyncio.run(main()) is True and turns == []
    assert not sleep._scope_cancelled()  # no loop at all
