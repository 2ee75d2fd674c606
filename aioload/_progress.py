"""A tqdm bar over a loader, for ``for`` and ``async for``: batches/s and the live data-bound %.

``aioload.progress(loader)`` wraps any iterable loader (torch's too, without the data-bound
figure); ``DataLoader(..., progress=True)`` wraps every pass of that loader. The bar is closed
when the pass ends, fails, or is abandoned (``break``), so no half-drawn bar is left behind.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tqdm import tqdm

from ._engine.counters import PassStats

__all__ = ["Progress", "progress"]

# How often the data-bound figure is recomputed for the bar. tqdm itself redraws at most every
# 0.1 s; the postfix changes slowly, and this keeps its cost off most batches.
_POSTFIX_INTERVAL_S = 0.5


class _Bar:
    """One bar for one pass."""

    def __init__(self, total: int | None, stats: PassStats | None, options: dict[str, Any]) -> None:
        settings: dict[str, Any] = {"unit": "batch", "dynamic_ncols": True}
        settings.update(options)
        self.total = total
        self.settings = settings
        self.bar = tqdm(total=total, **settings)
        self.stats = stats
        self.next_postfix = 0.0
        self.closed = False

    def tick(self) -> None:
        if self.closed:
            # The pass went on after an error the caller caught: a new bar takes over the
            # count where the closed one stopped.
            self.bar = tqdm(total=self.total, **{**self.settings, "initial": self.bar.n})
            self.closed = False
        self.bar.update(1)
        if self.stats is not None:
            now = time.monotonic()
            if now >= self.next_postfix:
                self.next_postfix = now + _POSTFIX_INTERVAL_S
                self._show_data_bound()

    def _show_data_bound(self) -> None:
        assert self.stats is not None
        pct = self.stats.data_bound_pct()
        parts = [] if pct is None else [f"data-bound {pct:.0f}%"]
        # num_workers / prefetch_factor / worker_concurrency "auto": the current choice.
        tuning = self.stats.tuning
        if tuning is not None:
            parts.append(tuning.brief())
        # Samples skipped so far (on_sample_error), shown once there is one.
        skipped = len(self.stats.skipped)
        if skipped:
            parts.append(f"skipped {skipped}")
        if parts:
            self.bar.set_postfix_str(", ".join(parts), refresh=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.stats is not None:
            self._show_data_bound()  # the final figure stays on the closed bar
        self.bar.close()


def _pass_stats(inner: Any) -> PassStats | None:
    """The pass's counters: an aioload iterator carries them (torch's has none)."""
    stats = getattr(inner, "pass_stats", None)
    return stats if isinstance(stats, PassStats) else None


def _bar(inner: Any, loader: Any, options: dict[str, Any]) -> _Bar:
    stats = _pass_stats(inner)
    # A resumed pass's bar starts at the batches it had yielded before the checkpoint.
    initial = stats.resumed_batches if stats is not None else 0
    return _Bar(_total(loader), stats, {"initial": initial, **options})


def _total(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:  # an IterableDataset without __len__
        return None


class _SyncProgress:
    def __init__(self, inner: Iterator[Any], bar: _Bar) -> None:
        self._inner = inner
        self._bar = bar

    def __iter__(self) -> _SyncProgress:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._inner)
        except BaseException:
            # The end of the pass, or an error. After an error the caller may go on (a dataset
            # error ends only its batch, as in torch): then tick() opens a new bar that goes on
            # counting. Closing now rather than when this iterator is collected matters: an
            # exception that escapes the loop may keep the iterator alive for a long time.
            self._bar.close()
            del self  # nor may the error's traceback keep the pass alive (release_pass_frames)
            raise
        self._bar.tick()
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def close(self) -> None:
        self._bar.close()
        close = getattr(self._inner, "close", None)
        if close is not None:
            close()

    def __del__(self) -> None:
        # ``break`` drops the iterator: close the bar with it (not at interpreter exit, where
        # tqdm's own machinery may be gone already).
        with contextlib.suppress(Exception):
            self._bar.close()


class _AsyncProgress:
    def __init__(self, inner: AsyncIterator[Any], bar: _Bar) -> None:
        self._inner = inner
        self._bar = bar

    def __aiter__(self) -> _AsyncProgress:
        return self

    async def __anext__(self) -> Any:
        try:
            batch = await self._inner.__anext__()
        except BaseException:
            # As in _SyncProgress: closed now, and continued by tick() if the caller goes on
            # (after a dataset error, or a cancelled wait it retries).
            self._bar.close()
            del self
            raise
        self._bar.tick()
        return batch

    async def aclose(self) -> None:
        self._bar.close()
        aclose = getattr(self._inner, "aclose", None)
        if aclose is not None:
            await aclose()

    async def __aenter__(self) -> _AsyncProgress:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._bar.close()


def wrap_sync(inner: Iterator[Any], loader: Any, options: dict[str, Any]) -> _SyncProgress:
    return _SyncProgress(inner, _bar(inner, loader, options))


def wrap_async(inner: AsyncIterator[Any], loader: Any, options: dict[str, Any]) -> _AsyncProgress:
    return _AsyncProgress(inner, _bar(inner, loader, options))


class Progress:
    """What `progress()` returns: iterate it with ``for`` or ``async for``."""

    def __init__(self, loader: Any, options: dict[str, Any]) -> None:
        self.loader = loader
        self.options = options

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        inner: Iterator[Any] = iter(self.loader)
        if getattr(self.loader, "progress", False) is True:
            self._warn_ignored()
            return inner  # the loader draws its own bar already
        return wrap_sync(inner, self.loader, self.options)

    def __aiter__(self) -> AsyncIterator[Any]:
        inner: AsyncIterator[Any] = self.loader.__aiter__()
        if getattr(self.loader, "progress", False) is True:
            self._warn_ignored()
            return inner
        return wrap_async(inner, self.loader, self.options)

    def _warn_ignored(self) -> None:
        if self.options:
            warnings.warn(
                "aioload.progress(): the loader was built with progress=True and draws its own "
                f"bar; these options are ignored: {sorted(self.options)}",
                UserWarning,
                stacklevel=3,
            )


def progress(loader: Any, **tqdm_options: Any) -> Progress:
    """Iterate ``loader`` with a tqdm progress bar showing batches/s and, for an aioload loader,
    the live data-bound % (the share of the loop's time spent waiting for data)::

        for batch in aioload.progress(loader): ...
        async for batch in aioload.progress(loader, desc="train"): ...

    ``tqdm_options`` go to ``tqdm`` (``desc``, ``leave``, ``position``, ``file``, ...). The
    total is ``len(loader)`` where the loader has one.

    Raises:
        Exception: While iterating, whatever iterating ``loader`` raises; nothing of its own.

    Warns:
        UserWarning: ``tqdm_options`` given for a loader built with ``progress=True``, which
            draws its own bar: the options are ignored.
    """
    return Progress(loader, tqdm_options)
