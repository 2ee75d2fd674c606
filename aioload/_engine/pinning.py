"""The pin / host-to-device stage: one dedicated thread between the orchestrator and the consumer.

torch's pin-memory thread only pins; the copy to the GPU is left to the training loop, where it
serializes with compute. Here the same thread also issues the copy, on a CUDA stream of its own,
so the whole host-to-device leg runs off the consumer's critical path:

    orchestrator ──(seq, outcome)──▶ inbox ──▶ pin thread: pin, .to(device, non_blocking) on its
                                                stream, record an event
    consumer ◀── ordered by seq ◀── done ◀─────┘   (and a byte on the wake pipe)

* Order: outcomes enter and leave in sequence order. An error outcome passes through untouched,
  so it reaches the consumer at its place in the epoch.
* Readiness without a host sync: the consumer's current stream waits on the copy's event
  (``wait_event``), and ``record_stream`` tells the caching allocator that the consumer's stream
  uses the memory, so it is not reused while the consumer's kernels may still read it.
* Waking the loop: the thread writes one byte to a pipe that sits in the worker pool's selector,
  so the orchestrator's single await also covers this stage.
* Lifetime: the thread belongs to one pass. ``close`` sends a sentinel and joins it; it finishes
  at most the batch in hand, so the join is bounded by one transfer.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.data
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from .._named_tuple import NamedTuple
from .._wire.messages import Batch, Outcome, Raised
from .counters import PassStats

__all__ = [
    "CudaTransfer",
    "PinPlan",
    "PinStage",
    "PinTransfer",
    "Transfer",
    "make_transfer",
    "torch_pin_plan",
]


class _Staged(NamedTuple):
    """A batch the stage's thread has transferred; handed over on the consumer's side."""

    value: Any


class Transfer:
    """What the stage does to each batch, in its thread (``run``) and then in the consumer's
    thread when the batch is handed over (``handover``)."""

    def setup(self) -> None:
        """Runs once in the stage's thread before the first batch."""

    def run(self, batch: Any) -> Any:
        raise NotImplementedError

    def handover(self, result: Any) -> Any:
        return result


class PinTransfer(Transfer):
    """``pin_memory=True``: torch's own pin_memory util (nested structures, and objects with a
    ``pin_memory()`` method of their own, are honoured as in torch)."""

    def __init__(self, device: str | None) -> None:
        self.device = device

    def run(self, batch: Any) -> Any:
        return torch_pin_memory(batch, self.device)  # type: ignore[no-untyped-call]


class CudaTransfer(Transfer):
    """``device="cuda:N"``: pin (if asked), then copy with ``non_blocking=True`` on the stage's
    own stream and record an event; the consumer's stream waits on that event."""

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device = device
        self.pin = pin
        self.stream: Any = None

    def setup(self) -> None:
        # Created in the stage's thread, on the target device: the copies are issued here.
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def run(self, batch: Any) -> Any:
        host = torch_pin_memory(batch, "cuda") if self.pin else batch  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self.stream):
            moved = _to_device(host, self.device)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        # ``host`` is returned with the result so that the pinned source stays referenced until
        # the consumer has made its stream wait on the copy.
        return moved, event, host

    def handover(self, result: Any) -> Any:
        moved, event, _host = result
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        _record_stream(moved, consumer)
        return moved


def _to_device(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, dict):
        return _rebuild_mapping(data, device)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_to_device(v, device) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(v, device) for v in data)
    if hasattr(data, "to") and callable(data.to):
        with contextlib.suppress(TypeError):
            return data.to(device, non_blocking=True)
    return data


def _rebuild_mapping(data: Any, device: torch.device) -> Any:
    # Keep the mapping's type where it can be built from a dict, as torch's collate does.
    try:
        return type(data)({k: _to_device(v, device) for k, v in data.items()})
    except TypeError:
        return {k: _to_device(v, device) for k, v in data.items()}


def _record_stream(data: Any, stream: Any) -> None:
    if isinstance(data, torch.Tensor):
        if data.is_cuda:
            data.record_stream(stream)
    elif isinstance(data, dict):
        for value in data.values():
            _record_stream(value, stream)
    elif isinstance(data, (list, tuple)):
        for value in data:
            _record_stream(value, stream)


@dataclass(frozen=True)
class PinPlan:
    """What the installed torch's DataLoader iterator makes of ``pin_memory`` and
    ``pin_memory_device``: whether it pins, for which device, and what it warns."""

    pin: bool
    device: str | None = None
    warnings: tuple[tuple[type[Warning], str], ...] = ()

    def warn(self, stacklevel: int) -> None:
        """Emit torch's warnings, from the caller's caller's frame up ``stacklevel``."""
        for category, message in self.warnings:
            warnings.warn(message, category, stacklevel=stacklevel + 1)


def torch_pin_plan(pin_memory: bool, pin_memory_device: str) -> PinPlan:
    """Ask the installed torch what a pass pins, rather than copy one release's rules.

    The rules differ between releases: up to torch 2.8 a pass pins for CUDA when CUDA is
    available, or for ``pin_memory_device`` when one is named, and says nothing when it cannot;
    from 2.9 on ``pin_memory_device`` is deprecated, the current accelerator is used, and a
    machine without one gets "'pin_memory' argument is set as true but no accelerator is
    found" (a CUDA build on a GPU-less machine included) and unpinned batches. torch decides
    this in its iterator's base ``__init__``, so that is run on an empty loader of the same two
    arguments (with a generator of its own: it draws a seed, which must not come from the
    global RNG). Should a future torch refuse the probe, torch 2.9's rules apply.
    """
    if not pin_memory and not pin_memory_device:
        return PinPlan(pin=False)
    try:
        nothing: Any = []
        probe: torch.utils.data.DataLoader[Any] = torch.utils.data.DataLoader(
            nothing,
            pin_memory=pin_memory,
            pin_memory_device=pin_memory_device,
            generator=torch.Generator(),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            iterator = torch.utils.data.dataloader._BaseDataLoaderIter(probe)
        device = iterator._pin_memory_device
        return PinPlan(
            pin=bool(iterator._pin_memory),
            device=str(device) if device else None,
            warnings=tuple((w.category, str(w.message)) for w in caught),
        )
    except Exception:
        return _accelerator_pin_plan(pin_memory, pin_memory_device)


def _accelerator_pin_plan(pin_memory: bool, pin_memory_device: str) -> PinPlan:
    """torch 2.9's rules: the current accelerator, if one is usable."""
    said: list[tuple[type[Warning], str]] = []
    if pin_memory and pin_memory_device:
        said.append(
            (
                UserWarning,
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{pin_memory_device}'.",
            )
        )
    available = pin_memory and torch.accelerator.is_available()
    if pin_memory and not available:
        said.append(
            (
                UserWarning,
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
            )
        )
    accelerator = torch.accelerator.current_accelerator() if available else None
    if accelerator is None or accelerator.type == "mps":
        return PinPlan(pin=False, warnings=tuple(said))
    return PinPlan(pin=True, device=accelerator.type, warnings=tuple(said))


def make_transfer(plan: PinPlan, device: torch.device | None) -> Transfer | None:
    """The stage a loader needs, or None when batches go to the consumer as they arrive.

    ``device`` (aioload's, checked by the loader: a usable accelerator) copies there, pinned
    first for CUDA; without it, ``pin_memory`` pins as the installed torch would (``plan``).
    """
    if device is not None and device.type == "cuda":
        return CudaTransfer(device, pin=True)
    if device is not None and device.type != "cpu":
        return _GenericDeviceTransfer(device)
    if plan.pin:
        return PinTransfer(plan.device)
    return None


class _GenericDeviceTransfer(Transfer):
    """A non-CUDA accelerator (e.g. xpu, mps): copy on the stage's thread without streams."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def run(self, batch: Any) -> Any:
        return _to_device(batch, self.device)


class PinStage:
    """The stage's thread and its two queues."""

    def __init__(self, transfer: Transfer, depth: int) -> None:
        self.transfer = transfer
        self.depth = max(1, depth)
        self._inbox: queue.SimpleQueue[tuple[int, Outcome] | None] = queue.SimpleQueue()
        self._done: dict[int, Outcome | _Staged] = {}
        self._lock = threading.Lock()
        # The pass's counters, if any; written from the stage's thread only.
        self.stats: PassStats | None = None
        self._next_in = 0
        self._next_out = 0
        self.wake_r, self._wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._loop, name="aioload-pin", daemon=True)
        self._thread.start()
        self.closed = False

    @property
    def pending(self) -> int:
        """Outcomes handed in and not yet taken out."""
        return self._next_in - self._next_out

    def has_room(self) -> bool:
        return self.pending < self.depth

    def submit(self, outcome: Outcome) -> None:
        self._inbox.put((self._next_in, outcome))
        self._next_in += 1

    def take(self) -> Outcome | None:
        """The next outcome in order, if it is done."""
        with self._lock:
            outcome = self._done.pop(self._next_out, None)
        if outcome is None:
            return None
        self._next_out += 1
        if isinstance(outcome, _Staged):
            try:
                return Batch(self.transfer.handover(outcome.value))
            except Exception as exc:
                return Raised(exc)
        return outcome

    def drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_r, 4096):
                pass

    def _loop(self) -> None:
        setup_error: BaseException | None = None
        try:
            self.transfer.setup()
        except Exception as exc:
            setup_error = exc
        while True:
            item = self._inbox.get()
            if item is None:
                return
            seq, outcome = item
            done: Outcome | _Staged = outcome
            if isinstance(outcome, Batch):
                if setup_error is not None:
                    done = Raised(setup_error)
                else:
                    started = time.perf_counter()
                    try:
                        done = _Staged(self.transfer.run(outcome.value))
                        if self.stats is not None:
                            self.stats.transferred(time.perf_counter() - started)
                    except Exception as exc:
                        # Reaches the consumer in order, like a dataset error.
                        done = Raised(exc)
            with self._lock:
                self._done[seq] = done
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # The thread finishes at most the batch in hand, then sees the sentinel: bounded.
        self._inbox.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        with self._lock:
            self._done.clear()
        for fd in (self.wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
