"""README's first code block is a whole program that runs as written: a reader copies it into
a file and runs it with their Python, and it works, under the default start method and under
forkserver (Linux's default from Python 3.14), which imports the script in every worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _first_block() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^```python\n(.*?)^```", text, re.M | re.S)
    assert match, "README.md has no Python block"
    return match.group(1)


def test_the_first_block_is_a_whole_program() -> None:
    code = _first_block()
    assert not code.startswith("# excerpt"), "README's first block must run as it is"
    assert 'if __name__ == "__main__":' in code
    assert "asyncio.run(" in code and "async for " in code and "\n    for " in code
    workers = [int(n) for n in re.findall(r"num_workers=(\d+)", code)]
    assert workers and max(workers) <= 2, "a num_workers that fits a 2-core machine"


# Generous bounds, against a hang only: under forkserver every worker start imports torch
# again, which takes long on a loaded machine.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", [None, "forkserver"])
def test_the_first_block_runs_as_a_user_would(tmp_path: Path, start_method: str | None) -> None:
    code = _first_block()
    if start_method is not None:
        code = (
            f"import multiprocessing\nmultiprocessing.set_start_method({start_method!r}, "
            "force=True)\n" + code
        )
    script = tmp_path / "first.py"
    script.write_text(code)
    # As installed: aioload importable, the script in a directory of its own, run by path.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    finished = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    # What the README says it prints.
    readme = (ROOT / "README.md").read_text()
    for line in finished.stdout.splitlines():
        assert f"`{line}`" in readme, f"README does not say that it prints {line!r}"
    assert finished.stdout.splitlines() == [
        "for: the last batch has shape (40, 2)",
        "async for: 16 batches",
    ]
    assert "Warning" not in finished.stderr, finished.stderr[-3000:]


def test_the_readme_promises_only_what_the_settings_give() -> None:
    # A hung sample with the default timeout=0 is waited for, as in torch: no "never hangs".
    head = (ROOT / "README.md").read_text().split("## Install", 1)[0]
    assert "never hangs" not in head
    assert "timeout=0" in head and "max_worker_restarts" in head
