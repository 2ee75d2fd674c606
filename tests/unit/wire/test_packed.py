"""The packed reply and task (aioload._wire.packed): the answer most batches get and every task, read
back field for field as the pickled ones would be, and every other message still pickled,
through the real channels."""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest
import torch

import aioload
from aioload._wire import leaves as _leaves
from aioload._wire import packed as _packed
from aioload._wire.channel import ParentChannel, WorkerChannel, encode_frame
from aioload._wire.messages import (
    Failure,
    FreeSlabs,
    IndexRange,
    PassPlan,
    PickledBatch,
    Reply,
    Reset,
    SlabBatch,
    StreamEnded,
    StreamState,
    Task,
)

_LONE = _leaves.LONE_LEAF_PAYLOAD


def _slab_reply(leaves: list[Any], payload: bytes = _LONE, **fields: Any) -> Reply:
    reply = Reply(7, 3, SlabBatch(2, 1 << 20, 4096, payload, leaves), None, 0.0125, [])
    return reply._replace(**fields)


_PACKABLE = {
    "lone tensor": _slab_reply([("t", 0, torch.int64, (256,), None)]),
    "scalar leaf": _slab_reply([("t", 64, torch.float32, (), None)]),
    "empty leaf": _slab_reply([("t", 0, torch.uint8, (0, 3), None)]),
    "several leaves": _slab_reply(
        [
            ("t", 0, torch.uint8, (64, 3, 224, 224), None),
            ("t", 9633792, torch.int64, (64,), None),
            ("t", 9634304, torch.bool, (64, 1), None),
        ],
        payload=b"\x80\x05a pickled dict naming its three leaves",
    ),
    "every dtype": _slab_reply(
        [("t", 64 * i, d, (2, 2), None) for i, d in enumerate(_packed._DTYPES)]
    ),
    "no leaves": _slab_reply([], payload=b"\x80\x05just a pickle"),
    "large ids": _slab_reply(
        [("t", 0, torch.float64, (3,), None)], task_id=1 << 40, generation=1 << 33
    ),
}

_PICKLED = {
    "numpy leaf": _slab_reply([("n", 0, np.dtype("float32"), (4,), None)]),
    "strided leaf": _slab_reply([("t", 0, torch.float32, (4, 4), (1, 4))]),
    "odd dtype": _slab_reply([("t", 0, torch.qint8, (4,), None)]),
    "stream position": _slab_reply(
        [("t", 0, torch.int64, (4,), None)], stream=StreamState(10, {"pos": 10}, False)
    ),
    "dropped slabs": _slab_reply([("t", 0, torch.int64, (4,), None)], dropped_slabs=[0, 1]),
    "pickled batch": Reply(1, 0, PickledBatch(b"\x80\x05x"), None, 0.1, []),
    "failure": Reply(1, 0, Failure("boom"), None, 0.1, []),
    "stream ended": Reply(1, 0, StreamEnded(), None, 0.1, []),
    "not a reply": ("t", 1),
    "more leaves than the head counts": _slab_reply(
        [("t", 8 * i, torch.int64, (1,), None) for i in range(0x10000)]
    ),
}


@pytest.mark.parametrize("name", list(_PACKABLE))
def test_a_packed_reply_reads_back_as_the_reply(name: str) -> None:
    reply = _PACKABLE[name]
    packed = _packed.pack_reply(reply)
    assert packed is not None and packed[0] == _packed.MARKER
    got = _packed.unpack_reply(memoryview(packed))
    assert got == reply
    # Field types too: a shape is a tuple, as the pickled reply's is (tensors are made from it).
    assert type(got.result) is SlabBatch
    assert [type(leaf[3]) for leaf in got.result.leaves] == [tuple] * len(reply.result.leaves)
    assert type(got.result.payload) is bytes


@pytest.mark.parametrize("name", list(_PICKLED))
def test_what_the_packed_form_does_not_carry_is_pickled(name: str) -> None:
    assert _packed.pack_reply(_PICKLED[name]) is None


def test_packed_and_pickled_frames_share_one_socket() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        worker = WorkerChannel(ours, pack=_packed.pack_reply)
        parent = ParentChannel(theirs, unpack=_packed.unpack_reply)
        # (The 65,536-leaf reply is left out: its megabytes would fill the socket, which this
        # one thread writes before it reads.)
        left_out = {"not a reply", "more leaves than the head counts"}
        sent = [*_PACKABLE.values(), *[m for k, m in _PICKLED.items() if k not in left_out]]
        for message in sent:
            worker.send(message)
        got: list[Any] = []
        while len(got) < len(sent):
            got += parent.pump_in()
        assert got == sent
        # Each packed frame is smaller than its pickle.
        for message in _PACKABLE.values():
            assert len(encode_frame(message, _packed.pack_reply)) < len(encode_frame(message))


# Indices are whatever the sampler yields: each kind must come back as it went, type included.
_TASKS = {
    "ints": Task(5, 2, list(range(1000, 1256))),
    "freed slabs": Task(6, 2, [3, 1, 2], (4, 9)),
    "numpy ints": Task(7, 0, [np.int64(3), np.int32(4)]),
    "a tensor of indices": Task(8, 0, torch.arange(4)),
    "keys": Task(9, 1, ["a/b.jpg", ("shard", 3), {"row": 2}]),
    "one index (no automatic batching)": Task(10, 0, 17),
    "huge ids": Task(2**40, 2**33, [2**62]),
}


@pytest.mark.parametrize("name", list(_TASKS))
def test_a_task_is_read_back_as_it_was_sent(name: str) -> None:
    task = _TASKS[name]
    frame = _packed.pack_to_worker(task)
    assert frame is not None and frame[0] == _packed.TASK_MARKER
    got = _packed.unpack_to_worker(memoryview(frame))
    assert type(got) is Task
    assert got.task_id == task.task_id and got.generation == task.generation
    assert got.freed_slabs == task.freed_slabs
    if isinstance(task.indices, torch.Tensor):
        assert torch.equal(got.indices, task.indices)
    else:
        assert got.indices == task.indices
        assert [type(i) for i in _as_list(got.indices)] == [type(i) for i in _as_list(task.indices)]
    # Smaller than the pickled Task: no reference to its class.
    assert len(frame) < len(encode_frame(task))


# A sequential sampler's batches travel as their bounds: integers only.
_RANGE_TASKS = {
    "a range": Task(11, 4, IndexRange(1024, 1280)),
    "a range and freed slabs": Task(12, 4, IndexRange(0, 3), (4, 9)),
    "a short last range": Task(13, 0, IndexRange(2**40, 2**40 + 1)),
    "an empty range": Task(2**40, 2**33, IndexRange(7, 7)),
}


@pytest.mark.parametrize("name", list(_RANGE_TASKS))
def test_a_range_task_is_read_back_as_it_was_sent(name: str) -> None:
    task = _RANGE_TASKS[name]
    frame = _packed.pack_to_worker(task)
    assert frame is not None and frame[0] == _packed.RANGE_TASK_MARKER
    got = _packed.unpack_to_worker(memoryview(frame))
    assert type(got) is Task and got == task
    assert type(got.indices) is IndexRange
    assert got.indices.as_list() == list(range(task.indices.start, task.indices.stop))
    assert [type(i) for i in got.freed_slabs] == [int] * len(task.freed_slabs)


@pytest.mark.parametrize("slab_ids", [[], [0], [3, 1, 2], [2**40]])
def test_freed_slabs_are_read_back_as_they_were_sent(slab_ids: list[int]) -> None:
    frame = _packed.pack_to_worker(FreeSlabs(slab_ids))
    assert frame is not None and frame[0] == _packed.FREE_MARKER
    got = _packed.unpack_to_worker(memoryview(frame))
    assert type(got) is FreeSlabs and got.slab_ids == slab_ids
    assert [type(i) for i in got.slab_ids] == [int] * len(slab_ids)


def _as_list(indices: Any) -> list[Any]:
    return list(indices) if isinstance(indices, list) else [indices]


def test_tasks_and_pickled_messages_share_one_socket() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        parent = ParentChannel(ours, unpack=_packed.unpack_reply, pack=_packed.pack_to_worker)
        worker = WorkerChannel(theirs, pack=_packed.pack_reply, unpack=_packed.unpack_to_worker)
        sent = [
            FreeSlabs([1, 2]),
            Reset(3, PassPlan()),
            *[_TASKS[name] for name in ("ints", "freed slabs", "keys")],
            *_RANGE_TASKS.values(),
            Reset(3, PassPlan()),
            _TASKS["huge ids"],
        ]
        assert _packed.pack_to_worker(Reset(3, PassPlan())) is None  # pickled
        for message in sent:
            parent.queue(message)
        parent.pump_out()
        got: list[Any] = []
        while len(got) < len(sent):
            worker.fill(wait=True)
            while worker.has_frame():
                got.append(worker.pop())
        assert got == sent
        assert [type(m) for m in got] == [type(m) for m in sent]


class _Mixed(torch.utils.data.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "image": torch.full((3, 8, 8), i, dtype=torch.uint8),
            "label": i,
            "mask": torch.tensor([i % 2 == 0, True]),
            "half": torch.full((2,), float(i), dtype=torch.bfloat16),
            "np": np.full((2,), i, dtype=np.int16),
        }


@pytest.mark.timeout(60)
def test_batches_through_workers_match_torchs(no_leaks: None) -> None:
    want = list(torch.utils.data.DataLoader(_Mixed(), batch_size=5))
    got = list(aioload.DataLoader(_Mixed(), batch_size=5, num_workers=2))
    assert len(got) == len(want)
    for ours, theirs in zip(got, want, strict=True):
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert type(ours[key]) is type(theirs[key])
            assert ours[key].dtype == theirs[key].dtype
            assert torch.equal(ours[key], theirs[key])
