"""aioload's run-time ``NamedTuple`` makes the class ``typing.NamedTuple`` makes, without
compiling each field's annotation (``aioload/_named_tuple.py``)."""

from __future__ import annotations

import pickle
import typing

import pytest

from aioload._named_tuple import NamedTuple
from aioload._wire.messages import Task


class Point(NamedTuple):
    """A point."""

    x: int
    y: int = 0
    label: str | None = None

    @property
    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)

    def moved(self, dx: int) -> Point:
        return self._replace(x=self.x + dx)


class TypingPoint(typing.NamedTuple):
    """A point."""

    x: int
    y: int = 0
    label: str | None = None


def test_a_record_is_the_tuple_typing_makes() -> None:
    p = Point(3, -4)
    q = TypingPoint(3, -4)
    assert isinstance(p, tuple) and tuple(p) == tuple(q) == (3, -4, None)
    assert Point._fields == TypingPoint._fields
    assert Point._field_defaults == TypingPoint._field_defaults
    # (typing keeps ForwardRefs, this the strings; both read the same.)
    assert typing.get_type_hints(Point) == typing.get_type_hints(TypingPoint)
    assert Point.__doc__ == TypingPoint.__doc__ == "A point."
    assert (Point.__module__, Point.__qualname__) == (__name__, "Point")
    assert repr(p) == "Point(x=3, y=-4, label=None)"
    assert p._asdict() == q._asdict()
    assert p.norm1 == 7 and p.moved(1) == Point(4, -4)
    with pytest.raises(AttributeError):
        p.x = 1  # type: ignore[misc]
    assert not hasattr(p, "__dict__")


def test_a_record_pickles_by_reference() -> None:
    p = Point(1, 2, "a")
    assert pickle.loads(pickle.dumps(p)) == p
    task = Task._make(range(len(Task._fields)))
    assert pickle.loads(pickle.dumps(task)) == task


def test_a_record_refuses_what_typing_refuses() -> None:
    with pytest.raises(TypeError, match="Non-default"):

        class _Bad(NamedTuple):
            a: int = 0
            b: int  # type: ignore[misc]

    with pytest.raises(AttributeError, match="_replace"):

        class _Worse(NamedTuple):
            a: int

            def _replace(self) -> None:  # type: ignore[override]
                pass

    with pytest.raises(TypeError, match="alone"):

        class _Mixed(NamedTuple, typing.Generic[typing.TypeVar("T")]):  # type: ignore[misc]
            a: int
