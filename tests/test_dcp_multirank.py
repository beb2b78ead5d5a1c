"""DCP storage plugins on real gloo process groups: DTensor state saved at world size 4 loads at 2 and
1 with equal values, through dcp.load and through CheckpointManager.restore (resharding)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptd
from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter
from ckptd.testing import run_multirank

pytestmark = pytest.mark.multirank

DCP_STEP, MANAGER_STEP = 5, 7


def _global() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12 * 6, dtype=torch.float32).reshape(12, 6) / 7,
            "emb": (torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3) - 4).to(torch.bfloat16),
            "bias": torch.linspace(-1, 1, 6)}


def _sharded(world_size: int, fill: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    source = _global()
    if not fill:
        source = {k: torch.zeros_like(v) for k, v in source.items()}
    return {"w": distribute_tensor(source["w"], mesh, [Shard(0)]),
            "emb": distribute_tensor(source["emb"], mesh, [Shard(1)]),
            "bias": distribute_tensor(source["bias"], mesh, [Replicate()])}


def _save_at(rank: int, world_size: int, root: str) -> bool:
    state = {"model": _sharded(world_size, fill=True), "epoch": 4, "tag": {"name": "dtensor", "ok": True}}
    dcp.save(state, storage_writer=CkptdStorageWriter(root, step=DCP_STEP))
    manager = ckptd.CheckpointManager(f"{root}/managed", capture_rng=False)
    manager.save(MANAGER_STEP, {"model": _sharded(world_size, fill=True), "epoch": 4})
    manager.close()
    return True


def _full(state: dict[str, Any]) -> dict[str, bytes]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).contiguous().view(torch.uint8).numpy().tobytes()
            for k, v in state.items()}


def _load_at(rank: int, world_size: int, root: str) -> bool:
    expected = {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in _global().items()}
    state = {"model": _sharded(world_size, fill=False), "epoch": 0, "tag": {"name": "", "ok": False}}
    dcp.load(state, storage_reader=CkptdStorageReader(root, step=DCP_STEP))
    assert _full(state["model"]) == expected
    assert state["epoch"] == 4 and state["tag"] == {"name": "dtensor", "ok": True}

    managed = {"model": _sharded(world_size, fill=False), "epoch": 0}
    manager = ckptd.CheckpointManager(f"{root}/managed", capture_rng=False)
    assert manager.restore(managed) == MANAGER_STEP
    assert manager.last_restore is not None and manager.last_restore.resharded
    manager.close()
    assert all(isinstance(v, DTensor) for v in managed["model"].values())
    assert _full(managed["model"]) == expected and managed["epoch"] == 4
    return True


def test_dtensor_saved_at_4_loads_at_2_and_1(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert run_multirank(_save_at, 4, root, timeout_s=150) == [True] * 4
    assert run_multirank(_load_at, 2, root, timeout_s=150) == [True] * 2

    expected = _global()  # world size 1, no process group: plain tensors receive the whole tensors
    state = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "epoch": 0,
             "tag": {"name": "", "ok": False}}
    dcp.load(state, storage_reader=CkptdStorageReader(root, step=DCP_STEP))
    for key, value in expected.items():
        assert state["model"][key].view(torch.uint8).numpy().tobytes() == value.view(torch.uint8).numpy().tobytes()
    assert state["epoch"] == 4

    managed = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "epoch": 0}
    with ckptd.CheckpointManager(f"{root}/managed", capture_rng=False) as manager:
        assert manager.restore(managed) == MANAGER_STEP
    for key, value in expected.items():
        assert torch.equal(managed["model"][key], value)


def _async_save_at(rank: int, world_size: int, root: str) -> bool:
    state = {"model": _sharded(world_size, fill=True)}
    expected = _full(state["model"])
    writer = CkptdStorageWriter(root, step=3)
    future = dcp.async_save(state, storage_writer=writer)
    state["model"]["w"].to_local().add_(5.0)  # modify right after staging
    future.result()
    writer.close()
    loaded = {"model": _sharded(world_size, fill=False)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(root, step=3))
    assert _full(loaded["model"]) == expected
    return True


def test_async_save_with_dtensor_at_world_size_2(tmp_path: Path) -> None:
    assert run_multirank(_async_save_at, 2, str(tmp_path), timeout_s=120) == [True, True]
