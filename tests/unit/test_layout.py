"""The package's import graph: no cycle, and no import against the declared layering.

Layers, bottom up (docs/architecture.md): ``errors`` and ``stats``; ``_wire`` and ``_aio``;
``_worker``; ``_backends``; ``_engine``; the front (``loader``, ``_progress``, ``__init__``).
A module may import its own layer and the ones below, never one above. Imports inside
functions count as much as those at the top: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "aioload"

LAYERS: dict[str, int] = {
    "errors": 0,
    "stats": 0,
    "_wire": 1,
    "_aio": 1,
    "_worker": 2,
    "_backends": 3,
    "_engine": 4,
    "loader": 5,
    "_progress": 5,
    "__init__": 6,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = importer.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        base = ".".join(parts[:keep] + ([node.module] if node.module else []))
    if not base.startswith("aioload"):
        return []
    # ``from .pkg import mod`` names a module; ``from .mod import name`` a name in it. A bare
    # ``from . import mod`` depends on ``mod``, not on the package around it.
    named = [f"{base}.{alias.name}" for alias in node.names]
    return named if node.module is None else [base, *named]


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(name, is_package, node)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("aioload")]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    # An import of ``aioload._x.y`` runs ``aioload/_x/__init__.py`` too, and those are
    # docstring-only: leaving them out of the graph loses no edge.
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    return LAYERS[key]


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in _modules() if m != "aioload" and m.split(".")[1] not in LAYERS]
    assert not unplaced, f"modules outside the declared layers: {unplaced}"


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = [
        f"{importer} -> {imported}"
        for importer, imports in sorted(import_graph().items())
        if importer != "aioload"
        for imported in sorted(imports)
        if imported != "aioload" and _layer(imported) > _layer(importer)
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_package_top_stays_small() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


def test_no_class_has_over_450_lines() -> None:
    """Physical lines, from ``class`` to its last line: docstrings, comments and blank lines
    count too. The why of the code is welcome at any length, but it is read with the class,
    and a class that long does more than one thing: the part that can stand alone goes to a
    class of its own (as the orchestrator's ledger did)."""
    big = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                if (lines := node.end_lineno - node.lineno + 1) > 450:
                    big.append(f"{_module_name(path)}.{node.name}: {lines} lines")
    assert not big, big
