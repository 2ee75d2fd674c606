"""Benchmark harness comparing ``aioload.DataLoader`` with ``torch.utils.data.DataLoader``.

Run it as ``python -m benchmarks --help``.  Every measured run happens in a fresh
subprocess (:mod:`benchmarks._one`) so that peak-RSS numbers are fair and runs are
isolated from each other; the parent (:mod:`benchmarks.__main__`) alternates torch and
aioload runs and writes ``docs/benchmarks.{md,json,png}`` (:mod:`benchmarks.report`).

Debug switch: ``AIOLOAD_BENCH_FAKE=1`` makes the "aioload" side use torch's DataLoader
(wrapped in a trivial async adapter for the async modes).  It exists only to develop the
harness before ``aioload.DataLoader`` is importable; results produced with it are marked
``FAKE`` everywhere and must never be published.
"""

from __future__ import annotations

__all__: list[str] = []
