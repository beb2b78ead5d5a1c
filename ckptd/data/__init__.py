"""Verified data shards: manifest and indexer, shard cache, readers, and the resumable loader.

Typical use::

    from ckptd.data import ShardDataset, ShardLoader

    dataset = ShardDataset("manifest.json", global_batch_size=256, seed=1234)
    loader = ShardLoader(dataset, num_workers=2)
    state = {"model": model, "optim": optim, "data": loader}
    manager.restore(state)          # puts the loader back at the saved position
    for batch in loader: ...        # one epoch from the current position; batches are tensors

``ShardLoader(..., batches_per_step=, start_step=)`` map the step a manager saves to the batch the
next step trains on (:mod:`ckptd.data.position`), so loops that fetch ahead resume exactly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptd.data.cache import ShardCache
from ckptd.data.fetch import VerifiedFetcher
from ckptd.data.indexer import IndexResult, index_dataset
from ckptd.data.manifest import DatasetManifest, ShardRecord, load_dataset_manifest, save_dataset_manifest
from ckptd.data.order import EpochOrder, RankSchedule
from ckptd.data.position import StepConvention
from ckptd.data.reader_api import OpenShard, ShardLayout, ShardReader
from ckptd.data.registry import available_formats, make_reader, reader_class, register_reader

if TYPE_CHECKING:
    from ckptd.data.collate import list_batch, next_token_split, tensor_batch
    from ckptd.data.dataset import RankBatch, ShardDataset
    from ckptd.data.loader import LoaderState, ShardLoader
    from ckptd.state.loaders import (describe_loader, first_warning_for, has_position, loader_state_item,
                                     warn_unresumable_loader)

#: Names that need torch, and their modules: imported on first use (PEP 562), so that indexing
#: (``ckptd data index``) and manifest tools start without torch.
_LAZY: dict[str, str] = {
    "list_batch": "ckptd.data.collate", "next_token_split": "ckptd.data.collate",
    "tensor_batch": "ckptd.data.collate", "RankBatch": "ckptd.data.dataset", "ShardDataset": "ckptd.data.dataset",
    "LoaderState": "ckptd.data.loader", "ShardLoader": "ckptd.data.loader",
    # any framework's loader as a state item (ckptd.state.loaders): what integrations use
    "describe_loader": "ckptd.state.loaders", "first_warning_for": "ckptd.state.loaders",
    "has_position": "ckptd.state.loaders",
    "loader_state_item": "ckptd.state.loaders", "warn_unresumable_loader": "ckptd.state.loaders",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "describe_loader",
    "first_warning_for",
    "has_position",
    "loader_state_item",
    "warn_unresumable_loader",
    "DatasetManifest",
    "EpochOrder",
    "IndexResult",
    "LoaderState",
    "OpenShard",
    "RankBatch",
    "RankSchedule",
    "ShardCache",
    "ShardDataset",
    "ShardLayout",
    "ShardLoader",
    "ShardReader",
    "ShardRecord",
    "StepConvention",
    "VerifiedFetcher",
    "available_formats",
    "index_dataset",
    "list_batch",
    "load_dataset_manifest",
    "make_reader",
    "next_token_split",
    "reader_class",
    "register_reader",
    "save_dataset_manifest",
    "tensor_batch",
]
