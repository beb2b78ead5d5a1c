"""A ShardDataset built before the process group exists takes its rank and world size when it starts
iterating (``ShardDataset.bind``), follows a process group formed again (a new generation), and refuses to
be iterated inside a group of several ranks once it was bound without one. Real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptd.data import ShardDataset, ShardLoader, index_dataset, save_dataset_manifest
from ckptd.errors import ConfigError
from ckptd.testing.multirank import free_port, run_multirank

pytestmark = pytest.mark.multirank


def _regroup(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def _binding(rank: int, world_size: int, manifest: str, cache: str, ports: list[int]) -> dict[str, Any]:
    import torch.distributed as dist

    dist.destroy_process_group()  # from here as in an elastic job's setup_fn: no group yet
    built_early = ShardDataset(manifest, global_batch_size=4, seed=1, cache_dir=cache)
    lonely = ShardDataset(manifest, global_batch_size=4, seed=1, cache_dir=cache)
    next(iter(lonely))  # bound as rank 0 of 1, without a group
    _regroup(rank, world_size, ports[0])
    loader = ShardLoader(built_early, with_sample_ids=True)
    _, first = next(iter(loader))
    try:
        next(iter(lonely))
        refused = ""
    except ConfigError as error:
        refused = str(error)
    _regroup(rank, world_size, ports[1])  # the next generation's group
    _, second = next(iter(loader))
    return {"first": first, "second": second, "refused": refused, "world": built_early.schedule.world_size}


def test_a_dataset_built_before_the_group_binds_at_its_first_iteration(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-0.jsonl").write_text("".join(json.dumps({"id": index}) + "\n" for index in range(16)))
    save_dataset_manifest(index_dataset(str(data), "jsonl").manifest, tmp_path / "manifest.json")
    results = run_multirank(_binding, 2, str(tmp_path / "manifest.json"), str(tmp_path / "cache"),
                            [free_port(), free_port()])
    assert [result["world"] for result in results] == [2, 2]
    firsts = [result["first"] for result in results]
    assert len(firsts[0]) == len(firsts[1]) == 2 and not set(firsts[0]) & set(firsts[1]), firsts
    seconds = [result["second"] for result in results]  # the second global batch, in the new group
    assert len(set(seconds[0] + seconds[1])) == 4 and not set(seconds[0] + seconds[1]) & set(firsts[0] + firsts[1])
    for result in results:
        assert "took rank 0 of 1 when it was first iterated (without a process group)" in result["refused"], result
        assert "rank= and world_size=" in result["refused"]
