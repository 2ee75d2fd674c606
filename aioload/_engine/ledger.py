"""Every task of a pass, from sent to delivered: the bookkeeping behind exactly-once, the
reorder buffer, the prefetch bound and resume.

The orchestrator (``_engine/orchestrator.py``) decides: which worker a task goes to, when to
wait, what a lost worker costs, when the pass ends. The ledger records what those decisions
did to each task (sent, answered, waiting for its turn, handed to the pin stage, delivered)
and what each worker's dataset had reached, and answers the orchestrator's questions from
that record. It sends and waits for nothing itself, and raises only the skip cap's error
(``cap_error``, which the orchestrator then ends the pass with). The orchestrator owns the round
robin; the ledger only hears where it stands (``sent``, ``round_robin_at``), for checkpoints.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from .._wire.messages import AllSkipped, Answer, Batch, Outcome, StreamEnded
from .._worker.fetch import take_skips
from .resume import PassProgress, StreamPoint

if TYPE_CHECKING:
    from ..errors import TooManySampleErrors
    from ..stats import SkippedSample
    from .counters import PassStats, SkipCap
    from .pinning import PinStage

__all__ = ["Ledger", "Sent"]


class Sent:
    """A task sent and not yet delivered: one record, made as it is sent, in ``inflight``
    until it is answered and among the assigned tasks until it is delivered (one object
    for both, and no tuple rebuilt when its answer comes: this runs for every batch)."""

    __slots__ = ("indices", "point", "position", "worker_id")

    def __init__(self, worker_id: int, indices: Any, position: int) -> None:
        self.worker_id = worker_id
        self.indices = indices
        self.position = position  # in sampler order
        # Where the worker's IterableDataset stream stood after it, once answered.
        self.point: StreamPoint | None = None


# An answered task waiting for its turn: (worker id, outcome, samples). A plain tuple, made
# for every batch.
_Done = tuple[int, Outcome, int]


class Ledger:
    """One pass's tasks. ``in_order``: answers wait for their turn in the reorder buffer (else
    they are delivered as they arrive). ``skip_cap`` (``max_skipped``) is checked as skipped
    samples are recorded; past it, the error is kept in ``cap_error`` and raised."""

    def __init__(
        self,
        progress: PassProgress,
        stats: PassStats,
        num_workers: int,
        *,
        in_order: bool,
        skip_cap: SkipCap | None,
        next_worker: int,
    ) -> None:
        self.progress = progress
        self._stats = stats
        self._in_order = in_order
        self._skip_cap = skip_cap
        # The skip cap's error, once raised: the pass is over.
        self.cap_error: TooManySampleErrors | None = None
        self._send_idx = 0  # id of the next task to send
        self.rcvd_idx = 0  # id of the next task to yield (in order)
        # Sent, not yet answered.
        self.inflight: dict[int, Sent] = {}
        # Sent, not yet delivered (the same records).
        self._assigned: dict[int, Sent] = {}
        # Tasks handed to the pin stage, in order (it keeps order), with their sample counts.
        self._staged: deque[tuple[int, int]] = deque()
        # Answered, waiting for their turn (in order).
        self._reorder_buffer: dict[int, _Done] = {}
        # Answered, in arrival order (in_order=False): (task id, answer).
        self._completed: deque[tuple[int, _Done]] = deque()
        # Tasks between "sent" and "yielded or skipped", the quantity prefetch bounds.
        self.unyielded = 0
        self.per_worker = [0] * num_workers
        # Tasks each worker holds unanswered (its queue, as far as the engine knows): what the
        # run-ahead tops up while the head of the line is late (``RunAhead.top_up``).
        self.unanswered = [0] * num_workers
        # A resumed IterableDataset pass: streams that had run dry stay so.
        self.active = [not progress.streams[w].ended for w in range(num_workers)]
        # Samples each IterableDataset stream had drawn by its last answer.
        self._samples_seen = [progress.streams[w].samples_seen for w in range(num_workers)]
        # Where each worker's dataset stood after its last answer: a replacement for a lost
        # worker starts there (a Stateful dataset's state goes on).
        self.answered = [progress.streams[w].copy() for w in range(num_workers)]
        # Where the orchestrator's round robin stands (the worker the next task goes to,
        # unless it cannot take one), as it last said: a checkpoint records where the batch
        # after the last yielded went, or would go.
        self._round_robin = next_worker
        # Skipped samples of answered tasks, recorded when the task is delivered.
        self._skips: dict[int, list[SkippedSample]] = {}

    # -- questions ---------------------------------------------------------------------------

    def answered_waiting(self) -> int:
        """Answered tasks waiting for their turn (not those in the pin stage)."""
        return len(self._reorder_buffer) + len(self._completed)

    def waiting(self) -> int:
        """Answered tasks not yet delivered, the pin stage's included."""
        return len(self._reorder_buffer) + len(self._completed) + len(self._staged)

    def nothing_ready(self) -> bool:
        """Whether tasks are in flight and ``pop_ready`` would find none of them answered."""
        if not self.inflight:
            return False
        if self._in_order:
            return self.rcvd_idx not in self._reorder_buffer
        return not self._completed

    def head_late(self) -> bool:
        """In order: whether the next task to yield is still unanswered (a consumer waiting
        now waits for it)."""
        return self.rcvd_idx in self.inflight

    def held_by(self, worker_id: int) -> list[int]:
        """The unanswered tasks of ``worker_id``, oldest first."""
        return sorted(t for t, sent in self.inflight.items() if sent.worker_id == worker_id)

    def oldest(self) -> tuple[int, Sent] | None:
        """The oldest unanswered task: the one a consumer in order waits for, if any."""
        if not self.inflight:
            return None
        task_id = min(self.inflight)
        return task_id, self.inflight[task_id]

    def awaited(self) -> int | None:
        """The worker holding the next task to yield in order, if it is unanswered: what a wait
        of a consumer in order (with no pin stage) is for (``waitable``'s ``awaited``). Its
        sibling finishes its own batch about as often first as not, and a wait that any answer
        ends would wake the parent for it, to find the batch it needs still missing and sleep
        again: a context switch that also evicts the workers' caches on a machine with fewer
        cores than processes (docs/benchmark-notes.md, "Waiting for one worker")."""
        sent = self.inflight.get(self.rcvd_idx)
        return sent.worker_id if sent is not None else None

    # -- records -----------------------------------------------------------------------------

    def sent(self, worker_id: int, position: int, indices: Any, next_worker: int) -> int:
        """A task for the batch at sampler ``position`` goes to ``worker_id``, and the round
        robin stands at ``next_worker`` after it; its task id."""
        self._round_robin = next_worker
        task_id = self._send_idx
        self._send_idx += 1
        self.inflight[task_id] = self._assigned[task_id] = Sent(worker_id, indices, position)
        self.per_worker[worker_id] += 1
        self.unanswered[worker_id] += 1
        self.unyielded += 1
        return task_id

    def round_robin_at(self, next_worker: int) -> None:
        """The round robin moved with no task sent (no worker could take one, or the sampler
        ran out): it stands at ``next_worker``."""
        self._round_robin = next_worker

    def accept(self, answer: Answer) -> None:
        """An answer arrived: filed for its turn, with where its worker's stream stands. An
        answer to a task already answered (a lost worker's, sent again) is dropped."""
        task_id, worker_id, outcome = answer.task_id, answer.worker_id, answer.outcome
        sent = self.inflight.pop(task_id, None)
        if sent is None:
            return
        self.unanswered[sent.worker_id] -= 1
        if answer.busy_s is not None:
            self._stats.fetched(worker_id, answer.busy_s)
        samples = self._stats.count(sent.indices)
        skipped, outcome = take_skips(outcome)
        if skipped:
            # The skip records travel inside the batch's answer; they count when the task is
            # delivered (one with nothing left is delivered as AllSkipped: not yielded).
            self._skips[task_id] = skipped
            samples -= len(skipped)
        stream = answer.stream
        if stream is not None:
            # Where the worker's dataset stands after the task: recorded when it is delivered.
            point = StreamPoint.of(stream)
            self.answered[worker_id] = point
            sent.point = point
        if isinstance(outcome, StreamEnded):
            # This worker's IterableDataset copy has run dry for this epoch.
            self.active[worker_id] = False
        elif self.progress.iterable and stream is not None:
            # The stream's own count says what the batch holds (a short last batch, or a
            # collate whose result has no batch dimension).
            samples = stream.samples_seen - self._samples_seen[worker_id] - len(skipped)
            self._samples_seen[worker_id] = stream.samples_seen
        done = (worker_id, outcome, samples)
        if self._in_order:
            self._reorder_buffer[task_id] = done
        else:
            self._completed.append((task_id, done))

    def pop_ready(self, through_stage: bool = False) -> tuple[int, Outcome, int] | None:
        """The next answer whose turn has come, as (task id, outcome, samples), if any. A
        stream's end and an all-skipped task are recorded here, in their turn, and not
        returned; through the pin stage, which keeps the order, they go on to it instead."""
        while True:
            if self._in_order:
                done = self._reorder_buffer.pop(self.rcvd_idx, None)
                if done is None:
                    return None
                task_id = self.rcvd_idx
                self.rcvd_idx += 1
            else:
                if not self._completed:
                    return None
                task_id, done = self._completed.popleft()
            self.unyielded -= 1
            worker_id, outcome, samples = done
            if type(outcome) is not Batch:  # (the common case, tested without a call)
                if isinstance(outcome, StreamEnded):
                    if through_stage:
                        return task_id, outcome, 0
                    self.end_reached(task_id)
                    continue
                if isinstance(outcome, AllSkipped) and not through_stage:
                    # Nothing to yield, but delivered here, in its turn (through the stage,
                    # which keeps the order, it is recorded when the stage hands it back).
                    self.per_worker[worker_id] -= 1
                    self.record_yield(task_id)
                    continue
            self.per_worker[worker_id] -= 1
            return task_id, outcome, samples

    def through_stage(self, stage: PinStage) -> tuple[int, Outcome, int] | None:
        """``pop_ready`` through the pin stage: what is ready goes to the stage, in order, as
        far as it has room; returns the next outcome the stage has handed back, if any."""
        while True:
            while stage.has_room():
                # An IterableDataset's "end" goes through the stage too, so that it is
                # recorded only once every batch before it has been yielded.
                ready = self.pop_ready(through_stage=True)
                if ready is None:
                    break
                task_id, outcome, samples = ready
                self._staged.append((task_id, samples))
                stage.submit(outcome)
            staged = stage.take()
            if staged is None:
                return None
            task_id, samples = self._staged.popleft()
            if isinstance(staged, StreamEnded):
                self.end_reached(task_id)
            elif isinstance(staged, AllSkipped):
                self.record_yield(task_id)
            else:
                return task_id, staged, samples

    def end_reached(self, task_id: int) -> None:
        """A worker's stream ended at ``task_id``, in its turn: where it stood is what the next
        pass starts from."""
        assigned = self._assigned.pop(task_id, None)
        if assigned is not None:
            if assigned.point is not None:
                # The state after the stream ran dry: what the next pass starts from.
                self.progress.streams[assigned.worker_id] = assigned.point
            self.progress.streams[assigned.worker_id].ended = True
        self._note_next_worker(task_id)

    def _note_next_worker(self, task_id: int) -> None:
        # In order, the batch after this one is task_id + 1: the worker it went to, or (not
        # sent yet) the one the round robin will pick.
        following = self._assigned.get(task_id + 1)
        self.progress.next_worker = following.worker_id if following else self._round_robin

    def record_yield(self, task_id: int) -> None:
        """``task_id`` is delivered (yielded, raised, or all skipped): its position, stream
        point and skipped samples go into the pass's progress, for ``state_dict()``."""
        assigned = self._assigned.pop(task_id, None)
        if assigned is None:
            return
        progress = self.progress
        progress.yielded.add(assigned.position)
        if assigned.point is not None:
            progress.streams[assigned.worker_id] = assigned.point
        # (Map-style too: a resumed pass gives the next batch to the worker whose dataset
        # state would have fetched it.)
        self._note_next_worker(task_id)
        skipped = self._skips.pop(task_id, None)
        if skipped:
            # Recorded with the batch's position, so a checkpoint has both or neither.
            progress.skipped.extend(skipped)
        cap = self._skip_cap
        if cap is not None and (skipped or cap.limit is None):
            # (A fraction of an unknown total moves with every batch.)
            self.check_skip_cap(final=False)

    def check_skip_cap(self, final: bool) -> None:
        """Past max_skipped: TooManySampleErrors, kept in ``cap_error`` and raised (the
        orchestrator ends the pass with it)."""
        cap = self._skip_cap
        if cap is None:
            return
        progress = self.progress
        if progress.iterable:
            drawn = sum(point.samples_seen for point in progress.streams)
        else:
            drawn = self._stats.samples + len(progress.skipped)
        error = cap.error(progress.skipped, drawn, final)
        if error is not None:
            self.cap_error = error
            raise error
