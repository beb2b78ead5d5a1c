"""Restoring into another layout on real gloo processes: a 2-stage pipeline split restored as 1 stage (and
1 stage split into 2), and an FSDP2 model with its Adam state saved at world size 4 and restored at 2; bit
for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptd
from ckptd.stepio.step_reader import load_step_manifest
from ckptd.testing import run_multirank
from ckptd.tiers.local import LocalTier
from test_fsdp2_multirank import _full_bytes, _model, _train

pytestmark = pytest.mark.multirank

STEP = 4
LAYERS = 4


def _layer(index: int, *, empty: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(index)
    shape = (16 + 8 * index, 16 + 8 * (index + 1))
    make = (lambda *s: torch.zeros(s)) if empty else (lambda *s: torch.randn(s, generator=generator))
    return {"weight": make(*shape), "exp_avg": make(*shape), "bias": make(shape[0])}


def _stage_state(stage: int, stages: int, *, empty: bool = False) -> dict[str, Any]:
    """The state of one pipeline stage: its layers' weights (by their model-wide names) and their moments."""
    per_stage = LAYERS // stages
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    model, optim = {}, {}
    for index in layers:
        made = _layer(index, empty=empty)
        model[f"layers.{index}.weight"], model[f"layers.{index}.bias"] = made["weight"], made["bias"]
        optim[f"layers.{index}.weight"] = {"exp_avg": made["exp_avg"]}
    return {"model": model, "optim": optim, "schedule": {"lr": 0.5}}


def _tensor_bytes(state: dict[str, Any]) -> dict[str, bytes]:
    found = {f"model/{k}": v.view(torch.uint8).numpy().tobytes() for k, v in state["model"].items()}
    found.update({f"optim/{k}": v["exp_avg"].view(torch.uint8).numpy().tobytes() for k, v in state["optim"].items()})
    return found


def _save_stages(rank: int, world_size: int, root: str) -> dict[str, bytes]:
    state = _stage_state(rank, world_size)
    with ckptd.CheckpointManager(root, layout=ckptd.Layout(mesh={"pp": world_size}), capture_rng=False) as manager:
        assert manager.save(STEP, state, force=True)
    return _tensor_bytes(state)


def _restore_stages(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _stage_state(rank, world_size, empty=True)
    with ckptd.CheckpointManager(root, layout=ckptd.Layout(mesh={"pp": world_size}), capture_rng=False) as manager:
        assert manager.restore(state) == STEP
    return {"bytes": _tensor_bytes(state), "keys": sorted(state["model"]), "schedule": state["schedule"]}


def _expected(stage: int, stages: int) -> dict[str, bytes]:
    return _tensor_bytes(_stage_state(stage, stages))


@pytest.mark.parametrize(("saved_stages", "restored_stages"), [(2, 1), (1, 2)])
def test_a_pipeline_split_restores_into_another_split(tmp_path: Path, saved_stages: int, restored_stages: int) -> None:
    root = str(tmp_path / "ckpt")
    run_multirank(_save_stages, saved_stages, root, timeout_s=120)
    assert load_step_manifest(LocalTier(root), STEP).layout.mesh == {"pp": saved_stages}
    restored = run_multirank(_restore_stages, restored_stages, root, timeout_s=120)
    for stage, result in enumerate(restored):
        expected = _expected(stage, restored_stages)
        assert result["bytes"] == expected, f"stage {stage} of {restored_stages}"
        assert result["keys"] == sorted(_stage_state(stage, restored_stages)["model"]), "no other stage's layers"
        assert result["schedule"] == {"lr": 0.5}


def _save_fsdp(rank: int, world_size: int, root: str) -> dict[str, bytes]:
    model, optimizer = _model(world_size)
    _train(model, optimizer, range(STEP))
    model_state, optim_state = get_state_dict(model, optimizer)
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.save(STEP, {"model": model_state, "optim": optim_state}, force=True)
    return _full_bytes({"model": model_state, "optim": optim_state})


def _restore_fsdp(rank: int, world_size: int, root: str) -> dict[str, bytes]:
    model, optimizer = _model(world_size)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.restore(state) == STEP
        assert manager.last_restore.resharded
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_state, optim_state = get_state_dict(model, optimizer)
    return _full_bytes({"model": model_state, "optim": optim_state})


def test_an_fsdp2_model_saved_at_world_size_4_restores_at_2(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_multirank(_save_fsdp, 4, root, timeout_s=120)
    layout = load_step_manifest(LocalTier(root), STEP).layout
    assert layout.source == "dtensor" and layout.mesh == {"dim0": 4} and layout.coordinates == ((0,), (1,), (2,), (3,))
    restored = run_multirank(_restore_fsdp, 2, root, timeout_s=120)
    for rank, values in enumerate(restored):
        assert values.keys() == saved[0].keys()
        for name, expected in saved[0].items():
            assert values[name] == expected, f"rank {rank}: {name}"


def _sharded(dim: int, *, empty: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("tp",))
    full = torch.zeros(8, 12) if empty else torch.randn(8, 12, generator=torch.Generator().manual_seed(7))
    return {"w": distribute_tensor(full, mesh, [Shard(dim)])}


def _save_sharded(rank: int, world_size: int, root: str) -> bytes:
    state = _sharded(0, empty=False)
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.save(STEP, state, force=True)
    return state["w"].full_tensor().view(torch.uint8).numpy().tobytes()


def _restore_resharded(rank: int, world_size: int, root: str) -> tuple[bytes, bool]:
    state = _sharded(1, empty=True)
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.restore(state) == STEP
        resharded = manager.last_restore.resharded
    return state["w"].full_tensor().view(torch.uint8).numpy().tobytes(), resharded


def test_a_sharding_change_on_the_same_mesh_restores_bit_for_bit(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_multirank(_save_sharded, 2, root, timeout_s=120)
    for rank, (restored, resharded) in enumerate(run_multirank(_restore_resharded, 2, root, timeout_s=120)):
        assert resharded and restored == saved[0], f"rank {rank}: rows -> columns"
