"""aioload.progress(loader) and DataLoader(progress=True): a tqdm bar for both doors."""

from __future__ import annotations

import gc
import io
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import IterableDataset
from tqdm import tqdm

import aioload
from tests.helpers import batches_and_errors, consume
from tests.scripts.datasets import Scalars

pytestmark = [pytest.mark.timeout(60)]


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(6))


def _open_bars() -> int:
    gc.collect()
    return len(getattr(tqdm, "_instances", ()))


@pytest.fixture(autouse=True)
def _no_bar_left_open() -> Iterator[None]:
    before = _open_bars()
    yield
    assert _open_bars() == before, "a progress bar was left open"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_bar_counts_batches_and_shows_data_bound(
    mode: str, num_workers: int, no_leaks: None
) -> None:
    out = io.StringIO()
    loader = aioload.DataLoader(Scalars(40), batch_size=4, num_workers=num_workers)
    assert consume(aioload.progress(loader, file=out, desc="train"), mode) == 10
    text = out.getvalue()
    assert "train" in text and "10/10" in text
    assert "batch/s" in text
    assert "data-bound" in text
    assert loader.stats().batches == 10


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bar_closes_on_break(mode: str, no_leaks: None) -> None:
    out = io.StringIO()
    loader = aioload.DataLoader(Scalars(400), batch_size=4, num_workers=2)
    assert consume(aioload.progress(loader, file=out), mode, stop_after=3) == 3
    assert "3/100" in out.getvalue()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bar_closes_on_error(mode: str, no_leaks: None) -> None:
    out = io.StringIO()
    loader = aioload.DataLoader(Scalars(40, fail_at=9), batch_size=4, num_workers=2)
    with pytest.raises(ValueError, match="bad sample 9"):
        consume(aioload.progress(loader, file=out), mode)
    assert "2/10" in out.getvalue()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_progress_option_on_the_loader(
    mode: str, capsys: pytest.CaptureFixture[str], no_leaks: None
) -> None:
    loader = aioload.DataLoader(Scalars(12), batch_size=4, num_workers=2, progress=True)
    assert consume(loader, mode) == 3
    # A loader that draws its own bar is not wrapped in a second one.
    assert consume(aioload.progress(loader), mode) == 3
    err = capsys.readouterr().err
    assert err.count("3/3") == 2
    assert "data-bound" in err


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_without_length_the_bar_has_no_total(no_leaks: None) -> None:
    out = io.StringIO()
    loader = aioload.DataLoader(Stream(), batch_size=4, num_workers=0)
    assert consume(aioload.progress(loader, file=out), "sync") == 2
    assert "2batch" in out.getvalue().replace(" ", "")
    assert "/2" not in out.getvalue()


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_wraps_torchs_loader_too() -> None:
    out = io.StringIO()
    loader = torch.utils.data.DataLoader(Scalars(8), batch_size=4)
    assert consume(aioload.progress(loader, file=out), "sync") == 2
    assert "2/2" in out.getvalue()
    assert "data-bound" not in out.getvalue()
    assert len(aioload.progress(loader)) == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bar_survives_a_recoverable_dataset_error(num_workers: int, no_leaks: None) -> None:
    out = io.StringIO()
    loader = aioload.DataLoader(Scalars(40, fail_at=9), batch_size=4, num_workers=num_workers)
    iterator = iter(aioload.progress(loader, file=out, mininterval=0))
    got = batches_and_errors(iterator, (ValueError,))
    errors = sum(isinstance(x, ValueError) for x in got)
    assert (len(got) - errors, errors) == (9, 1)
    assert iterator._bar.bar.n == 9  # type: ignore[attr-defined]  # counting went on
    assert iterator._bar.closed  # type: ignore[attr-defined]
    assert "9/10" in out.getvalue()


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_resumed_pass_bar_starts_where_the_checkpoint_was(no_leaks: None) -> None:
    loader = aioload.DataLoader(Scalars(40), batch_size=4)
    iterator = iter(loader)
    for _ in range(6):
        next(iterator)
    state = loader.state_dict()
    resumed = aioload.DataLoader(Scalars(40), batch_size=4)
    resumed.load_state_dict(state)
    bars = iter(aioload.progress(resumed, file=io.StringIO(), mininterval=0))
    assert sum(1 for _ in bars) == 4
    assert bars._bar.bar.n == 10  # type: ignore[attr-defined]


@pytest.mark.no_local_workers("starts no worker (num_workers=0, or no pass runs)")
def test_progress_iterator_keeps_len(no_leaks: None) -> None:
    loader = aioload.DataLoader(Scalars(40), batch_size=4, progress=True)
    iterator = iter(loader)
    assert len(iterator) == 10  # type: ignore[arg-type]
    del iterator
