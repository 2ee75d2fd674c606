"""Where and when a benchmark ran, for the figures it publishes: the machine (cores, CPU,
Python, torch), the code's commit, and the words a page puts them in."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__.split("+")[0],
    }


def commit() -> str:
    """The checkout's short commit ("unknown" in a copy without .git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def describe(machine: dict[str, Any]) -> str:
    """ "16 cores (CPU), Python 3.12.3, torch 2.11.0", and the load average where recorded."""
    words = (
        f"{machine['cores']} cores ({machine['cpu']}), Python {machine['python']}, "
        f"torch {machine['torch']}"
    )
    if "load_average" in machine:
        words += f", load average {machine['load_average']}"
    return words
