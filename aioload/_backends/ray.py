"""Workers as Ray actors: the third ``_backends.base.WorkerBackend``, for preprocessing past one machine.

Nothing here is imported by ``import aioload``: ``RayWorkers`` (in ``aioload.workers``) is a
plain description, and this module (and Ray) is imported only when a pass starts on it.

- **One worker step.** Each actor holds a ``_worker.main.WorkerStep``, the same object a local
  worker process runs: seeds, ``get_worker_info()`` (ids 0..num_workers-1), ``worker_init_fn``,
  fetch and collate. A task is one actor method call, answered with a ``_wire.messages.Reply``.
- **The dataset travels once.** ``(dataset, collate_fn, worker_init_fn)`` is put in the object
  store once per loader (``ray.put``); every actor, and every replacement, reads that object.
- **Batches come back through the object store**, as the return value of the method call: on the
  same node Ray maps numpy buffers without a copy; across nodes Ray moves them. Ray pickles a
  torch tensor in-band by default (torch's reducer copies the storage into bytes, the object
  store copies those, and unpickling copies them again), so each CPU tensor of a batch travels
  as a ``_TensorBytes``: its bytes as a numpy uint8 array, which Ray writes out of band once
  and the driver maps from the store without a copy (``torch.from_numpy``).
- **Waiting never blocks the event loop.** One thread per backend waits in ``ray.wait`` on the
  outstanding results and writes a byte to a pipe when some are ready; that pipe is what the
  backend offers the engine to sleep on (``waitable``), as the process pool offers its
  selector, so asyncio, uvloop, trio and the sync front end all work.
- **Faults.** A killed actor's pending results resolve to ``RayActorError`` (Ray notices within
  about a second on one node); the backend reports ``WorkerLost`` naming the actor, its node
  and the indices it held. Restarts are the orchestrator's decision, as for local workers:
  ``restart`` starts a new actor in the slot, and the orchestrator sends the tasks again.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

from .._aio.waiting import Descriptor
from .._wire import slabs as _transport
from .._wire.messages import (
    Answer,
    Event,
    Failed,
    Failure,
    PassPlan,
    Reply,
    Reset,
    StreamEnded,
    StreamState,
    Task,
    ValueBatch,
    WorkerLost,
    answer_to,
    failed_in_setup,
)
from .._worker.heap import HeapPolicy
from .._worker.main import StepResult, WorkerConfig, WorkerStep
from ..errors import WorkerDiedError
from .base import OUT_OF_PROCESS, BackendTraits, Place, Waitable, WorkerSpec

__all__ = ["RayBackend"]

# How long one ray.wait in the waiter thread blocks before it looks for new results to watch.
_WAIT_SLICE_S = 0.05
# The longest sleep the engine is offered: a lost actor's results resolve to errors, which the
# waiter thread announces as any result, so this only bounds the sleep.
_HEALTH_CHECK_S = 1.0
# How long the backend's start waits for its actors to report their node (a cluster without
# free resources may take longer; the actors then report later, in stats).
_START_WAIT_S = 30.0


class _ActorImpl:
    """The body of one Ray actor: a WorkerStep behind two methods."""

    def __init__(self, config: WorkerConfig, payload: Any) -> None:
        import torch

        torch.set_num_threads(1)
        # The actor's process is its own, as a worker's is: its heap keeps a batch's freed
        # samples for the next batch, as a worker's does (see _worker.heap), instead of faulting them
        # in again on every batch where glibc happens to give them back. Batches here are
        # not stacked into slabs and their size is not tracked, so the trim threshold stays
        # at its floor (64 MiB, for batches up to 32 MiB).
        HeapPolicy()
        # A Ray actor has its own process, as a worker does (Ray's local mode, where it would
        # share the driver's, is deprecated; there this only stacks as outside a worker).
        _transport.stack_tensors_privately()
        # ``payload`` is the object-store copy of (dataset, collate_fn, worker_init_fn): Ray
        # resolved the ObjectRef argument to its value before calling us.
        self.step = WorkerStep(config._replace(payload=payload), slabs=None)

    def where(self) -> tuple[int, str, str]:
        import ray

        context = ray.get_runtime_context()
        return os.getpid(), context.get_node_id(), ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]

    def reset(self, reset: Reset) -> None:
        step = self.step
        step.generation = max(step.generation, reset.generation)
        if step.accepts(reset):
            step.new_pass(reset.plan)

    def run(self, task: Task) -> Reply:
        started = time.perf_counter()
        result = self.step.run(task)
        return _reply(task, result, self.step.point_of(result), started)


class _AsyncActorImpl(_ActorImpl):
    """An async dataset's actor: Ray runs its coroutine methods on the actor's event loop, so
    map-style batches are gathered concurrently; an IterableDataset's tasks take turns."""

    def __init__(self, config: WorkerConfig, payload: Any) -> None:
        super().__init__(config, payload)
        self.turns: Any = None
        self.entered = False

    async def _setup(self) -> None:
        import asyncio

        if self.turns is not None:
            return
        self.turns = asyncio.Lock()
        step = self.step
        await step.finish_async_init()
        self.entered = await step.enter_async_context()

    async def reset_async(self, reset: Reset) -> None:
        await self._setup()
        step = self.step
        step.generation = max(step.generation, reset.generation)
        if not step.accepts(reset):
            return
        if step.iterable:
            async with self.turns:
                await step.start_async_stream(reset.plan)
        else:
            step.new_async_pass(reset.plan)

    async def run_async(self, task: Task) -> Reply:
        await self._setup()
        started = time.perf_counter()
        if self.step.iterable:
            # Ray starts an actor's calls in the order they were made; the lock keeps them in
            # that order, since they pull from one stream.
            async with self.turns:
                result = await self.step.run_async(task)
                stream = self.step.point_of(result)
        else:
            result = await self.step.run_async(task, self.step.fetcher)
            stream = self.step.point_of(result)
        return _reply(task, result, stream, started)


def _reply(task: Task, result: StepResult, stream: StreamState | None, started: float) -> Reply:
    """An actor's answer to ``task``: ``result`` is what the WorkerStep returned for it (a
    batch, a Failure or StreamEnded), with the batch's tensors put on the wire (``to_wire``),
    and ``stream``, where the worker's dataset stood after it; busy since ``started``
    (``time.perf_counter()``)."""
    wire: Any = (
        result if isinstance(result, Failure | StreamEnded) else ValueBatch(to_wire(result.data))
    )
    return Reply(task.task_id, task.generation, wire, stream, time.perf_counter() - started, [])


class _TensorBytes:
    """A CPU tensor on the wire: its bytes as a uint8 numpy array (pickled out of band by Ray,
    mapped from the object store on the same node), and what it takes to view them again."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: Any, dtype: Any, shape: tuple[int, ...]) -> None:
        self.data = data
        self.dtype = dtype
        self.shape = shape

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_TensorBytes, (self.data, self.dtype, self.shape))


def _plain_tensor(value: Any) -> bool:
    import torch

    return (
        type(value) is torch.Tensor
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and not value.requires_grad
        and not value.is_quantized
        and not value.is_conj()
        and not value.is_neg()
    )


def to_wire(value: Any) -> Any:
    """``value`` with every plain CPU tensor (in lists, tuples, named tuples and dicts) as a
    ``_TensorBytes``; anything else is left to Ray's serializer."""
    if _plain_tensor(value):
        import torch

        flat = value.contiguous().reshape(-1).view(torch.uint8)
        return _TensorBytes(flat.numpy(), value.dtype, tuple(value.shape))
    return _map_containers(value, to_wire)


def from_wire(value: Any) -> Any:
    """The inverse of ``to_wire``: tensors viewing the received buffers, without a copy."""
    if isinstance(value, _TensorBytes):
        import torch

        with warnings.catch_warnings():
            # The buffer is the object store's, which numpy marks read-only; the tensor is the
            # batch's only owner from here on, as a local worker's shared-memory batch is.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(value.data)
        return flat.view(value.dtype).reshape(value.shape)
    return _map_containers(value, from_wire)


def _map_containers(value: Any, convert: Any) -> Any:
    if isinstance(value, list):
        return [convert(v) for v in value]
    if isinstance(value, tuple):
        if hasattr(value, "_fields"):  # a named tuple
            return type(value)(*(convert(v) for v in value))
        return tuple(convert(v) for v in value)
    if type(value) is dict:
        return {k: convert(v) for k, v in value.items()}
    return value


@dataclass
class _Slot:
    """One worker slot's current actor."""

    actor: Any
    incarnation: int
    where: Any = None  # ObjectRef of (pid, node id, node ip)
    description: str | None = None


@dataclass
class _Pending:
    worker_id: int
    incarnation: int
    task_id: int
    generation: int
    indices: Any


def connect(address: str | None) -> None:
    """Use the Ray session already initialized here; else ``address``; else RAY_ADDRESS;
    else start a local instance (``ray.init()`` decides between the last two)."""
    import ray

    if ray.is_initialized():
        return
    ray.init(address=address, log_to_driver=False)


class RayBackend:
    # Creating actors takes a while; actors fetch ahead of the consumer.
    TRAITS: ClassVar[BackendTraits] = OUT_OF_PROCESS

    def __init__(self, spec: WorkerSpec, base_seed: int, options: Any) -> None:
        import ray

        connect(options.address)
        self._ray = ray
        self.spec = spec
        self.options = options
        self.num_workers = spec.num_workers
        self.base_seed = base_seed
        self.retired = False
        self.closed = False
        self.generation = 0
        self.passes = 0
        self.plans: list[PassPlan] = [PassPlan()] * self.num_workers
        self._payload = options.payload_ref(spec)
        self._is_async = _is_async(spec)
        actor_options: dict[str, Any] = {
            "num_cpus": options.num_cpus,
            "num_gpus": options.num_gpus,
            # Restarts are the orchestrator's (max_worker_restarts), never Ray's own: a
            # restarted actor would not know which tasks to answer again.
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        if options.resources:
            actor_options["resources"] = dict(options.resources)
        if options.runtime_env:
            actor_options["runtime_env"] = dict(options.runtime_env)
        impl = _AsyncActorImpl if self._is_async else _ActorImpl
        self._actor_class = ray.remote(**actor_options)(impl)
        self._incarnations = 0
        self.slots: list[_Slot] = []
        # Results not yet taken in: ObjectRef -> what it answers. The waiter thread watches
        # these; ``_ready`` holds those it saw complete.
        self._pending: dict[Any, _Pending] = {}
        self._lock = threading.Lock()
        self._ready: deque[Any] = deque()
        self._lost: list[Event] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # What the engine sleeps on: the waiter thread writes to the pipe as results are ready.
        self._descriptor = Descriptor(self._wake_r)
        self._stop = threading.Event()
        self._submitted = threading.Event()
        # Results the waiter has seen ready (it watches the others); under ``_lock``.
        self._seen: set[Any] = set()
        try:
            for worker_id in range(self.num_workers):
                self.slots.append(self._start_actor(worker_id))
        except BaseException:
            self.close()
            raise
        # The start runs off the event loop (or in the sync iterator's own): wait here, bounded,
        # until the actors are up, so the first stats and error messages can name their nodes.
        # The first batch waits for the actors' start anyway.
        with contextlib.suppress(Exception):
            ray.wait(
                [slot.where for slot in self.slots],
                num_returns=len(self.slots),
                timeout=_START_WAIT_S,
            )
        self._waiter = threading.Thread(target=self._watch_results, name="aioload-ray", daemon=True)
        self._waiter.start()

    # -- actors ------------------------------------------------------------------------------

    def _start_actor(self, worker_id: int) -> _Slot:
        config = self.spec.worker_config(
            worker_id, self.base_seed, self.generation, payload=b"", shared_memory=False
        )
        actor: Any = self._actor_class.options(name=None).remote(config, self._payload)
        self._incarnations += 1
        slot = _Slot(actor, self._incarnations)
        slot.where = actor.where.remote()
        return slot

    def _reset(self, worker_id: int) -> None:
        slot = self.slots[worker_id]
        reset = Reset(self.generation, self.plans[worker_id])
        if self._is_async:
            slot.actor.reset_async.remote(reset)
        else:
            slot.actor.reset.remote(reset)

    # -- the seam ----------------------------------------------------------------------------

    def start_pass(self, plans: list[PassPlan]) -> None:
        if self.closed:
            raise RuntimeError("aioload: the Ray workers have been shut down")
        self._lost.clear()
        self.plans = list(plans)
        if self.passes:
            self.generation += 1
        self.passes += 1
        for worker_id in range(self.num_workers):
            self._reset(worker_id)

    def submit(self, worker_id: int, task_id: int, indices: Any) -> None:
        slot = self.slots[worker_id]
        task = Task(task_id, self.generation, indices)
        method = slot.actor.run_async if self._is_async else slot.actor.run
        ref = method.remote(task)
        with self._lock:
            self._pending[ref] = _Pending(
                worker_id, slot.incarnation, task_id, self.generation, indices
            )
        self._submitted.set()

    def poll(self) -> list[Event]:
        self._drain_wake()
        events: list[Event] = []
        if self._lost:
            events.extend(self._lost)
            self._lost.clear()
        lost_now: dict[int, list[_Pending]] = {}
        while self._ready:
            ref = self._ready.popleft()
            with self._lock:
                pending = self._pending.pop(ref, None)
            if pending is None:
                continue
            if pending.incarnation != self.slots[pending.worker_id].incarnation:
                continue  # a replaced actor's late answer
            try:
                reply: Reply = self._ray.get(ref, timeout=0)
            except self._ray.exceptions.GetTimeoutError:
                # Ready but not here yet (evicted or still in transfer): watch it again.
                with self._lock:
                    self._pending[ref] = pending
                    self._seen.discard(ref)
                self._submitted.set()
                continue
            except self._ray.exceptions.RayActorError:
                lost_now.setdefault(pending.worker_id, []).append(pending)
                continue
            except self._ray.exceptions.RayTaskError as exc:
                # The method itself failed outside the dataset's code (it catches those).
                if pending.generation == self.generation:
                    events.append(Answer(pending.worker_id, pending.task_id, Failed(_Wrapped(exc))))
                continue
            if reply.generation != self.generation:
                continue
            answer = answer_to(pending.worker_id, reply, _batch_value)
            if failed_in_setup(answer):
                self.retired = True
            events.append(answer)
        for worker_id, held in lost_now.items():
            events.append(self._lose(worker_id, held))
        return events

    def _lose(self, worker_id: int, held: list[_Pending]) -> WorkerLost:
        slot = self.slots[worker_id]
        # Every other result of this actor is void: forget them, so each is reported once.
        with self._lock:
            for ref, pending in list(self._pending.items()):
                if pending.worker_id == worker_id and pending.incarnation == slot.incarnation:
                    held.append(pending)
                    del self._pending[ref]
        slot.incarnation = -slot.incarnation  # answers of this actor are stale from now on
        indices = [p.indices for p in sorted(held, key=lambda p: p.task_id)]
        message = (
            f"DataLoader worker {worker_id} ({self._describe(slot)}) died; it held "
            f"indices {indices}."
        )
        return WorkerLost(
            worker_id, WorkerDiedError(message, worker_id=worker_id, pid=None, exitcode=None)
        )

    def flush(self) -> None:
        pass  # a task is an actor call, made as it is submitted

    def waitable(self, awaited: int | None = None) -> Waitable:
        """The waiter thread's pipe; no sleep at all where results are here already (one that
        was ready, but not yet local, is watched again)."""
        return Waitable(self._descriptor, 0.0 if self._ready or self._lost else _HEALTH_CHECK_S)

    def restart(self, worker_id: int, plan: PassPlan | None = None) -> None:
        if plan is not None:
            self.plans[worker_id] = plan
        old = self.slots[worker_id]
        with contextlib.suppress(Exception):
            self._ray.kill(old.actor, no_restart=True)
        self.slots[worker_id] = self._start_actor(worker_id)
        self._reset(worker_id)

    def abandon(self, worker_id: int) -> None:
        # Its pending results then fail with RayActorError, reported as a loss.
        with contextlib.suppress(Exception):
            self._ray.kill(self.slots[worker_id].actor, no_restart=True)

    def retire(self) -> None:
        self.retired = True

    def place(self, worker_id: int) -> Place:
        slot = self.slots[worker_id]
        name = self._describe(slot)
        return Place(name, started=slot.description is not None)

    def dump_stack(self, worker_id: int) -> str | None:
        # An actor's stack would take a call into the actor, which is busy in the sample it
        # is stuck in (``ray stack`` on its node shows it): the report names the actor alone.
        return None

    def _describe(self, slot: _Slot) -> str:
        # Never waits: this runs on the event loop (stats, a loss, a restart). An actor that has
        # not answered ``where`` yet is still starting.
        if slot.description is None:
            actor_id = slot.actor._actor_id.hex()[:12]
            ready, _ = self._ray.wait([slot.where], timeout=0, fetch_local=True)
            if not ready:
                return f"Ray actor {actor_id}, starting (node not known yet)"
            try:
                pid, node_id, node_ip = self._ray.get(slot.where, timeout=0)
            except Exception:
                slot.description = f"Ray actor {actor_id}, node unknown"
            else:
                slot.description = (
                    f"Ray actor {actor_id}, pid {pid}, node {node_id[:12]} at {node_ip}"
                )
        return slot.description

    def nodes(self) -> list[str]:
        """The node each worker's actor runs on (for stats)."""
        found = []
        for slot in self.slots:
            try:
                found.append(self._ray.get(slot.where, timeout=5)[1])
            except Exception:
                found.append("unknown")
        return found

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.retired = True
        # The waiter first (bounded by one ray.wait slice), then every actor we made.
        self._stop.set()
        self._submitted.set()
        waiter = getattr(self, "_waiter", None)
        if waiter is not None and threading.current_thread() is not waiter:
            waiter.join(timeout=2.0)
        for slot in self.slots:
            with contextlib.suppress(Exception):
                self._ray.kill(slot.actor, no_restart=True)
        self.slots = []
        with self._lock:
            self._pending.clear()
        self._ready.clear()
        # (An engine's wait watches a duplicate of the pipe, which it closes itself.)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the waiter thread -------------------------------------------------------------------

    def _watch_results(self) -> None:
        seen = self._seen
        while not self._stop.is_set():
            with self._lock:
                refs = [ref for ref in self._pending if ref not in seen]
                self._submitted.clear()
            if not refs:
                # ``submit`` sets this, so a new result is watched at once, not a poll later.
                self._submitted.wait(_WAIT_SLICE_S)
                continue
            try:
                # As soon as one is ready (not when all are: a ready batch must not wait for
                # the slowest in flight), then every other that is ready by now. fetch_local:
                # ready means here, pulled from the actor's node, so ``poll`` never waits.
                done, rest = self._ray.wait(
                    refs, num_returns=1, timeout=_WAIT_SLICE_S, fetch_local=True
                )
                if done and rest:
                    more, _ = self._ray.wait(
                        rest, num_returns=len(rest), timeout=0, fetch_local=True
                    )
                    done = done + more
            except Exception:
                if self._stop.is_set():
                    return
                continue
            if done:
                with self._lock:
                    seen.update(done)
                self._ready.extend(done)
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_w, b"\0")
            # Forget refs that were taken in, so the set does not grow.
            with self._lock:
                seen.intersection_update(self._pending)

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass


class _Wrapped:
    """A failure of the actor method itself, re-raised in the consumer as it is."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.from_init = False

    def reraise(self) -> None:
        raise self.error


def _batch_value(result: Any) -> Any:
    """An actor's batch (a ``ValueBatch`` from the object store) as the consumer gets it."""
    return from_wire(result.value)


def _is_async(spec: WorkerSpec) -> bool:
    from .._worker.async_fetch import is_async_dataset

    return is_async_dataset(spec.dataset, spec.dataset_kind)
