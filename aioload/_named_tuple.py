"""``NamedTuple`` for aioload's own record types: ``typing.NamedTuple`` to type checkers, and at
run time the same class made without ``typing``'s checks of each field's annotation.

NOTE [ Why not typing.NamedTuple at run time ]
Every module of the package is written with ``from __future__ import annotations``, so each
field's annotation is a string, and ``typing.NamedTuple`` checks each one by compiling it
(``typing.ForwardRef``). The package makes about 40 record types on import, with about 160
fields: in a fresh process that compiling took about 2.5 ms of ``import aioload`` (12-14 ms in
all; measured with the check skipped, alternating fresh processes), and the import is a large
share of a script's first batch. The class made here is the one ``typing`` makes from
``collections.namedtuple``, with the same fields, defaults, methods, docstring and
``__annotations__`` (left as the strings they are): only the check is gone, which a type
checker does better anyway.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

__all__ = ["NamedTuple"]

# What a record's body may not define (as typing refuses them), and what it defines that is
# not copied onto the class.
_PROHIBITED = frozenset(
    {
        "__new__",
        "__init__",
        "__slots__",
        "__getnewargs__",
        "_fields",
        "_field_defaults",
        "_make",
        "_replace",
        "_asdict",
        "_source",
    }
)
_SPECIAL = frozenset({"__module__", "__name__", "__annotations__"})
# (Typed loosely: its fields are known at run time only.)
_namedtuple: Any = collections.namedtuple


def _record(name: str, namespace: dict[str, Any]) -> type:
    annotations: dict[str, Any] = namespace.get("__annotations__", {})
    defaults = []
    for field in annotations:
        if field in namespace:
            defaults.append(namespace[field])
        elif defaults:
            raise TypeError(f"Non-default namedtuple field {field} cannot follow default field")
    record: type = _namedtuple(
        name, list(annotations), defaults=defaults, module=namespace["__module__"]
    )
    record.__annotations__ = dict(annotations)
    for key, value in namespace.items():
        if key in _PROHIBITED:
            raise AttributeError(f"Cannot overwrite NamedTuple attribute {key}")
        if key not in _SPECIAL and key not in annotations:
            setattr(record, key, value)
    return record


class _RecordMeta(type):
    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> Any:
        if bases != (_RecordBase,):
            raise TypeError("a NamedTuple record derives from NamedTuple alone")
        return _record(name, namespace)


_RecordBase: Any = type.__new__(_RecordMeta, "NamedTuple", (), {"__module__": __name__})

if TYPE_CHECKING:
    from typing import NamedTuple as NamedTuple
else:
    NamedTuple = _RecordBase
