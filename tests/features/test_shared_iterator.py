"""One iterator, several consumers: threads that share a sync iterator take turns, and every
batch goes to exactly one of them, as with torch's iterator; a second task awaiting an async
iterator that is already waiting is refused at once (tests/features/test_async.py). Nothing is
lost, and nothing hangs."""

from __future__ import annotations

import threading

import pytest

import aioload
from tests.helpers import within
from tests.scripts.datasets import Squares

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_threads_sharing_a_sync_iterator_get_every_batch_once(
    num_workers: int, no_leaks: None
) -> None:
    loader = aioload.DataLoader(Squares(400), batch_size=4, num_workers=num_workers)
    it = iter(loader)
    got: list[list[int]] = [[], [], []]
    errors: list[BaseException] = []

    def consume(mine: list[int]) -> None:
        try:
            for batch in it:
                mine.extend(int(x) for x in batch[:, 0])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=consume, args=(mine,)) for mine in got]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(within(30))
    assert not any(thread.is_alive() for thread in threads), "a consumer hangs"
    assert errors == []
    assert sorted(x for mine in got for x in mine) == list(range(400))
    # (Each thread's share is in order: it takes its batches one after another.)
    assert all(mine == sorted(mine) for mine in got)
