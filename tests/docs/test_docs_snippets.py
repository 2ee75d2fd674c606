"""Every fenced Python block in README.md and docs/*.md runs as written, or says it is not a
whole program. A reader copies these; a block that fails to run is a bug in the docs.

A block is one of:

- a program: run as a script in a fresh subprocess (the loaders in it are sized to run in a
  few seconds), and it must exit 0;
- a continuation: its first line is ``# continued from the block above``; run after the
  page's previous Python block, as one script;
- an excerpt: its first line starts with ``# excerpt:`` and says what the reader supplies
  (their dataset, their training step, a launcher). It is only parsed (top-level ``await`` and
  ``async for`` allowed, as they appear inside a coroutine), since it is not a program.

An unmarked block that does not run fails here, so an excerpt cannot pass unmarked.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXCERPT = "# excerpt:"
CONTINUED = "# continued from the block above"
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    previous: Block | None  # the page's previous Python block

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.lstrip("\n").split("\n", 1)[0].strip()


def _python_blocks(page: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent = len(opening["indent"])
        language = opening["info"].strip().split(" ", 1)[0].lower()
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        if language in ("python", "py", "python3", "pycon"):
            code = "\n".join(line[indent:] for line in lines[index + 1 : end]) + "\n"
            blocks.append(Block(page, index + 1, code, blocks[-1] if blocks else None))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in _python_blocks(page)]


def test_the_pages_have_python_blocks() -> None:
    # Guards the parser: a change of fence style must not make every check below vanish.
    assert len(BLOCKS) >= 15
    assert any(block.page.name == "README.md" for block in BLOCKS)


def _script(block: Block) -> str:
    if block.first_line == CONTINUED:
        assert block.previous is not None, f"{block.name}: nothing above to continue"
        assert not block.previous.first_line.startswith(EXCERPT), (
            f"{block.name} continues an excerpt, which does not run"
        )
        return _script(block.previous) + "\n" + block.code
    return block.code


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_block_runs_or_is_marked_as_an_excerpt(block: Block, tmp_path: Path) -> None:
    if block.first_line.startswith(EXCERPT):
        assert len(block.first_line) > len(EXCERPT) + 3, (
            f"{block.name}: say what the excerpt needs from the reader"
        )
        compile(
            block.code,
            block.name,
            "exec",
            flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
            dont_inherit=True,
        )
        return
    script = tmp_path / "snippet.py"
    script.write_text(_script(block))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    try:
        finished = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=40,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.name} did not finish in 40 s")
    assert finished.returncode == 0, (
        f"{block.name} does not run as written (mark it '{EXCERPT} ...' if it is not a "
        f"program):\n{finished.stderr[-3000:]}"
    )
