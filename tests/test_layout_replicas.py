"""A 2-D mesh (dp=2, tp=2) on 4 real gloo processes: replicated DTensors are written once, balanced job-wide
(the busiest rank within 1.15x the mean), the manifest records the layout, and the step restores bit for bit into the same mesh and
into (dp=4, tp=1), (dp=1, tp=2) and (dp=1, tp=1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptd
from ckptd.errors import ResumeMismatchError
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.stepio.step_reader import load_rank_index, load_step_manifest
from ckptd.testing import run_multirank
from ckptd.tiers.local import LocalTier

pytestmark = pytest.mark.multirank

STEP = 5
#: name -> (global shape, placements on (dp, tp)); "R" replicate, "S0"/"S1" shard on that tensor dim.
TENSORS: dict[str, tuple[tuple[int, ...], tuple[str, str]]] = {
    **{f"col{i}.weight": ((64, 24 + 8 * i), ("R", "S0")) for i in range(4)},      # TP column-parallel
    **{f"row{i}.weight": ((40 + 8 * i, 32), ("R", "S1")) for i in range(4)},      # TP row-parallel
    **{f"norm{i}.weight": ((96 + 32 * i,), ("R", "R")) for i in range(6)},        # replicated everywhere
    **{f"moment{i}": ((32, 16 + 16 * i), ("S0", "S1")) for i in range(3)},        # ZeRO-sharded, unique
}


def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=generator)


def _placement(code: str) -> Any:
    return Replicate() if code == "R" else Shard(int(code[1]))


def _state(dp: int, tp: int, *, empty: bool = False) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = {}
    for name, (shape, codes) in TENSORS.items():
        full = torch.zeros(shape) if empty else _full(name, shape)
        model[name] = distribute_tensor(full, mesh, [_placement(c) for c in codes])
    return {"model": model, "meta": {"step": 0 if empty else STEP}}


def _full_bytes(state: dict[str, Any]) -> dict[str, bytes]:
    return {name: t.full_tensor().contiguous().view(torch.uint8).numpy().tobytes()
            for name, t in state["model"].items()}


def _expected() -> dict[str, bytes]:
    return {name: _full(name, shape).view(torch.uint8).numpy().tobytes() for name, (shape, _) in TENSORS.items()}


def _save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    state = _state(2, 2)
    with ckptd.CheckpointManager(root, capture_rng=False, codec="raw") as manager:
        assert manager.save(STEP, state, force=True)
        manager.wait()
        fresh = _state(2, 2, empty=True)
        assert manager.restore(fresh) == STEP  # the memory tier: replicas written by others come from disk
        from_memory = _full_bytes(fresh), manager.last_restore.tier
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        fresh = _state(2, 2, empty=True)
        assert manager.restore(fresh) == STEP
        from_disk = _full_bytes(fresh), manager.last_restore.tier, fresh["meta"]
    return {"memory": from_memory, "disk": from_disk}


def _restore_into(rank: int, world_size: int, root: str, dp: int, tp: int) -> dict[str, Any]:
    fresh = _state(dp, tp, empty=True)
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.restore(fresh) == STEP
        resharded = manager.last_restore.resharded
    return {"bytes": _full_bytes(fresh), "resharded": resharded, "meta": fresh["meta"]}


def _restore_wrong_shape(rank: int, world_size: int, root: str) -> str:
    fresh = _state(1, 2, empty=True)
    mesh = fresh["model"]["col0.weight"].device_mesh
    fresh["model"]["col0.weight"] = distribute_tensor(torch.zeros(64, 25), mesh, [Replicate(), Shard(0)])
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        with pytest.raises(ResumeMismatchError) as caught:
            manager.restore(fresh)
    return str(caught.value)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("layout") / "ckpt"
    results = run_multirank(_save, 4, str(root), timeout_s=120)
    return root, results


def test_replicas_are_written_once_balanced_and_the_layout_is_recorded(saved: tuple[Path, list[Any]]) -> None:
    root, _ = saved
    tier = LocalTier(root)
    manifest = load_step_manifest(tier, STEP)
    written = {entry.rank: sum(r.nbytes for r in load_rank_index(tier, manifest, entry.rank).tensors.values())
               for entry in manifest.ranks}
    unique = sum(_full(name, shape).numel() * 4 for name, (shape, _) in TENSORS.items())
    assert sum(written.values()) == unique, f"bytes written {written} vs unique {unique}: a replica written twice"
    mean = unique / 4
    assert max(written.values()) <= 1.15 * mean, f"busiest rank writes {max(written.values())} > 1.15 x {mean}"
    data = sum(entry.data_size for entry in manifest.ranks)
    assert unique <= data < unique + 4 * 64 * 1024, "data files hold the unique bytes (plus alignment)"

    layout = manifest.layout
    assert manifest.format_version == 4 and layout is not None
    assert layout.mesh == {"dp": 2, "tp": 2} and layout.source == "dtensor"
    assert layout.coordinates == ((0, 0), (0, 1), (1, 0), (1, 1))
    pieces = {(p.name, p.holders): p.writer for p in layout.replicated}
    assert {holders for (name, holders) in pieces if name == "model/col0.weight"} == {(0, 2), (1, 3)}
    assert {holders for (name, holders) in pieces if name == "model/norm0.weight"} == {(0, 1, 2, 3)}
    assert not any(name.startswith("model/moment") for name, _ in pieces), "unique shards are not replicas"
    for (name, holders), writer in pieces.items():
        assert writer in holders
        for rank in holders:
            index = load_rank_index(tier, manifest, rank)
            assert (name in index.tensors) == (rank == writer), f"{name} stored by {rank}, writer {writer}"
    raw = json.loads((root / step_dir(STEP) / MANIFEST_NAME).read_text())
    assert raw["layout"]["mesh"] == [["dp", 2], ["tp", 2]]


def test_the_same_mesh_restores_bit_for_bit_from_memory_and_disk(saved: tuple[Path, list[Any]]) -> None:
    _, results = saved
    expected = _expected()
    for rank, result in enumerate(results):
        memory_bytes, memory_tier = result["memory"]
        disk_bytes, disk_tier, meta = result["disk"]
        assert memory_tier == "memory" and disk_tier.startswith("local")
        assert memory_bytes == expected and disk_bytes == expected, f"rank {rank}"
        assert meta == {"step": STEP}


@pytest.mark.parametrize(("dp", "tp"), [(4, 1), (1, 2), (1, 1)])
def test_the_step_restores_into_another_mesh_bit_for_bit(saved: tuple[Path, list[Any]], dp: int, tp: int) -> None:
    root, _ = saved
    results = run_multirank(_restore_into, dp * tp, str(root), dp, tp, timeout_s=120)
    expected = _expected()
    for rank, result in enumerate(results):
        assert result["resharded"], "another mesh goes through DCP's resharding"
        assert result["bytes"] == expected, f"rank {rank} of dp={dp}, tp={tp}"
        assert result["meta"] == {"step": STEP}


def test_a_target_of_another_shape_is_refused_naming_the_tensor(saved: tuple[Path, list[Any]]) -> None:
    root, _ = saved
    messages = run_multirank(_restore_wrong_shape, 2, str(root), timeout_s=120)
    for message in messages:
        assert "model/col0.weight" in message and "[64, 24]" in message and "[64, 25]" in message


def test_inspect_shows_the_layout(saved: tuple[Path, list[Any]]) -> None:
    from click.testing import CliRunner

    from ckptd.cli.main import cli

    root, _ = saved
    result = CliRunner().invoke(cli, ["inspect", str(root), "--json"])
    assert result.exit_code == 0, result.output
    layout = json.loads(result.output)["layout"]
    assert layout["mesh"] == {"dp": 2, "tp": 2} and layout["source"] == "dtensor"
    assert layout["placements"]["model/col0.weight"] == "R,S0" and layout["placements"]["model/moment0"] == "S0,S1"
    assert [row["coordinates"] for row in layout["ranks"]] == [
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert {(p["name"], tuple(p["holders"])) for p in layout["replicated"]} >= {
        ("model/norm0.weight", (0, 1, 2, 3)), ("model/col0.weight", (0, 2)), ("model/col0.weight", (1, 3))}
    text = CliRunner().invoke(cli, ["inspect", str(root)])
    assert text.exit_code == 0 and "layout: mesh dp=2 x tp=2 (from dtensor)" in text.output
    assert "dp=1,tp=0" in text.output and "replica model/col0.weight: written by rank" in text.output
    manifest = load_step_manifest(LocalTier(root), STEP)
    per_rank = json.loads(result.output)["bytes_per_rank"]
    assert [row["data_bytes"] for row in per_rank["ranks"]] == [entry.data_size for entry in manifest.ranks]
    tensor_bytes = [row["tensor_bytes"] for row in per_rank["ranks"]]
    assert sum(tensor_bytes) == sum(_full(n, shape).numel() * 4 for n, (shape, _) in TENSORS.items())
    busiest = max(row["data_bytes"] for row in per_rank["ranks"])
    assert per_rank["busiest_over_mean"] == pytest.approx(busiest / (sum(e.data_size for e in manifest.ranks) / 4))
    assert per_rank["busiest_over_mean"] <= 1.15
    assert f"busiest rank {per_rank['busiest_rank']} writes {per_rank['busiest_over_mean']:.3f}x the mean" in text.output
