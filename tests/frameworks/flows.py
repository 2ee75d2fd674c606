"""What each rank runs, one function per framework flow. Each returns a JSON-able report: the
sample indices this rank trained on, the loader's type, and the time spent waiting for data.

Run one by hand (2 ranks) with ``python -m tests.frameworks.measure FLOW``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

import aioload

from ._ranks import BATCH, STEP_SECONDS, Indexed, type_name


def _aioload_loader(**overrides: Any) -> aioload.DataLoader[Any]:
    # shard="auto": each rank reads its own shard (the default, as torch's, is the whole set).
    arguments: dict[str, Any] = dict(batch_size=BATCH, num_workers=2, shuffle=True, shard="auto")
    arguments.update(overrides)
    return aioload.DataLoader(Indexed(), **arguments)


def _step() -> None:
    """A training step's synchronous work, as a stand-in for forward and backward."""
    time.sleep(STEP_SECONDS)


def _epoch(batches: Iterable[Any]) -> dict[str, Any]:
    """One pass: the indices seen, the wait for the first batch (workers starting), and the
    wall time spent in next() for the others (waiting for data) against the time in the step."""
    seen: list[int] = []
    first = waited = stepped = 0.0
    iterator = iter(batches)
    while True:
        started = time.perf_counter()
        batch = next(iterator, None)
        if seen:
            waited += time.perf_counter() - started
        else:
            first = time.perf_counter() - started
        if batch is None:
            break
        seen += [int(i) for i in batch["index"]]
        started = time.perf_counter()
        _step()
        stepped += time.perf_counter() - started
    return {"indices": seen, "first_batch_s": first, "wait_s": waited, "step_s": stepped}


def _aioload_stats(loader: Any) -> dict[str, Any] | None:
    if not isinstance(loader, aioload.DataLoader):
        return None
    stats = loader.stats().as_dict()
    return {key: stats[key] for key in ("batches", "waiting_s", "between_s", "data_bound_pct")}


def accelerate() -> dict[str, Any]:
    """accelerate: the loader given to ``prepare()``, and the loader used as it is."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert torch.distributed.is_initialized()
    report: dict[str, Any] = {"rank": accelerator.process_index}

    original = _aioload_loader()
    # What frameworks read describes the whole dataset, not this rank's shard.
    report["public_len_batch_sampler"] = len(original.batch_sampler)  # type: ignore[arg-type]
    report["public_sampler"] = type_name(original.sampler)
    report["len_loader"] = len(original)
    prepared = accelerator.prepare(original)
    report["prepared_type"] = type_name(prepared)
    report["prepared_is_aioload"] = isinstance(prepared, aioload.DataLoader)
    report["prepared_len"] = len(prepared)
    report["prepare"] = _epoch(prepared)

    direct = _aioload_loader()
    report["direct_len"] = len(direct)
    report["direct"] = _epoch(direct)
    report["direct_stats"] = _aioload_stats(direct)
    # A second epoch: the shard's shuffle moves on (set_epoch implied by iterating).
    report["direct_epoch1"] = _epoch(direct)["indices"]
    direct.shutdown()
    accelerator.end_training()
    return report


class _Recorder:
    """Hook timestamps around each batch: the gap between one batch's end and the next one's
    start is what the training loop spent getting data (plus the framework's own work)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.waited = 0.0
        self.stepped = 0.0
        self._last_end: float | None = None
        self._start = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()
        if self._last_end is not None:
            self.waited += self._start - self._last_end

    def end(self) -> None:
        self._last_end = time.perf_counter()
        self.stepped += self._last_end - self._start

    def report(self) -> dict[str, Any]:
        return {"indices": self.seen, "wait_s": self.waited, "step_s": self.stepped}


def lightning() -> dict[str, Any]:
    """Lightning, ``use_distributed_sampler=True`` (its default): Lightning rebuilds the
    loader with a DistributedSampler. Once from a ``train_dataloader`` hook (Lightning saw
    the arguments), once passed to ``fit`` (Lightning reads them back from attributes)."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self, from_hook: bool) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.from_hook = from_hook
            self.recorder = _Recorder()
            self.loader_seen: Any = None

        def train_dataloader(self) -> Any:
            if not self.from_hook:
                raise NotImplementedError
            return _aioload_loader()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.recorder.start()

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
            self.recorder.seen += [int(i) for i in batch["index"]]
            _step()
            return self.layer(batch["x"]).pow(2).mean()  # type: ignore[no-any-return]

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.recorder.end()

        def on_train_epoch_end(self) -> None:
            self.loader_seen = self.trainer.train_dataloader

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    report: dict[str, Any] = {}
    for flow in ("hook", "fit_argument"):
        module = Module(from_hook=flow == "hook")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_epochs=1,
            use_distributed_sampler=True,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        if flow == "hook":
            trainer.fit(module)
        else:
            trainer.fit(module, train_dataloaders=_aioload_loader())
        loader = module.loader_seen
        report[flow] = module.recorder.report()
        report[flow + "_type"] = type_name(loader)
        report[flow + "_is_aioload"] = isinstance(loader, aioload.DataLoader)
        report[flow + "_sampler"] = type_name(loader.sampler)
        report[flow + "_shuffles"] = bool(getattr(loader.sampler, "shuffle", False))
        report[flow + "_len"] = len(loader)
        report[flow + "_stats"] = _aioload_stats(loader)
        if isinstance(loader, aioload.DataLoader):
            loader.shutdown()
    return report


def transformers() -> dict[str, Any]:
    """HF ``Trainer`` whose ``get_train_dataloader`` returns an aioload loader."""
    from transformers import Trainer, TrainingArguments

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.recorder = _Recorder()

        def forward(
            self, index: torch.Tensor, x: torch.Tensor, labels: torch.Tensor
        ) -> dict[str, torch.Tensor]:
            self.recorder.start()
            self.recorder.seen += [int(i) for i in index]
            _step()
            loss = (self.layer(x).squeeze(-1) - labels).pow(2).mean()
            self.recorder.end()
            return {"loss": loss}

    class AioloadTrainer(Trainer):
        def get_train_dataloader(self) -> Any:
            self.aioload_loader = _aioload_loader(batch_size=self.args.per_device_train_batch_size)
            return self.aioload_loader

    model = Tiny()
    with tempfile.TemporaryDirectory() as output_dir:
        arguments = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=BATCH,
            num_train_epochs=1,
            use_cpu=True,
            ddp_backend="gloo",
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            learning_rate=0.01,
        )
        trainer = AioloadTrainer(model=model, args=arguments, train_dataset=Indexed())
        started = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - started
    loader = trainer.aioload_loader
    # The Trainer's loop runs between forward calls: the recorder's gaps include the
    # backward pass and the optimizer step, so the loader's own figure is the fairer one.
    return {
        "rank": int(os.environ["RANK"]),
        "train": model.recorder.report(),
        "train_s": elapsed,
        "global_step": trainer.state.global_step,
        "type": type_name(loader),
        "len": len(loader),
        "stats": _aioload_stats(loader),
    }
