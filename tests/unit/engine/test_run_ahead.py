"""In order, workers run ahead of a late head of the line (``_engine/runahead.py``, NOTE
[run-ahead] in the orchestrator): over the fake backend with serial workers (a worker works on
one task at a time, as a real one does), so a slow task holds up its worker's queue behind it.

Order, exactly-once and torch's round robin hold whatever the run-ahead does; it stays within
its limit, stats() report it, and a checkpoint taken while batches wait ahead of a late head
resumes exactly.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest
import torch

import aioload
from aioload._backends.fake import FakeBackend, FakeWorkers, VirtualClock
from aioload._engine import runahead
from aioload._engine.counters import PassStats
from aioload._engine.ledger import Sent
from aioload._engine.runahead import RunAhead
from aioload._wire.messages import Answer

from .test_engine import _drain, _engine, front  # noqa: F401 (front: both doors, autouse)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

WORKERS, PREFETCH = 4, 2
WINDOW = WORKERS * PREFETCH
SLOW = 9  # the late head: a task after the first batch, whose size starts the run-ahead
BATCHES = [[i] for i in range(160)]


class _Recording(FakeBackend):
    """Serial workers; records, at each task sent, how many tasks were between sent and
    yielded, and which tasks had been answered when the slow one was. The scripted delays
    count on the fake's own clock, which stands still while the engine works: on the
    machine's, a loaded machine stalls the engine past a late head's delay (or holds an
    on-time head's worker up), and what a test scripts is not what the engine sees."""

    def __init__(self, delay: Any, workers: int = WORKERS) -> None:
        super().__init__(workers, delay=delay, serial=True)
        self.clock = VirtualClock()
        self.engine: Any = None
        self.unyielded: list[int] = []
        self.limits: list[int] = []

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        self.unyielded.append(self.engine._ledger.unyielded)
        super().submit(worker_id, task_id, indices)

    def waitable(self, awaited: int | None = None) -> Any:
        # (With each wait, whether the engine could run ahead then.)
        self.limits.append(self.engine._ahead.limit)
        return super().waitable(awaited)

    def poll(self) -> list[Any]:
        # Each answer reports its task's scripted time as the worker's busy time (the fake
        # reports 1 ms for every task), so that the stats see the tasks' spread.
        return [
            e._replace(busy_s=self.delay(e.task_id)) if isinstance(e, Answer) else e
            for e in super().poll()
        ]


def _late_head(task_id: int) -> float:
    return 0.4 if task_id == SLOW else 0.001


def _run(
    delay: Any,
    batches: list[list[int]] = BATCHES,
    workers: int = WORKERS,
) -> tuple[_Recording, Any, list[Any]]:
    backend = _Recording(delay, workers)
    engine = _engine(backend, batches, prefetch=PREFETCH)
    backend.engine = engine
    got = _drain(engine)
    return backend, engine, got


def test_idle_workers_run_ahead_of_a_late_head() -> None:
    backend, engine, got = _run(_late_head)
    assert got == BATCHES, "in order, exactly once"
    # torch's round robin: every task went to the worker torch would give it.
    assert all(worker == task % WORKERS for worker, task in backend.submits)
    assert len(backend.submits) == len(BATCHES), "nothing sent twice"
    # While the slow task held its worker, the other three went on well past the window.
    before_slow = backend.answered[: backend.answered.index(SLOW)]
    assert len(before_slow) > 3 * WINDOW
    stats = engine.stats.snapshot()
    assert stats.run_ahead_limit == runahead.RUN_AHEAD_WINDOWS * WINDOW
    assert WINDOW < stats.run_ahead_peak <= stats.run_ahead_limit
    assert stats.waiting_in_order_peak > WINDOW
    assert max(backend.unyielded) <= WINDOW + stats.run_ahead_limit
    assert "run-ahead: up to" in str(stats)


def test_while_workers_run_ahead_any_answer_ends_a_wait() -> None:
    # Waiting on the late head's worker alone, the others would run dry behind it and sit
    # idle until it answers: while they may run further ahead, any worker's answer wakes the
    # engine, which tops that worker up at once. Before the first window is handed over (no
    # run-ahead yet), and once the head is on time, a wait names the head's worker.
    backend, _, got = _run(_late_head)
    assert got == BATCHES
    late = [a for a, u in backend.awaited if SLOW in u and min(u) == SLOW]
    # (Once the run-ahead reaches its limit, the wait is the head's worker's again.)
    assert len(late) > 5 and late[:5] == [None] * 5, late[:8]
    assert late[-1] == SLOW % WORKERS, "at the limit, the head's worker"
    # (Which waits come before the first survey depends on how fast the consumer is: on a
    # loaded machine the first window's answers can all be in before it first waits.)
    before_any = [w for w, limit in zip(backend.awaited, backend.limits, strict=True) if not limit]
    assert all(awaited == u[min(u)] for awaited, u in before_any)


def _uneven(task_id: int) -> float:
    # One task in five ten times slower: task times spread (coefficient of variation 1.3).
    return 0.010 if task_id % 5 == 0 else 0.001


def test_with_two_workers_any_answer_ends_a_wait_where_task_times_are_uneven() -> None:
    # Two workers, uneven tasks: behind a late head the other worker is topped up as it
    # answers (waiting on the head's worker alone, it ran dry after prefetch_factor tasks).
    backend, _, got = _run(_uneven, workers=2)
    assert got == BATCHES
    assert all(worker == task % 2 for worker, task in backend.submits)
    assert len(backend.submits) == len(BATCHES), "nothing sent twice"
    assert None in [awaited for awaited, _ in backend.awaited[4:]]
    assert all(awaited == u[min(u)] for awaited, u in backend.awaited[:2])


def test_with_two_workers_even_tasks_keep_the_wait_on_the_heads_worker() -> None:
    # Two workers taking turns, every task alike: the head is late at most hand-overs with no
    # sample slow, and a wake-up at the other worker's answer would only take a core from
    # the workers (jpeg on 2 cores lost 8-14 % of its items/s to it).
    backend, _, got = _run(lambda task_id: 0.002 + 0.0001 * (task_id % 3), workers=2)
    assert got == BATCHES
    assert backend.awaited
    assert all(awaited == u[min(u)] for awaited, u in backend.awaited)


class _LateHead:
    """A ledger whose head (task 0, worker 0's) is late, with answers waiting behind it."""

    unyielded = 4
    rcvd_idx = 0
    inflight: ClassVar[dict[int, Sent]] = {0: Sent(0, [0], 0)}

    def head_late(self) -> bool:
        return True

    def answered_waiting(self) -> int:
        return 3


@pytest.mark.parametrize("slots", [2, 3, 8])
def test_the_sleep_is_cut_to_a_tick_with_three_workers_or_more(slots: int) -> None:
    # With two workers the consumer wakes at answers only: a tick would wake it several times
    # for each batch of a worker that is slower for good (one that shares the consumer's core).
    # And it wakes at any answer only where task times are uneven.
    stats = PassStats(slots, False, True)
    for counter in stats.workers:  # each worker: a first task of 0, one of 40 ms, four of 0
        counter.tasks, counter.busy_s, counter.busy_sq = 6, 0.04, 0.04**2
    ahead = RunAhead(_LateHead(), stats, 2 * slots, enabled=True)  # type: ignore[arg-type]
    ahead.resize(2 * slots, slots)
    ahead.survey(torch.zeros(10), yielded=1)
    assert ahead.wakes_on_any()
    assert (ahead.sleep_bound(ahead.wakes_on_any()) == ahead.tick) == (slots > 2)
    assert slots > 2 or ahead.sleep_bound(ahead.wakes_on_any()) == float("inf")
    for counter in stats.workers:  # after the first, five tasks of 8 ms each
        counter.busy_sq = 5 * 0.008**2
    ahead.survey(torch.zeros(10), yielded=65)
    assert ahead.wakes_on_any() == (slots > 2)


def test_the_run_ahead_stays_within_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runahead, "RUN_AHEAD_WINDOWS", 1)
    backend, engine, got = _run(_late_head)
    assert got == BATCHES
    stats = engine.stats.snapshot()
    assert stats.run_ahead_limit == WINDOW
    # It reached its limit (the slow task is slow enough), and went no further.
    assert stats.run_ahead_peak == WINDOW
    assert max(backend.unyielded) == 2 * WINDOW  # (each count includes the task sent)


def test_an_on_time_head_keeps_torchs_window() -> None:
    # Every task alike: the window is never exceeded (tasks beyond it go out only when a
    # worker would run dry behind a late head).
    backend, engine, got = _run(lambda task_id: 0.0005)
    assert got == BATCHES
    assert max(backend.unyielded) <= WINDOW
    assert engine.stats.snapshot().run_ahead_peak <= WORKERS


def test_uneven_times_keep_order_and_exactly_once_in_and_out_of_order() -> None:
    rng = random.Random(5)
    times = {t: min(0.02, rng.lognormvariate(-7.0, 1.0)) for t in range(len(BATCHES))}
    backend, engine, got = _run(times.__getitem__)
    assert got == BATCHES
    assert sorted(backend.answered) == list(range(len(BATCHES)))
    assert all(worker == task % WORKERS for worker, task in backend.submits)
    backend = FakeBackend(WORKERS, delay=times.__getitem__, serial=True)
    engine = _engine(backend, BATCHES, prefetch=PREFETCH, in_order=False)
    assert sorted(_drain(engine)) == BATCHES
    assert engine.stats.snapshot().run_ahead_limit == 0, "out of order there is no line"


def test_a_lost_worker_during_the_run_ahead_repeats_and_loses_nothing() -> None:
    backend = _Recording(_late_head)
    backend.lose_on = {SLOW + 2 * WORKERS + 1}  # a task sent while the head is late
    engine = _engine(backend, BATCHES, prefetch=PREFETCH, restarts=1)
    backend.engine = engine
    with pytest.warns(RuntimeWarning, match="replaced it"):
        got = _drain(engine)
    assert got == BATCHES
    assert backend.restarts == [(SLOW + 2 * WORKERS + 1) % WORKERS]


def test_the_limit_is_the_memory_bound() -> None:
    stats = PassStats(2, False, True)
    batch = torch.zeros(1000, dtype=torch.uint8)

    def ahead_of(max_memory: int | None) -> RunAhead:
        return RunAhead(None, stats, 4, enabled=True, max_memory=max_memory)  # type: ignore[arg-type]

    ahead = ahead_of(None)
    ahead.resize(4)
    assert ahead.limit == 0, "no run-ahead before a batch's size is known"
    ahead.survey(batch, yielded=1)
    assert ahead.limit == min(runahead.RUN_AHEAD_WINDOWS * 4, runahead.RUN_AHEAD_BYTES // 1000)
    # With max_memory, what the budget leaves beside the window and two batches.
    ahead = ahead_of(20_000)
    ahead.survey(batch, yielded=1)
    assert ahead.limit == 20 - (4 + 2)
    assert stats.run_ahead_limit == 14 and stats.batch_bytes == 1000
    ahead.resize(8)  # the controller doubled the window
    assert ahead.limit == 20 - (8 + 2)
    ahead = ahead_of(5_000)
    ahead.survey(batch, yielded=1)
    assert ahead.limit == 0, "a budget the window fills leaves no run-ahead"
    # The largest batch seen sizes the bound.
    ahead.survey(torch.zeros(10, dtype=torch.uint8), yielded=65)
    assert ahead.batch_bytes == 1000


class _Where(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        return torch.tensor([index, -1 if info is None else info.id, random.randrange(1 << 30)])


def _loader(fake: FakeWorkers, seed_per_sample: bool = True) -> aioload.DataLoader:
    return aioload.DataLoader(
        _Where(),
        batch_size=1,
        num_workers=3,
        shuffle=True,
        seed_per_sample=seed_per_sample,
        generator=torch.Generator().manual_seed(11),
        workers=fake,
    )


def test_a_checkpoint_taken_while_batches_wait_ahead_resumes_exactly(front: str) -> None:  # noqa: F811
    # Batch SLOW is late; once it is handed over, the batches its siblings ran ahead to are
    # waiting in the reorder buffer. The checkpoint records only what was yielded: a resumed
    # loader yields the rest, each batch once, as the uninterrupted pass does.
    # With seed_per_sample the tasks go to the least busy worker (NOTE [balanced in order]),
    # which depends on timing: [index, random draw] must match. Without it, torch's round
    # robin: [index, worker id] match (the draws come from each worker's own generators,
    # which a resumed pass does not replay).
    for seed_per_sample in (True, False):
        fake = FakeWorkers(delay=_late_head, serial=True, clock=VirtualClock())
        whole = [b[0].tolist() for b in _loader(fake, seed_per_sample)]
        loader = _loader(
            FakeWorkers(delay=_late_head, serial=True, clock=VirtualClock()), seed_per_sample
        )
        it = iter(loader)
        head = [next(it)[0].tolist() for _ in range(SLOW + 1)]
        stats = loader.stats()
        assert stats.run_ahead_peak > 0 and stats.waiting_in_order > 0, "taken mid-run-ahead"
        state = loader.state_dict()
        del it
        resumed = _loader(
            FakeWorkers(delay=_late_head, serial=True, clock=VirtualClock()), seed_per_sample
        )
        resumed.load_state_dict(state)
        tail = [b[0].tolist() for b in resumed]
        if seed_per_sample:
            assert [[i, r] for i, _, r in head + tail] == [[i, r] for i, _, r in whole]
        else:
            assert [[i, w] for i, w, _ in head + tail] == [[i, w] for i, w, _ in whole]
        assert len(whole) == 40 and sorted(i for i, _, _ in whole) == list(range(40))


def _slow_index(task_id: int) -> float:
    # Every third task is slow: under round robin they all land on worker 0.
    return 0.05 if task_id % 3 == 0 else 0.002


@pytest.mark.parametrize("seed_per_sample", [True, False])
def test_with_seed_per_sample_in_order_tasks_go_to_the_least_busy_worker(
    seed_per_sample: bool,
) -> None:
    # NOTE [balanced in order]: with seed_per_sample a batch does not depend on its worker, so
    # in order the tasks go to whichever worker holds the fewest; batches still come in the
    # sampler's order, each once, with the same per-sample draws. Without it, torch's round
    # robin: each worker fetches its fixed third, whatever it costs.
    got = [
        b[0].tolist()
        for b in _loader(
            FakeWorkers(delay=_slow_index, serial=True, clock=VirtualClock()), seed_per_sample
        )
    ]
    reference = [b[0].tolist() for b in _loader(FakeWorkers(serial=True), seed_per_sample)]
    assert [[i, r] for i, _, r in got] == [[i, r] for i, _, r in reference]
    assert sorted(i for i, _, _ in got) == list(range(40))
    slow_on = {w for k, (_, w, _) in enumerate(got) if k % 3 == 0}
    if seed_per_sample:
        assert len(slow_on) > 1, "the slow tasks went to the workers that were free"
    else:
        assert slow_on == {0}
        assert [w for _, w, _ in got] == [k % 3 for k in range(40)]


def test_a_larger_batch_waiting_behind_a_late_head_shrinks_the_limit_at_once() -> None:
    # Batches that grow in the middle of a pass (bucketed by size): the bound follows the
    # first large one that waits, not the next survey, 64 batches on.
    stats = PassStats(2, False, True)
    on_time = _LateHead()
    on_time.head_late = lambda: False  # type: ignore[method-assign]
    ahead = RunAhead(on_time, stats, 4, enabled=True, max_memory=50_000)  # type: ignore[arg-type]
    ahead.survey(torch.zeros(1000, dtype=torch.uint8), yielded=1)
    assert ahead.limit == 50 - (4 + 2)
    ahead.answered(torch.zeros(5000, dtype=torch.uint8))
    assert ahead.limit == 44, "an answer that waits behind no late head is not sized"
    ahead._ledger = _LateHead()  # type: ignore[assignment]
    ahead.answered(torch.zeros(5000, dtype=torch.uint8))
    assert ahead.limit == 10 - (4 + 2) and stats.run_ahead_limit == 4
    ahead.answered(torch.zeros(10, dtype=torch.uint8))
    assert ahead.limit == 4, "a smaller batch leaves the bound as it is"


class _Growing(torch.utils.data.Dataset[torch.Tensor]):
    """Samples 0-47 of 4 bytes, then of 40 KB."""

    def __len__(self) -> int:
        return 160

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(10_000 if index >= 48 else 1, dtype=torch.int32)


def test_batches_that_grow_keep_the_batches_waiting_within_the_memory_bound() -> None:
    # Batch 40 is late (its worker sleeps), behind it 40 KB batches: the answers waiting in
    # order stay within what max_memory leaves, though the survey saw 4-byte batches.
    def delay(task_id: int) -> float:
        return 0.5 if task_id == 40 else 0.001

    loader = aioload.DataLoader(
        _Growing(),
        batch_size=1,
        num_workers=4,
        prefetch_factor="auto",
        max_memory=1 << 20,
        workers=FakeWorkers(delay=delay, serial=True, clock=VirtualClock()),
    )
    got = [int(b.numel()) for b in loader]
    assert got == [1] * 48 + [10_000] * 112
    stats = loader.stats()
    assert stats.reorder_bytes_peak <= 1 << 20
    assert stats.run_ahead_peak > 0


def test_batch_bytes_is_an_estimate_that_never_raises() -> None:
    """A sparse tensor has no ``nbytes`` (torch raises), nor may a user's object in a batch:
    the run-ahead's memory estimate measures them without ending the pass."""
    from aioload._engine.measure import batch_bytes

    class Odd:
        @property
        def nbytes(self) -> int:
            raise ValueError("no size")

    sparse = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse()
    assert batch_bytes({"s": sparse, "odd": Odd(), "x": torch.zeros(4)}) >= 16
    # A text batch's list of strings holds no tensor (and is not walked); a sample's tuple
    # of a string and tensors still counts its tensors.
    assert batch_bytes({"text": ["a"] * 256, "x": torch.zeros(4)}) == 16
    assert batch_bytes(("a", torch.zeros(4), torch.zeros(4))) == 32


def test_batch_bytes_counts_a_long_list_and_a_deep_one_whole() -> None:
    """A batch kept as a list of more tensors than are measured counts them all (the sample
    is scaled up), and one nested a few levels deep still counts: either, undercounted, would
    let the run-ahead past ``max_memory``."""
    from aioload._engine.measure import batch_bytes

    assert batch_bytes([torch.zeros(128, dtype=torch.float64)] * 1024) == 1024 * 1024
    assert batch_bytes({str(k): torch.zeros(2) for k in range(1000)}) == 8000
    assert batch_bytes([[torch.zeros(1)] * 3] * 300) == 300 * 3 * 4
    # A sample spread over the whole list, whatever its length and wherever the large ones are.
    small, large = torch.zeros(1), torch.zeros(100_000)
    for items in ([small] * 256 + [large] * 255, [large] * 255 + [small] * 256):
        true = sum(t.nbytes for t in items)
        assert 0.9 * true <= batch_bytes(items) <= 1.1 * true
    deep: object = torch.zeros(16)
    for _ in range(6):
        deep = [deep]
    assert batch_bytes(deep) == 64


def test_a_head_worker_slow_for_good_is_not_run_ahead_of() -> None:
    # Round robin runs at the pace of a worker several times slower than the others: running
    # ahead of it would only fill memory and wake the consumer. A slow sample now and then is
    # another matter, and with tasks going to the least busy worker the others take its share.
    stats = PassStats(3, False, True)
    for worker_id, busy in ((0, 0.160), (1, 0.016), (2, 0.019)):
        stats.workers[worker_id].tasks = 8
        stats.workers[worker_id].busy_s = busy
    ahead = RunAhead(_LateHead(), stats, 6, enabled=True)  # type: ignore[arg-type]
    ahead.resize(6, 3)
    ahead.survey(torch.zeros(10), yielded=1)
    assert ahead.slow_for_good(0) and not ahead.slow_for_good(1)
    assert not ahead.wakes_on_any(), "the head's worker, 0, sets the pace"
    assert ahead.sleep_bound(ahead.wakes_on_any()) == float("inf")
    stats.workers[0].busy_s = 0.048  # 6 ms a task against 2.2: slow samples, not a slow worker
    assert not ahead.slow_for_good(0) and ahead.wakes_on_any()
    stats.workers[0].tasks = 7  # too few to tell
    stats.workers[0].busy_s = 0.140
    assert not ahead.slow_for_good(0)
    stats.workers[0].tasks, stats.workers[0].busy_s = 8, 0.160
    least_busy = RunAhead(_LateHead(), stats, 6, enabled=True, round_robin=False)  # type: ignore[arg-type]
    least_busy.resize(6, 3)
    least_busy.survey(torch.zeros(10), yielded=1)
    assert not least_busy.slow_for_good(0) and least_busy.wakes_on_any()
