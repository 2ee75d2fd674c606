"""The /dev/shm part of the ``no_leaks`` fixture: entries that this process tree made and left.

/dev/shm belongs to the whole machine: another test run, or any program using torch's shared
memory, adds and removes entries there while a test runs. So the check does not compare the
whole listing; it asks who made each new entry.

- aioload's own slabs are memfds: they never have a name in /dev/shm, so nothing aioload itself
  makes can show here. What can show from a test is what torch makes (in a worker's batch, in
  torch's own DataLoader that the conformance tests compare with) and what libraries loaded
  into its processes make.
- Most such names carry the pid of the process that made them: torch's shared memory is
  ``torch_<pid>_<random>_<counter>`` (kept under the file_system sharing strategy; under the
  default file_descriptor one the name is unlinked as soon as it is mapped, so another
  program's shows for an instant), and an OpenMP runtime registers itself as
  ``__KMP_REGISTERED_LIB_<pid>[_<uid>]``. Such an entry is ours when that pid is this process
  or one of its descendants. Descendants are mostly gone by the time the check runs (a leak is
  typically left by a worker that has exited), so ``ProcessTree`` watches the tree while the
  test runs and remembers every pid it saw.
- A name without a pid (``psm_*`` from multiprocessing.shared_memory, anything else) is counted
  as ours unless it disappears within a short wait (its maker was about to remove it) or a live
  process outside this tree has it open or mapped.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterable
from types import TracebackType

SHM_DIR = "/dev/shm"

# Names that start with the pid of the process that made them.
_PID_NAMED = re.compile(r"(?:torch_|__KMP_REGISTERED_LIB_)(\d+)")


def shm_entries(root: str = SHM_DIR) -> set[str]:
    try:
        return set(os.listdir(root))
    except FileNotFoundError:
        return set()


def maker_pid(name: str) -> int | None:
    """The pid a /dev/shm name says made it, or None when the name carries none."""
    match = _PID_NAMED.match(name)
    return int(match.group(1)) if match else None


def descendants(pid: int) -> set[int]:
    """The live descendants of ``pid``. Read from /proc/<pid>/task/<tid>/children, so it costs a
    few small reads per process of the tree, not a scan of every process on the machine."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue  # gone meanwhile
        for tid in threads:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as children:
                    pids = [int(p) for p in children.read().split()]
            except OSError:
                continue
            for child in pids:
                if child not in found:
                    found.add(child)
                    frontier.append(child)
    return found


class ProcessTree:
    """This process (or ``root``) and every descendant seen while the tree is watched
    (``with``): a thread looks every ``interval`` seconds, so a worker that has exited by the
    time the check runs still counts as ours. A process that lives less than ``interval`` may
    be missed; its pid-named entries are then taken for another program's. ``observe`` looks
    once, now."""

    def __init__(self, interval: float = 0.02, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.pids = {self.root}
        self.interval = interval
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def observe(self) -> None:
        self.pids |= descendants(self.root)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self.observe()

    def start(self) -> ProcessTree:
        """Watch from now on (again, after ``stop``: the pids seen so far are kept)."""
        self.observe()
        self._stop.clear()
        self._watcher = threading.Thread(target=self._watch, name="no_leaks-tree", daemon=True)
        self._watcher.start()
        return self

    def stop(self) -> None:
        # Joined before the caller counts descriptors: the watcher opens /proc files.
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        self.observe()

    def __enter__(self) -> ProcessTree:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def holders(paths: Iterable[str], besides: set[int]) -> set[str]:
    """Which of ``paths`` a live process not in ``besides`` has open or mapped (as far as
    /proc lets us read: another user's processes may not be readable)."""
    wanted = set(paths)
    held: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in besides:
            continue
        with contextlib.suppress(OSError), open(f"/proc/{entry}/maps") as maps:
            for line in maps:
                # "... /dev/shm/name" or "... /dev/shm/name (deleted)"
                path = line.rstrip("\n").removesuffix(" (deleted)").split(" ")[-1]
                if path in wanted:
                    held.add(path)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    path = os.readlink(f"/proc/{entry}/fd/{fd}")
                    if path in wanted:
                        held.add(path)
    return held


def shm_leaks(
    before: set[str], tree: set[int], root: str = SHM_DIR, settle_s: float = 1.0
) -> list[str]:
    """The entries of ``root`` that are new since ``before`` and that the processes ``tree``
    made (see the module's docstring for how that is told), sorted."""
    leaked: list[str] = []
    unnamed: list[str] = []
    for name in sorted(shm_entries(root) - before):
        pid = maker_pid(name)
        if pid is None:
            unnamed.append(name)
        elif pid in tree:
            leaked.append(name)
    deadline = time.monotonic() + settle_s
    while True:
        unnamed = [name for name in unnamed if os.path.lexists(os.path.join(root, name))]
        if not unnamed or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    if unnamed:
        others = holders((os.path.join(root, name) for name in unnamed), besides=tree)
        leaked += [name for name in unnamed if os.path.join(root, name) not in others]
    # A pid-named entry that is gone by now was removed by its maker: nobody's leak.
    return sorted(name for name in leaked if os.path.lexists(os.path.join(root, name)))


def worker_threads(wait: float = 0.0) -> list[threading.Thread]:
    """aioload's worker threads (``worker_method="thread"``) still alive after up to ``wait``
    seconds: the thread workers' counterpart of a loader's child processes."""
    deadline = time.monotonic() + wait
    while True:
        alive = [t for t in threading.enumerate() if t.name.startswith("aioload-worker-")]
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            return alive
        alive[0].join(min(left, 0.05))
