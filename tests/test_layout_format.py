"""The layout records and the write plan in one process: Layout checks its input and maps ranks to
coordinates as init_device_mesh does; the plan is the same whatever order the pieces come in and keeps
every holder within its group's mean plus its largest piece; the manifest's layout round-trips (format 4),
a malformed one is refused naming the manifest, steps without one stay format 3; rank 0 refuses to commit
a step in which a rank refers to a replica nobody wrote for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.errors import CommitError, ConfigError, FormatError
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.format.mesh_layout import ReplicatedPiece, SavedLayout
from ckptd.format.records import FORMAT_VERSION, LAYOUT_SINCE, Manifest, RankEntry
from ckptd.manager.holdings import Holdings, LayoutRecorder
from ckptd.state.replicas import WritePlan, holders_of, plan_writers
from ckptd.state.rng import RNG_KEY
from ckptd.stepio.step_reader import load_step_manifest
from ckptd.testing import tamper
from ckptd.tiers.local import LocalTier

DIGEST = "0" * 32


def test_layout_maps_ranks_row_major_and_finds_the_holders_of_replicated_dimensions() -> None:
    layout = ckptd.Layout(mesh={"pp": 2, "dp": 2, "tp": 2}, replicated={"model": ("dp",)}, zero_stage=1)
    assert layout.world_size == 8 and layout.dims == ("pp", "dp", "tp")
    assert [layout.coordinates(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1),
                                                                 (1, 1, 1)]
    assert all(layout.rank_at(layout.coordinates(r)) == r for r in range(8))
    assert layout.holders(5, ("dp",)) == (5, 7)
    assert layout.holders(0, ("dp", "tp")) == (0, 1, 2, 3)
    assert layout.replicated_dims("model") == ("dp",) and layout.replicated_dims("optim") == ()
    assert ckptd.Layout(mesh={"dp": 4}, replicated="dp").replicated_dims("anything") == ("dp",)


@pytest.mark.parametrize("bad", [
    {"mesh": {}}, {"mesh": {"dp": 0}}, {"mesh": {"dp": 2}, "zero_stage": 4},
    {"mesh": {"dp": 2}, "replicated": ("tp",)}])
def test_a_bad_layout_is_refused(bad: dict) -> None:
    with pytest.raises(ConfigError):
        ckptd.Layout(**bad)


def test_plain_tensors_are_replicated_only_where_the_layout_says_and_never_the_rng() -> None:
    layout = ckptd.Layout(mesh={"dp": 2, "tp": 2}, replicated={"model": ("dp",)})
    tensors = {"model/w": torch.zeros(4), "optim/m": torch.zeros(4), f"{RNG_KEY}/torch": torch.zeros(4)}
    assert holders_of(tensors, rank=1, layout=layout) == {"model/w": (1, 3)}
    everything = ckptd.Layout(mesh={"dp": 2}, replicated=("dp",))
    assert set(holders_of(tensors, rank=0, layout=everything)) == {"model/w", "optim/m"}


def test_the_plan_is_deterministic_and_balanced_within_each_group() -> None:
    sizes = [7, 3, 3, 9, 1, 12, 5, 5, 2, 8, 4, 6]
    tensors = {f"t{i}": torch.zeros(size) for i, size in enumerate(sizes)}
    holders = {name: (0, 1, 2) for name in tensors}
    plans = [plan_writers(dict(order), holders, rank=0).writers
             for order in (tensors.items(), reversed(list(tensors.items())))]
    assert plans[0] == plans[1], "the plan does not depend on the order the state lists its tensors"
    load = {rank: sum(tensors[n].numel() for n, w in plans[0].items() if w == rank) for rank in (0, 1, 2)}
    assert max(load.values()) <= sum(sizes) / 3 + max(sizes)
    assert max(load.values()) - min(load.values()) <= max(sizes)
    plan = plan_writers(tensors, holders, rank=1)
    assert set(plan.replicas.values()) <= {0, 2} and all(plan.writes(name) for name in plan.shared)


def _entry(rank: int, **fields: object) -> RankEntry:
    return RankEntry(rank=rank, index_file=f"rank-{rank:05d}.index.json", index_size=1, index_digest=DIGEST,
                     data_files=(), **fields)


def _holdings(rank: int, writers: dict[str, int]) -> Holdings:
    plan = WritePlan(rank=rank, holders={name: (0, 1) for name in writers}, writers=writers)
    return Holdings(mesh={"dp": 2}, coordinates=(rank,), source="given", zero_stage=None, plan=plan)


def test_the_manifest_layout_round_trips_and_a_rank_left_without_its_replica_is_refused() -> None:
    writers = {"model/a": 0, "model/b": 1}
    entries = [_holdings(rank, writers).entry(_entry(rank)) for rank in (0, 1)]
    manifest = _holdings(0, writers).manifest(Manifest(step=3, world_size=2, ranks=tuple(entries), codec="raw"))
    assert manifest.format_version == LAYOUT_SINCE == 4
    parsed = Manifest.from_json_bytes(manifest.to_json_bytes(), path="m", step=3)
    assert parsed.layout == manifest.layout and parsed.ranks == manifest.ranks
    assert parsed.layout.writer_of(1, "model/a") == 0 and parsed.layout.writer_of(0, "model/a") == 0
    assert set(parsed.layout.replicated) == {ReplicatedPiece("model/a", 0, (0, 1)), ReplicatedPiece("model/b", 1, (0, 1))}

    lost = [_holdings(0, {"model/a": 1}).entry(_entry(0)), _holdings(1, {"model/a": 0}).entry(_entry(1))]
    with pytest.raises(CommitError) as caught:
        _holdings(0, {}).manifest(Manifest(step=3, world_size=2, ranks=tuple(lost), codec="raw"))
    assert "'model/a'" in str(caught.value) and "rank 1" in str(caught.value)


def test_a_malformed_layout_is_refused_naming_the_manifest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with ckptd.CheckpointManager(root, layout=ckptd.Layout(mesh={"dp": 1}), capture_rng=False) as manager:
        manager.save(1, {"w": torch.arange(4.0)}, force=True)
    body = tamper.read_json(root / step_dir(1) / MANIFEST_NAME)
    assert body["format_version"] == 4 and body["layout"]["mesh"] == [["dp", 1]]
    tamper.rewrite_manifest(root, 1, lambda b: b["layout"].update(coordinates=[[0], [1]]))
    with pytest.raises(FormatError) as caught:
        load_step_manifest(LocalTier(root), 1)
    assert "layout" in str(caught.value) and MANIFEST_NAME in str(caught.value)


def test_a_step_without_a_layout_stays_format_3(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        manager.save(1, {"w": torch.arange(4.0)}, force=True)
        state = {"w": torch.zeros(4)}
        assert manager.restore(state) == 1 and torch.equal(state["w"], torch.arange(4.0))
    body = json.loads((root / step_dir(1) / MANIFEST_NAME).read_text())
    assert body["format_version"] == FORMAT_VERSION == 3 and "layout" not in body
    assert "coordinates" not in body["ranks"][0] and load_step_manifest(LocalTier(root), 1).layout is None


def test_a_layout_of_another_world_size_and_an_unknown_write_mode_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        LayoutRecorder(0, ckptd.Layout(mesh={"dp": 2}), world_size=1)
    with pytest.raises(ConfigError):
        ckptd.CheckpointManager(tmp_path / "x", write_replicas="sometimes")
    assert SavedLayout(mesh={"dp": 1}, coordinates=((0,),)).writer_of(0, "w") is None
