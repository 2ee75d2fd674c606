"""``make bench-gpu``: a training-like loop on a GPU, fed by aioload and by torch's DataLoader.

Each step runs a fixed GPU matmul load on the batch. Compared:

* aioload with ``device="cuda"`` (pinning and the host-to-device copy on aioload's own thread
  and stream);
* torch's DataLoader with ``pin_memory=True`` and ``.to("cuda", non_blocking=True)`` in the loop.

Reported: steps/s and the fraction of GPU time spent waiting for data, measured with CUDA events
on the consumer's stream: the gap between the end of one step's compute and the start of the
next one's, over the whole run. For torch the copy is issued in that gap on the same stream, so
it counts as waiting for data, as it does in a real training loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import aioload

from .workloads import ImageDataset


def _step_load(batch: torch.Tensor, weight: torch.Tensor, matmuls: int) -> torch.Tensor:
    x = batch.flatten(1)[:, : weight.shape[0]].float()
    for _ in range(matmuls):
        x = torch.tanh(x @ weight)
    return x.sum()


def _run(kind: str, samples: int, batch_size: int, workers: int, matmuls: int) -> dict[str, Any]:
    device = torch.device("cuda")
    weight = torch.randn(4096, 4096, device=device) / 64
    ds = ImageDataset(samples)
    loader: Any
    if kind == "aioload":
        loader = aioload.DataLoader(ds, batch_size=batch_size, num_workers=workers, device=device)
    else:
        loader = torch.utils.data.DataLoader(
            ds, batch_size=batch_size, num_workers=workers, pin_memory=True
        )
    stream = torch.cuda.current_stream(device)
    starts: list[torch.cuda.Event] = []
    ends: list[torch.cuda.Event] = []
    steps = 0
    it = iter(loader)
    first = next(it)
    del first
    torch.cuda.synchronize()
    wall = time.perf_counter()
    for batch in it:
        if kind == "torch":
            batch = batch.to(device, non_blocking=True)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(stream)
        _step_load(batch, weight, matmuls)
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(stream)
        starts.append(start)
        ends.append(end)
        steps += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    busy = sum(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    total = starts[0].elapsed_time(ends[-1])
    return {
        "loader": kind,
        "steps_per_s": steps / wall,
        "data_wait_fraction": max(0.0, 1.0 - busy / total),
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=6400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--matmuls", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench-gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
    rows: dict[str, list[dict[str, Any]]] = {"torch": [], "aioload": []}
    for _ in range(args.repeats):
        for kind in ("torch", "aioload"):
            rows[kind].append(_run(kind, args.samples, args.batch_size, args.workers, args.matmuls))
    summary = {
        kind: {
            "steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
            "data_wait_fraction": statistics.median(r["data_wait_fraction"] for r in runs),
        }
        for kind, runs in rows.items()
    }
    summary["device"] = {"name": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps(summary, indent=2))
    t, a = summary["torch"], summary["aioload"]
    print(
        f"steps/s  torch {t['steps_per_s']:.1f}  aioload {a['steps_per_s']:.1f}  "
        f"({a['steps_per_s'] / t['steps_per_s']:.2f}x)\n"
        f"data-wait fraction  torch {t['data_wait_fraction']:.3f}  "
        f"aioload {a['data_wait_fraction']:.3f}"
    )


if __name__ == "__main__":
    main()
