"""Three errors that say what to do:

- an argument that cannot be pickled under spawn or forkserver (a lambda ``collate_fn``, a
  dataset holding a lock) says which one it is, and what to make of it, beside pickle's own
  message and with pickle's own exception type;
- a worker that dies under spawn because the script has no ``if __name__ == "__main__":``
  guard says so;
- a dataset error names the index of the sample whose fetch raised, beside torch's message
  (whose first lines, and the exception's own last line, stay as torch has them).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import aioload
from tests.scripts.datasets import Squares

ROOT = Path(__file__).resolve().parents[2]


def _identity(batch: Any) -> Any:
    return batch


class Locked(Squares):
    """A dataset holding a thread lock: it cannot be pickled."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


@pytest.mark.processes_only(
    "spawn pickles the collate_fn for each worker process; threads pickle nothing"
)
@pytest.mark.timeout(60)
def test_a_lambda_collate_fn_under_spawn_is_named(stop_mp_helpers: None) -> None:
    loader = aioload.DataLoader(
        Squares(8),
        batch_size=2,
        num_workers=2,
        collate_fn=lambda batch: batch,
        multiprocessing_context="spawn",
    )
    # pickle's own type: PicklingError, or AttributeError for a lambda defined in a function.
    with pytest.raises((pickle.PicklingError, AttributeError)) as caught:
        next(iter(loader))
    message = str(caught.value)
    assert message.startswith("collate_fn cannot be pickled")
    assert "define it with `def` at the top level of a module" in message
    assert "not as a lambda" in message
    assert "Can't pickle" in message  # pickle's own words, kept
    assert type(caught.value.__cause__) is type(caught.value)


@pytest.mark.processes_only(
    "forkserver pickles worker_init_fn for each worker process; threads pickle nothing"
)
@pytest.mark.timeout(60)
def test_a_local_worker_init_fn_under_forkserver_is_named(stop_mp_helpers: None) -> None:
    def init(worker_id: int) -> None:
        pass

    loader = aioload.DataLoader(
        Squares(8),
        batch_size=2,
        num_workers=1,
        collate_fn=_identity,
        worker_init_fn=init,
        multiprocessing_context="forkserver",
    )
    with pytest.raises((pickle.PicklingError, AttributeError)) as caught:
        next(iter(loader))
    assert str(caught.value).startswith("worker_init_fn cannot be pickled")


@pytest.mark.processes_only("pickling the dataset for worker processes; threads share it")
@pytest.mark.timeout(60)
def test_an_unpicklable_dataset_keeps_picklings_type(stop_mp_helpers: None) -> None:
    loader = aioload.DataLoader(
        Locked(8), batch_size=2, num_workers=1, multiprocessing_context="spawn"
    )
    with pytest.raises(TypeError) as caught:
        next(iter(loader))
    message = str(caught.value)
    assert message.startswith("the dataset cannot be pickled")
    assert "in worker_init_fn, or on first use" in message
    assert "cannot pickle '_thread.lock' object" in message


SCRIPT_WITHOUT_GUARD = """
    import torch
    import aioload
    from torch.utils.data import Dataset


    class Numbers(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            return torch.tensor(index)


    loader = aioload.DataLoader(
        Numbers(), batch_size=2, num_workers=1, multiprocessing_context="spawn"
    )
    print(len(list(loader)))
"""


@pytest.mark.no_local_workers("a script of its own, whose spawned worker processes re-run it")
@pytest.mark.timeout(120)
def test_a_missing_main_guard_under_spawn_is_hinted(tmp_path: Path) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(SCRIPT_WITHOUT_GUARD))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("aioload.errors.WorkerDiedError: DataLoader worker (pid"), last
    assert "exited unexpectedly with exit code 1." in last
    assert 'move that code under `if __name__ == "__main__":`' in last


class BadRecord(Squares):
    """Record 5 raises."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 5:
            raise ValueError("record 5 is unreadable")
        return super().__getitem__(index)


def _first_error(loader: aioload.DataLoader[Any]) -> BaseException:
    with pytest.raises(Exception) as caught:  # the type is checked by the caller
        for _ in loader:
            pass
    return caught.value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_dataset_error_names_the_samples_index(no_leaks: None, shuffle: bool) -> None:
    error = _first_error(
        aioload.DataLoader(BadRecord(16), batch_size=4, num_workers=2, shuffle=shuffle)
    )
    assert isinstance(error, ValueError)
    message = str(error)
    lines = message.splitlines()
    assert lines[0].startswith("Caught ValueError in DataLoader worker process ")
    assert lines[1] == "Original Traceback (most recent call last):"
    assert lines[2] == "  (fetching the sample at index 5)"
    assert lines[-1] == "ValueError: record 5 is unreadable"


def _failing_collate(batch: Any) -> Any:
    raise ValueError("collate failed")


@pytest.mark.timeout(60)
def test_an_error_of_no_one_sample_names_no_index(no_leaks: None) -> None:
    error = _first_error(
        aioload.DataLoader(Squares(8), batch_size=4, num_workers=1, collate_fn=_failing_collate)
    )
    assert "fetching the sample at index" not in str(error)
    assert str(error).rstrip().endswith("ValueError: collate failed")
