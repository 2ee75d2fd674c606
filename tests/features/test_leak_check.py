"""The leak check itself: ``no_leaks`` fails a test that leaves a /dev/shm entry behind, and only
for what this process tree left, whatever other programs do in /dev/shm meanwhile."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.leaks import ProcessTree, descendants, maker_pid, shm_entries, shm_leaks

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here"),
    pytest.mark.no_local_workers("the leak check itself, no loader"),
]


def _maker(mode: str, token: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.scripts.shm_maker", mode, token],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == b"ready"
    return process


def _stop(process: subprocess.Popen[bytes]) -> None:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.close()
    try:
        process.wait(timeout=10)
    finally:
        process.stdout.close()
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def token() -> Iterator[str]:
    """A mark for every name a test makes; whatever carries it is removed afterwards."""
    mark = uuid.uuid4().hex[:12]
    yield mark
    for name in shm_entries():
        if mark in name:
            os.unlink(f"/dev/shm/{name}")


def test_maker_pid_reads_torch_and_openmp_names() -> None:
    assert maker_pid("torch_4242_3141592653_7") == 4242
    assert maker_pid("__KMP_REGISTERED_LIB_4242") == 4242
    assert maker_pid("__KMP_REGISTERED_LIB_4242_0") == 4242
    assert maker_pid("psm_4242") is None
    assert maker_pid("sem.mp-abc") is None
    assert maker_pid("torch_shm_manager") is None


@pytest.mark.timeout(30)
def test_descendants_and_the_watched_tree(no_leaks: None) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    try:
        assert child.pid in descendants(os.getpid())
        with ProcessTree(interval=0.01) as tree:
            assert child.pid in tree.pids
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=10)
    # Still ours once it has exited: a leak is typically left by a worker that is gone.
    assert child.pid in tree.pids
    assert child.pid not in descendants(os.getpid())


@pytest.mark.timeout(60)
def test_the_check_counts_what_the_tree_left_and_nothing_else(no_leaks: None, token: str) -> None:
    before = shm_entries()
    noise = _maker("noise", token)
    try:
        ours = _maker("leave", token)
        # The tree of ``ours``: to it, ``noise`` (its sibling) is another program.
        tree = ProcessTree(root=ours.pid)
        tree.observe()
        _stop(ours)  # gone, its entries left behind
        time.sleep(0.1)  # a few more rounds of the other program's entries
        new = {name for name in shm_entries() - before if token in name}
        leaked = shm_leaks(before, tree.pids)
    finally:
        _stop(noise)
    left = sorted([f"torch_{ours.pid}_{token}_0", f"psm_{token}_{ours.pid}"])
    assert [name for name in leaked if token in name] == left
    # The other program's entries were there, new, of every kind the check tells apart: named
    # after a live process outside the tree, unnamed but mapped by such a process, and unnamed
    # and removed a moment later.
    others = new - set(left)
    assert any(name.startswith(f"torch_{noise.pid}_") for name in others)
    assert any(name.startswith(f"__KMP_REGISTERED_LIB_{noise.pid}_") for name in others)
    assert any(name.startswith(f"psm_{token}_held") for name in others)
    assert any(name.startswith(f"psm_{token}_t") for name in others)


_INNER = textwrap.dedent(
    '''
    import multiprocessing
    import os
    import time

    from tests.leaks import shm_entries

    TOKEN = os.environ["AIOLOAD_LEAK_TOKEN"]


    def wait_for_the_other_program():
        """Until the other program has made a new entry while this test runs."""
        seen = shm_entries()
        deadline = time.monotonic() + 20
        while not any(TOKEN in name for name in shm_entries() - seen):
            assert time.monotonic() < deadline, "the other program made nothing"
            time.sleep(0.01)


    def leave_a_torch_segment():
        fd = os.open(f"/dev/shm/torch_{os.getpid()}_{TOKEN}_leak", os.O_CREAT | os.O_RDWR)
        os.close(fd)
        time.sleep(0.2)  # as a worker does, it lives longer than the watcher's interval


    def test_clean(no_leaks):
        wait_for_the_other_program()


    def test_leaky(no_leaks):
        wait_for_the_other_program()
        worker = multiprocessing.get_context("fork").Process(target=leave_a_torch_segment)
        worker.start()
        worker.join()
        os.close(os.open(f"/dev/shm/psm_{TOKEN}_leak", os.O_CREAT | os.O_RDWR))
        wait_for_the_other_program()
    '''
)


@pytest.mark.timeout(120)
def test_no_leaks_fails_a_leaking_test_and_passes_a_clean_one(
    no_leaks: None, token: str, tmp_path: Path
) -> None:
    """The fixture itself, in a pytest run of its own, while another program (a sibling of
    that run, not its descendant) keeps making and removing entries."""
    (tmp_path / "test_inner.py").write_text(_INNER)
    noise = _maker("noise", token)
    try:
        run = subprocess.run(
            [
                *(sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest"),
                *("-p", "no:randomly", "-p", "no:asyncio", "-p", "no:cacheprovider", str(tmp_path)),
            ],
            cwd=ROOT,
            env={**os.environ, "AIOLOAD_LEAK_TOKEN": token},
            capture_output=True,
            text=True,
            timeout=100,
        )
    finally:
        _stop(noise)
    output = run.stdout + run.stderr
    # The leak check fails at the leaky test's teardown: an error of that test, the clean one
    # passing beside it.
    assert "2 passed, 1 error" in output, output
    assert re.search(r"ERROR \S*test_inner\.py::test_leaky\b", output), output
    listed = re.search(r"new /dev/shm entries left behind: (\[.*?\])", output)
    assert listed is not None, output
    leaked = ast.literal_eval(listed.group(1))
    assert len(leaked) == 2 and f"psm_{token}_leak" in leaked, leaked
    (torch_name,) = (name for name in leaked if name.startswith("torch_"))
    # Made by the inner test's forked worker, not by the other program.
    assert torch_name.endswith(f"_{token}_leak") and maker_pid(torch_name) != noise.pid
