"""Iterating the loader must not consume the training's global random numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptd.data import ShardDataset, ShardLoader, index_dataset
from ckptd.data.testing import write_jsonl_shards


@pytest.mark.parametrize("num_workers", [0, 2])
def test_starting_an_epoch_leaves_the_global_torch_rng_alone(tmp_path: Path, num_workers: int) -> None:
    write_jsonl_shards(tmp_path / "shards", [8, 8])
    manifest = index_dataset(str(tmp_path / "shards"), "jsonl").manifest
    loader = ShardLoader(ShardDataset(manifest, global_batch_size=4, seed=3, cache_dir=tmp_path / "cache"),
                         num_workers=num_workers)
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    batches = list(loader)
    assert len(batches) == 4
    assert torch.equal(torch.rand(4), expected)
