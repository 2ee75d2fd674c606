"""A process that makes /dev/shm entries, for the tests of the leak check (tests/leaks.py).

    python -m tests.scripts.shm_maker leave TOKEN
    python -m tests.scripts.shm_maker noise TOKEN

``leave`` makes a torch-named segment (``torch_<pid>_<TOKEN>_0``) and an unnamed one
(``psm_<TOKEN>_<pid>``), prints ``ready``, and exits when its stdin closes, leaving both behind:
a leak.

``noise`` is another program at work on the machine: every ``_ROUND_S`` it makes a torch-named
segment and an OpenMP registration named after its own pid, and an unnamed segment that it
keeps mapped; it removes them ``_KEPT_S`` later. It also makes an unnamed segment that it
removes ``_TRANSIENT_S`` later. It prints ``ready`` after its first round and stops,
removing what it still has, when its stdin closes (so it never outlives the test).

Every name carries TOKEN, so that the test can remove whatever is left.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import sys
import time
from collections import deque

_ROUND_S = 0.1
# Longer than the leak check waits for an unnamed entry to go: the check must tell the kept
# mapped ones by their holder.
_KEPT_S = 3.0
_TRANSIENT_S = 0.2


def _make(name: str, size: int = 0) -> int:
    # What shm_open(3) does on Linux: a file in /dev/shm.
    fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    if size:
        os.ftruncate(fd, size)
    return fd


def _remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")


def _stdin_closed(timeout: float) -> bool:
    readable, _, _ = select.select([sys.stdin], [], [], timeout)
    return bool(readable) and not sys.stdin.buffer.read1(1)


def leave(token: str) -> None:
    pid = os.getpid()
    for name in (f"torch_{pid}_{token}_0", f"psm_{token}_{pid}"):
        os.close(_make(name))
    print("ready", flush=True)
    while not _stdin_closed(1.0):
        pass


def noise(token: str) -> None:
    pid = os.getpid()
    # (when to remove, names, mapping): kept ones, then the transient ones.
    kept: deque[tuple[float, list[str], mmap.mmap]] = deque()
    transient: deque[tuple[float, str]] = deque()
    round_ = 0
    try:
        while True:
            names = [
                f"torch_{pid}_{token}_{round_}",
                f"__KMP_REGISTERED_LIB_{pid}_{round_}_{token}",
                f"psm_{token}_held{round_}",
            ]
            for name in names[:2]:
                os.close(_make(name))
            # Mapped, its descriptor closed, as a segment in use usually is.
            fd = _make(names[2], mmap.PAGESIZE)
            mapping = mmap.mmap(fd, mmap.PAGESIZE)
            os.close(fd)
            now = time.monotonic()
            kept.append((now + _KEPT_S, names, mapping))
            name = f"psm_{token}_t{round_}"
            os.close(_make(name))
            transient.append((now + _TRANSIENT_S, name))
            while kept and kept[0][0] <= now:
                _, old, old_mapping = kept.popleft()
                old_mapping.close()
                for name in old:
                    _remove(name)
            while transient and transient[0][0] <= now:
                _remove(transient.popleft()[1])
            if round_ == 0:
                print("ready", flush=True)
            round_ += 1
            if _stdin_closed(_ROUND_S):
                return
    finally:
        for _, names, mapping in kept:
            mapping.close()
            for name in names:
                _remove(name)
        for _, name in transient:
            _remove(name)


if __name__ == "__main__":
    mode, token = sys.argv[1], sys.argv[2]
    {"leave": leave, "noise": noise}[mode](token)
