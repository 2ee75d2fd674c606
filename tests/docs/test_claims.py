"""Claims the guides make about what a call does, run: each case names the page that makes the
claim and checks the page still says it, then does what a reader would and checks the result.
A page and the code that drift apart fail here."""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Subset

import aioload

ROOT = Path(__file__).resolve().parents[2]


def _page(name: str) -> str:
    return (ROOT / name).read_text()


def _section(name: str, heading: str) -> str:
    text = _page(name)
    start = text.index(heading)
    level = len(heading) - len(heading.lstrip("#"))  # ends at the next heading as high
    following = re.search(rf"^#{{1,{level}}} ", text[start + len(heading) :], re.M)
    return text[start : start + len(heading) + (following.start() if following else len(text))]


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, index * index])


class AsyncSquares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    async def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        return torch.tensor([index])


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(10))


def test_every_argument_is_on_the_migrating_page() -> None:
    # migrating.md: "Every argument" (torch's) and "What is new" (aioload's) name them all.
    tables = _section("docs/migrating.md", "## Every argument") + _section(
        "docs/migrating.md", "## What is new"
    )
    named = set(re.findall(r"^\| `(\w+)", tables, re.M))
    named |= set(re.findall(r"^\|[^|\n]*?, `(\w+)", tables, re.M))
    named |= set(re.findall(r"`(\w+)=", tables))
    parameters = [p for p in inspect.signature(aioload.DataLoader.__init__).parameters][1:]
    missing = [name for name in parameters if name not in named]
    assert not missing, f"docs/migrating.md does not list the arguments {missing}"


# (what the errors page says, in its row's words; the arguments; the exception)
AT_CONSTRUCTION: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("`prefetch_factor=0` with workers", {"num_workers": 1, "prefetch_factor": 0}, ValueError),
    ("`prefetch_factor` without workers", {"prefetch_factor": 2}, ValueError),
    ('neither a non-negative (positive) integer nor `"auto"`', {"num_workers": "x"}, ValueError),
    ('given without `num_workers="auto"`', {"num_workers": 1, "max_memory": 10**9}, ValueError),
    ("`max_worker_restarts` negative", {"num_workers": 1, "max_worker_restarts": -1}, ValueError),
    ("above 0 with `num_workers=0`", {"max_worker_restarts": 1}, ValueError),
    ("`worker_concurrency` above 1", {"num_workers": 1, "worker_concurrency": 2}, ValueError),
    ("`shard` other than", {"shard": "x"}, ValueError),
    ("`on_sample_error` other than", {"on_sample_error": "x"}, ValueError),
    ('set with `on_sample_error="raise"`', {"max_skipped": 3}, ValueError),
    ("`sample_retries` or `snapshot_every_n_steps` negative", {"sample_retries": -1}, ValueError),
    ("`workers` neither `None` nor", {"workers": 3}, TypeError),
    ("`worker_method` other than", {"worker_method": "x"}, ValueError),
    ("`hang_report_after` neither `None`", {"hang_report_after": 0}, ValueError),
]


@pytest.mark.parametrize(("row", "arguments", "error"), AT_CONSTRUCTION, ids=lambda v: str(v))
def test_the_errors_page_construction_table(
    row: str, arguments: dict[str, Any], error: type[Exception]
) -> None:
    table = _section("docs/errors.md", "## When you build a loader")
    line = next((line for line in table.splitlines() if row in line), None)
    assert line is not None, f"docs/errors.md no longer says {row!r}"
    assert line.startswith(f"| `{error.__name__}` |"), line
    with pytest.raises(error):
        aioload.DataLoader(Squares(), **arguments)


def test_restarts_with_an_iterable_dataset_are_refused() -> None:
    # limitations.md and errors.md: refused at construction, with a ValueError.
    assert "refused\nwith a `ValueError` at construction" in _page("docs/limitations.md")
    with pytest.raises(ValueError, match="IterableDataset"):
        aioload.DataLoader(Stream(), num_workers=1, max_worker_restarts=1)


def test_subset_around_an_async_dataset() -> None:
    # limitations.md: not detected as async; worker_concurrency > 1 is refused with a
    # ValueError (the fetch itself fails in the worker with a TypeError).
    page = _page("docs/limitations.md")
    assert "`worker_concurrency > 1` is refused at construction with a `ValueError`" in page
    with pytest.raises(ValueError, match="Subset is synchronous"):
        aioload.DataLoader(Subset(AsyncSquares(), range(8)), num_workers=1, worker_concurrency=4)


def test_the_thread_seed_warning_is_on_the_errors_page() -> None:
    page = _page("docs/errors.md")
    assert "`UserWarning` `aioload: with worker_method='thread', thread workers share" in page
    with pytest.warns(UserWarning, match="thread workers share the process-wide"):
        aioload.DataLoader(Squares(), num_workers=2, worker_method="thread", seed_per_sample=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the claim is about a machine without one")
def test_a_device_without_an_accelerator_warns_and_stays_on_the_cpu() -> None:
    # migrating.md: "an accelerator `device` warns once ... and batches stay on the CPU"; a
    # "cuda:3" raises only where an accelerator is there.
    assert "an accelerator `device` warns once" in _page("docs/migrating.md")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = aioload.DataLoader(Squares(), batch_size=8, device="cuda:3")
        batch = next(iter(loader))
    assert batch.device.type == "cpu"
    assert [str(w.message) for w in caught] == [
        "aioload: 'device' argument is set as 'cuda:3' but no accelerator is found, then "
        "batches stay on the CPU."
    ]


@pytest.mark.timeout(60)
def test_batch_tensors_are_not_is_shared() -> None:
    # limitations.md: `tensor.is_shared()` is False on batch tensors (torch's say True).
    assert "**`tensor.is_shared()` is `False`** on batch tensors" in _page("docs/limitations.md")
    loader = aioload.DataLoader(Squares(), batch_size=8, num_workers=1)
    batch = next(iter(loader))
    assert batch.is_shared() is False
    del batch, loader


def test_ray_workers_without_ray_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # scaling.md and errors.md: `RayWorkers` without Ray raises an ImportError naming the extra.
    assert "raises an ImportError naming the extra" in _page("docs/scaling.md")
    assert "| `ImportError` | `aioload.RayWorkers(...)` without Ray installed" in _page(
        "docs/errors.md"
    )
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ImportError, match=r"aioload\[ray\]"):
        aioload.RayWorkers(num_cpus=1)


def test_a_second_anext_on_a_waiting_iterator_is_refused() -> None:
    # async.md: "A second `anext()` on an iterator that is already waiting raises
    # `RuntimeError: aioload: this iterator is already waiting for a batch`".
    message = "aioload: this iterator is already waiting for a batch"
    assert f"raises `RuntimeError: {message}`" in _page("docs/async.md").replace("\n", " ")

    class Slow(Dataset[int]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> int:
            time.sleep(0.2)
            return index

    async def main() -> None:
        iterator = aiter(aioload.DataLoader(Slow(), batch_size=2, num_workers=1))
        first = asyncio.ensure_future(anext(iterator))
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match=message):
            await anext(iterator)
        await first
        await iterator.aclose()

    asyncio.run(main())


def test_the_tuning_page_gives_the_tuners_own_constants() -> None:
    # tuning.md's "What it measures" and "How it decides" quote the thresholds the tuner uses.
    from aioload._engine import tuning as t

    page = " ".join(_page("docs/tuning.md").split())

    def pct(share: float) -> str:
        return f"{round(share * 100):d} %"

    quoted = [
        f"at least {t.MIN_BATCHES} batches and {t.MIN_SECONDS:g} s, or {t.MAX_SECONDS:g} s",
        f"The consumer waits at least {pct(t.WAIT_HIGH)} of its time",
        f"It waits at most {pct(t.WAIT_LOW)} with the workers mostly idle",
        f"at most {pct(t.SHRINK_BUSY)} busy without it",
        f"from {t.START_CONCURRENCY}, four times as many while the consumer waits at least half",
        f"up to {t.MAX_CONCURRENCY}, while each step brings at least {pct(t.CONCURRENCY_GAIN - 1)}",
        f"A growth must bring {pct(t.GAIN - 1)} more samples/s "
        f"({pct(t.CONCURRENCY_GAIN - 1)} for concurrency)",
        f"a shrink must keep {pct(t.KEEP)} of the throughput",
        f"a bound for the next {t.RETRY_WINDOWS} windows",
        f"turns direction {t.MAX_REVERSALS} times in a pass",
    ]
    assert t.WAIT_MOSTLY == 0.5 and t.SHRINK_DEPTH_BUSY == 0.5  # "half its time", "half busy"
    missing = [text for text in quoted if text not in page]
    assert not missing, f"docs/tuning.md no longer matches the tuner: {missing}"
