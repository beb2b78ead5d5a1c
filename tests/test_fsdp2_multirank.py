"""FSDP2 (``fully_shard``) on CPU with gloo: a model and its Adam state, sharded over 2 real processes,
saved by CheckpointManager and restored at world size 2 and 1 with equal bytes; training then goes on
exactly as it would have without the restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import ckptd
from ckptd.testing import run_multirank

pytestmark = pytest.mark.multirank

STEP = 2


def _model(world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(8, 16, generator=generator)
        loss = model(inputs).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _full_bytes(tree: Any, prefix: str = "") -> dict[str, bytes]:
    """Every tensor of a nested state as its full (gathered) bytes, by path."""
    found: dict[str, bytes] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            found.update(_full_bytes(value, f"{prefix}/{key}"))
    elif isinstance(tree, DTensor):
        found[prefix] = tree.full_tensor().reshape(-1).view(torch.uint8).numpy().tobytes()
    elif isinstance(tree, torch.Tensor):
        found[prefix] = tree.reshape(-1).view(torch.uint8).numpy().tobytes()
    return found


def _save(rank: int, world_size: int, root: str) -> dict[str, bytes]:
    model, optimizer = _model(world_size)
    _train(model, optimizer, range(STEP))
    model_state, optim_state = get_state_dict(model, optimizer)
    assert any(isinstance(v, DTensor) for v in model_state.values()), "FSDP2 state is DTensor"
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        manager.save(STEP, {"model": model_state, "optim": optim_state}, force=True)
    saved = _full_bytes({"model": model_state, "optim": optim_state})
    _train(model, optimizer, range(STEP, STEP + 2))
    saved["after"] = _full_bytes(get_state_dict(model, optimizer)[0])["/0.weight"]
    return saved


def _restore(rank: int, world_size: int, root: str) -> dict[str, bytes]:
    model, optimizer = _model(world_size)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.restore(state) == STEP
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_state, optim_state = get_state_dict(model, optimizer)
    restored = _full_bytes({"model": model_state, "optim": optim_state})
    _train(model, optimizer, range(STEP, STEP + 2))
    restored["after"] = _full_bytes(get_state_dict(model, optimizer)[0])["/0.weight"]
    return restored


def test_fsdp2_state_saved_at_2_restores_at_2_and_1_and_training_continues_identically(tmp_path: Path) -> None:
    root = str(tmp_path)
    saved = run_multirank(_save, 2, root, timeout_s=180)
    assert saved[0] == saved[1]
    reference = saved[0]
    assert any(path.startswith("/optim/state") for path in reference), "the optimizer state was saved"
    for world_size in (2, 1):
        restored = run_multirank(_restore, world_size, root, timeout_s=180)
        for result in restored:
            assert result.keys() == reference.keys()
            assert result == reference, f"world size {world_size}: restored state or continued training differs"
