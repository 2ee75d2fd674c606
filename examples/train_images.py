"""The main demo (``make run``): a small image-classification pipeline, trained with ``async for``.

1. On the first run, about 2,000 JPEGs of coloured shapes (four classes) are drawn with Pillow
   into ``data/images/`` (git-ignored). Later runs reuse them. A few are corrupt on purpose
   (truncated, or not a JPEG at all), as some records always are at scale.
2. A dataset decodes each JPEG with Pillow and augments it with numpy (random crop, flip,
   brightness), as a real vision pipeline does.
3. A small CNN trains for one epoch on the CPU, under ``async for``, with a progress bar that
   shows batches/s and the live data-bound %. ``on_sample_error="skip"`` trains through the
   corrupt files: each costs its sample, and is counted, listed and capped (``max_skipped``).
4. It prints ``loader.stats()`` (the skipped files among it), then the images/s of aioload
   next to torch's DataLoader on the same pipeline, training one epoch and loading alone (on
   the readable files: one corrupt file would end torch's epoch). Each rate is timed from the
   pass's first batch on, so the workers' start is left out for both.

aioload's workers are processes; ``--worker-method thread`` runs them as threads.
Options: ``--images``, ``--batch-size``, ``--workers``, ``--worker-method``, ``--data-dir``;
run with ``--help``.
With ``AIOLOAD_EXAMPLE_SMALL=1`` it runs on 64 images (the examples test does this).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import uvloop
from PIL import Image, ImageDraw
from torch import nn
from torch.utils.data import Dataset, get_worker_info

import aioload

SMALL = os.environ.get("AIOLOAD_EXAMPLE_SMALL", "") not in ("", "0")
CLASSES = ("circle", "square", "triangle", "cross")
IMAGE_SIDE = 96  # stored size
# Images written corrupt on purpose (those below --images): two truncated, two not JPEGs.
CORRUPT = {5: "truncated", 37: "garbage", 1001: "truncated", 1666: "garbage"}
CROP_SIDE = 80  # what the network sees, after a random crop
# Worker processes: with two workers on two cores they decoded and augmented JPEGs faster
# than threads did (docs/benchmarks.md, the jpeg rows of the thread-workers section).
# `--worker-method thread` runs the same pipeline on threads (docs/threads.md).
WORKER_METHOD = "multiprocessing"


# -- 1. the images -------------------------------------------------------------------------------


def _draw(index: int) -> tuple[Image.Image, int]:
    """Image ``index``: a shape of class ``index % 4`` at a random place, size and colour, on
    a noisy background. Seeded by the index, so every run draws the same images."""
    rng = np.random.default_rng(index)
    label = index % len(CLASSES)
    background = rng.integers(0, 90, size=(IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    image = Image.fromarray(background, "RGB")
    draw = ImageDraw.Draw(image)
    size = int(rng.integers(28, 56))
    x, y = (int(v) for v in rng.integers(4, IMAGE_SIDE - size - 4, size=2))
    colour = tuple(int(c) for c in rng.integers(120, 256, size=3))
    box = (x, y, x + size, y + size)
    if label == 0:
        draw.ellipse(box, fill=colour)
    elif label == 1:
        draw.rectangle(box, fill=colour)
    elif label == 2:
        draw.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)], fill=colour)
    else:
        bar = max(4, size // 4)
        draw.rectangle((x + (size - bar) // 2, y, x + (size + bar) // 2, y + size), fill=colour)
        draw.rectangle((x, y + (size - bar) // 2, x + size, y + (size + bar) // 2), fill=colour)
    return image, label


def ensure_images(folder: Path, count: int) -> list[Path]:
    """The ``count`` JPEGs in ``folder``, drawn on first use. A marker file written last says
    the set is complete, so an interrupted first run is redone rather than half used."""
    # (v2: sets drawn before the corrupt files existed are drawn again.)
    marker = folder / f".complete-v2-{count}"
    paths = [folder / f"{i:05d}_{CLASSES[i % len(CLASSES)]}.jpg" for i in range(count)]
    if marker.exists():
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i, path in enumerate(paths):
        image, _ = _draw(i)
        image.save(path, quality=90)
        damage = CORRUPT.get(i)
        if damage == "truncated":
            # Cut off mid-scan, as an interrupted copy leaves it: Pillow opens it, then fails
            # to decode it.
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
        elif damage == "garbage":
            path.write_bytes(b"<html>404 Not Found</html>")  # what a failed download saved
    marker.touch()
    corrupt = sum(1 for i in CORRUPT if i < count)
    print(
        f"drew {count} JPEGs into {folder} in {time.perf_counter() - started:.1f} s "
        f"({corrupt} corrupt on purpose)"
    )
    return paths


# -- 2. the dataset ------------------------------------------------------------------------------


def _augmentation() -> tuple[int, int, bool, float]:
    """A random crop's corner, a flip or not, a brightness scale."""
    rng = getattr(get_worker_info(), "rng", None)
    # A thread worker draws from its own generators: threads share numpy's global one, so
    # the draws would depend on how the threads interleave. A worker process draws from
    # numpy's global generator, which each worker seeds differently (torch's rule, kept by
    # aioload). Both are numpy RandomStates, with np.random's methods.
    draw: Any = np.random if rng is None else rng.numpy_generator
    top, left = draw.randint(0, IMAGE_SIDE - CROP_SIDE + 1, size=2)
    return int(top), int(left), bool(draw.rand() < 0.5), float(draw.uniform(0.8, 1.2))


class JpegShapes(Dataset[tuple[torch.Tensor, int]]):
    """Decode with Pillow, augment with numpy, return a normalised CHW float tensor."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths = [str(p) for p in paths]
        self.labels = [CLASSES.index(Path(p).stem.split("_")[1]) for p in self.paths]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.paths[index]) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
        top, left, flip, scale = _augmentation()
        pixels = pixels[top : top + CROP_SIDE, left : left + CROP_SIDE]
        if flip:
            pixels = pixels[:, ::-1]
        pixels = pixels * scale / 255.0
        pixels = (pixels - 0.25) / 0.25
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))), self.labels[index]


# -- 3. the model and one epoch --------------------------------------------------------------


def small_cnn() -> nn.Module:
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))

    # Small on purpose: one step costs tens of milliseconds on two CPU cores.
    return nn.Sequential(
        block(3, 8),
        block(8, 16),
        block(16, 32),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, len(CLASSES)),
    )


class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = small_cnn()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.003)
        self.loss_fn = nn.CrossEntropyLoss()
        self.correct = 0
        self.seen = 0

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        logits = self.model(images)
        loss = self.loss_fn(logits, labels)
        loss.backward()
        self.optimizer.step()
        self.correct += int((logits.argmax(1) == labels).sum())
        self.seen += len(labels)
        return loss.item()


# Rates are timed from the first batch on: the workers' start (a one-off, which persistent
# workers pay once) is left out for both loaders, and what is measured is the steady state.


async def train_epoch_async(loader: aioload.DataLoader[Any]) -> tuple[Trainer, float]:
    """The trainer, and images/s from the first batch on."""
    trainer = Trainer()
    started, first = 0.0, 0
    async for images, labels in aioload.progress(loader, desc="train (aioload, async for)"):
        if not started:
            started, first = time.perf_counter(), len(images)
        trainer.step(images, labels)
        # A real loop would also await logging, checkpoints, an eval server... here, a yield.
        await asyncio.sleep(0)
    return trainer, (trainer.seen - first) / (time.perf_counter() - started)


def train_epoch_sync(loader: Any) -> tuple[Trainer, float]:
    """The trainer, and images/s from the first batch on."""
    trainer = Trainer()
    started, first = 0.0, 0
    # The same bar as the aioload run, so both loops pay the same for it.
    for images, labels in aioload.progress(loader, desc="train (torch, for)"):
        if not started:
            started, first = time.perf_counter(), len(images)
        trainer.step(images, labels)
    return trainer, (trainer.seen - first) / (time.perf_counter() - started)


def load_only(loader: Any) -> float:
    """Images/s of the loader alone (decode and augment, no training), from the first batch."""
    started, count = 0.0, 0
    for images, _labels in loader:
        if not started:
            started = time.perf_counter()
        else:
            count += len(images)
    return count / (time.perf_counter() - started)


# -- 4. the report -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--images", type=int, default=64 if SMALL else 2000)
    parser.add_argument("--batch-size", type=int, default=16 if SMALL else 32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--worker-method",
        choices=["thread", "multiprocessing", "auto"],
        default=WORKER_METHOD,
        help=f"aioload's workers (default {WORKER_METHOD!r})",
    )
    default_data = (
        os.environ.get("AIOLOAD_EXAMPLE_DATA") or Path(__file__).resolve().parents[1] / "data"
    )
    parser.add_argument("--data-dir", type=Path, default=Path(default_data) / "images")
    args = parser.parse_args()

    # The loader's workers need CPUs too: training threads that compete with them for the same
    # cores make each step several times slower (OpenMP threads spin waiting for each other).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - args.workers))
    paths = ensure_images(args.data_dir, args.images)
    dataset = JpegShapes(paths)
    settings: dict[str, Any] = {
        "batch_size": args.batch_size,
        "num_workers": args.workers,
        "shuffle": True,
        "generator": torch.Generator().manual_seed(0),
    }

    # A corrupt file costs its sample, not the run: skipped, counted and listed in the stats,
    # and the run stops (TooManySampleErrors) if more than 5 % of the epoch is unreadable.
    loader = aioload.DataLoader(
        dataset,
        **settings,
        worker_method=args.worker_method,
        on_sample_error="skip",
        max_skipped=0.05,
    )
    trainer, aio_train = uvloop.run(train_epoch_async(loader))
    print()
    stats = loader.stats()
    print(stats)
    print(f"\none epoch: accuracy {trainer.correct / trainer.seen:.1%} on {trainer.seen} images")
    for record in stats.skipped:
        print(f"  skipped {Path(dataset.paths[record.index]).name}: {record.error}")

    # torch's DataLoader has no skip: its runs read only the readable files.
    readable = JpegShapes([p for i, p in enumerate(paths) if i not in CORRUPT])
    dataset = readable

    settings["generator"] = torch.Generator().manual_seed(0)
    torch_loader = torch.utils.data.DataLoader(dataset, **settings)
    _, torch_train = train_epoch_sync(torch_loader)

    aio_load = load_only(aioload.DataLoader(dataset, **settings, worker_method=args.worker_method))
    torch_load = load_only(torch.utils.data.DataLoader(dataset, **settings))

    n = len(dataset)
    print(
        f"\n{n} JPEGs {IMAGE_SIDE}x{IMAGE_SIDE}, batch {args.batch_size}, "
        f"{args.workers} workers ({args.worker_method} for aioload), {os.cpu_count()} CPUs"
    )
    print(f"  {'images/s, from the first batch':<32} {'aioload':>10} {'torch':>10}")
    print(f"  {'train one epoch':<32} {aio_train:>8.0f}/s {torch_train:>8.0f}/s")
    print(f"  {'load only':<32} {aio_load:>8.0f}/s {torch_load:>8.0f}/s")


if __name__ == "__main__":
    main()
