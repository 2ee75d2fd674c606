"""What one pass is made of, besides its engine: its description (``PassSetup``), what it must
release (``PassResources``), the sampler's draws with the error kept in place (``Drawn``), how
an error lets go of the pass's frames (``release_pass_frames``), and the engine's errors and
warnings, word for word (torch's where torch has them).

The orchestrator (``_engine/orchestrator.py``) runs the pass; this module holds what it is given
and what it says, so that the engine's module is the engine alone.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._named_tuple import NamedTuple
from ..errors import DataLoaderTimeoutError
from .hang import NO_HANG_REPORT, HangWatch

if TYPE_CHECKING:
    from .._aio.waiting import Waiter
    from .._backends.base import BackendTraits, WorkerBackend
    from .._wire.messages import PassPlan, WorkerLost
    from .counters import SkipCap
    from .ledger import Ledger
    from .pass_tuning import PassTuning
    from .pinning import PinStage, Transfer
    from .resume import PassProgress

__all__ = [
    "Drawn",
    "PassResources",
    "PassSetup",
    "release_pass_frames",
    "replaced",
    "timeout_error",
    "warn_past_length",
]


class PassSetup(NamedTuple):
    """Everything one pass needs to know, decided once when the pass is made (see
    ``_engine.passes.PassPlanner._plan``)."""

    # (sampler position, indices), resumed positions already left out (``_engine.resume.PassStart``).
    batches: Iterator[tuple[int, Any]]
    num_workers: int
    prefetch: int
    in_order: bool
    timeout: float
    max_worker_restarts: int
    # Where the pass records what it yielded (for state_dict()), and each worker's plan.
    progress: PassProgress
    plans: list[PassPlan]
    # What the pass's backend declares of itself (``BackendTraits``): the engine's only
    # knowledge of which kind of backend it drives.
    traits: BackendTraits
    # The pin / host-to-device stage, if any.
    transfer: Transfer | None = None
    # torch's IterableDataset length warning: len(dataloader) as reported, and the dataset.
    iterable_len: int | None = None
    dataset: Any = None
    # max_skipped, if any (on_sample_error).
    skip_cap: SkipCap | None = None
    # num_workers / prefetch_factor / worker_concurrency "auto": the pass's feed to the
    # controller (``_engine.pass_tuning``); None when every number is the user's.
    tuning: PassTuning | None = None
    # hang_report_after: the pass's hang report (``_engine.hang``), asked before each wait.
    hang: HangWatch = NO_HANG_REPORT


class PassResources:
    """What one pass must release: its pin stage, and its backend when it owns it. A finalizer
    holds this, not the orchestrator, so an abandoned pass (``break``, ``del``) is still
    cleaned up when it is collected."""

    def __init__(self) -> None:
        self.backend: WorkerBackend | None = None
        self.stage: PinStage | None = None
        self.waiter: Waiter | None = None

    def close(self) -> None:
        # In this order. The waiter: the loop lets go of what it watches (from the loop's own
        # thread) before the stage and the backend close their descriptors. The stage: it may
        # be working on a batch, and nothing after it needs it. The backend last.
        owned = (self.waiter, self.stage, self.backend)
        self.waiter = self.stage = self.backend = None
        for each in owned:
            if each is not None:
                each.close()


class Drawn:
    """NOTE [a failing sampler]. The pass's batches as the sampler draws them; an error of the
    sampler ends them, and is kept to be raised in its place.

    Torch raises the sampler's error from the ``next()`` that was refilling the prefetch window,
    which may be the one handing over a batch already fetched: that batch is lost, yet counted
    as yielded. Here the error takes the place of the batch the sampler failed to make: the
    batches drawn before it are delivered first, in order, then ``next()`` raises it
    (``raise_error``, when nothing is left in flight), once, and the pass is over (the
    sampler's iterator is finished, as torch's ``num_workers=0`` leaves it). ``state_dict()``
    records exactly the batches that were yielded.

    The error is kept without this frame: a traceback keeps its frames alive, and this one
    links to the pass's call stack (the orchestrator, the iterator), which would then hold the
    error in a cycle. The frames left are the sampler's own (generator frames, which hold no
    link to their callers)."""

    __slots__ = ("batches", "error")

    def __init__(self, batches: Iterator[tuple[int, Any]]) -> None:
        self.batches = batches
        self.error: BaseException | None = None

    def __iter__(self) -> Drawn:
        return self

    def __next__(self) -> tuple[int, Any]:
        try:
            return next(self.batches)
        except StopIteration:
            raise
        except Exception as error:
            tb = error.__traceback__
            self.error = error.with_traceback(tb.tb_next if tb is not None else None)
            raise StopIteration from None

    def raise_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            try:
                raise error
            finally:
                del error  # (this frame is in its traceback)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The modules whose frames hold a pass (its iterator, its orchestrator, or what they hold):
# their functions are plain ones, or coroutines that have finished whenever an exception
# passed out of them, so clearing their frames in a traceback never touches a live one.
_PASS_HOLDERS = frozenset(
    os.path.join(_PACKAGE, *name.split("/"))
    for name in (
        "_engine/orchestrator.py",
        "_engine/pass_setup.py",
        "_engine/ledger.py",
        "loader.py",
        "_progress.py",
        "_aio/sync_loop.py",
    )
)


def release_pass_frames(error: BaseException) -> None:
    """Let go of what aioload's frames in ``error``'s traceback hold: the pass's iterator and
    orchestrator, and the batches they were handing over.

    An exception keeps every frame it passed through, with its locals, for as long as it lives,
    and often longer than anyone expects: asyncio's task and the exception that ends it hold
    each other (``asyncio.run`` raises out of such a cycle), a notebook keeps the last one in
    ``sys.last_value``, a logger or a test keeps it. The iterator's frames would keep the pass,
    and so its workers, alive with it until a garbage collection. Cleared here, the pass lives
    exactly as long as the consumer's own references: an error that leaves the ``for`` or
    ``async for`` drops the iterator, and its finalizer stops the workers at once, while a
    consumer that catches the error inside the loop goes on with the same pass. The
    traceback's text (files, lines, the user's own frames and locals) is untouched.

    Frames that are still running (the caller's own) cannot be cleared; the iterators drop
    their own references themselves before the error leaves them."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename in _PASS_HOLDERS:
            with contextlib.suppress(RuntimeError):  # still running
                frame.clear()
        tb = tb.tb_next


def warn_past_length(setup: PassSetup, num_yielded: int) -> None:
    """torch's warning for an IterableDataset that yields more batches than its ``len`` said,
    word for word (users grep for it), from ``Orchestrator._deliver``."""
    warn_msg = (
        f"Length of IterableDataset {setup.dataset} was reported to be "
        f"{setup.iterable_len}(when accessing len(dataloader)), but "
        f"{num_yielded} samples have been fetched. "
    )
    if setup.traits.runs_ahead:
        warn_msg += (
            "For multiprocessing data-loading, this could be caused by not properly "
            "configuring the IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
            "for examples."
        )
    warnings.warn(warn_msg, stacklevel=5)  # next or next_blocking, as for _lost's warning


def replaced(lost: WorkerLost, limit: int, restarts_left: int) -> str:
    """``Orchestrator._lost``'s warning: the worker is replaced, its tasks sent again."""
    return (
        f"{lost.error} aioload replaced it with a new worker {lost.worker_id} "
        f"(restart {limit - restarts_left} of max_worker_restarts={limit}) and is "
        "sending its unfinished tasks again."
    )


def timeout_error(timeout: float, ledger: Ledger, backend: WorkerBackend) -> DataLoaderTimeoutError:
    """The pass's ``timeout`` passed: the error, naming the task waited for and its worker."""
    message = f"DataLoader timed out after {timeout} seconds"
    oldest = ledger.oldest()
    if oldest is not None:
        waiting, sent = oldest
        message += (
            f" (waiting for batch {waiting} from DataLoader worker {sent.worker_id}, "
            f"{backend.place(sent.worker_id).name}, holding indices {short_indices(sent.indices)})"
        )
    return DataLoaderTimeoutError(message, timeout=timeout)


def short_indices(indices: Any, limit: int = 16) -> str:
    try:
        items = list(indices)
    except TypeError:
        return repr(indices)
    if len(items) <= limit:
        return repr(items)
    return repr(items[:limit])[:-1] + f", ... ({len(items)} in all)]"
