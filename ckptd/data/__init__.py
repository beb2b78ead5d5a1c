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

from ckptd.data.cache import ShardCache
from ckptd.data.collate import list_batch, next_token_split, tensor_batch
from ckptd.data.dataset import RankBatch, ShardDataset
from ckptd.data.fetch import VerifiedFetcher
from ckptd.data.indexer import IndexResult, index_dataset
from ckptd.data.loader import LoaderState, ShardLoader
from ckptd.data.manifest import DatasetManifest, ShardRecord, load_dataset_manifest, save_dataset_manifest
from ckptd.data.order import EpochOrder, RankSchedule
from ckptd.data.position import StepConvention
from ckptd.data.reader_api import OpenShard, ShardLayout, ShardReader
from ckptd.data.registry import available_formats, make_reader, reader_class, register_reader

__all__ = [
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
