"""Workers as Ray actors on a (local, two-node) Ray cluster.

    pip install 'aioload[ray]'
    python examples/ray_cluster.py

The example starts its own cluster with ``ray.cluster_utils.Cluster``: a head node and one more
node, 1 CPU each, in this machine. On a real cluster you would skip that part: under Ray Train
(or after ``ray.init(address=...)``) the session already exists, and ``RayWorkers()`` uses it;
otherwise it connects to ``RAY_ADDRESS``. The loader's 2 workers run as Ray actors, one on each
node; the example reads one epoch of augmented "images", checks that every sample arrived once,
in order, and prints ``loader.stats()``, which names the node each actor ran on.

Ray binds to this machine's network interface; the repository's tests run this example in a
loopback-only network namespace.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

import aioload

SMALL = os.environ.get("AIOLOAD_EXAMPLE_SMALL") == "1"
SAMPLES = 128 if SMALL else 4_096


class Augmented(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """A 3x64x64 "decoded image" per index, randomly flipped and brightened: CPU work that
    would run on the cluster's nodes instead of the GPU host."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        image = torch.full((3, 64, 64), index % 251, dtype=torch.uint8)
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        image = (image.float() * (0.8 + 0.4 * torch.rand(()))).clamp(0, 255).to(torch.uint8)
        return {"image": image, "index": torch.tensor(index)}


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    # A short temp dir: Ray's AF_UNIX socket paths must stay under 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="aioex-", dir="/tmp")
    # Cluster records its address in $RAY_TMPDIR/ray/ray_current_cluster: keep that private.
    os.mkdir(os.path.join(temp_dir, "ray"))
    os.environ["RAY_TMPDIR"] = temp_dir
    node_args = {"num_cpus": 1, "temp_dir": temp_dir}
    started = time.perf_counter()
    try:
        cluster = Cluster(
            initialize_head=True, head_node_args={**node_args, "include_dashboard": False}
        )
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    try:
        cluster.add_node(**node_args)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        print(f"local Ray cluster: {len(ray.nodes())} nodes, {time.perf_counter() - started:.1f} s")

        loader = aioload.DataLoader(
            Augmented(SAMPLES),
            batch_size=32,
            num_workers=2,
            seed_per_sample=True,
            workers=aioload.RayWorkers(num_cpus=1),
        )
        seen: list[int] = []
        started = time.perf_counter()
        for batch in loader:
            seen.extend(int(i) for i in batch["index"])
        elapsed = time.perf_counter() - started
        assert seen == list(range(SAMPLES)), "every sample once, in order"
        print(f"one epoch: {SAMPLES} samples in {elapsed:.1f} s (actor start included)")
        stats = loader.stats()
        print(stats)
        for w in stats.workers:
            print(f"worker {w.worker_id}: {w.where}")
        nodes = {w.where.split(" node ")[1].split(" ")[0] for w in stats.workers if w.where}
        print(f"actors ran on {len(nodes)} node(s)")
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
