"""Launch one measured run in a fresh subprocess and sample its process-tree RSS."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

SAMPLE_PERIOD_S = 0.05
_PKG_ROOT = str(Path(__file__).resolve().parents[1])  # directory containing ``aioload/``


@dataclass
class ChildOutcome:
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    peak_tree_rss_bytes: int = 0
    peak_main_rss_bytes: int = 0
    max_tree_procs: int = 0
    samples: int = 0
    wall_s: float = 0.0
    returncode: int | None = None
    error: str = ""
    leftover_procs: int = 0
    # Shared-memory segments torch's loader left in /dev/shm (removed after the run).
    torch_segments_removed: int = 0


def _tree_rss(proc: psutil.Process, pids: set[int]) -> tuple[int, int, int]:
    """(sum of RSS over proc and all descendants, RSS of proc, number of processes); the
    descendants' pids are added to ``pids``."""
    main = 0
    with contextlib.suppress(psutil.Error):
        main = int(proc.memory_info().rss)
    total, count = main, 1
    try:
        children = proc.children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        pids.add(child.pid)
        with contextlib.suppress(psutil.Error):
            total += int(child.memory_info().rss)
            count += 1
    return total, main, count


def remove_torch_segments(pids: set[int], shm_dir: Path = Path("/dev/shm")) -> int:
    """Remove the shared-memory segments that processes ``pids`` (a run's, all gone) left.

    torch's loader workers put each batch in a segment named ``torch_<pid>_...`` and unlink
    it once the parent has it; a worker stopped in between (torch's shutdown terminates
    workers still busy when the run stops mid-epoch) leaves it behind, 9 MiB for an image
    batch, until the machine reboots. Returns how many were removed."""
    removed = 0
    if not pids or not shm_dir.is_dir():
        return 0
    for entry in shm_dir.iterdir():
        parts = entry.name.split("_")
        if len(parts) < 3 or parts[0] != "torch" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid in pids and not psutil.pid_exists(pid):
            with contextlib.suppress(OSError):
                entry.unlink()
                removed += 1
    return removed


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes still in process group ``pgid`` (the child's session)."""
    found: list[psutil.Process] = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def _kill_group(pgid: int, grace_s: float) -> int:
    """Wait up to ``grace_s`` for the group to empty, then SIGKILL it; return survivors."""
    deadline = time.monotonic() + grace_s
    members = _group_members(pgid)
    while members and time.monotonic() < deadline:
        time.sleep(0.1)
        members = _group_members(pgid)
    if members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return len(members)


def run_child(
    args: list[str],
    timeout_s: float,
    env: dict[str, str] | None = None,
    module: str = "benchmarks._one",
) -> ChildOutcome:
    """Run ``python -m benchmarks._one ARGS`` (or ``module``) and return its JSON result and
    peak RSS.

    The child gets its own session/process group so that on timeout the whole tree
    (including loader workers) can be killed, and so that workers it leaks are detected.
    """
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PKG_ROOT, child_env.get("PYTHONPATH", "")) if p
    )
    out = ChildOutcome(ok=False)
    cmd = [sys.executable, "-m", module, *args]
    with tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, stdout=fout, stderr=ferr, env=child_env, start_new_session=True
        )
        pids = {proc.pid}
        try:
            ps = psutil.Process(proc.pid)
            timed_out = False
            while proc.poll() is None:
                tree, main, count = _tree_rss(ps, pids)
                out.peak_tree_rss_bytes = max(out.peak_tree_rss_bytes, tree)
                out.peak_main_rss_bytes = max(out.peak_main_rss_bytes, main)
                out.max_tree_procs = max(out.max_tree_procs, count)
                out.samples += 1
                if time.monotonic() - t0 > timeout_s:
                    timed_out = True
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
                    break
                time.sleep(SAMPLE_PERIOD_S)
        finally:
            if proc.poll() is None:  # e.g. KeyboardInterrupt in the parent
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            out.leftover_procs = _kill_group(proc.pid, grace_s=3.0)
            out.torch_segments_removed = remove_torch_segments(pids)
        out.wall_s = time.monotonic() - t0
        out.returncode = proc.returncode
        fout.seek(0)
        ferr.seek(0)
        stdout = fout.read().decode(errors="replace")
        stderr = ferr.read().decode(errors="replace")
    if timed_out:
        out.error = f"timed out after {timeout_s:.0f} s"
        return out
    if proc.returncode != 0:
        tail = stderr.strip().splitlines()[-6:]
        out.error = f"exit code {proc.returncode}: " + " | ".join(tail)
        return out
    lines = stdout.strip().splitlines()
    try:
        parsed = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        out.error = "no JSON result on stdout"
        return out
    out.result = parsed
    out.ok = True
    return out
