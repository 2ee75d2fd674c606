"""The short path in: README.md and docs/quickstart.md say how to install aioload into your
own environment, and name every dependency pip will install with it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dependencies() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0] for spec in project["dependencies"]]


@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md"])
def test_the_install_section_names_every_dependency(page: str) -> None:
    text = (ROOT / page).read_text()
    section = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    # A real install line (no placeholder URL): from a checkout, or a wheel built from it.
    assert "pip install /path/to/aioload " in section
    assert "pip wheel --no-deps -w dist /path/to/aioload" in section
    assert "pip install dist/aioload-*.whl" in section
    assert "<repository URL>" not in section and "git+" not in section
    # How to keep a CPU-only torch: torch first, from PyTorch's CPU index, then aioload.
    flat = " ".join(section.split())
    assert "PyTorch's CPU-only package index" in flat and "--index-url" in flat
    assert "pip keeps that torch" in flat
    missing = [name for name in _dependencies() if f"`{name}`" not in section]
    assert not missing, f"{page}'s install section does not name {missing}"
    # torch's range, as pyproject.toml declares it: "torch>=A.B,<C.D" is "from A.B to C.(D-1)".
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    spec = next(s for s in project["dependencies"] if s.startswith("torch"))
    low = re.search(r">=\s*(\d+\.\d+)", spec)
    high = re.search(r"<\s*(\d+)\.(\d+)", spec)
    assert low and high, spec
    assert f"from {low.group(1)} to {high.group(1)}.{int(high.group(2)) - 1}" in " ".join(
        section.split()
    ), f"{page} does not give torch's range {spec!r}"


def test_the_quickstart_names_the_demo_make_run_runs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^run:.*\n\t\$\(PY\) (examples/\w+\.py)", makefile, re.M)
    assert demo, "the Makefile's run target runs no example"
    for page in ("README.md", "docs/quickstart.md"):
        assert demo.group(1) in (ROOT / page).read_text(), page
