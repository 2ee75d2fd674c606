"""A pass interrupted mid-epoch (Ctrl-C, a signal handler's exception, a cancellation): where
the interrupt lands in the wait for a batch, the pass goes on, as torch's iterator does;
anywhere else it ends, and the iterator says so rather than ending the epoch short. Either
way ``state_dict()`` resumes it exactly."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from typing import Any

import pytest
import torch

import aioload
from aioload._backends import fake
from tests.helpers import flat

pytestmark = pytest.mark.timeout(60)


class SlowThird(torch.utils.data.Dataset[int]):
    """Eight samples; sample 4 (batch 2, worker 0's second) takes two seconds."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        time.sleep(2.0 if i == 4 else 0.001)
        return i


def test_ctrl_c_in_the_wait_keeps_the_pass_as_torchs_iterator_does(no_leaks: None) -> None:
    previous = signal.signal(signal.SIGALRM, signal.default_int_handler)
    try:
        for make in (torch.utils.data.DataLoader, aioload.DataLoader):
            it = iter(make(SlowThird(), batch_size=2, num_workers=2))
            got = [next(it), next(it)]
            # Batch 3 comes from worker 1 at once; batch 2 holds the consumer in its wait.
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(KeyboardInterrupt):
                next(it)
            got += list(it)
            assert flat(got) == list(range(8)), make
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _interrupt_the_nth_poll(monkeypatch: pytest.MonkeyPatch, n: int, error: type) -> None:
    """The fake's poll (the engine's intake, outside any wait) raises ``error`` once."""
    calls = itertools.count()
    original = fake.FakeBackend.poll

    def poll(self: fake.FakeBackend) -> Any:
        if next(calls) == n:
            raise error
        return original(self)

    monkeypatch.setattr(fake.FakeBackend, "poll", poll)


@pytest.mark.no_local_workers("a fake backend: its poll is where the interrupt lands")
@pytest.mark.parametrize("front", ["for", "async for"])
def test_an_interrupt_outside_the_wait_ends_the_pass_and_says_so(
    monkeypatch: pytest.MonkeyPatch, front: str
) -> None:
    """It used to end the epoch quietly: a notebook's next `for b in it` got nothing."""
    error = KeyboardInterrupt if front == "for" else asyncio.CancelledError
    _interrupt_the_nth_poll(monkeypatch, 1, error)
    loader = aioload.DataLoader(range(20), batch_size=2, num_workers=2, workers=fake.FakeWorkers())
    got: list[Any] = []
    if front == "for":
        it = iter(loader)
        with pytest.raises(KeyboardInterrupt):
            while True:
                got.append(next(it))
        with pytest.raises(RuntimeError, match="ended by KeyboardInterrupt before its end"):
            next(it)
    else:

        async def main() -> None:
            it = aiter(loader)
            with pytest.raises(asyncio.CancelledError):
                while True:
                    got.append(await anext(it))
            with pytest.raises(RuntimeError, match="ended by CancelledError before its end"):
                await anext(it)

        asyncio.run(main())
    assert 0 < len(got) < 10
    # As the message says: the state taken now continues where the pass stopped.
    loader.load_state_dict(loader.state_dict())
    assert flat(got + list(loader)) == list(range(20))
