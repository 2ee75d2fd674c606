"""Summaries, machine description and the docs/benchmarks.{md,json,png} writers."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from aioload.bench.workloads import WORKLOADS

TTFB_TARGET = 1.0
"""aioload TTFB must be no worse than torch's (ratio of medians <= 1.0)."""
RSS_TARGET = 1.2
"""aioload peak RSS (process tree) must be within 1.2x of torch's."""


@dataclass
class SummaryRow:
    workload: str
    mode: str
    torch_ips: float
    aioload_ips: float
    ratio: float
    target_ratio: float
    torch_ttfb_s: float
    aioload_ttfb_s: float
    torch_rss_bytes: float
    aioload_rss_bytes: float
    torch_runs: int
    aioload_runs: int
    failures: int
    max_epochs: int

    @property
    def ratio_ok(self) -> bool:
        return self.ratio >= self.target_ratio

    @property
    def ttfb_ok(self) -> bool:
        return self.aioload_ttfb_s <= TTFB_TARGET * self.torch_ttfb_s

    @property
    def rss_ok(self) -> bool:
        return self.aioload_rss_bytes <= RSS_TARGET * self.torch_rss_bytes


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(
    runs: list[dict[str, Any]], workloads: list[str], modes: list[str]
) -> list[SummaryRow]:
    """One row per (workload, aioload mode); the torch side is always its sync runs."""
    rows: list[SummaryRow] = []
    for w in workloads:
        torch_runs = [r for r in runs if r["workload"] == w and r["loader"] == "torch" and r["ok"]]
        for mode in modes:
            aio_all = [
                r
                for r in runs
                if r["workload"] == w and r["loader"] == "aioload" and r["mode"] == mode
            ]
            aio = [r for r in aio_all if r["ok"]]
            failures = (
                len(aio_all)
                - len(aio)
                + sum(
                    1
                    for r in runs
                    if r["workload"] == w
                    and r["loader"] == "torch"
                    and r["pair_mode"] == mode
                    and not r["ok"]
                )
            )
            t_ips = _median([r["items_per_s"] for r in torch_runs])
            a_ips = _median([r["items_per_s"] for r in aio])
            rows.append(
                SummaryRow(
                    workload=w,
                    mode=mode,
                    torch_ips=t_ips,
                    aioload_ips=a_ips,
                    ratio=a_ips / t_ips if t_ips > 0 else math.nan,
                    target_ratio=WORKLOADS[w].target_ratio,
                    torch_ttfb_s=_median([r["ttfb_s"] for r in torch_runs]),
                    aioload_ttfb_s=_median([r["ttfb_s"] for r in aio]),
                    torch_rss_bytes=_median([r["peak_tree_rss_bytes"] for r in torch_runs]),
                    aioload_rss_bytes=_median([r["peak_tree_rss_bytes"] for r in aio]),
                    torch_runs=len(torch_runs),
                    aioload_runs=len(aio),
                    failures=failures,
                    max_epochs=max([r["epochs"] for r in torch_runs + aio], default=0),
                )
            )
    return rows


# ---------------------------------------------------------------- formatting helpers


def fmt_ips(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:,.0f}"


def fmt_ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v * 1e3:.0f} ms"


def fmt_mib(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v / 2**20:,.0f} MiB"


def fmt_ratio(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.2f}x"


def _mark(ok: bool, v: float) -> str:
    return "?" if math.isnan(v) else ("PASS" if ok else "FAIL")


def table_rows(rows: list[SummaryRow]) -> tuple[list[str], list[list[str]]]:
    header = [
        "workload",
        "mode",
        "torch items/s",
        "aioload items/s",
        "ratio",
        "target",
        "TTFB torch / aioload",
        "peak RSS torch / aioload",
        "notes",
    ]
    body: list[list[str]] = []
    for r in rows:
        notes = []
        if r.failures:
            notes.append(f"{r.failures} failed run(s)")
        if r.max_epochs > 1:
            notes.append(f"up to {r.max_epochs} epochs/run")
        rss_ratio = r.aioload_rss_bytes / r.torch_rss_bytes if r.torch_rss_bytes else math.nan
        body.append(
            [
                r.workload,
                r.mode,
                fmt_ips(r.torch_ips),
                fmt_ips(r.aioload_ips),
                fmt_ratio(r.ratio),
                f">= {r.target_ratio:g}x {_mark(r.ratio_ok, r.ratio)}",
                f"{fmt_ms(r.torch_ttfb_s)} / {fmt_ms(r.aioload_ttfb_s)} "
                f"{_mark(r.ttfb_ok, r.aioload_ttfb_s)}",
                f"{fmt_mib(r.torch_rss_bytes)} / {fmt_mib(r.aioload_rss_bytes)} "
                f"({fmt_ratio(rss_ratio)}) {_mark(r.rss_ok, rss_ratio)}",
                "; ".join(notes),
            ]
        )
    return header, body


def text_table(header: list[str], body: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(row[i]) for row in body)) if body else len(h)
        for i, h in enumerate(header)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(line.rstrip() for line in lines)


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


# ---------------------------------------------------------------- machine description


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_rev() -> str:
    try:
        res = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return res.stdout.strip() if res.returncode == 0 else "unknown"


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception:  # an unimportable package is reported, not fatal
        return "not importable"
    return str(getattr(mod, "__version__", "unknown"))


def machine_info() -> dict[str, Any]:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": affinity,
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "aioload": _version("aioload"),
        "uvloop": _version("uvloop"),
        "numpy": _version("numpy"),
        "git_rev": _git_rev(),
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


# ---------------------------------------------------------------- writers


def write_json(
    path: Path, meta: dict[str, Any], rows: list[SummaryRow], runs: list[dict[str, Any]]
) -> None:
    payload = {"meta": meta, "summary": [asdict(r) for r in rows], "runs": runs}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def write_png(path: Path, rows: list[SummaryRow], fake: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in rows))
    modes = list(dict.fromkeys(r.mode for r in rows))
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(workloads)), 4.2), dpi=120)
    for mi, mode in enumerate(modes):
        xs: list[float] = []
        ys: list[float] = []
        for wi, w in enumerate(workloads):
            row = next((r for r in rows if r.workload == w and r.mode == mode), None)
            if row is None or math.isnan(row.ratio):
                continue
            xs.append(wi - 0.4 + width * (mi + 0.5))
            ys.append(row.ratio)
        bars = ax.bar(xs, ys, width=width * 0.95, label=mode)
        ax.bar_label(bars, labels=[f"{y:.2f}x" for y in ys], fontsize=8, padding=2)
    for wi, w in enumerate(workloads):
        target = WORKLOADS[w].target_ratio
        ax.hlines(
            target,
            wi - 0.45,
            wi + 0.45,
            colors="tab:red",
            linestyles="dashed",
            linewidth=1.2,
            label="target" if wi == 0 else "_nolegend_",
        )
    ax.axhline(1.0, color="black", linewidth=1.0)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("aioload / torch items/s (median)")
    title = "aioload vs torch.utils.data.DataLoader, steady-state throughput"
    ax.set_title(("[FAKE aioload] " if fake else "") + title, fontsize=10)
    ax.legend(fontsize=8)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def render_markdown(meta: dict[str, Any], rows: list[SummaryRow], png_name: str) -> str:
    m = meta["machine"]
    cfg = meta["config"]
    header, body = table_rows(rows)
    out: list[str] = ["# Benchmarks: aioload vs `torch.utils.data.DataLoader`", ""]
    if meta["fake"]:
        out += [
            "> **FAKE RUN**: `AIOLOAD_BENCH_FAKE=1` was set, so the *aioload* column is "
            "actually torch's DataLoader. These numbers say nothing about aioload.",
            "",
        ]
    out += [
        "Generated by the benchmark harness (`aioload/bench/`); do not edit by hand.",
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
                source["command"],
                "```",
                "",
            ]
    else:
        out += ["```", meta["command"], "```", ""]
    out += [
        "## Machine",
        "",
        "| | |",
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
        "## Results",
        "",
        f"Medians over {cfg['repeats']} repeat(s); every run is a fresh subprocess, and runs "
        "alternate torch / aioload. The `async-*` rows are aioload under `async for` and are "
        "compared with the same torch (sync) runs.",
        "",
        markdown_table(header, body),
        "",
        f"![aioload/torch throughput ratio]({png_name})",
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
    out += [
        "",
        f"`cpu` burns {cfg['cpu_iters']:,} iterations of a pure-Python loop per sample "
        "(calibrated once to ~1 ms, identical for both loaders).",
        "",
        "## Method and targets",
        "",
        "- **items/s**: items received after the first batch / time from first to last batch "
        "arrival (steady state). One epoch per run; a further epoch is only added when the "
        f"first one is shorter than {cfg['min_seconds']:g} s (see *notes*).",
        "- **TTFB**: from just before `DataLoader(...)` is constructed (so eager work in the "
        "constructor counts) until the first batch is received, including worker start-up.",
        f"- **peak RSS**: max over samples every {cfg['sample_ms']:g} ms of the summed RSS of "
        "the run's process and all its descendants (workers); `ru_maxrss` of the main "
        "process is in `benchmarks.json`. Shared pages are counted once per process for "
        "both loaders alike.",
        "- Each batch is touched (at most 8 elements are read) and released before the "
        "next one is requested.",
        "- Targets: throughput ratio "
        + ", ".join(f"{w} >= {WORKLOADS[w].target_ratio:g}x" for w in cfg["workloads"])
        + f"; aioload TTFB <= {TTFB_TARGET:g}x torch; aioload peak RSS <= {RSS_TARGET:g}x "
        "torch.",
        "- `latency` and `http`: torch reads the synchronous version of the dataset, aioload "
        "the async one (`async def __getitem__`) with the workload's `worker_concurrency`; see "
        "`docs/async-datasets.md`.",
        "",
        "Raw per-run numbers: `benchmarks.json`.",
        "",
    ]
    return "\n".join(out)


def _source(meta: dict[str, Any]) -> dict[str, Any]:
    """Which invocation produced which workloads' numbers."""
    return {
        "command": meta["command"],
        "workloads": list(meta["config"]["workloads"]),
        "date_utc": meta["machine"]["date_utc"],
        "git_rev": meta["machine"]["git_rev"],
    }


def merge_previous(
    path: Path, meta: dict[str, Any], rows: list[SummaryRow], runs: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[SummaryRow], list[dict[str, Any]]]:
    """Keep the results of workloads this run did not measure from the existing
    ``benchmarks.json``, so that running one workload does not erase the others' numbers.
    A fake run and a real one are never mixed."""
    try:
        previous = json.loads(path.read_text())
        old_meta: dict[str, Any] = previous["meta"]
        old_rows = [SummaryRow(**row) for row in previous["summary"]]
        old_runs: list[dict[str, Any]] = previous["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        return meta, rows, runs
    if bool(old_meta.get("fake")) != bool(meta["fake"]):
        return meta, rows, runs
    ours = set(meta["config"]["workloads"])
    kept = [w for w in dict.fromkeys(r.workload for r in old_rows) if w not in ours]
    if not kept:
        return meta, rows, runs
    merged = dict(meta)
    config = dict(meta["config"])
    old_config = old_meta["config"]
    config["workloads"] = kept + list(meta["config"]["workloads"])
    for key in ("sizes", "batch_sizes"):
        config[key] = {**old_config.get(key, {}), **meta["config"][key]}
    if "cpu" in kept:
        config["cpu_iters"] = old_config.get("cpu_iters", config["cpu_iters"])
    merged["config"] = config
    sources = [
        {**source, "workloads": [w for w in source["workloads"] if w in kept]}
        for source in old_meta.get("sources", [_source(old_meta)])
    ]
    merged["sources"] = [s for s in sources if s["workloads"]] + [_source(meta)]
    return (
        merged,
        [r for r in old_rows if r.workload in kept] + rows,
        [r for r in old_runs if r["workload"] in kept] + runs,
    )


def write_all(
    out_dir: Path, meta: dict[str, Any], rows: list[SummaryRow], runs: list[dict[str, Any]]
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js, png = (out_dir / f"benchmarks.{ext}" for ext in ("md", "json", "png"))
    meta, rows, runs = merge_previous(js, meta, rows, runs)
    write_json(js, meta, rows, runs)
    write_png(png, rows, bool(meta["fake"]))
    # Keep the "Ray workers" section, which `make bench-ray` writes (aioload/bench/ray.py).
    ray_section = ""
    if md.exists() and "<!-- ray-bench:start -->" in (text := md.read_text()):
        ray_section = "\n<!-- ray-bench:start -->" + text.split("<!-- ray-bench:start -->", 1)[1]
    md.write_text(render_markdown(meta, rows, png.name) + ray_section)
    return [md, js, png]
