"""What a worker does before its first task, and what the parent keeps resident for it.

- numpy's global RNG: a worker seeds it as torch's workers do, but where ``numpy.random`` has
  not been imported yet it is seeded on import instead of imported for the seed
  (``_worker.main._seed_numpy``). The draws must be torch's either way.
- the parent maps a worker's slabs lazily, and the channels' read buffers are resident only
  where reads have written (``_wire.slabs._map_fd``, ``_wire.channel._read_buffer``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

from aioload._wire import channel as _channel
from aioload._wire import slabs as _transport
from aioload._worker import main as _worker_main
from tests.helpers import run_fresh, wait_until

if TYPE_CHECKING:
    from aioload._backends.base import WorkerSpec

pytestmark = pytest.mark.timeout(120)

# Run in a fresh interpreter, where nothing has imported numpy.random: a dataset that imports
# it inside __getitem__ draws from it, under torch's loader and aioload's, forked workers.
_LATE_NUMPY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.utils.data import DataLoader as TorchLoader, Dataset

    # Whether numpy.random was in this worker before its dataset first imported it.
    imported_before = None

    class LateNumpy(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            global imported_before
            if imported_before is None:
                imported_before = "numpy.random" in sys.modules
            import numpy.random

            info = torch.utils.data.get_worker_info()
            return {"worker": info.id, "imported_before": imported_before,
                    "draw": int(numpy.random.randint(0, 2**31)),
                    "state": int(numpy.random.get_state()[1][0])}

    def run(cls):
        loader = cls(LateNumpy(), batch_size=2, num_workers=2,
                     generator=torch.Generator().manual_seed(1234),
                     multiprocessing_context="fork")
        rows = []
        for batch in loader:
            for i in range(len(batch["draw"])):
                rows.append({k: (v[i].item() if hasattr(v[i], "item") else v[i])
                             for k, v in batch.items()})
        return rows

    assert "numpy.random" not in sys.modules, "the test needs a parent without numpy.random"
    import aioload
    result = {"torch": run(TorchLoader), "aioload": run(aioload.DataLoader),
              "parent_imported": "numpy.random" in sys.modules}
    print(json.dumps(result))
    """
)


def test_numpy_seeded_on_import_draws_as_torch(no_leaks: None) -> None:
    result = json.loads(run_fresh(_LATE_NUMPY_SCRIPT))
    # The parent never needed numpy.random, so aioload's workers took the on-import path
    # (torch's imported it to seed it) ...
    assert not result["parent_imported"]
    assert not any(row["imported_before"] for row in result["aioload"])
    assert all(row["imported_before"] for row in result["torch"])
    # ... and drew exactly what torch's workers (which import it to seed it) drew.
    assert [row["draw"] for row in result["aioload"]] == [row["draw"] for row in result["torch"]]
    assert [row["state"] for row in result["aioload"]] == [row["state"] for row in result["torch"]]
    assert [row["worker"] for row in result["aioload"]] == [0, 0, 1, 1, 0, 0, 1, 1]


_SEED_TWICE_SCRIPT = textwrap.dedent(
    """
    import sys
    from aioload._worker import main as _worker_main

    assert "numpy.random" not in sys.modules, "the test needs numpy.random not imported yet"
    _worker_main._seed_numpy([1, 2, 3])
    _worker_main._seed_numpy([4, 5, 6])  # a second seeding before the import replaces the first
    hooks = [f for f in sys.meta_path if isinstance(f, _worker_main._AfterImport)]
    assert len(hooks) == 1, hooks
    import numpy.random

    assert not any(isinstance(f, _worker_main._AfterImport) for f in sys.meta_path)
    first = int(numpy.random.randint(0, 2**31))
    numpy.random.seed([4, 5, 6])
    assert first == int(numpy.random.randint(0, 2**31)), "not seeded with the second state"
    print("ok")
    """
)


def test_a_second_seeding_before_numpy_random_is_imported_replaces_the_first() -> None:
    assert run_fresh(_SEED_TWICE_SCRIPT) == "ok"


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("aioload_hooked_ok", "aioload_hooked_broken"):
            sys.modules.pop(name, None)


def test_after_import_runs_once_after_the_module_and_leaves(module_dir: Path) -> None:
    (module_dir / "aioload_hooked_ok.py").write_text("VALUE = 41\nVALUE += 1\n")
    seen: list[int] = []

    def then(module: ModuleType) -> None:
        seen.append(module.VALUE)

    finder = _worker_main._AfterImport("aioload_hooked_ok", then)
    sys.meta_path.insert(0, finder)
    try:
        import aioload_hooked_ok  # type: ignore[import-not-found]
    finally:
        assert finder not in sys.meta_path
    assert seen == [42]  # after the whole module ran, once
    loader = aioload_hooked_ok.__loader__
    assert aioload_hooked_ok.__spec__.loader is loader
    assert "exec_module" not in vars(loader)  # the wrapper is gone from the loader object
    sys.modules.pop("aioload_hooked_ok")
    import aioload_hooked_ok as again  # noqa: F401

    assert seen == [42]


def test_after_import_of_a_failing_module_runs_nothing(module_dir: Path) -> None:
    (module_dir / "aioload_hooked_broken.py").write_text("raise ImportError('broken')\n")
    seen: list[ModuleType] = []
    finder = _worker_main._AfterImport("aioload_hooked_broken", seen.append)
    sys.meta_path.insert(0, finder)
    with pytest.raises(ImportError, match="broken"):
        import aioload_hooked_broken  # type: ignore[import-not-found]  # noqa: F401
    assert finder not in sys.meta_path
    assert seen == []


def _resident_kib(address: int) -> int:
    """Rss of the mapping that starts at ``address``, from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            for field in lines[i + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


def test_parent_maps_slabs_lazily_and_the_worker_populated() -> None:
    size = 256 * 4096
    fd = _transport._create_memfd(size)
    try:
        written = _transport._map_fd(fd, size, populate=True)
        read = _transport._map_fd(fd, size, populate=False)
    finally:
        os.close(fd)
    import ctypes

    assert _resident_kib(ctypes.addressof(written)) == size // 1024
    assert _resident_kib(ctypes.addressof(read)) == 0
    written[5 * 4096] = 7
    assert read[5 * 4096] == 7  # the same memory ...
    # ... of which only what was read counts (the page, and the few around it that the kernel
    # maps along with it on a read fault: 64 KiB by default)
    assert 4 <= _resident_kib(ctypes.addressof(read)) <= 64


def _anonymous_resident_kib(address: int, length: int) -> int:
    """Resident KiB of private anonymous memory at ``address`` (mincore(2)). Not from smaps: once
    a page is written, the kernel may merge the mapping with an anonymous neighbour, and then
    no mapping starts at ``address`` any more (and the merged one's Rss is not only ours)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    pages = (length + page - 1) // page
    residency = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), residency) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(flag & 1 for flag in residency) * page // 1024


def test_read_buffer_is_resident_only_where_written() -> None:
    buffer = _channel._read_buffer()
    assert len(buffer) == _channel._READ_CHUNK
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert _anonymous_resident_kib(address, len(buffer)) == 0
    buffer[:10] = b"0123456789"
    assert _anonymous_resident_kib(address, len(buffer)) == 4
    assert bytes(buffer[:10]) == b"0123456789"


# -- a staggered start ------------------------------------------------------------------------


class _Pids:
    """Each sample is the pid of the worker that fetched it, after every worker's
    worker_init_fn has written its pid into ``seen`` (a directory)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return os.getpid()


def _note_pid(seen: Path) -> Callable[[int], None]:
    def init(worker_id: int) -> None:
        (seen / f"{worker_id}-{os.getpid()}").touch()

    return init


def _sockets(pid: int) -> set[str]:
    """The sockets a process holds, as /proc names them ("socket:[inode]")."""
    names = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            name = os.readlink(fd)
        except OSError:
            continue
        if name.startswith("socket:"):
            names.add(name)
    return names


@pytest.mark.parametrize("front", ["for", "async for"])
@pytest.mark.parametrize("num_batches", [1, 8], ids=["fewer-batches-than-workers", "many"])
def test_a_staggered_start_starts_every_worker_once(
    no_leaks: None, tmp_path: Path, num_batches: int, front: str
) -> None:
    """Worker 0 is forked first and each other worker at a wait (under ``async for``, in a
    thread): every worker still starts, once, whether or not it gets a task, and none holds
    another worker's end of its socket."""
    import aioload
    from aioload._backends import process as _workers

    loader = aioload.DataLoader(
        _Pids(num_batches),
        batch_size=1,
        num_workers=3,
        worker_init_fn=_note_pid(tmp_path),
        multiprocessing_context="fork",
    )

    def pool() -> Any:
        return next(p for p in list(_workers._pools) if not p.closed)

    def more(batches: list[int]) -> bool:
        # The others are forked at the waits that follow the first (all at once where they
        # have no task): by the time the pass has gone on for as many batches as workers.
        return len(batches) < num_batches and not all(w.process for w in pool().workers)

    def started(batches: list[int]) -> list[int | None]:
        assert pool().stagger and pool().workers[0].pid == batches[0]
        assert all(w.process is not None for w in pool().workers)
        pids = [w.pid for w in pool().workers]
        # Once every worker has run its worker_init_fn (so it is past the closing of what it
        # inherited), each holds its own socket and no other: none of ours (the parent's
        # ends), and no other one ours is not (a sibling's end). (The event loop's own
        # socketpair, under async for, the parent holds too.)
        wait_until(lambda: len(list(tmp_path.iterdir())) >= 3, timeout=30)
        parent = _sockets(os.getpid())
        ends = {f"socket:[{os.fstat(w.channel.sock.fileno()).st_ino}]" for w in pool().workers}
        for pid in pids:
            assert pid is not None
            held = _sockets(pid)
            assert len(held - parent) == 1 and not held & ends, "a worker holds another's socket"
        return pids

    if front == "for":
        it = iter(loader)
        batches = [int(next(it))]
        while more(batches):
            batches.append(int(next(it)))
        pids = started(batches)
        batches += [int(b) for b in it]
    else:

        async def main() -> tuple[list[int], list[int | None]]:
            ait = aiter(loader)
            batches = [int(await anext(ait))]
            while more(batches):
                batches.append(int(await anext(ait)))
            pids = started(batches)
            batches += [int(b) async for b in ait]
            return batches, pids

        batches, pids = asyncio.run(main())
    assert len(batches) == num_batches
    # torch's round robin: batch i came from worker i % 3, whenever that worker was forked.
    assert batches == [pids[i % 3] for i in range(num_batches)]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"{i}-{pid}" for i, pid in enumerate(pids))


def _spec(num_workers: int) -> WorkerSpec:
    from aioload._backends.base import WorkerSpec

    return WorkerSpec(
        dataset=list(range(64)),
        dataset_kind=0,
        auto_collation=True,
        collate_fn=lambda x: x,
        drop_last=False,
        worker_init_fn=None,
        num_workers=num_workers,
        prefetch_factor=2,
        multiprocessing_context=None,
        slab_collate=False,
    )


def _wait_step(pool: Any, awaited: int | None) -> Any:
    """One of the engine's waits on ``pool``: the fork it offers, run as under ``for``."""
    waitable = pool.waitable(awaited)
    if waitable.work is not None:
        assert waitable.work.work_blocking()
    return waitable


def test_a_staggered_start_forks_one_worker_a_wait_the_awaited_one_first(
    no_leaks: None,
) -> None:
    """A task for a worker not forked yet waits in its socket; each wait offers one fork as
    the engine's work in place of a sleep (the worker the consumer waits for, if it waits for
    its fork, else the first with a task): the first batch is not held up by every other
    worker's fork. Once all are forked, a wait is a sleep again. The tasks are all answered."""
    from aioload._backends.process import WorkerPool
    from aioload._wire.messages import Answer, PassPlan

    pool = WorkerPool(_spec(4), base_seed=0, stagger=True)
    try:
        pool.start_pass([PassPlan()] * 4)
        for task_id in range(4):
            pool.submit(task_id, task_id, [task_id])
        forked = lambda: [w.process is not None for w in pool.workers]  # noqa: E731
        assert forked() == [True, False, False, False]
        offered = pool.waitable(awaited=0)
        assert offered.work is not None and forked() == [True, False, False, False]
        assert offered.work.work_blocking() and forked() == [True, True, False, False]
        assert _wait_step(pool, awaited=3).work is not None
        assert forked() == [True, True, False, True]
        assert _wait_step(pool, awaited=0).work is not None
        assert forked() == [True] * 4
        last = pool.waitable(awaited=0)
        assert last.work is None and last.budget > 0
        answered: set[int] = set()

        def all_answered() -> bool:
            answered.update(e.task_id for e in pool.poll() if isinstance(e, Answer))
            return len(answered) == 4

        wait_until(all_answered, timeout=30)
    finally:
        pool.close()


def test_a_staggered_start_forks_every_worker_at_once_where_none_has_a_task(
    no_leaks: None,
) -> None:
    """Fewer tasks than workers: the workers with none are forked together at the first wait
    (torch starts every worker); a slot that num_workers="auto" retired before its fork still
    gets forked for the task it holds, and an inactive slot with none is left for later
    (a wait is then a sleep, not a fork that forks nothing)."""
    from aioload._backends.process import WorkerPool
    from aioload._wire.messages import PassPlan

    pool = WorkerPool(_spec(4), base_seed=0, stagger=True)
    try:
        pool.start_pass([PassPlan()] * 4)
        pool.submit(0, 0, [0])
        assert _wait_step(pool, awaited=0).work is not None
        assert all(w.process is not None for w in pool.workers)
        assert pool.waitable(awaited=0).work is None
    finally:
        pool.close()
    pool = WorkerPool(_spec(3), base_seed=0, stagger=True)
    try:
        pool.start_pass([PassPlan()] * 3)
        pool.submit(0, 0, [0])
        pool.submit(2, 1, [1])
        pool.activate(1)
        assert _wait_step(pool, awaited=2).work is not None
        assert [w.process is not None for w in pool.workers] == [True, False, True]
        asleep = pool.waitable(awaited=2)
        assert asleep.work is None and asleep.budget > 0
        # Activated later, slot 1 is forked at the next wait.
        pool.activate(2)
        assert _wait_step(pool, awaited=2).work is not None
        assert all(w.process is not None for w in pool.workers)
        assert pool.waitable(awaited=2).work is None
    finally:
        pool.close()


def test_a_close_waits_for_a_staggered_fork_in_its_thread(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``async for`` a fork runs in a thread, and a native cancel ends its await while the
    fork goes on: a close meanwhile waits for that fork and stops the worker it made, and a
    fork offered before the close forks nothing after it."""
    from aioload._backends import process as _workers
    from aioload._backends.process import WorkerPool
    from aioload._wire.messages import PassPlan

    pool = WorkerPool(_spec(3), base_seed=0, stagger=True)
    real_fork = WorkerPool._fork
    in_fork = threading.Event()

    def slow_fork(self: WorkerPool, worker: Any) -> None:
        in_fork.set()
        time.sleep(0.3)
        real_fork(self, worker)

    monkeypatch.setattr(WorkerPool, "_fork", slow_fork)
    try:
        pool.start_pass([PassPlan()] * 3)
        for task_id in range(3):
            pool.submit(task_id, task_id, [task_id])
        first = pool.waitable(awaited=0).work
        later = pool.waitable(awaited=0).work
        assert first is not None and later is not None

        async def cancelled_fork() -> None:
            task = asyncio.ensure_future(first.work())
            await asyncio.sleep(0)
            while not in_fork.is_set():
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancelled_fork())
        pool.close()  # while the fork's thread is still in its sleep
        forked = [w for w in pool.workers if w.process is not None]
        assert [w.worker_id for w in forked] == [0, 1]
        # (Stopped and reaped: no_leaks finds no child left.)
        assert all(w.exited for w in forked)
        assert later.work_blocking() and [w.process is not None for w in pool.workers] == [
            True,
            True,
            False,
        ]
        assert not _workers._unforked_ends
    finally:
        pool.close()


def test_a_staggered_pool_closed_before_its_first_wait_leaves_nothing(no_leaks: None) -> None:
    from aioload._backends import process as _workers
    from aioload._backends.process import WorkerPool

    spec = _spec(3)
    before = len(os.listdir("/proc/self/fd"))
    pool = WorkerPool(spec, base_seed=0, stagger=True)
    assert [w.process is not None for w in pool.workers] == [True, False, False]
    assert len(_workers._unforked_ends) == 2
    pool.close()
    assert not _workers._unforked_ends
    # (Waited for, bounded: in a full run another test's leftover thread may hold a file
    # open for a moment.)
    assert wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before, timeout=5)
