"""The page docs/benchmarks.md, from a run's summary rows and metadata: its results tables
(throughput, other loaders, first batch, cost), targets, machine, workloads and method
(``report.write_all`` writes it with the sections other runs keep there)."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.report import (
    SummaryRow,
    _command,
    _mode_name,
    _peer_cell,
    _unmet,
    fmt_ips,
    fmt_mib,
    fmt_ms,
    fmt_pct,
    fmt_ratio,
    fmt_us,
    markdown_table,
    targets,
)
from benchmarks.workloads import WORKLOADS


def _fmt_pair(aio: str, torch: str) -> str:
    return f"{aio} / {torch}"


def results_tables(meta: dict[str, Any], rows: list[SummaryRow]) -> str:
    """The results, as four tables narrow enough for a page: throughput, other loaders, start-up
    and cost. aioload's figure comes first wherever two are paired."""
    return "\n".join(
        [
            *_throughput(rows),
            *_other_loaders(rows),
            *_first_batch(meta, rows),
            *_cost(rows),
        ]
    )


def _throughput(rows: list[SummaryRow]) -> list[str]:
    out: list[str] = []
    body = []
    for r in rows:
        body.append(
            [
                r.workload,
                _mode_name(r.mode),
                fmt_ips(r.aioload_ips) + fmt_pct(r.pct_floor(r.aioload_ips)),
                fmt_ips(r.torch_ips) + fmt_pct(r.pct_floor(r.torch_ips)),
                f"**{fmt_ratio(r.ratio)}**",
                f">= {r.target_ratio:g}x{_unmet(r.ratio_ok, r.ratio)}",
                fmt_ips(r.floor_ips),
            ]
        )
    out += [
        "### Throughput",
        "",
        "Items/s in steady state, and in brackets as a share of the workload's floor (no loader, "
        "see *Method*). torch's DataLoader always runs under `for`; each aioload mode is "
        "compared with those same runs.",
        "",
        markdown_table(
            [
                "workload",
                "aioload mode",
                "aioload items/s",
                "torch items/s",
                "aioload / torch",
                "target",
                "floor items/s",
            ],
            body,
        ),
        "",
    ]
    return out


def _other_loaders(rows: list[SummaryRow]) -> list[str]:
    """Other loaders (they run under `for`, on the map-style workloads)."""
    out: list[str] = []
    peers = list(dict.fromkeys(p for r in rows for p in [*r.peer_ips, *r.peers_absent]))
    sync_rows = [r for r in rows if r.mode == "sync" and any(p in r.peer_ips for p in peers)]
    if peers and sync_rows:
        out += [
            "### Other loaders",
            "",
            "The same workloads under `for`, items/s (share of the floor): "
            "`torchdata.nodes` and SPDL, next to aioload and torch's DataLoader. How each is "
            "configured, and why SPDL's figures are not those of its own pipelines, is under "
            "[Method](#method).",
            "",
            markdown_table(
                ["workload", "aioload", "torch", *peers],
                [
                    [
                        r.workload,
                        fmt_ips(r.aioload_ips) + fmt_pct(r.pct_floor(r.aioload_ips)),
                        fmt_ips(r.torch_ips) + fmt_pct(r.pct_floor(r.torch_ips)),
                        *(_peer_cell(r, p) for p in peers),
                    ]
                    for r in sync_rows
                ],
            ),
            "",
        ]
    return out


def _first_batch(meta: dict[str, Any], rows: list[SummaryRow]) -> list[str]:
    """Start-up: three ways of timing the first batch."""
    out: list[str] = []
    startup: dict[str, dict[str, float]] = meta.get("startup") or {}
    first_rows = [r for r in rows if r.mode == "sync"]
    body = []
    for r in first_rows:
        cell = startup.get(r.workload, {})
        fresh = _fmt_pair(
            fmt_ms(cell.get("aioload_first_s", math.nan)),
            fmt_ms(cell.get("torch_first_s", math.nan)),
        )
        later = _fmt_pair(
            fmt_ms(cell.get("aioload_later_s", math.nan)),
            fmt_ms(cell.get("torch_later_s", math.nan)),
        )
        in_run = _fmt_pair(fmt_ms(r.aioload_ttfb_s), fmt_ms(r.torch_ttfb_s))
        body.append([r.workload, fresh, later, in_run])
    out += [
        "### Time to the first batch",
        "",
        "aioload / torch, under `for`, medians. Three measurements:",
        "",
        "- **fresh process**: from just before `import aioload` (for torch, before `from "
        "torch.utils.data import DataLoader`; `import torch` comes before the clock for both) "
        "to the first batch, in a new Python process: what a script waits for.",
        "- **later epoch**: the first batch of the next pass over the same loader, without "
        "persistent workers (the workers start again).",
        "- **in the run**: from just before `DataLoader(...)` to the first batch, inside each "
        "throughput run above (imports done, workers started by the pass).",
        "",
        markdown_table(["workload", "fresh process", "later epoch", "in the run"], body),
        "",
    ]
    imports = meta.get("import")
    if imports:
        out += [
            f"`import aioload` after `import torch`: {imports['import_s'] * 1e3:.1f} ms; "
            f"with `aioload.DataLoader` in hand: {imports['loader_s'] * 1e3:.1f} ms (medians "
            "over fresh processes).",
            "",
        ]
    out += [
        "`python -m benchmarks.startup` holds the fresh-process figure against torch's at each "
        "worker count, under `for` and `async for`: it exits 1, with a FAIL line, when aioload's "
        "first batch is over 0.8x torch's (the median of each round's ratio; aioload and torch "
        "alternate, so each ratio is taken under the same load). `--max-ratio` moves the bound, "
        "`--max-ratio 0` only prints the ratios.",
        "",
    ]
    return out


def _cost(rows: list[SummaryRow]) -> list[str]:
    """Cost: the training process's CPU and the peak memory."""
    out: list[str] = []
    body = []
    for r in rows:
        rss = r.aioload_rss_bytes / r.torch_rss_bytes if r.torch_rss_bytes else math.nan
        notes = []
        if r.failures:
            notes.append(f"{r.failures} failed run(s)")
        if r.max_epochs > 1:
            notes.append(f"up to {r.max_epochs} epochs/run")
        body.append(
            [
                r.workload,
                _mode_name(r.mode),
                _fmt_pair(fmt_us(r.aioload_parent_cpu_s), fmt_us(r.torch_parent_cpu_s)),
                _fmt_pair(fmt_mib(r.aioload_rss_bytes), fmt_mib(r.torch_rss_bytes))
                + f" ({fmt_ratio(rss)})",
                "; ".join(notes),
            ]
        )
    out += [
        "### Cost",
        "",
        "aioload / torch: the training process's CPU time per batch (its own threads, not the "
        "workers'), and the peak resident memory of the whole process tree (workers included).",
        "",
        markdown_table(
            ["workload", "aioload mode", "CPU per batch", "peak RSS (ratio)", "notes"], body
        ),
        "",
    ]
    return out


def render_markdown(meta: dict[str, Any], rows: list[SummaryRow], png_name: str) -> str:
    """docs/benchmarks.md, down to its sections of other runs (kept by ``report.write_all``)."""
    return "\n".join(
        [
            *_head(meta),
            *_results(meta, rows, png_name),
            *_machine(meta),
            *_method(meta),
        ]
    )


def _head(meta: dict[str, Any]) -> list[str]:
    out: list[str] = ["# Benchmarks: aioload vs torch's `DataLoader`", ""]
    if meta["fake"]:
        out += [
            "> **FAKE RUN**: `AIOLOAD_BENCH_FAKE=1` was set, so the *aioload* column is "
            "actually torch's DataLoader. These numbers say nothing about aioload.",
            "",
        ]
    out += [
        "`make bench` writes this page, the JSON of every run (`benchmarks.json`), the plot, "
        "and the short table of ratios on the home page and in the README, all from one run. "
        "A run takes about 15 minutes. `python -m benchmarks --from-json docs/benchmarks.json` "
        "writes them again from a run's JSON.",
        "",
    ]
    sources = meta.get("sources")
    if sources:
        # Merged: each invocation measured some of the workloads.
        for source in sources:
            out += [
                f"{', '.join(source['workloads'])} ({source['date_utc']}, git "
                f"{source['git_rev']}):",
                "",
                "```",
                _command(source["command"]),
                "```",
                "",
            ]
    else:
        out += ["The run's command:", "", "```", _command(meta["command"]), "```", ""]
    return out


def _results(meta: dict[str, Any], rows: list[SummaryRow], png_name: str) -> list[str]:
    cfg = meta["config"]
    out = [
        "## Results",
        "",
        f"The tables down to *Method* are from one run: {meta['machine']['date_utc']}, "
        f"commit {meta['machine']['git_rev']}, {meta['machine']['usable_cores']} usable cores "
        f"({meta['machine']['cpu_model']}; see [Machine](#machine)); the sections after it come "
        f"from runs of their own. Medians over {cfg['repeats']} repeats; every run is a fresh "
        "process, and the runs of the loaders alternate.",
        "",
        # A link to the plot itself: on a phone the plot is shown at a third of its width, too
        # small to read, and a tap opens it at full size.
        f"[![aioload's items/s over torch's, for each workload and mode, on a log scale]"
        f"({png_name})]({png_name})",
        "",
        results_tables(meta, rows),
    ]
    found = targets(rows, meta.get("startup") or {}, meta.get("import"))
    if found:
        out += [
            "## Targets",
            "",
            "What the benchmark expects of aioload on this machine, with 2 workers; medians "
            "of alternating runs. These are benchmark targets, not timed tests. Where the "
            "figures come from is in [Benchmark notes](benchmark-notes.md).",
            "",
            markdown_table(
                ["target", "measured", "met"],
                [
                    [t.name, t.figure, "yes" if t.ok else ("n/a" if t.ok is None else "**no**")]
                    for t in found
                ],
            ),
            "",
        ]
    if meta.get("peers_absent"):
        out += [
            "Loaders not measured: "
            + "; ".join(f"{k}: {v}" for k, v in meta["peers_absent"].items()),
            "",
        ]
    return out


def _machine(meta: dict[str, Any]) -> list[str]:
    m = meta["machine"]
    cfg = meta["config"]
    out = [
        "## Machine",
        "",
        "| part | this run |",
        "|---|---|",
        f"| CPU | {m['cpu_model']} |",
        f"| cores | {m['logical_cores']} logical ({m['physical_cores']} physical, "
        f"{m['usable_cores']} usable) |",
        f"| RAM | {m['ram_bytes'] / 2**30:.1f} GiB |",
        f"| OS | {m['platform']} |",
        f"| Python | {m['python']} |",
        f"| torch | {m['torch']} |",
        f"| aioload | {m['aioload']} (git {m['git_rev']}) |",
        f"| uvloop | {m['uvloop']} |",
        f"| date | {m['date_utc']} |",
        "",
        "## Workloads",
        "",
        "| workload | samples | batch | workers | what it measures |",
        "|---|---|---|---|---|",
    ]
    for name in cfg["workloads"]:
        w = WORKLOADS[name]
        out.append(
            f"| {name} | {cfg['sizes'][name]:,} | {w.batch_size} | {w.num_workers} "
            f"| {w.description} |"
        )
    return out


def _method(meta: dict[str, Any]) -> list[str]:
    cfg = meta["config"]
    return [
        "",
        f"`cpu` burns {cfg['cpu_iters']:,} iterations of a pure-Python loop per sample "
        "(calibrated once to ~1 ms, identical for both loaders).",
        "",
        "## Method",
        "",
        "- **items/s**: items received after the first batch / time from first to last batch "
        f"arrival (steady state). A run stops once its steady state has lasted "
        f"{cfg['min_seconds']:g} s, mid-epoch (each epoch is longer); a further epoch is only "
        "added where one is shorter (see *notes*).",
        "- **floor**: no loader: `num_workers` processes that only make the samples (the same "
        "dataset, the async one with the same concurrency where aioload reads that) and "
        "`torch.stack` them into a reused shared-memory buffer (`benchmarks/floor.py`). "
        "*% floor* is a loader's items/s over the floor's, from the same invocation.",
        "- Each batch is touched (at most 8 elements are read) and released before the "
        "next one is requested.",
        "- **time to the first batch**: the three measurements are described above the table. "
        "The fresh-process one runs `benchmarks/_first_batch.py` by path, so nothing of aioload "
        "is imported earlier; bytecode caches are on for both loaders (aioload is compiled "
        "first).",
        f"- **peak RSS**: max over samples every {cfg['sample_ms']:g} ms of the summed RSS of "
        "the run's process and all its descendants (workers); `ru_maxrss` of the main "
        "process is in `benchmarks.json`. Shared pages are counted once per process for "
        "both loaders alike.",
        "- **CPU per batch**: CPU time of the training process (all its threads, not the "
        "workers) from the first to the last batch, per batch.",
        "- **other loaders**: `torchdata.nodes` (sampler -> `Batcher` -> process "
        "`ParallelMapper` that fetches and collates -> `Loader`) and SPDL, from the `bench` "
        "extra. Their failed runs are counted in their cells and left out of their medians.",
        "- **SPDL's configuration**: `spdl.dataloader.get_pytorch_dataloader(dataset, "
        "batch_size=B, num_workers=2)`, its other arguments at their defaults "
        "(`prefetch_factor=2`, `in_order=False`): SPDL's loader for an existing map-style "
        "torch `Dataset`. It fetches and collates in a process pool, and each batch comes back "
        "through the pool's result queue, pickled (SPDL 0.8.0's source). SPDL's published "
        "gains over torch's DataLoader come from its thread-based `Pipeline`, with stages that "
        "release the GIL, such as its own media decoders (its pages *Why migrate to SPDL?* and "
        "*Building High-Performance DataLoaders*), which restructure a dataset into I/O and "
        "CPU stages. These workloads are torch `Dataset`s as a DataLoader user has them; "
        "rewritten as SPDL pipelines they would be other programs. So SPDL runs here in its "
        "drop-in form, and its figures are not those of its pipelines.",
        "- `latency` and `http`: torch reads the synchronous version of the dataset, aioload "
        "the async one (`async def __getitem__`) with the workload's `worker_concurrency`; see "
        "[Async datasets](async-datasets.md).",
        "",
        "Raw per-run numbers: `benchmarks.json`.",
        "",
    ]
