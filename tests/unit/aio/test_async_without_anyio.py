"""``async for`` under plain asyncio and uvloop, in a program that has not imported anyio.

There the engine starts and stops its workers with a thread and a future of its own
(``waiting.run_off_loop``) instead of anyio's, and imports no anyio at all. The pytest process
always has anyio (its pytest plugin), so these run in a fresh interpreter.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.helpers import run_fresh

pytestmark = pytest.mark.timeout(120)

_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys, time
    import psutil, torch
    import aioload

    LOOP = sys.argv[1]


    def workers_left(deadline_s=10.0):
        # Worker processes still alive, waiting (boundedly) for stopped ones to be reaped.
        me = psutil.Process()
        end = time.monotonic() + deadline_s
        while True:
            alive = []
            for c in me.children(recursive=True):
                try:
                    if c.status() != psutil.STATUS_ZOMBIE:
                        alive.append(c)
                except psutil.NoSuchProcess:
                    pass  # reaped between the listing and the look
            if not alive or time.monotonic() > end:
                return len(alive)
            time.sleep(0.02)


    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            time.sleep(0.02)
            return i


    async def whole_pass():
        loader = aioload.DataLoader(list(range(50)), batch_size=4, num_workers=2)
        return [int(i) async for b in loader for i in b]


    async def cancelled_while_starting():
        loader = aioload.DataLoader(list(range(50)), batch_size=4, num_workers=2)
        it = aiter(loader)
        task = asyncio.ensure_future(anext(it))
        await asyncio.sleep(0)  # the task is now in the pool's start (a thread)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        # Whatever the thread was doing, the pass is closed and its workers stop.
        return workers_left()


    async def timeout_mid_pass():
        loader = aioload.DataLoader(Slow(), batch_size=2, num_workers=2)
        got = []
        try:
            async with asyncio.timeout(0.3):
                async for b in loader:
                    got.extend(int(i) for i in b)
        except TimeoutError:
            pass
        return got, workers_left()


    async def start_error():
        # Made in the thread, raised in the awaiting task, with its own type.
        loader = aioload.DataLoader(
            [lambda: 0] * 4, batch_size=2, num_workers=1, multiprocessing_context="spawn"
        )
        try:
            async for _ in loader:
                pass
        except Exception as exc:
            return type(exc).__name__
        return "no error"


    async def checkpoint_per_batch():
        # A training step of synchronous work, so the next batch is mostly waiting already:
        # each __anext__ must still go round the loop once (a callback queued before it runs).
        loader = aioload.DataLoader(list(range(400)), batch_size=4, num_workers=2)
        loop = asyncio.get_running_loop()
        it = aiter(loader)
        got, batches, went_round = [], 0, 0
        while True:
            ran = []
            loop.call_soon(ran.append, True)
            try:
                batch = await anext(it)
            except StopAsyncIteration:
                break
            batches += 1
            went_round += bool(ran)
            got.extend(int(i) for i in batch)
            time.sleep(0.002)
        return {"all": got == list(range(400)), "batches": batches, "went_round": went_round}


    async def main():
        full = await whole_pass()
        at_checkpoint = await checkpoint_per_batch()
        left_after_cancel = await cancelled_while_starting()
        got, left_after_timeout = await timeout_mid_pass()
        error = await start_error()
        again = await whole_pass()
        return {
            "full": full,
            "left_after_cancel": left_after_cancel,
            "timeout_prefix": got == list(range(len(got))),
            "left_after_timeout": left_after_timeout,
            "error": error,
            "again": again == full,
            "at_checkpoint": at_checkpoint,
            "anyio": sorted(m for m in sys.modules if m.split(".")[0] == "anyio"),
            # (Without trio imported, the checkpoint does not ask which loop runs.)
            "trio": "trio" in sys.modules,
            "threads_left": threads_left(),
        }


    def threads_left():
        # A thread settles its future just before it ends; give each a moment to end.
        import threading
        mine = [t for t in threading.enumerate() if t.name == "aioload-off-loop"]
        for t in mine:
            t.join(5)
        return [t.name for t in mine if t.is_alive()]


    if LOOP == "uvloop":
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(main())
    else:
        result = asyncio.run(main())
    print(json.dumps(result))
    """
)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_async_for_starts_and_stops_workers_without_importing_anyio(loop: str) -> None:
    result = json.loads(run_fresh(_SCRIPT, loop))
    assert result["full"] == list(range(50))
    assert result["left_after_cancel"] == 0
    assert result["timeout_prefix"]
    assert result["left_after_timeout"] == 0
    assert result["error"] in {"PicklingError", "AttributeError", "TypeError"}, result["error"]
    assert result["again"]
    assert result["at_checkpoint"] == {"all": True, "batches": 100, "went_round": 100}
    assert result["anyio"] == []
    assert result["trio"] is False
    assert result["threads_left"] == []


_INLINE_CONTEXT_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, warnings
    import torch
    import aioload

    events = []


    class Sessioned(torch.utils.data.Dataset):
        async def __aenter__(self):
            await asyncio.sleep(0)
            events.append("enter")
            return self

        async def __aexit__(self, *exc):
            await asyncio.sleep(0)
            events.append("exit")

        def __len__(self):
            return 12

        async def __getitem__(self, i):
            await asyncio.sleep(0)
            return i


    async def main():
        # num_workers=0: the dataset runs on this loop, and its context must be exited on it
        # when the pass ends (the close reaches the loop from the thread that runs it).
        loader = aioload.DataLoader(Sessioned(), batch_size=4, num_workers=0)
        got = [int(i) async for b in loader for i in b]
        it = aiter(loader)
        await anext(it)
        await it.aclose()
        return got


    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        got = asyncio.run(main())
    print(json.dumps({"got": got, "events": events}))
    """
)


def test_an_async_datasets_context_is_exited_on_the_loop_with_num_workers_0() -> None:
    # In a fresh interpreter, where nothing but aioload itself imports anyio.
    result = json.loads(run_fresh(_INLINE_CONTEXT_SCRIPT))
    assert result["got"] == list(range(12))
    assert result["events"] == ["enter", "exit", "enter", "exit"]
