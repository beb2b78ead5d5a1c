"""What users of plain DCP pass to ckptd's storage plugins: picklable writers for
``async_save(..., AsyncCheckpointerType.PROCESS)``, ``io.BytesIO`` values without pickle, every dtype DCP
stores, any directory as ``checkpoint_id``, and meaningful ``storage_meta``/``storage_data``. Saves
in DCP's checkpoint process, save after save, run in tests/test_dcp_training_loop.py."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter
from ckptd.dcp.metadata import StoredPiece
from ckptd.errors import AlreadyCommittedError
from ckptd.format.layout import rank_index_name, step_dir


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_writer_pickles_after_staging_and_the_copy_writes(tmp_path: Path) -> None:
    writer = CkptdStorageWriter(tmp_path, step=2)
    staged = writer.stage({"w": torch.arange(5.0)})
    copy = pickle.loads(pickle.dumps(writer))  # failed with "cannot pickle '_thread.lock'"
    assert copy.root == str(tmp_path) and copy.step == 2 and copy._stager is None
    dcp.save(staged, storage_writer=copy)
    loaded = {"w": torch.zeros(5)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=2))
    assert torch.equal(loaded["w"], torch.arange(5.0))
    again = writer.stage({"w": torch.full((5,), 7.0)})  # the staged copy went elsewhere: new buffers
    assert again["w"].data_ptr() != staged["w"].data_ptr() and torch.equal(staged["w"], torch.arange(5.0))
    writer.close()


def test_bytesio_values_are_stored_as_bytes_without_pickle(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 9
    state = {"w": torch.ones(4), "train_state": io.BytesIO(payload), "empty": io.BytesIO()}
    dcp.save(state, storage_writer=CkptdStorageWriter(tmp_path, step=1))  # allow_pickle is False
    index = json.loads((tmp_path / step_dir(1) / rank_index_name(0)).read_text())
    assert index["values"]["pickled"] == [] and sorted(index["values"]["buffers"]) == ["empty", "train_state"]
    assert index["tensors"]["train_state"]["dtype"] == "uint8"
    loaded = {"w": torch.zeros(4), "train_state": io.BytesIO(), "empty": io.BytesIO(b"x")}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=1))  # allow_pickle is False
    assert isinstance(loaded["train_state"], io.BytesIO) and loaded["train_state"].getvalue() == payload
    assert loaded["empty"].getvalue() == b""


_ONE_BYTE_FLOATS = [name for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                      "float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, name)]


@pytest.mark.parametrize("name", _ONE_BYTE_FLOATS)
def test_every_float8_dtype_round_trips_bit_for_bit(tmp_path: Path, name: str) -> None:
    dtype = getattr(torch, name)
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3)  # every bit pattern, NaNs too
    tensor = bits.view(dtype)
    dcp.save({"t": tensor}, storage_writer=CkptdStorageWriter(tmp_path, step=0, codec="byteplane"))
    loaded = {"t": torch.zeros(768, dtype=torch.uint8).view(dtype)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=0))
    assert loaded["t"].dtype == dtype and _raw(loaded["t"]) == _raw(tensor)


def test_any_directory_is_a_checkpoint_id_and_each_save_is_a_new_step(tmp_path: Path) -> None:
    target = tmp_path / "ckpt" / "epoch_3"
    first = {"w": torch.arange(6.0), "epoch": 3}
    meta = dcp.save(first, checkpoint_id=str(target), storage_writer=CkptdStorageWriter())
    assert meta.storage_meta is not None and meta.storage_meta.checkpoint_id == f"{target}/{step_dir(0)}"
    assert meta.storage_meta.save_id and meta.storage_data == {
        MetadataIndex("w", torch.Size([0])): StoredPiece(0, "w", "tensor"),
        MetadataIndex("epoch"): StoredPiece(0, "epoch", "object")}
    second = {"w": torch.arange(6.0) * 2, "epoch": 4}
    dcp.save(second, checkpoint_id=str(target), storage_writer=CkptdStorageWriter())  # FileSystemWriter overwrites
    assert sorted(p.name for p in target.iterdir()) == [step_dir(0), step_dir(1)]  # step 0 stays as committed

    loaded = {"w": torch.zeros(6), "epoch": 0}
    dcp.load(loaded, checkpoint_id=str(target), storage_reader=CkptdStorageReader())
    assert torch.equal(loaded["w"], second["w"]) and loaded["epoch"] == 4
    reader = CkptdStorageReader(target, step=0)
    dcp.load(loaded, storage_reader=reader)
    assert torch.equal(loaded["w"], first["w"]) and loaded["epoch"] == 3
    metadata = reader.read_metadata()
    assert metadata.storage_meta.checkpoint_id == f"{target}/{step_dir(0)}"  # type: ignore[union-attr]
    assert metadata.storage_meta.save_id == meta.storage_meta.save_id  # type: ignore[union-attr]
    assert metadata.storage_meta.load_id  # type: ignore[union-attr]
    assert metadata.storage_data[MetadataIndex("w", torch.Size([0]))] == StoredPiece(0, "w", "tensor")


def test_root_plus_step_and_step_directory_ids_keep_committed_steps(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3)}, storage_writer=CkptdStorageWriter(tmp_path, step=7))
    with pytest.raises(BaseException) as caught:
        dcp.save({"w": torch.zeros(3)}, checkpoint_id=str(tmp_path / step_dir(7)),
                 storage_writer=CkptdStorageWriter())
    assert isinstance(caught.value, AlreadyCommittedError) or "AlreadyCommittedError" in str(caught.value)
    dcp.save({"w": torch.full((3,), 2.0)}, checkpoint_id=str(tmp_path), storage_writer=CkptdStorageWriter())
    loaded = {"w": torch.zeros(3)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=7))
    assert torch.equal(loaded["w"], torch.ones(3))
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path))  # newest: the root's next step, 8
    assert torch.equal(loaded["w"], torch.full((3,), 2.0))
    assert CkptdStorageWriter.validate_checkpoint_id(str(tmp_path / "runs" / "epoch_3"))
    assert not CkptdStorageWriter.validate_checkpoint_id("")


def _quantized() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {"q8": torch.quantize_per_tensor(torch.randn(33), 0.0371, 5, torch.qint8),
            "qu8": torch.quantize_per_tensor(torch.randn(4, 9), 0.1, 128, torch.quint8),
            "q32": torch.quantize_per_tensor(torch.randn(7), 1e-4, -3, torch.qint32),
            "channels": torch.quantize_per_channel(torch.randn(4, 6), torch.rand(4, dtype=torch.float64) / 7 + 0.01,
                                                   torch.tensor([0, 3, -2, 1]), 0, torch.qint8)}


def _targets() -> dict[str, torch.Tensor]:
    return {"q8": torch.quantize_per_tensor(torch.zeros(33), 1.0, 0, torch.qint8),
            "qu8": torch.quantize_per_tensor(torch.zeros(4, 9), 1.0, 0, torch.quint8),
            "q32": torch.quantize_per_tensor(torch.zeros(7), 1.0, 0, torch.qint32),
            "channels": torch.quantize_per_channel(torch.zeros(4, 6), torch.ones(4, dtype=torch.float64),
                                                   torch.zeros(4, dtype=torch.int64), 0, torch.qint8)}


@pytest.mark.filterwarnings("ignore:.*quantize_per_.*deprecated")
@pytest.mark.parametrize("async_save", [False, True])
def test_quantized_tensors_keep_values_scales_and_zero_points(tmp_path: Path, async_save: bool) -> None:
    state = _quantized()
    writer = CkptdStorageWriter(tmp_path, step=1)
    if async_save:
        dcp.async_save(state, storage_writer=writer).result()
    else:
        dcp.save(state, storage_writer=writer)
    loaded = _targets()
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=1))
    for name, expected in state.items():
        actual = loaded[name]
        assert actual.dtype == expected.dtype and actual.qscheme() == expected.qscheme()
        assert _raw(actual.int_repr()) == _raw(expected.int_repr()), name
        if expected.qscheme() == torch.per_tensor_affine:
            assert (actual.q_scale(), actual.q_zero_point()) == (expected.q_scale(), expected.q_zero_point())
        else:
            assert torch.equal(actual.q_per_channel_scales(), expected.q_per_channel_scales())
            assert torch.equal(actual.q_per_channel_zero_points(), expected.q_per_channel_zero_points())
    wrong = _targets()
    wrong["q8"] = torch.zeros(33)
    with pytest.raises(BaseException) as caught:
        dcp.load(wrong, storage_reader=CkptdStorageReader(tmp_path, step=1))
    assert "saved as a qint8 tensor" in str(caught.value)


@pytest.mark.parametrize(("checkpoint_id", "expected"), [
    ("step-000000000001", (".", 1)), ("/a/step-000000000002/", ("/a", 2)), ("/step-000000000003", ("/", 3)),
    ("/ckpt/epoch_3", ("/ckpt/epoch_3", None)), ("/ckpt/step-12", ("/ckpt/step-12", None)),
    ("s3://bucket/run/step-000000000004", ("s3://bucket/run", 4)), ("s3://bucket/run", ("s3://bucket/run", None))])
def test_checkpoint_ids_split_into_root_and_step(checkpoint_id: str, expected: tuple) -> None:
    from ckptd.dcp.writer import split_checkpoint_id

    assert split_checkpoint_id(checkpoint_id) == expected


def test_a_failed_save_to_a_directory_keeps_its_committed_steps(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path), storage_writer=CkptdStorageWriter())
    with pytest.raises(BaseException) as caught:  # a value that needs pickle, refused: nothing is committed
        dcp.save({"w": torch.zeros(3), "odd": {1, 2}}, checkpoint_id=str(tmp_path), storage_writer=CkptdStorageWriter())
    assert "PickleRefusedError" in str(caught.value)
    dcp.save({"w": torch.full((3,), 5.0)}, checkpoint_id=str(tmp_path), storage_writer=CkptdStorageWriter())
    committed = CkptdStorageReader(tmp_path)
    loaded = {"w": torch.zeros(3)}
    dcp.load(loaded, storage_reader=committed)
    assert torch.equal(loaded["w"], torch.full((3,), 5.0)) and committed.step is not None and committed.step >= 1
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=0))
    assert torch.equal(loaded["w"], torch.ones(3))
