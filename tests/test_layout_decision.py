"""Every rank decides alike whether a restore reshards (real gloo processes): a resharded restore calls
``dcp.load``, whose collectives wait for every rank, so a rank that decided otherwise would leave the
others waiting. Pipeline stages hold DTensors of different names on their own sub-meshes: the manifest's
placements are rank 0's view, so only some ranks see that the sharding changed."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptd
from ckptd.errors import NoIntactCheckpointError
from ckptd.format.layout import RANKS_HERE_NAME, step_dir as step_dir_name
from ckptd.stepio.step_reader import load_step_manifest
from ckptd.testing import run_multirank
from ckptd.tiers.local import LocalTier

pytestmark = pytest.mark.multirank

STEP = 3


def _stage_weight(stage: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(40 + stage))


def _stage_state(rank: int, placement: Any, *, empty: bool) -> dict[str, Any]:
    """Stage ``rank // 2`` of a (pp=2, dp=2) mesh: its layer, a DTensor on the stage's own dp sub-mesh."""
    stage = rank // 2
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    full = torch.zeros(8, 6) if empty else _stage_weight(stage)
    return {"model": {f"layers.{stage}.weight": distribute_tensor(full, mesh, [placement])}}


def _save(rank: int, world_size: int, root: str) -> None:
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.save(STEP, _stage_state(rank, Shard(0), empty=False), force=True)


def _restore(rank: int, world_size: int, root: str, changed_stage: int) -> dict[str, Any]:
    placement = Replicate() if rank // 2 == changed_stage else Shard(0)
    state = _stage_state(rank, placement, empty=True)
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.restore(state) == STEP
        resharded = manager.last_restore.resharded
    weight = state["model"][f"layers.{rank // 2}.weight"].full_tensor()
    return {"bytes": weight.view(torch.uint8).numpy().tobytes(), "resharded": resharded}


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("decision") / "ckpt")
    run_multirank(_save, 4, root, timeout_s=90)
    return root


def test_the_layout_records_the_mesh_the_stages_were_cut_from(saved_root: str) -> None:
    layout = load_step_manifest(LocalTier(saved_root), STEP).layout
    assert layout.mesh == {"pp": 2, "dp": 2} and layout.source == "dtensor"
    assert layout.coordinates == ((0, 0), (0, 1), (1, 0), (1, 1)), "every rank its own coordinates"


@pytest.mark.parametrize("changed_stage", [0, 1], ids=["stage0-changed", "stage1-changed"])
def test_a_sharding_change_that_one_stage_sees_reshards_on_every_rank(saved_root: str, changed_stage: int) -> None:
    restored = run_multirank(_restore, 4, saved_root, changed_stage, timeout_s=60)
    assert [r["resharded"] for r in restored] == [True] * 4, "the ranks decided alike"
    for rank, result in enumerate(restored):
        assert result["bytes"] == _stage_weight(rank // 2).view(torch.uint8).numpy().tobytes(), f"rank {rank}"


def _replicated_state(*, empty: bool) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    make = (lambda n: torch.zeros(n)) if empty else (lambda n: torch.randn(n, generator=generator))
    return {"model": {"a": make(64), "b": make(32), "c": make(16)}}


def _save_node_roots(rank: int, world_size: int, roots: list[str]) -> None:
    layout = ckptd.Layout(mesh={"dp": world_size}, replicated=("dp",))
    with ckptd.CheckpointManager(roots[rank], layout=layout, write_replicas="once", capture_rng=False) as manager:
        assert manager.save(STEP, _replicated_state(empty=False), force=True)


def _restore_on_another_mesh(rank: int, world_size: int, roots: list[str]) -> str:
    layout = ckptd.Layout(mesh={"pp": 1, "dp": world_size}, replicated=("dp",))
    with ckptd.CheckpointManager(roots[rank], layout=layout, capture_rng=False) as manager:
        try:
            manager.restore(_replicated_state(empty=True))
        except NoIntactCheckpointError as error:
            return str(error)
    return "restored"


def test_a_resharded_restore_that_one_rank_cannot_open_fails_on_every_rank(tmp_path: Path) -> None:
    """Rank 0's directory holds its own share only; rank 1's holds every rank's. Rank 1 alone could
    reshard: it must not wait in dcp.load for rank 0, which cannot."""
    node0, node1 = str(tmp_path / "node0"), str(tmp_path / "node1")
    run_multirank(_save_node_roots, 2, [node0, node1], timeout_s=90)
    everything = tmp_path / "everything"
    shutil.copytree(node1, everything)
    step_dir = everything / step_dir_name(STEP)
    for path in (Path(node0) / step_dir_name(STEP)).iterdir():
        if not (step_dir / path.name).exists():
            shutil.copy(path, step_dir / path.name)
    (step_dir / RANKS_HERE_NAME).unlink()
    results = run_multirank(_restore_on_another_mesh, 2, [node0, str(everything)], timeout_s=60)
    for rank, result in enumerate(results):
        assert "rank(s) [0] could not read the step's metadata" in result, f"rank {rank}: {result}"
