"""A fork in user code while a pass runs: the parent makes a loader, takes one batch, and forks.

Usage: python forked.py CASE PERSISTENT, with CASE

- ``exit``: the child exits at once, normally (its exit handlers run);
- ``same``: the child asks the parent's iterator for a batch;
- ``new``: the child runs a pass of its own over the same loader;
- ``inside``: no fork in the parent; the dataset forks inside a worker, and the copy returns
  into the worker's loop (it does not end with ``os._exit()``);

and PERSISTENT ``0`` or ``1``. Prints one line, ``RESULT {json}``: what the child saw, and the
batches the parent's pass then yielded (it must be whole, its workers untouched).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch.utils.data import Dataset

import aioload
from tests.scripts.datasets import Squares


class ForksInside(Dataset[torch.Tensor]):
    """``[i, i*i]``; index 3 forks, and the copy returns a sample of its own: ``[3, -1]``."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 3:
            pid = os.fork()
            if pid == 0:
                return torch.tensor([i, -1])
            os.waitpid(pid, 0)
        return torch.tensor([i, i * i])


def child(case: str, loader: Any, it: Any, out: int) -> None:
    seen: dict[str, Any] = {}
    try:
        if case == "same":
            next(it)
        elif case == "new":
            seen["batches"] = [b[:, 0].tolist() for b in loader]
    except Exception as exc:
        seen["error"] = f"{type(exc).__name__}: {exc}"
    os.write(out, json.dumps(seen).encode())
    sys.exit(0)  # a normal exit: atexit handlers, finalizers


def main(case: str, persistent: bool) -> None:
    if case == "inside":
        loader = aioload.DataLoader(ForksInside(), batch_size=1, num_workers=2)
        batches = [b[0].tolist() for b in loader]
        print("RESULT " + json.dumps({"parent": batches}), flush=True)
        return
    loader = aioload.DataLoader(
        Squares(40), batch_size=2, num_workers=2, persistent_workers=persistent
    )
    it = iter(loader)
    first = next(it)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child(case, loader, it, w)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r) as pipe:
        seen = json.loads(pipe.read() or "{}")
    batches = [first[:, 0].tolist()] + [b[:, 0].tolist() for b in it]
    result = {"child": seen, "child_status": status, "parent": batches}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1")
