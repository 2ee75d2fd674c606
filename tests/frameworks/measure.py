"""Run one framework flow on 2 ranks and print what each rank saw: how many indices, how many
distinct across the ranks, and the time spent waiting for data.

    python -m tests.frameworks.measure accelerate|lightning|transformers
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from ._ranks import launch


def _summary(name: str, reports: list[dict[str, Any]]) -> None:
    for key in reports[0]:
        passes = [report[key] for report in reports]
        if not (isinstance(passes[0], dict) and "indices" in passes[0]):
            continue
        counts = [len(one["indices"]) for one in passes]
        distinct = len({i for one in passes for i in one["indices"]})
        print(f"{name}/{key}: indices per rank {counts}, total {sum(counts)}, distinct {distinct}")
        for rank, one in enumerate(passes):
            first = one.get("first_batch_s")
            first_text = "" if first is None else f"first batch {first:.3f} s, "
            print(
                f"  rank {rank}: {first_text}waited {one['wait_s']:.3f} s between batches, "
                f"steps {one['step_s']:.3f} s"
            )
    for key in reports[0]:
        if key.endswith("stats") and reports[0][key] is not None:
            for rank, report in enumerate(reports):
                stats = report[key]
                print(
                    f"  {key} rank {rank}: loader.stats() waiting {stats['waiting_s']:.3f} s, "
                    f"between {stats['between_s']:.3f} s, data-bound "
                    f"{stats['data_bound_pct']:.1f} %"
                )
        elif key.endswith("type"):
            print(f"  {key}: {reports[0][key]}")


if __name__ == "__main__":
    for flow in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as out:
            _summary(flow, launch(flow, Path(out), timeout=300))
