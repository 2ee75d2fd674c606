"""How a worker process gets what it runs: ``(dataset, collate_fn, worker_init_fn)``, as the
objects themselves (fork) or pickled once for every worker (spawn, forkserver), and what the
consumer reads when one of them cannot be pickled (torch's warning, where the installed torch
gives it, and which object it is, with what to do).
"""

from __future__ import annotations

import functools
import inspect
import pickle
import warnings
from typing import Any

__all__ = ["payload"]


def payload(objects: tuple[Any, Any, Any], forking: bool) -> tuple[Any, Any, Any] | bytes:
    """How ``(dataset, collate_fn, worker_init_fn)`` travel to each worker (in its
    ``WorkerConfig``, which is part of ``Process(args=...)``).

    - fork: the objects themselves. The workers inherit them; nothing is pickled.
    - spawn and forkserver, fast path: pickled here once, and the same bytes go to every worker
      (and to any replacement), rather than one pickle of the dataset per worker.
    - spawn and forkserver, when that pickle fails: the objects themselves, so that each
      ``Process.start()`` pickles them while it is spawning, as torch's loader does. That is
      the only time multiprocessing lets a Lock, Event, Condition, Value or Queue of the
      loader's context cross to a child ("... should only be shared between processes through
      inheritance" otherwise). ``start()`` still does not wait for a worker to come up, so
      the workers start concurrently either way.
    - anything else that cannot be pickled (a thread lock, an open file) cannot be pickled
      while spawning either: it raises here, before ``Process.start()`` would start
      multiprocessing's resource tracker (or forkserver) only to fail, leaving that helper
      process behind.
    """
    if forking:
        return objects
    try:
        return pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
    except RuntimeError as error:
        # Only the "shared through inheritance" refusal is worth a second try while spawning.
        if "inheritance" not in str(error):
            raise _unpicklable(objects, error) from error
        return objects
    except (TypeError, AttributeError, pickle.PicklingError) as error:
        # The errors torch's loader warns about as it starts a worker, where it does.
        _warn_as_torch_on_pickle_error()
        raise _unpicklable(objects, error) from error
    except Exception as error:
        raise _unpicklable(objects, error) from error


# What torch's loader warns (from torch 2.11) when a worker's arguments cannot be pickled.
_TORCH_PICKLE_WARNING = (
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork')."
)


@functools.cache
def _torch_warns_on_pickle_error() -> bool:
    """Whether the installed torch's loader gives that warning: read from its source, once,
    and only when a pickle has failed (a feature, not a version, is asked about)."""
    from torch.utils.data import dataloader

    try:
        source = inspect.getsource(dataloader._MultiProcessingDataLoaderIter)
    except (OSError, TypeError):
        return False
    return "Got pickle error when attempting to start a worker Process" in source


def _warn_as_torch_on_pickle_error() -> None:
    if _torch_warns_on_pickle_error():
        warnings.warn(_TORCH_PICKLE_WARNING, stacklevel=3)


_PICKLED = ("the dataset", "collate_fn", "worker_init_fn")


def _unpicklable(objects: tuple[Any, Any, Any], error: Exception) -> Exception:
    """``error``, of its own type where it can be made from a message, with a message that
    says which of ``(dataset, collate_fn, worker_init_fn)`` cannot be pickled and what to do."""
    culprit = None
    for name, obj in zip(_PICKLED, objects, strict=True):
        try:
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            culprit = (name, obj)
            break
    if culprit is None:
        return error
    name, obj = culprit
    if name == "the dataset":
        advice = (
            "make what cannot be pickled (an open file, a lock, a client) in the worker "
            "instead: in worker_init_fn, or on first use"
        )
    else:
        advice = (
            f"define it with `def` at the top level of a module, not as a lambda or inside "
            f"another function (a functools.partial of such a function works too); {name} is "
            f"{obj!r}"
        )
    message = (
        f"{name} cannot be pickled, and under the 'spawn' and 'forkserver' start methods "
        f"every worker gets a pickled copy: {advice}. {type(error).__name__}: {error}"
    )
    try:
        return type(error)(message)
    except Exception:
        return pickle.PicklingError(message)
