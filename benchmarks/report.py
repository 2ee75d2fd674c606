"""Summaries, machine description and the writers of docs/benchmarks.{md,json,png}, and of
the short table of ratios in README.md and docs/index.md (one run fills all of them)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.workloads import WORKLOADS

TTFB_TARGET = 1.0
"""aioload TTFB must be no worse than torch's (ratio of medians <= 1.0)."""
RSS_TARGET = 1.0
"""aioload peak RSS (process tree) must be no more than torch's."""
FLOOR_TARGETS: dict[str, float] = {"image": 0.85}
"""aioload items/s as a fraction of the workload's floor (no loader), where a target is set."""
IMPORT_TARGET_S = 0.010
"""``import aioload`` after ``import torch``, median wall time over fresh processes."""
TINY_PARENT_CPU_TARGET_S = 98e-6
"""The training process's CPU time per tiny batch, at most."""


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
    # Defaults keep rows from older benchmarks.json files (merged in) loadable.
    floor_ips: float = math.nan
    torch_parent_cpu_s: float = math.nan
    aioload_parent_cpu_s: float = math.nan
    # Peer loader -> median items/s (NaN: every run failed); absent peers are in `peers_absent`.
    peer_ips: dict[str, float] = field(default_factory=dict)
    # Peer loader -> how many of its runs failed (a peer's crash is its own, reported here
    # rather than failing the bench; see `exit_status`).
    peer_failures: dict[str, int] = field(default_factory=dict)
    peers_absent: dict[str, str] = field(default_factory=dict)

    @property
    def ratio_ok(self) -> bool:
        return self.ratio >= self.target_ratio

    @property
    def ttfb_ok(self) -> bool:
        return self.aioload_ttfb_s <= TTFB_TARGET * self.torch_ttfb_s

    @property
    def rss_ok(self) -> bool:
        return self.aioload_rss_bytes <= RSS_TARGET * self.torch_rss_bytes

    def pct_floor(self, ips: float) -> float:
        return ips / self.floor_ips if self.floor_ips > 0 else math.nan


OURS = ("torch", "aioload", "floor")
"""The loaders whose runs the targets read; every other loader is a peer."""


def exit_status(runs: list[dict[str, Any]], rows: list[SummaryRow]) -> int:
    """1 where a run of ours (torch, aioload or the floor) failed or a ratio could not be
    computed, else 0. A peer's failed run (torchdata's process pool has aborted with
    "terminate called without an active exception") is shown in its table cell and counted
    on stderr, but does not fail the bench: no target reads it, and the other runs stand."""
    ours_failed = any(not r["ok"] for r in runs if r["loader"] in OURS)
    return 1 if ours_failed or any(math.isnan(r.ratio) for r in rows) else 0


def _median(values: list[float]) -> float:
    values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else math.nan


def summarize(
    runs: list[dict[str, Any]],
    workloads: list[str],
    modes: list[str],
    peers_absent: dict[str, str] | None = None,
) -> list[SummaryRow]:
    """One row per (workload, aioload mode); the torch side is always its sync runs."""
    rows: list[SummaryRow] = []
    for w in workloads:
        of_w = [r for r in runs if r["workload"] == w]
        torch_runs = [r for r in of_w if r["loader"] == "torch" and r["ok"]]
        floor_runs = [r for r in of_w if r["loader"] == "floor" and r["ok"]]
        peers = [p for p in dict.fromkeys(r["loader"] for r in of_w) if p not in OURS]
        peer_ips = {
            peer: _median([r["items_per_s"] for r in of_w if r["loader"] == peer and r["ok"]])
            for peer in peers
        }
        peer_failures = {
            peer: sum(1 for r in of_w if r["loader"] == peer and not r["ok"]) for peer in peers
        }
        for mode in modes:
            aio_all = [r for r in of_w if r["loader"] == "aioload" and r["mode"] == mode]
            aio = [r for r in aio_all if r["ok"]]
            failures = (
                len(aio_all)
                - len(aio)
                + sum(
                    1
                    for r in of_w
                    if r["loader"] == "torch" and r["pair_mode"] == mode and not r["ok"]
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
                    floor_ips=_median([r["items_per_s"] for r in floor_runs]),
                    torch_parent_cpu_s=_median(
                        [r.get("parent_cpu_per_batch_s", math.nan) for r in torch_runs]
                    ),
                    aioload_parent_cpu_s=_median(
                        [r.get("parent_cpu_per_batch_s", math.nan) for r in aio]
                    ),
                    peer_ips=peer_ips,
                    peer_failures=peer_failures,
                    peers_absent=dict(peers_absent or {}),
                )
            )
    return rows


# ---------------------------------------------------------------- formatting helpers


def fmt_ips(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:,.0f}"


def fmt_ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v * 1e3:.0f} ms"


def fmt_us(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v * 1e6:.0f} us"


def fmt_mib(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v / 2**20:,.0f} MiB"


def fmt_ratio(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.2f}x"


def fmt_pct(v: float) -> str:
    return "" if math.isnan(v) else f" ({100 * v:.0f}%)"


def _mark(ok: bool, v: float) -> str:
    return "?" if math.isnan(v) else ("PASS" if ok else "FAIL")


def _unmet(ok: bool, v: float) -> str:
    """A page's word on a target: nothing where it is met (the page is a report, not a test)."""
    return " (no figure)" if math.isnan(v) else ("" if ok else " (not met)")


def _peer_cell(r: SummaryRow, peer: str) -> str:
    if peer in r.peers_absent:
        return "absent"
    if peer not in r.peer_ips:
        return "not run"
    ips = r.peer_ips[peer]
    if math.isnan(ips):
        return "failed"
    cell = fmt_ips(ips) + fmt_pct(r.pct_floor(ips))
    failed = r.peer_failures.get(peer, 0)
    return f"{cell}, {failed} run(s) failed" if failed else cell


def table_rows(rows: list[SummaryRow]) -> tuple[list[str], list[list[str]]]:
    peers = list(dict.fromkeys(p for r in rows for p in [*r.peer_ips, *r.peers_absent]))
    header = [
        "workload",
        "mode",
        "floor items/s",
        "torch items/s (% floor)",
        "aioload items/s (% floor)",
        "ratio",
        "target",
        *(f"{p} items/s (% floor)" for p in peers),
        "parent CPU/batch torch / aioload",
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
                fmt_ips(r.floor_ips),
                fmt_ips(r.torch_ips) + fmt_pct(r.pct_floor(r.torch_ips)),
                fmt_ips(r.aioload_ips) + fmt_pct(r.pct_floor(r.aioload_ips)),
                fmt_ratio(r.ratio),
                f">= {r.target_ratio:g}x {_mark(r.ratio_ok, r.ratio)}",
                *(_peer_cell(r, p) for p in peers),
                f"{fmt_us(r.torch_parent_cpu_s)} / {fmt_us(r.aioload_parent_cpu_s)}",
                f"{fmt_ms(r.torch_ttfb_s)} / {fmt_ms(r.aioload_ttfb_s)} "
                f"{_mark(r.ttfb_ok, r.aioload_ttfb_s)}",
                f"{fmt_mib(r.torch_rss_bytes)} / {fmt_mib(r.aioload_rss_bytes)} "
                f"({fmt_ratio(rss_ratio)}) {_mark(r.rss_ok, rss_ratio)}",
                "; ".join(notes),
            ]
        )
    return header, body


# ---------------------------------------------------------------- the targets


@dataclass
class Target:
    name: str
    figure: str
    ok: bool | None  # None: not measured in this run

    def line(self) -> str:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[self.ok]
        return f"{mark}  {self.name}: {self.figure}"


def summarize_startup(probes: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """workload -> medians of the fresh-process first batch and later-epoch first batch."""
    out: dict[str, dict[str, float]] = {}
    for w in dict.fromkeys(p["workload"] for p in probes):
        cell: dict[str, float] = {}
        for loader in ("torch", "aioload"):
            of = [p for p in probes if p["workload"] == w and p["loader"] == loader and p["ok"]]
            cell[f"{loader}_first_s"] = _median([p["first_batch_s"] for p in of])
            cell[f"{loader}_later_s"] = _median([p["later_epoch_first_batch_s"] for p in of])
            cell[f"{loader}_import_s"] = _median([p["import_s"] for p in of])
        out[w] = cell
    return out


def targets(
    rows: list[SummaryRow],
    startup: dict[str, dict[str, float]],
    import_stats: dict[str, float] | None,
) -> list[Target]:
    """The benchmark's targets, each with its figure (medians of alternating runs)."""
    found: list[Target] = []

    def by_mode(workload: str) -> list[SummaryRow]:
        return [r for r in rows if r.workload == workload]

    for workload, fraction in FLOOR_TARGETS.items():
        for r in by_mode(workload):
            pct = r.pct_floor(r.aioload_ips)
            found.append(
                Target(
                    f"{workload} >= {100 * fraction:.0f}% of its floor ({r.mode})",
                    f"{100 * pct:.0f}% ({fmt_ips(r.aioload_ips)} of {fmt_ips(r.floor_ips)} items/s)"
                    if not math.isnan(pct)
                    else "n/a",
                    None if math.isnan(pct) else pct >= fraction,
                )
            )
    for workload in ("tiny", "cpu"):
        for r in by_mode(workload):
            found.append(
                Target(
                    f"{workload} >= {r.target_ratio:g}x torch ({r.mode})",
                    fmt_ratio(r.ratio),
                    None if math.isnan(r.ratio) else r.ratio_ok,
                )
            )
    for r in by_mode("tiny"):
        cpu = r.aioload_parent_cpu_s
        found.append(
            Target(
                f"tiny parent CPU per batch <= {fmt_us(TINY_PARENT_CPU_TARGET_S)} ({r.mode})",
                f"{fmt_us(cpu)} (torch: {fmt_us(r.torch_parent_cpu_s)})",
                None if math.isnan(cpu) else cpu <= TINY_PARENT_CPU_TARGET_S,
            )
        )
    for w, cell in startup.items():
        for key, what in (
            ("first", "first batch from before `import aioload`, fresh process"),
            ("later", "a later epoch's first batch, no persistent workers"),
        ):
            t, a = cell[f"torch_{key}_s"], cell[f"aioload_{key}_s"]
            found.append(
                Target(
                    f"{w}: {what} <= torch's",
                    f"{fmt_ms(a)} vs {fmt_ms(t)}",
                    None if math.isnan(a) or math.isnan(t) else a <= t,
                )
            )
    if import_stats:
        wall = import_stats["import_s"]
        found.append(
            Target(
                f"`import aioload` <= {IMPORT_TARGET_S * 1e3:g} ms over `import torch`",
                f"{wall * 1e3:.1f} ms wall, {import_stats['import_cpu_s'] * 1e3:.1f} ms CPU; "
                f"`aioload.DataLoader` in hand: {import_stats['loader_s'] * 1e3:.1f} ms wall, "
                f"{import_stats['loader_cpu_s'] * 1e3:.1f} ms CPU",
                wall <= IMPORT_TARGET_S,
            )
        )
    for w in dict.fromkeys(r.workload for r in rows):
        r = by_mode(w)[0]
        if math.isnan(r.aioload_rss_bytes) or math.isnan(r.torch_rss_bytes):
            continue
        worst = max(x.aioload_rss_bytes for x in by_mode(w))
        found.append(
            Target(
                f"{w}: peak RSS <= torch's",
                f"{fmt_mib(worst)} vs {fmt_mib(r.torch_rss_bytes)}",
                worst <= RSS_TARGET * r.torch_rss_bytes,
            )
        )
    return found


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


def git_rev() -> str:
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
        "git_rev": git_rev(),
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


# ---------------------------------------------------------------- writers


def write_json(
    path: Path, meta: dict[str, Any], rows: list[SummaryRow], runs: list[dict[str, Any]]
) -> None:
    payload = {"meta": meta, "summary": [asdict(r) for r in rows], "runs": runs}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


MODE_NAMES = {
    "sync": "`for`",
    "async-uvloop": "`async for` (uvloop)",
    "async-asyncio": "`async for` (asyncio)",
}
"""How the pages name each aioload mode."""

SUMMARY_WHAT = {
    "image": "uint8 images, 3x224x224, batch 64: bandwidth",
    "image-collate": "the same, through a `collate_fn` of the user's own",
    "tiny": "scalar tensors, batch 256: per-batch overhead",
    "cpu": "~1 ms of pure Python per sample: compute scaling",
    "latency": "20 ms of waiting per sample, async dataset",
    "http": "small files over HTTP, 20 ms server latency, async dataset",
}
"""What each workload measures, in the short table of README.md and docs/index.md."""


def _mode_name(mode: str) -> str:
    return MODE_NAMES.get(mode, f"`{mode}`")


def write_png(path: Path, rows: list[SummaryRow], fake: bool) -> None:
    """The ratio of each workload and mode, on a log axis (ratios from 1x to 30x and more),
    with each workload's target. Sized to be shown at its own width in the docs' text column
    (about 870 px), so its text is as large as the page's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    workloads = list(dict.fromkeys(r.workload for r in rows))
    modes = list(dict.fromkeys(r.mode for r in rows))
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(8.6, 4.6), dpi=100)
    highest = 1.0
    for mi, mode in enumerate(modes):
        xs: list[float] = []
        ys: list[float] = []
        for wi, w in enumerate(workloads):
            row = next((r for r in rows if r.workload == w and r.mode == mode), None)
            if row is None or math.isnan(row.ratio):
                continue
            xs.append(wi - 0.4 + width * (mi + 0.5))
            ys.append(row.ratio)
        highest = max([highest, *ys])
        label = MODE_NAMES.get(mode, mode).replace("`", "")
        bars = ax.bar(xs, ys, width=width * 0.92, label=f"aioload, {label}")
        ax.bar_label(bars, labels=[f"{y:.1f}x" for y in ys], fontsize=10, padding=2)
    for wi, w in enumerate(workloads):
        ax.hlines(
            WORKLOADS[w].target_ratio,
            wi - 0.45,
            wi + 0.45,
            colors="tab:red",
            linestyles="dashed",
            linewidth=1.5,
            label="target" if wi == 0 else "_nolegend_",
        )
    ax.set_yscale("log")
    ax.set_ylim(0.5, highest * 2.2)
    ticks = [t for t in (0.5, 1, 2, 5, 10, 20, 50, 100) if t <= highest * 2.2]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.axhline(1.0, color="black", linewidth=1.0)
    ax.grid(axis="y", linewidth=0.5, alpha=0.4)
    ax.set_xticks(range(len(workloads)), workloads, fontsize=11)
    ax.tick_params(axis="y", labelsize=11)
    ax.set_ylabel("aioload's items/s over torch's (log scale)", fontsize=11)
    title = "aioload vs torch.utils.data.DataLoader, steady-state throughput"
    ax.set_title(("[FAKE aioload] " if fake else "") + title, fontsize=12)
    ax.legend(fontsize=10, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _ratio_cell(ratio: float, ok: bool) -> str:
    return "n/a" if math.isnan(ratio) else f"{ratio:.2f}x" + ("" if ok else " (below target)")


def render_summary(meta: dict[str, Any], rows: list[SummaryRow], benchmarks_link: str) -> str:
    """The short table README.md and docs/index.md show: each workload's ratio under each
    mode, from the same run as the benchmarks page, which ``benchmarks_link`` points to."""
    modes = list(dict.fromkeys(r.mode for r in rows))
    by = {(r.workload, r.mode): r for r in rows}
    header = ["workload", "what it measures", *(_mode_name(m) for m in modes)]
    body = []
    for w in dict.fromkeys(r.workload for r in rows):
        cells = []
        for m in modes:
            row = by.get((w, m))
            cells.append("" if row is None else _ratio_cell(row.ratio, row.ratio_ok))
        body.append([w, SUMMARY_WHAT.get(w, WORKLOADS[w].description), *cells])
    cfg = meta["config"]
    workers = cfg.get("num_workers", 2)
    machine = meta["machine"]
    lines = [
        SUMMARY_BEGIN,
        f"aioload's items/s over torch's DataLoader's, in steady state, with {workers} workers: "
        f"medians of {cfg['repeats']} alternating runs of `make bench` on "
        f"{machine['date_utc'].split(' ')[0]} at commit {machine['git_rev']}, on a "
        f"{machine['usable_cores']}-core machine ({machine['cpu_model']}). The method, the full "
        f"results (time to the first batch, memory, the training process's CPU time, each "
        f"workload's no-loader floor and other loaders) and the machine are on "
        f"[the benchmarks page]({benchmarks_link}).",
        "",
        markdown_table(header, body),
        SUMMARY_END,
    ]
    return "\n".join(lines)


def _command(recorded: str) -> str:
    """A run's command as it is typed today: runs recorded while the harness was the
    ``aioload.bench`` package name it so."""
    return recorded.replace("-m aioload.bench", "-m benchmarks")


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


SWEEP_BEGIN = "<!-- sweep:begin (make bench-sweep writes this section) -->"
SWEEP_END = "<!-- sweep:end -->"


def replace_block(text: str, block: str) -> str:
    """``text`` with its sweep section replaced by ``block`` (appended where it has none)."""
    if SWEEP_BEGIN in text and SWEEP_END in text:
        head, rest = text.split(SWEEP_BEGIN, 1)
        tail = rest.split(SWEEP_END, 1)[1]
        return head + block + tail
    return text.rstrip("\n") + "\n\n" + block + "\n"


def current_block(text: str) -> str:
    if SWEEP_BEGIN in text and SWEEP_END in text:
        return SWEEP_BEGIN + text.split(SWEEP_BEGIN, 1)[1].split(SWEEP_END, 1)[0] + SWEEP_END
    return ""


RAY_BEGIN, RAY_END = "<!-- ray-bench:start -->", "<!-- ray-bench:end -->"
# The many-core model (its inputs and predictions, written by hand from
# ``python -m benchmarks.auto --model``): not a run's figures, so a run keeps it as it is.
MODEL_BEGIN, MODEL_END = "<!-- model:start -->", "<!-- model:end -->"
# Uneven samples (``python -m benchmarks.uneven``, run by ``make bench`` after this page is
# written) and many cores (``make bench-cores``): sections of their own.
UNEVEN_BEGIN, UNEVEN_END = "<!-- uneven:start", "<!-- uneven:end -->"
THREADS_BEGIN, THREADS_END = "<!-- threads:start", "<!-- threads:end -->"
CORES_BEGIN, CORES_END = "<!-- cores:start", "<!-- cores:end -->"
# Sections a run of ``make bench`` keeps from the page it replaces, appended in this order.
KEPT_SECTIONS = (
    (UNEVEN_BEGIN, UNEVEN_END),
    (THREADS_BEGIN, THREADS_END),
    (MODEL_BEGIN, MODEL_END),
    (CORES_BEGIN, CORES_END),
    (RAY_BEGIN, RAY_END),
)


def keep_section(old: str, text: str, begin: str, end: str) -> str:
    """``text`` with the section of ``old`` between ``begin`` and ``end`` appended."""
    if begin not in old or end not in old:
        return text
    section = begin + old.split(begin, 1)[1].split(end, 1)[0] + end
    return text.rstrip("\n") + "\n\n" + section + "\n"


def keep_ray_section(old: str, text: str) -> str:
    """``text`` with the "Ray workers" section of ``old`` (``make bench-ray``) appended."""
    return keep_section(old, text, RAY_BEGIN, RAY_END)


SUMMARY_BEGIN = "<!-- bench-summary:begin (written by `make bench`; do not edit) -->"
SUMMARY_END = "<!-- bench-summary:end -->"
SUMMARY_PAGES = {"README.md": "docs/benchmarks.md", "docs/index.md": "benchmarks.md"}
"""The pages, relative to the repository, that show the short table of ratios, each with its
link to the benchmarks page."""


def replace_summary(text: str, block: str) -> str | None:
    """``text`` with its short table of ratios replaced by ``block``; None where it has no
    place for one (both markers)."""
    begin = SUMMARY_BEGIN.split(" (", 1)[0]
    if begin not in text or SUMMARY_END not in text:
        return None
    head, rest = text.split(begin, 1)
    tail = rest.split(SUMMARY_END, 1)[1]
    return head + block + tail


def write_summaries(repo: Path, meta: dict[str, Any], rows: list[SummaryRow]) -> list[Path]:
    """Fill the short table of ratios in README.md and docs/index.md (where they have its
    markers) from the same run as the benchmarks page."""
    written = []
    for name, link in SUMMARY_PAGES.items():
        page = repo / name
        if not page.exists():
            continue
        text = replace_summary(page.read_text(), render_summary(meta, rows, link))
        if text is not None:
            page.write_text(text)
            written.append(page)
    return written


def write_all(
    out_dir: Path,
    meta: dict[str, Any],
    rows: list[SummaryRow],
    runs: list[dict[str, Any]],
    *,
    from_json: bool = False,
) -> list[Path]:
    """Write the benchmarks page, its JSON and plot into ``out_dir``, and, where ``out_dir``
    is a repository's ``docs/``, the short table of ratios in its README.md and index.md.
    ``from_json``: the figures come from ``out_dir``'s benchmarks.json, which is left as it is.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js, png = (out_dir / f"benchmarks.{ext}" for ext in ("md", "json", "png"))
    if not from_json:
        meta, rows, runs = merge_previous(js, meta, rows, runs)
        write_json(js, meta, rows, runs)
    write_png(png, rows, bool(meta["fake"]))
    # The sweep's section (make bench-sweep) is kept as it was, and so are the many-core
    # model and the "Ray workers" section (make bench-ray, benchmarks/ray.py), appended at
    # the end.
    old = md.read_text() if md.exists() else ""
    sweep = current_block(old)
    from benchmarks.report_markdown import render_markdown

    text = render_markdown(meta, rows, png.name)
    text = replace_block(text, sweep) if sweep else text
    for begin, end in KEPT_SECTIONS:
        text = keep_section(old, text, begin, end)
    md.write_text(text)
    written = [md, png] if from_json else [md, js, png]
    if out_dir.resolve().name == "docs" and not meta["fake"]:
        written += write_summaries(out_dir.resolve().parent, meta, rows)
    return written


def load_json(path: Path) -> tuple[dict[str, Any], list[SummaryRow], list[dict[str, Any]]]:
    """A run's meta, summary rows and runs, as ``write_json`` wrote them."""
    payload = json.loads(path.read_text())
    rows = [SummaryRow(**row) for row in payload["summary"]]
    return payload["meta"], rows, payload["runs"]
