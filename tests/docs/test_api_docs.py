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
