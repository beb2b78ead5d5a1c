"""DCP storage plugins in a single process (no process group): save, async_save, load, JSON values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter
from ckptd.format.layout import rank_index_name, step_dir


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(64, 33), "b": torch.arange(7, dtype=torch.int64)},
        "half": torch.randn(40).to(torch.bfloat16),
        "epoch": 3,
        "meta": {"name": "run-a", "lr": 0.25, "ids": [1, 2, 3]},
    }


def _zeros_like(state: dict) -> dict:
    return {
        "model": {"w": torch.zeros(64, 33), "b": torch.zeros(7, dtype=torch.int64)},
        "half": torch.zeros(40, dtype=torch.bfloat16),
        "epoch": 0,
        "meta": {"name": "", "lr": 0.0, "ids": []},
    }


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        a.contiguous().view(torch.uint8).numpy().tobytes() == b.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("codec", ["raw", "zstd", "byteplane"])
def test_save_and_load_round_trip_without_process_group(tmp_path: Path, codec: str) -> None:
    state = _state()
    dcp.save(state, storage_writer=CkptdStorageWriter(tmp_path, step=4, codec=codec))
    loaded = _zeros_like(state)
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=4))
    assert _same_bytes(loaded["model"]["w"], state["model"]["w"])
    assert _same_bytes(loaded["model"]["b"], state["model"]["b"])
    assert _same_bytes(loaded["half"], state["half"])
    assert loaded["epoch"] == 3 and loaded["meta"] == state["meta"]


def test_metadata_and_values_are_json_not_pickle(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=CkptdStorageWriter(tmp_path, step=1))
    directory = tmp_path / step_dir(1)
    assert sorted(p.name for p in directory.iterdir()) == ["manifest.json", "rank-00000.data",
                                                           "rank-00000.index.json"]
    index = json.loads((directory / rank_index_name(0)).read_text())
    assert index["values"]["objects"]["epoch"] == {"dict": [["value", {"value": 3}]], "ordered": False}
    assert index["values"]["pickled"] == []
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["extra"]["dcp"]["planner_data"]["model.w"] == ["model", "w"]
    data = (directory / "rank-00000.data").read_bytes()
    assert b"PK" not in data[:2] and b"pickle" not in data  # no torch.save zip or pickle stream


def test_values_that_need_pickle_are_refused_unless_allowed(tmp_path: Path) -> None:
    state = {"w": torch.ones(3), "odd": {1, 2}}
    with pytest.raises(BaseException) as caught:
        dcp.save(state, storage_writer=CkptdStorageWriter(tmp_path, step=1))
    assert "PickleRefusedError" in str(caught.value)
    assert not (tmp_path / step_dir(1) / "manifest.json").exists()
    dcp.save(state, storage_writer=CkptdStorageWriter(tmp_path, step=2, allow_pickle=True))
    loaded = {"w": torch.zeros(3), "odd": None}
    with pytest.raises(BaseException):
        dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=2))
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=2, allow_pickle=True))
    assert loaded["odd"] == {1, 2} and torch.equal(loaded["w"], torch.ones(3))


def test_async_save_stages_and_the_state_may_change_right_after(tmp_path: Path) -> None:
    state = _state()
    expected = state["model"]["w"].clone()
    writer = CkptdStorageWriter(tmp_path, step=9)
    future = dcp.async_save(state, storage_writer=writer)
    state["model"]["w"].add_(100.0)  # modified while the background write may run
    future.result()
    loaded = _zeros_like(state)
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=9))
    assert _same_bytes(loaded["model"]["w"], expected)
    writer.close()


def test_checkpoint_id_names_a_step_directory(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path / step_dir(12)), storage_writer=CkptdStorageWriter())
    loaded = _zeros_like(state)
    dcp.load(loaded, checkpoint_id=str(tmp_path / step_dir(12)), storage_reader=CkptdStorageReader())
    assert _same_bytes(loaded["model"]["w"], state["model"]["w"])


def test_dcp_reader_detects_corruption(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, storage_writer=CkptdStorageWriter(tmp_path, step=1))
    data = tmp_path / step_dir(1) / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BaseException) as caught:
        dcp.load(_zeros_like(state), storage_reader=CkptdStorageReader(tmp_path, step=1))
    assert "digest" in str(caught.value)


def test_manager_step_loads_through_dcp_reader(tmp_path: Path) -> None:
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        manager.save(3, {"w": torch.arange(6.0), "n": 2})
        manager.wait()
    loaded = {"w": torch.zeros(6)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=3))
    assert torch.equal(loaded["w"], torch.arange(6.0))
