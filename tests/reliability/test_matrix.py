"""The failure matrix: every way a pass can fail or be stopped, each cell in a child process.

Each cell runs ``tests.reliability.cell`` in a process of its own with a hard timeout, forked
from ``tests.reliability.cell_server`` (which has made the imports once; the signalled cells
below run in a fresh interpreter); the child makes the failure happen, measures, checks for
leftovers itself and prints one JSON line, on which this module asserts:

* the error's type and message (worker id, pid, signal name or exit code, the worker's
  traceback), reported within 5 s (``REPORT_S``, scaled by ``AIOLOAD_TEST_TIME_SCALE``; the
  timeout case: within its timeout, give or take);
* afterwards no worker process (psutil), no descriptor growth, no new /dev/shm entry, no
  zombie, and no warning beyond torch's pin_memory one (ResourceWarnings are on);
* the same loader runs a whole, correct new epoch, where that makes sense.

The worker-death and user-code cases are crossed with sync and async iteration, persistent
workers on and off, and pin_memory on and off (on a machine with no accelerator, pin_memory
only warns; the cell is still run). Elsewhere the cross product is pruned to what can matter.
``sigint`` and ``parent-sigkill`` are signalled from here, as a user or the OOM killer would.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest

from aioload._backends import process
from tests.helpers import alive, wait_gone, within
from tests.leaks import ProcessTree, shm_entries, shm_leaks

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
# Hang guards, scaled for a slow machine (tests.helpers.within): a cell that runs longer than
# HARD_TIMEOUT_S hung; an error, a stop or the workers' exit later than REPORT_S is stuck.
HARD_TIMEOUT_S = within(30)
REPORT_S = within(5.0)
TIMEOUT_S = 0.5  # the loader timeout the ``timeout`` cell uses (cell.TIMEOUT_S)

DEATHS = {
    "sigkill": ("is killed by signal: Killed (SIGKILL).", -9),
    "segv": ("is killed by signal: Segmentation fault (SIGSEGV).", -11),
    "exit3": ("exited unexpectedly with exit code 3.", 3),
}
# case: (exception type, function it was raised in, source line, last line of the traceback,
# batches delivered before it)
PAIRS = [[i, i + 1] for i in range(0, 16, 2)]
STREAM = [[w + i, w + i + 2] for i in range(0, 16, 4) for w in (0, 1)]
SINGLES = [[i] for i in range(16)]
USER_ERRORS = {
    "getitem": (
        "CellError",
        "in __getitem__",
        'raise CellError(f"getitem-marker index {i}")',
        "tests.reliability.cell_datasets.CellError: getitem-marker index 7",
        PAIRS[:3],
    ),
    "iter": (
        "CellError",
        "in __iter__",
        'raise CellError(f"iter-marker worker {worker_id}")',
        "tests.reliability.cell_datasets.CellError: iter-marker worker 1",
        STREAM[:1],
    ),
    "collate": (
        "CellError",
        "in __call__",
        'raise CellError(f"collate-marker saw index {self.fail_at}")',
        "tests.reliability.cell_datasets.CellError: collate-marker saw index 7",
        PAIRS[:3],
    ),
    "init": (
        "CellError",
        "in __call__",
        'raise CellError(f"init-marker worker {worker_id}")',
        "tests.reliability.cell_datasets.CellError: init-marker worker 1",
        PAIRS[:1],
    ),
    "unpicklable-sample": (
        "TypeError",
        "in encode_batch",
        "pickler.dump(batch)",
        # The sample's index and type are named (on_sample_error's raise mode).
        "index 7 (_thread.lock): TypeError: cannot pickle '_thread.lock' object. Return "
        "picklable samples, or pass on_sample_error='skip' to skip them",
        SINGLES[:7],
    ),
}
FULL_EPOCH = {"iter": STREAM, "unpicklable-sample": SINGLES}
PIN_WARNING = (
    "UserWarning: 'pin_memory' argument is set as true but no accelerator is found, "
    "then device pinned memory won't be used."
)


class CellSpec(NamedTuple):
    case: str
    mode: str  # sync or async
    persistent: int | None = None  # None: not crossed (off)
    pin: int | None = None
    backend: str = "asyncio"

    @property
    def id(self) -> str:
        parts = [self.case, self.backend if self.case == "anyio-cancel" else self.mode]
        if self.persistent is not None:
            parts.append("persist" if self.persistent else "nopersist")
        if self.pin is not None:
            parts.append("pin" if self.pin else "nopin")
        return "-".join(parts)

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "tests.reliability.cell",
            self.case,
            f"--mode={self.mode}",
            f"--backend={self.backend}",
            f"--persistent={self.persistent or 0}",
            f"--pin={self.pin or 0}",
        ]


MODES = ("sync", "async")
BOOLS = (0, 1)


def _matrix() -> list[CellSpec]:
    cells = [
        CellSpec(case, mode, persistent, pin)
        for case in (*DEATHS, *USER_ERRORS, "shm-full")
        for mode in MODES
        for persistent in BOOLS
        for pin in BOOLS
    ]
    # No pin crossing: the failure comes before any batch, or pinning cannot change it.
    cells += [
        CellSpec(case, mode, persistent)
        for case in ("unpicklable-dataset", "timeout", "break", "del")
        for mode in MODES
        for persistent in BOOLS
    ]
    cells += [CellSpec("task-cancel", "async", persistent) for persistent in BOOLS]
    cells += [
        CellSpec("anyio-cancel", "async", persistent, backend=backend)
        for backend in ("asyncio", "trio")
        for persistent in BOOLS
    ]
    return cells


SIGNALLED = {
    # Persistent workers do not change what Ctrl-C does.
    "sigint": [CellSpec("sigint", mode, pin=pin) for mode in MODES for pin in BOOLS],
    "parent-sigkill": [
        CellSpec("parent-sigkill", mode, persistent) for mode in MODES for persistent in BOOLS
    ],
}


# -- running a cell --------------------------------------------------------------------------


def _result(stdout: str, stderr: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, (
        f"the cell printed no result.\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    assert "crash" not in result, result["crash"] + "\nstderr:\n" + stderr[-3000:]
    return result


class CellServer:
    """``tests.reliability.cell_server``: forks each cell from one interpreter that has made
    its imports (about 2 s a cell on the 2-core machine) once. A cell that runs past
    ``HARD_TIMEOUT_S`` is killed with its workers, and reported as hung."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.count = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.pending = b""

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.cell_server"],
                cwd=REPO,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            self.pending = b""
        return self.proc

    def _line(self, proc: subprocess.Popen[bytes], deadline: float) -> str | None:
        """The server's next line, or None if none came by ``deadline`` (or it exited)."""
        assert proc.stdout is not None
        while b"\n" not in self.pending:
            with selectors.DefaultSelector() as sel:
                sel.register(proc.stdout, selectors.EVENT_READ)
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    return None
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def run(self, args: list[str]) -> tuple[str, str]:
        """Run one cell; its stdout and stderr."""
        proc = self._start()
        assert proc.stdin is not None
        self.count += 1
        out, err = self.tmp / f"{self.count}.out", self.tmp / f"{self.count}.err"
        request = {"args": args, "out": str(out), "err": str(err)}
        pid: int | None = None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
            started = self._line(proc, time.monotonic() + HARD_TIMEOUT_S)
            assert started is not None and started.startswith("STARTED "), (
                f"the cell server did not start the cell: {started!r}"
            )
            pid = int(started.split()[1])
            if self._line(proc, time.monotonic() + HARD_TIMEOUT_S) is None:
                raise AssertionError(
                    f"the cell hung past {HARD_TIMEOUT_S} s\nstdout:\n"
                    f"{out.read_text()[-3000:]}\nstderr:\n{err.read_text()[-6000:]}"
                )
        except BaseException:
            # A hung cell, or the test's own timeout: stop the cell, its workers and the
            # server (the next cell starts a new one).
            self._abort(pid)
            raise
        return out.read_text(), err.read_text()

    def _abort(self, pid: int | None) -> None:
        tree: list[psutil.Process] = []
        if pid is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                cell = psutil.Process(pid)
                tree = [*cell.children(recursive=True), cell]
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        if self.proc is not None:
            self.proc.kill()
        psutil.wait_procs(tree, timeout=within(5))
        self.close()

    def close(self) -> None:
        if self.proc is None:
            return
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=within(10))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc = None


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CellServer]:
    server = CellServer(tmp_path_factory.mktemp("cells"))
    try:
        yield server
    finally:
        server.close()


def _run(cell: CellSpec, cells: CellServer) -> dict[str, Any]:
    return _result(*cells.run(cell.argv()[3:]))


class Problems:
    """Every check of a cell runs; the test then fails once, listing what went wrong."""

    def __init__(self, cell: CellSpec, result: dict[str, Any]) -> None:
        self.cell = cell
        self.result = result
        self.found: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.found.append(what)

    def close(self) -> None:
        summary = "\n".join(f"{k}: {json.dumps(v)[:1500]}" for k, v in self.result.items())
        if self.found:
            pytest.fail("\n".join([*self.found, "", "cell result:", summary]), pytrace=False)


# -- the checks ------------------------------------------------------------------------------


def _check_gone(p: Problems, after: dict[str, Any], what: str) -> None:
    """The pass's workers stopped, within REPORT_S, leaving nothing behind."""
    p.expect(
        after["left_without_gc"] == [],
        f"{what}: workers {after['left_without_gc']} outlived the pass until gc.collect() "
        "(the iterator is only reachable through a reference cycle)",
    )
    p.expect(after["children"] == [], f"{what}: worker processes left: {after['children']}")
    p.expect(after["gone_s"] < REPORT_S, f"{what}: workers took {after['gone_s']:.2f} s to stop")
    p.expect(after["fd_growth"] == 0, f"{what}: {after['fd_growth']} more descriptors")
    p.expect(after["shm_new"] == [], f"{what}: new /dev/shm entries {after['shm_new']}")


def _check_final(p: Problems) -> None:
    result, cell = p.result, p.cell
    final = result["final"]
    p.expect(final["children"] == [], f"at the end: worker processes left: {final['children']}")
    p.expect(final["zombies"] == [], f"at the end: zombies {final['zombies']}")
    p.expect(final["fd_growth"] == 0, f"at the end: {final['fd_growth']} more descriptors")
    p.expect(final["shm_new"] == [], f"at the end: new /dev/shm entries {final['shm_new']}")
    expected = {PIN_WARNING} if cell.pin and not result["accelerator"] else set()
    if cell.case == "unpicklable-dataset" and process._torch_warns_on_pickle_error():
        # torch's own warning, where the installed torch gives one (tests/conformance checks
        # that aioload's is the same as torch's).
        expected.add(f"UserWarning: {process._TORCH_PICKLE_WARNING}")
    p.expect(
        set(result["warnings"]) == expected,
        f"warnings: {result['warnings']}, expected {sorted(expected)}",
    )


def _check_epoch(
    p: Problems, key: str, expected: list[list[int]], same_workers: bool | None
) -> None:
    """``result[key]`` is a whole, correct epoch; ``same_workers``: served by the workers the
    first pass had (True), by new ones (False), or either (None)."""
    epoch = p.result[key]
    p.expect(epoch["error"] is None, f"{key} raised: {epoch['error']}")
    p.expect(epoch["values"] == expected, f"{key} batches: {epoch['values']} != {expected}")
    p.expect(epoch["contents_ok"], f"{key}: a batch holds values of another index")
    if p.cell.pin and p.result["accelerator"]:
        p.expect(epoch["all_pinned"], f"{key}: batches are not pinned")
    if same_workers is not None:
        first = p.result["first"]["workers"]
        p.expect(
            epoch["same_workers"] == same_workers,
            f"{key}: workers {epoch['workers']}, first pass {first}, expected "
            f"{'the same' if same_workers else 'new ones'}",
        )


def _check_death_or_user_error(p: Problems) -> None:
    cell, result = p.cell, p.result
    first, marker, error = result["first"], result["marker"], result["first"]["error"]
    assert error is not None, f"no error reached the consumer: {first}"
    assert marker is not None, "the failure never happened"
    p.expect(marker["worker_id"] == 1, f"the failure was in worker {marker['worker_id']}, not 1")
    p.expect(
        result["report_s"] < REPORT_S, f"reported {result['report_s']:.2f} s after the failure"
    )
    persistent_survives = cell.persistent and cell.case in USER_ERRORS
    if cell.case in DEATHS:
        tail, exitcode = DEATHS[cell.case]
        p.expect(error["type"] == "WorkerDiedError", f"type {error['type']}")
        p.expect(error["module"] == "aioload.errors", f"module {error['module']}")
        p.expect(error["is_runtime_error"], "not a RuntimeError")
        expected_message = f"DataLoader worker (pid {marker['pid']}) {tail}"
        p.expect(error["message"] == expected_message, f"message {error['message']!r}")
        p.expect(error["pid"] == marker["pid"], f".pid {error['pid']} != {marker['pid']}")
        p.expect(error["worker_id"] == marker["worker_id"], f".worker_id {error['worker_id']}")
        p.expect(error["exitcode"] == exitcode, f".exitcode {error['exitcode']}")
        # What came before the death is a prefix of the epoch, in order.
        got = first["values"]
        p.expect(got == PAIRS[: len(got)] and len(got) <= 3, f"batches before: {got}")
    else:
        type_name, where, source, last, before = USER_ERRORS[cell.case]
        wid = marker["worker_id"]
        p.expect(error["type"] == type_name, f"type {error['type']}, expected {type_name}")
        message = error["message"]
        header = (
            f"Caught {type_name} in DataLoader worker process {wid}.\n"
            "Original Traceback (most recent call last):\n"
        )
        p.expect(message.startswith(header), f"message head {message[:160]!r}")
        p.expect(where in message, f"{where!r} not in the traceback")
        p.expect(source in message, f"{source!r} not in the traceback")
        p.expect(message.rstrip("\n").endswith(last), f"message tail {message[-160:]!r}")
        p.expect(first["values"] == before, f"batches before: {first['values']} != {before}")
    p.expect(first["contents_ok"], "a batch before the error holds values of another index")

    after = result["after_error"]
    if persistent_survives:
        # An error in user code ends neither the epoch nor a persistent pool.
        p.expect(
            after["children"] == first["workers"],
            f"persistent workers {first['workers']} did not survive: {after['children']}",
        )
    else:
        _check_gone(p, after, "after the error")
    # Persistent workers that survived serve the new epoch, except after a failed
    # worker_init_fn: a worker that never initialised may as well be replaced.
    same: bool | None = bool(persistent_survives)
    if persistent_survives and cell.case == "init":
        same = None
    _check_epoch(p, "new_epoch", FULL_EPOCH.get(cell.case, PAIRS), same)


def _check_timeout(p: Problems) -> None:
    cell, result = p.cell, p.result
    first, marker, error = result["first"], result["marker"], result["first"]["error"]
    assert error is not None, f"no error reached the consumer: {first}"
    assert marker is not None, "the slow sample never started"
    p.expect(error["type"] == "DataLoaderTimeoutError", f"type {error['type']}")
    p.expect(error["is_runtime_error"], "not a RuntimeError")
    p.expect(error["timeout"] == TIMEOUT_S, f".timeout {error['timeout']}")
    expected_message = (
        f"DataLoader timed out after {TIMEOUT_S} seconds (waiting for batch 3 from DataLoader "
        f"worker 1, pid {marker['pid']}, holding indices [6, 7])"
    )
    p.expect(error["message"] == expected_message, f"message {error['message']!r}")
    waited = result["since_last_batch_s"]
    p.expect(TIMEOUT_S * 0.9 <= waited < TIMEOUT_S + 1.0, f"raised after waiting {waited:.2f} s")
    p.expect(first["values"] == PAIRS[:3], f"batches before: {first['values']}")
    after = result["after_error"]
    if cell.persistent:
        p.expect(after["children"] == first["workers"], f"persistent workers: {after}")
        # The loader must still run a new epoch (reliability.md), though worker 1 is still
        # stuck in the 30 s sample of the pass that timed out.
        _check_epoch(p, "new_epoch", PAIRS, None)
    else:
        # The hung worker is killed after the shutdown grace.
        _check_gone(p, after, "after the timeout")
        _check_epoch(p, "new_epoch", PAIRS, False)


def _check_unpicklable_dataset(p: Problems) -> None:
    result = p.result
    for key, elapsed in (("first", result["since_start_s"]), ("again", result["again_s"])):
        error = result[key]["error"]
        assert error is not None, f"{key}: no error: {result[key]}"
        p.expect(error["type"] == "TypeError", f"{key}: type {error['type']}")
        p.expect(
            "cannot pickle '_thread.lock' object" in error["message"],
            f"{key}: message {error['message']!r}",
        )
        p.expect(elapsed < REPORT_S, f"{key}: raised after {elapsed:.2f} s")
        p.expect(result[key]["values"] == [], f"{key}: batches {result[key]['values']}")
    _check_gone(p, result["after_error"], "after the error")


def _check_shm_full(p: Problems) -> None:
    result = p.result
    memfd = result["memfd"]
    p.expect(memfd["made"] >= 1, f"no slab was made at all: {memfd}")
    p.expect(memfd["denied"] >= 1, f"the shared-memory limit was never hit: {memfd}")
    _check_epoch(p, "first", PAIRS, None)
    p.expect(result["kept_intact"], "a kept batch was overwritten")
    _check_epoch(p, "new_epoch", PAIRS, bool(p.cell.persistent))


def _check_stop(p: Problems) -> None:
    cell, result = p.cell, p.result
    first = result["first"]
    got = first["values"]
    full = [[i, i + 1] for i in range(0, 24, 2)]
    p.expect(first["error"] is None, f"the pass raised {first['error']}")
    if cell.case in ("break", "del"):
        p.expect(got == full[:3], f"batches: {got}")
    else:
        p.expect(result["cancelled"], "the cancellation was not seen")
        p.expect(result["cancel_s"] < REPORT_S, f"cancelling took {result['cancel_s']:.2f} s")
        # task-cancel waits for 2 batches; the 0.3 s scope gets what it gets, never all 12.
        least = 2 if cell.case == "task-cancel" else 0
        p.expect(least <= len(got) < len(full) and got == full[: len(got)], f"batches: {got}")
    after = result["after_stop"]
    if cell.persistent:
        # Stopping a pass does not stop a persistent loader's workers.
        p.expect(after["children"] == first["workers"], f"persistent workers: {after}")
    else:
        _check_gone(p, after, f"after {cell.case}")
    _check_epoch(p, "new_epoch", full, bool(cell.persistent))


CHECKS = {
    **{case: _check_death_or_user_error for case in (*DEATHS, *USER_ERRORS)},
    "timeout": _check_timeout,
    "unpicklable-dataset": _check_unpicklable_dataset,
    "shm-full": _check_shm_full,
    "break": _check_stop,
    "del": _check_stop,
    "task-cancel": _check_stop,
    "anyio-cancel": _check_stop,
}


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id) for c in _matrix()])
def test_cell(cell: CellSpec, cells: CellServer) -> None:
    result = _run(cell, cells)
    p = Problems(cell, result)
    CHECKS[cell.case](p)
    _check_final(p)
    p.close()


# -- cells signalled from outside ------------------------------------------------------------


def _wait_ready(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The child's READY line, within the hard timeout."""
    assert proc.stdout is not None
    deadline = time.monotonic() + HARD_TIMEOUT_S
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=deadline - time.monotonic()):
                break
            line = proc.stdout.readline()
            if line.startswith("READY "):
                ready: dict[str, Any] = json.loads(line[len("READY ") :])
                return ready
            if not line:
                break  # the child exited
            if line.startswith("RESULT "):
                _result(line, "")  # a crash: report it
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(
        f"the cell never got ready\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    )


def _stop(proc: subprocess.Popen[str], workers: list[int]) -> None:
    """Leave nothing running if the test failed half way."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in alive(workers):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id) for c in SIGNALLED["sigint"]])
def test_sigint_in_consumer(cell: CellSpec) -> None:
    proc = subprocess.Popen(
        cell.argv(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    workers: list[int] = []
    try:
        workers = _wait_ready(proc)["workers"]
        time.sleep(0.1)  # well inside the epoch, waiting on slow samples
        sent_at = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=HARD_TIMEOUT_S)
    finally:
        _stop(proc, workers)
    result = _result(out, err)
    p = Problems(cell, result)
    p.expect(len(workers) == 2, f"workers when interrupted: {workers}")
    p.expect(result["interrupted"], "no KeyboardInterrupt reached the consumer")
    if result["interrupted"]:
        # CLOCK_MONOTONIC is one clock for every process on the machine.
        took = result["caught_at"] - sent_at
        p.expect(0 <= took < REPORT_S, f"KeyboardInterrupt arrived {took:.2f} s after SIGINT")
    got = result["first"]["values"]
    p.expect(len(got) >= 3 and got == [[i, i + 1] for i in range(0, 2 * len(got), 2)], f"{got}")
    _check_gone(p, result["after_error"], "after Ctrl-C")
    _check_epoch(p, "new_epoch", [[i, i + 1] for i in range(0, 400, 2)], False)
    _check_final(p)
    p.close()


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id) for c in SIGNALLED["parent-sigkill"]])
def test_parent_sigkill(cell: CellSpec) -> None:
    shm_before = shm_entries()
    proc = subprocess.Popen(
        cell.argv(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    workers: list[int] = []
    try:
        # The cell's process tree, watched until its workers are gone: only /dev/shm entries
        # it made count (the directory is the machine's; see tests/leaks.py).
        with ProcessTree(root=proc.pid) as tree:
            workers = _wait_ready(proc)["workers"]
            assert len(workers) == 2, workers
            children = psutil.Process(proc.pid).children(recursive=True)
            assert set(workers) <= {c.pid for c in children}
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=HARD_TIMEOUT_S)
            left = wait_gone(workers, timeout=5.0)
    finally:
        _stop(proc, workers)
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert left == [], f"workers {left} outlived their SIGKILLed parent by {REPORT_S:.0f} s"
    assert shm_leaks(shm_before, tree.pids | set(workers)) == [], "new /dev/shm entries"
