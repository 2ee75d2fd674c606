"""The API reference is complete: every argument of ``aioload.DataLoader`` is documented in
its docstring (which ``help()``, IDEs and docs/api.md show), every public name is on
docs/api.md, and no docstring shown there carries a raw reST role.

The checks read the live signature, so an argument added to ``DataLoader.__init__`` without
its entry in the docstring fails here.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aioload

ROOT = Path(__file__).resolve().parents[2]
API_PAGE = ROOT / "docs" / "api.md"
ROLE = re.compile(r":(?:meth|func|class|attr|mod|obj|data|exc|ref|py:\w+):`")


def _init_parameters() -> list[str]:
    names = list(inspect.signature(aioload.DataLoader.__init__).parameters)
    assert names[0] == "self"
    return names[1:]


def _args_section(doc: str) -> dict[str, str]:
    """The ``Args:`` section of a Google-style docstring: name -> its description."""
    doc = inspect.cleandoc(doc)
    match = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)+)", doc, re.M)
    assert match, "the docstring has no Args: section"
    entries: dict[str, str] = {}
    name = None
    for line in match.group(1).splitlines():
        head = re.match(r"^    (\w+)(?: \([^)]*\))?: (.*)$", line)
        if head:
            name = head.group(1)
            entries[name] = head.group(2)
        elif name is not None and line.startswith("        "):
            entries[name] += " " + line.strip()
    return entries


def test_every_init_parameter_is_documented() -> None:
    documented = _args_section(aioload.DataLoader.__doc__ or "")
    parameters = _init_parameters()
    missing = [name for name in parameters if name not in documented]
    stale = [name for name in documented if name not in parameters]
    assert not missing, f"DataLoader's docstring does not document: {missing}"
    assert not stale, f"DataLoader's docstring documents arguments it does not take: {stale}"
    # In the signature's order, so the reference reads like the call.
    assert list(documented) == parameters
    short = [name for name, text in documented.items() if len(text.split()) < 5]
    assert not short, f"documented in fewer than five words: {short}"


def test_griffe_reads_every_parameter() -> None:
    # What mkdocstrings renders on docs/api.md: the Google-style section parsed by griffe.
    griffe = pytest.importorskip("griffe")
    docstring = griffe.Docstring(inspect.cleandoc(aioload.DataLoader.__doc__ or ""))
    sections = docstring.parse("google")
    parameters = [p.name for s in sections if s.kind.value == "parameters" for p in s.value]
    assert parameters == _init_parameters()


def test_both_doors_are_documented() -> None:
    for name in ("__iter__", "__aiter__"):
        doc = getattr(aioload.DataLoader, name).__doc__
        assert doc and len(doc.split()) >= 10, name


def test_every_public_name_is_on_the_api_page() -> None:
    page = API_PAGE.read_text()
    missing = [
        name
        for name in aioload.__all__
        if f"::: aioload.{name}\n" not in page and f"`aioload.{name}`" not in page
    ]
    assert not missing, f"not on docs/api.md: {missing}"


def _shown_docstrings() -> Iterator[tuple[str, str]]:
    """The docstrings docs/api.md renders: each public object's, and its public members'."""
    for name in aioload.__all__:
        obj: Any = getattr(aioload, name)
        if getattr(obj, "__module__", "").startswith("torch"):
            continue  # default_collate and default_convert: torch's own, documented by torch
        yield name, inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if member.startswith("_") and member not in ("__iter__", "__aiter__"):
                    continue
                doc = getattr(value, "__doc__", None)
                if isinstance(doc, str):
                    yield f"{name}.{member}", doc


def test_no_raw_rest_roles_on_the_api_page() -> None:
    found = [where for where, doc in _shown_docstrings() if ROLE.search(doc)]
    assert not found, f"docstrings with a reST role, shown raw by mkdocstrings: {found}"


def _sections(obj: Any) -> dict[str, list[Any]]:
    """The sections griffe (what mkdocstrings renders) reads in ``obj``'s docstring."""
    griffe = pytest.importorskip("griffe")
    parsed = griffe.Docstring(inspect.cleandoc(obj.__doc__ or "")).parse("google")
    sections: dict[str, list[Any]] = {}
    for section in parsed:
        sections.setdefault(section.kind.value, []).extend(
            section.value if isinstance(section.value, list) else [section.value]
        )
    return sections


@pytest.mark.parametrize(
    "name",
    ["LoaderStats", "WorkerStats", "SkippedSample"],
)
def test_every_stats_field_is_documented(name: str) -> None:
    # In the docstring, where help() and the API page show it, not in # comments.
    import dataclasses

    cls = getattr(aioload, name)
    documented = {a.name for a in _sections(cls).get("attributes", [])}
    fields = [f.name for f in dataclasses.fields(cls)]
    missing = [f for f in fields if f not in documented]
    assert not missing, f"{name}'s docstring does not document {missing}"


@pytest.mark.parametrize(
    "name", ["WorkerError", "WorkerDiedError", "DataLoaderTimeoutError", "TooManySampleErrors"]
)
def test_every_error_attribute_is_documented(name: str) -> None:
    cls = getattr(aioload, name)
    documented = {a.name for a in _sections(cls).get("attributes", [])}
    attributes = [
        p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "message")
    ]
    assert attributes and set(attributes) <= documented, (name, attributes, documented)


@pytest.mark.parametrize(
    "where",
    [
        "DataLoader",
        "DataLoader.__iter__",
        "DataLoader.__aiter__",
        "DataLoader.load_state_dict",
        "DataLoader.set_epoch",
        "progress",
        "RayWorkers",
    ],
)
def test_the_public_calls_say_what_they_raise(where: str) -> None:
    obj: Any = aioload
    for part in where.split("."):
        obj = getattr(obj, part)
    raises = _sections(obj).get("raises", [])
    assert raises, f"{where}'s docstring has no Raises: section"
    assert all(len(r.description.split()) >= 3 for r in raises), where


def test_auto_is_a_literal_in_the_signature() -> None:
    import typing

    hints = typing.get_type_hints(aioload.DataLoader.__init__)
    for name in ("num_workers", "prefetch_factor", "worker_concurrency"):
        assert typing.Literal["auto"] in typing.get_args(hints[name]), (name, hints[name])


def test_the_iterators_methods_are_documented() -> None:
    from aioload.loader import _AsyncIterator, _SyncIterator

    assert len((_SyncIterator.close.__doc__ or "").split()) >= 10
    assert len((_AsyncIterator.aclose.__doc__ or "").split()) >= 10
    for door in ("__iter__", "__aiter__"):
        returns = _sections(getattr(aioload.DataLoader, door)).get("returns", [])
        text = " ".join(r.description for r in returns)
        assert ("close()" in text) if door == "__iter__" else ("aclose()" in text), door
