"""What ``seed_per_sample=True`` costs: ``python -m benchmarks.seeding``.

Two measurements, both printed as JSON (and written with ``--json PATH``):

* the seeding itself, per sample: deriving the sample's seed and seeding ``random``, torch and
  numpy, timed in this process over many samples (median of several rounds);
* end to end: samples/s of the same loader (2 workers) with and without ``seed_per_sample``
  on two datasets, one as cheap as a dataset gets (the worst case for any per-sample cost)
  and one with a small image augmentation, alternating runs, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

import aioload
from aioload._worker.fetch import _seed_all, sample_seed
from benchmarks import provenance


class Scalars(Dataset[torch.Tensor]):
    """One random scalar per sample: almost nothing but the per-sample overhead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(())


class Crops(Dataset[torch.Tensor]):
    """A random crop and flip of a 3x40x40 image to 3x32x32, as small augmentations are."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.image = torch.randint(0, 256, (3, 40, 40), dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        top, left = np.random.randint(0, 9, size=2)
        crop = self.image[:, top : top + 32, left : left + 32]
        if torch.rand(()) < 0.5:
            crop = crop.flip(-1)
        return crop.contiguous()


def seeding_cost_us(rounds: int = 5, per_round: int = 20_000) -> float:
    medians = []
    for _ in range(rounds):
        start = time.perf_counter()
        for index in range(per_round):
            _seed_all(sample_seed(1234, 0, index))
        medians.append((time.perf_counter() - start) / per_round * 1e6)
    return statistics.median(medians)


def loader_rate(dataset: Dataset[Any], seeded: bool, batch_size: int) -> float:
    loader = aioload.DataLoader(
        dataset, batch_size=batch_size, num_workers=2, seed_per_sample=seeded
    )
    iterator = iter(loader)
    next(iterator)  # worker start-up is not what is measured
    start = time.perf_counter()
    samples = sum(len(batch) for batch in iterator)
    return samples / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--notes", help="write the table into this page's seeding block")
    args = parser.parse_args()

    results: dict[str, Any] = {"seeding_us_per_sample": round(seeding_cost_us(), 2)}
    for name, dataset, batch_size in (
        ("scalars", Scalars(100_000), 256),
        ("crops", Crops(40_000), 64),
    ):
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.runs):
            for seeded in (False, True):  # alternating, so drift hits both alike
                rates[seeded].append(loader_rate(dataset, seeded, batch_size))
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        results[name] = {
            "samples_per_s_off": round(off),
            "samples_per_s_on": round(on),
            "on_over_off": round(on / off, 3),
            "runs": args.runs,
        }
    results["machine"] = {
        **provenance.machine(),
        "load_average": f"{os.getloadavg()[0]:.1f} at the end",
    }
    results["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    results["commit"] = provenance.commit()
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    if args.notes:
        write_notes(Path(args.notes), results)


NOTES_BEGIN = "<!-- seeding:begin (from docs/seeding.json) -->"
NOTES_END = "<!-- seeding:end -->"


def notes_block(results: dict[str, Any]) -> str:
    """The benchmark notes' table of a run, with where and when it ran, and the per-sample
    differences worked out from it."""
    machine = results.get("machine")
    where = "Machine, date and commit not recorded."
    if machine:
        where = f"{provenance.describe(machine)}; {results['date']}, commit `{results['commit']}`."
    lines = [
        NOTES_BEGIN,
        where,
        "",
        "| | samples/s without | with `seed_per_sample` | ratio |",
        "|---|---|---|---|",
        f"| seeding alone, per sample | | {results['seeding_us_per_sample']} µs | |",
    ]
    worked = []
    for name in ("scalars", "crops"):
        row = results[name]
        off, on = row["samples_per_s_off"], row["samples_per_s_on"]
        lines.append(f"| `{name}` | {off:,} | {on:,} | {row['on_over_off']:.2f}x |")
        worked.append(f"2/{on:,} - 2/{off:,} s = {(2 / on - 2 / off) * 1e6:.1f} µs on `{name}`")
    lines += ["", f"Per sample and worker, the runs' difference is {worked[0]} and {worked[1]}."]
    return "\n".join([*lines, NOTES_END])


def write_notes(path: Path, results: dict[str, Any]) -> None:
    text = path.read_text()
    head, rest = text.split(NOTES_BEGIN, 1)
    path.write_text(head + notes_block(results) + rest.split(NOTES_END, 1)[1])


if __name__ == "__main__":
    main()
