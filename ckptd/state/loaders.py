"""Data loaders as state items: saved with their position when they have one, named in a warning when not.

A loader with ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``, ckptd's
``ShardLoader``, accelerate's loaders with ``use_stateful_dataloader``) is an ordinary stateful state item:
its position within the epoch, its workers' positions included, is saved with the step and put back by a
restore, so a resume in the middle of an epoch continues with the next batch.

A plain ``torch.utils.data.DataLoader`` keeps no position: a new iterator starts the epoch again, and a
shuffling sampler without a generator draws a new permutation from the global RNG. ckptd cannot capture
that from outside, so it saves nothing for such a loader and warns once per loader, naming it and the
one-line fix. Framework integrations that can capture more for their own loaders do so before they fall
back to this warning.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from torch.utils.data import DataLoader

log = logging.getLogger("ckptd.loaders")

#: The one-line fix the warning names.
STATEFUL_LOADER_FIX = ("build it as torchdata's StatefulDataLoader with the same arguments "
                       "(`from torchdata.stateful_dataloader import StatefulDataLoader`; pip install torchdata), "
                       "or use ckptd's ShardLoader")

_warned: weakref.WeakSet[Any] = weakref.WeakSet()
_warned_ids: set[int] = set()  # loaders that take no weak reference


def has_position(loader: Any) -> bool:
    """Whether ``loader`` saves and restores its own position (``state_dict()``/``load_state_dict()``). An
    accelerate loader prepared without ``use_stateful_dataloader`` has those methods but no state behind them."""
    if getattr(loader, "use_stateful_dataloader", True) is False:
        return False
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def is_unresumable_loader(value: Any) -> bool:
    """A torch ``DataLoader`` (or a subclass) without a position of its own (see the module docstring)."""
    return isinstance(value, DataLoader) and not has_position(value)


def describe_loader(loader: Any) -> str:
    """``DataLoader(dataset=MyDataset, sampler=RandomSampler, num_workers=2)``: enough to find it in a script."""
    parts = []
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        parts.append(f"dataset={type(dataset).__name__}")
    sampler = getattr(loader, "sampler", None)
    if sampler is not None:
        parts.append(f"sampler={type(sampler).__name__}")
    workers = getattr(loader, "num_workers", None)
    if workers is not None:
        parts.append(f"num_workers={workers}")
    return f"{type(loader).__name__}({', '.join(parts)})"


def first_warning_for(loader: Any) -> bool:
    """True the first time it is asked about ``loader``, False after: one warning per loader, whatever warns."""
    try:
        if loader in _warned:
            return False
        _warned.add(loader)
    except TypeError:  # a loader that takes no weak reference
        if id(loader) in _warned_ids:
            return False
        _warned_ids.add(id(loader))
    return True


def warn_unresumable_loader(loader: Any, name: str, why: str = "") -> bool:
    """Warn once per loader that its position within an epoch is not saved; True when this call warned.

    ``name`` says where the loader is (a state key, ``train_dataloader``); ``why`` what makes it unresumable
    when that is more than "a plain DataLoader"."""
    if not first_warning_for(loader):
        return False
    reason = why or "a plain DataLoader keeps no position within an epoch"
    log.warning("data loader %r, %s: %s, so ckptd saves no position for it and a resume in the middle of an "
                "epoch does not continue with the next batch (a shuffled loader draws a new order). To resume "
                "exactly, %s.", name, describe_loader(loader), reason, STATEFUL_LOADER_FIX)
    return True


def loader_state_item(loader: Any, name: str) -> Any | None:
    """What to put in a ckptd state for ``loader``: the loader itself when it saves its own position; None
    (after the once-per-loader warning) when it cannot."""
    if has_position(loader):
        return loader
    warn_unresumable_loader(loader, name)
    return None
