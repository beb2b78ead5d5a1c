"""One CkptdStorageWriter/CkptdStorageReader kept for many saves and loads, as trainers keep them: without
a checkpoint id (DCP then never calls ``reset``), with ``async_save`` calls that overlap, after a failed
save, and with two jobs that share a root. Every save writes its own step, whose bytes load back."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter
from ckptd.errors import AlreadyCommittedError
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.format.records import Manifest
from ckptd.tiers.local import LocalTier


def _state(i: int, size: int = 64) -> dict:
    return {"w": torch.arange(size, dtype=torch.float32) + i, "i": i}


def _loaded(reader: CkptdStorageReader, size: int = 64, **kwargs) -> dict:
    state = {"w": torch.zeros(size), "i": -1}
    dcp.load(state, storage_reader=reader, **kwargs)
    return state


def test_a_writer_and_a_reader_kept_without_checkpoint_id_save_and_load_the_newest_step(tmp_path: Path) -> None:
    writer, reader = CkptdStorageWriter(tmp_path), CkptdStorageReader(tmp_path)
    for i in range(3):  # the second save was refused: the first one's step was kept (AlreadyCommittedError)
        meta = dcp.save(_state(i), storage_writer=writer)
        assert meta.storage_meta.checkpoint_id == f"{tmp_path}/{step_dir(i)}"  # type: ignore[union-attr]
        loaded = _loaded(reader)  # the same reader: the newest step each time (it kept reading step 0)
        assert loaded["i"] == i and torch.equal(loaded["w"], _state(i)["w"]) and reader.step == i
    assert LocalTier(tmp_path).committed_steps() == [0, 1, 2]


@pytest.mark.parametrize("ids", ["writer root", "same directory", "other directories"])
def test_async_saves_that_overlap_each_commit_their_own_step(tmp_path: Path, ids: str) -> None:
    size = 1 << 21  # 8 MiB: the next save's reset came while the previous one committed
    writer = CkptdStorageWriter(tmp_path) if ids == "writer root" else CkptdStorageWriter()
    directory = {"writer root": lambda i: None, "same directory": lambda i: str(tmp_path),
                 "other directories": lambda i: str(tmp_path / f"run{i}")}[ids]
    futures = [dcp.async_save(_state(i, size), checkpoint_id=directory(i), storage_writer=writer) for i in range(4)]
    results = [future.result() for future in futures]  # failed with AlreadyCommittedError
    writer.close()
    for i, meta in enumerate(results):
        where = f"{tmp_path}/run{i}/{step_dir(0)}" if ids == "other directories" else f"{tmp_path}/{step_dir(i)}"
        assert meta.storage_meta.checkpoint_id == where  # type: ignore[union-attr]  # named another save's step
        loaded = _loaded(CkptdStorageReader(), size, checkpoint_id=where)
        assert loaded["i"] == i and torch.equal(loaded["w"], _state(i, size)["w"])
        manifest = json.loads(Path(where, MANIFEST_NAME).read_text())
        assert manifest["extra"]["dcp"]["save_id"] == meta.storage_meta.save_id  # type: ignore[union-attr]


def test_an_async_save_that_failed_before_writing_does_not_hold_up_the_next(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_COMMIT_TIMEOUT_S", "3")  # the next stage waited this long, then CommitError
    dcp.save(_state(0), storage_writer=CkptdStorageWriter(tmp_path, step=0))
    writer = CkptdStorageWriter()
    failed = dcp.async_save(_state(1), checkpoint_id=str(tmp_path / step_dir(0)), storage_writer=writer)
    with pytest.raises(BaseException) as caught:
        failed.result()
    assert isinstance(caught.value, AlreadyCommittedError) or "AlreadyCommittedError" in str(caught.value)
    dcp.async_save(_state(2), checkpoint_id=str(tmp_path), storage_writer=writer).result()
    writer.close()
    assert _loaded(CkptdStorageReader(tmp_path, step=0))["i"] == 0  # the committed step is as it was
    assert _loaded(CkptdStorageReader(tmp_path))["i"] == 2


def _save_by_hand(writer: CkptdStorageWriter, state: dict) -> tuple:
    """DCP's save protocol on one rank, step by step, so that two saves can be interleaved."""
    planner = DefaultSavePlanner()
    writer.set_up_storage_writer(True)
    planner.set_up_planner(state, writer.storage_meta(), True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    plan = planner.finish_plan(writer.prepare_global_plan(plans)[0])
    return writer, planner, plan, metadata


def _finish_by_hand(writer: CkptdStorageWriter, planner: DefaultSavePlanner, plan, metadata) -> None:
    results = writer.write_data(plan, planner).value()
    writer.finish(metadata, [results])


def test_two_jobs_sharing_a_root_never_write_the_same_step(tmp_path: Path) -> None:
    first = _save_by_hand(CkptdStorageWriter(tmp_path), _state(1))
    second = _save_by_hand(CkptdStorageWriter(tmp_path), _state(2))  # chose first's step too
    assert (first[0].step, second[0].step) == (0, 1)
    _finish_by_hand(*first)
    _finish_by_hand(*second)  # replaced the committed step's files, then failed to commit
    for step, i in ((0, 1), (1, 2)):
        loaded = _loaded(CkptdStorageReader(tmp_path, step=step))
        assert loaded["i"] == i and torch.equal(loaded["w"], _state(i)["w"])


def test_bytesio_and_quantized_values_need_a_reader_of_format_4(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=CkptdStorageWriter(tmp_path, step=0))
    dcp.save({"w": torch.ones(2), "b": io.BytesIO(b"abc")}, storage_writer=CkptdStorageWriter(tmp_path, step=1))
    versions = [json.loads((tmp_path / step_dir(s) / MANIFEST_NAME).read_text())["format_version"] for s in (0, 1)]
    assert versions == [3, 4]  # older readers refuse step 1 by its version instead of loading bytes as a tensor
    loaded = {"w": torch.zeros(2)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=0))  # the older format is still read
    assert loaded["w"].tolist() == [1.0, 1.0]
    path = tmp_path / step_dir(1) / MANIFEST_NAME  # the same step claiming the older format: refused by name
    older = dataclasses.replace(Manifest.from_json_bytes(path.read_bytes(), path=str(path), step=1), format_version=3)
    path.write_bytes(older.to_json_bytes())
    with pytest.raises(BaseException) as caught:
        dcp.load({"w": torch.zeros(2), "b": io.BytesIO()}, storage_reader=CkptdStorageReader(tmp_path, step=1))
    assert "'buffers' or 'quantized' in a step of manifest format 3" in str(caught.value)


def test_the_next_stage_goes_on_once_the_staged_copy_went_to_the_checkpoint_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_COMMIT_TIMEOUT_S", "60")  # it waited this long, then CommitError
    writer = CkptdStorageWriter(tmp_path)
    first = writer.stage({"w": torch.arange(8.0)})
    sent: list[bytes] = []
    # What DCP's process executor does on its own thread, once its checkpoint process is up (seconds).
    sender = threading.Timer(0.3, lambda: sent.append(pickle.dumps(writer)))
    sender.start()
    second = writer.stage({"w": torch.arange(8.0) * 2})  # async_save before waiting for the previous one
    sender.join()
    copy = pickle.loads(sent[0])
    assert torch.equal(first["w"], torch.arange(8.0)) and second["w"].data_ptr() != first["w"].data_ptr()
    dcp.save(first, storage_writer=copy)  # the copy sent away writes the first state, intact
    loaded = {"w": torch.zeros(8)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path))
    assert loaded["w"].tolist() == list(range(8))
    writer.close()


_PROCESS_SAVES = '''
import gc, io, json, os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from ckptd.dcp import CkptdStorageWriter


def shared_memory_files():
    found = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{name}").startswith("/dev/shm/")
        except OSError:
            pass
    return found


def quantized(i):
    generator = torch.Generator().manual_seed(i)
    values, scales = torch.randn(4, 6, generator=generator), torch.rand(6, dtype=torch.float64, generator=generator)
    return {"q": torch.quantize_per_channel(values, scales / 7 + 0.01, torch.arange(6) - 3, 1, torch.qint8)}


def main():
    root, port, saves = sys.argv[1], sys.argv[2], int(sys.argv[3])
    gc.disable()  # as DCP_DISABLE_AUTOMATIC_GC=1 does: the buffers must go without the collector's help
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    writer, held = CkptdStorageWriter(), []
    for i in range(saves):
        state = {"w": torch.full((1 << 18,), float(i)), "i": i, "b": io.BytesIO(bytes([i]) * 5), **quantized(i)}
        dcp.async_save(state, checkpoint_id=root, storage_writer=writer,
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        held.append(shared_memory_files())
    writer.close()
    print(json.dumps(held))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


@pytest.mark.filterwarnings("ignore:.*quantize_per_.*deprecated")
def test_process_mode_saves_free_their_shared_memory_save_after_save(tmp_path: Path) -> None:
    """Also: quantized tensors and io.BytesIO values reach DCP's checkpoint process whole (a quantized
    tensor arrived there without its quantizer: 'cannot call qscheme on UnknownQuantizer')."""
    from ckptd.testing.multirank import free_port

    script = tmp_path / "saves.py"
    script.write_text(_PROCESS_SAVES)
    saves = 6
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "root"), str(free_port()), str(saves)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    held = json.loads(done.stdout.strip().splitlines()[-1])
    # Shared memory holds one save's staged copy at most (w and q's integers), not one more per save.
    assert len(held) == saves and 1 <= max(held) <= 2
    assert LocalTier(tmp_path / "root").committed_steps() == list(range(saves))
    namespace: dict = {}
    exec(_PROCESS_SAVES.split("def main")[0], namespace)  # the script's quantized(i), without running it
    for i in (0, saves - 1):
        expected = namespace["quantized"](i)["q"]
        target = torch.quantize_per_channel(torch.zeros(4, 6), torch.ones(6, dtype=torch.float64),
                                            torch.zeros(6, dtype=torch.int64), 1, torch.qint8)
        loaded = {"w": torch.zeros(1 << 18), "i": -1, "b": io.BytesIO(), "q": target}
        dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path / "root", step=i))
        assert loaded["i"] == i and torch.equal(loaded["w"], torch.full((1 << 18,), float(i)))
        assert loaded["b"].getvalue() == bytes([i]) * 5
        assert torch.equal(loaded["q"].int_repr(), expected.int_repr()) and loaded["q"].q_per_channel_axis() == 1
        assert torch.equal(loaded["q"].q_per_channel_scales(), expected.q_per_channel_scales())
        assert torch.equal(loaded["q"].q_per_channel_zero_points(), expected.q_per_channel_zero_points())


def test_every_rank_of_a_load_reads_the_step_the_coordinator_chose(tmp_path: Path) -> None:
    dcp.save(_state(0), storage_writer=CkptdStorageWriter(tmp_path))
    coordinator = CkptdStorageReader(tmp_path)
    coordinator.read_metadata()  # the newest committed step now: 0
    dcp.save(_state(1), storage_writer=CkptdStorageWriter(tmp_path))  # committed while the ranks look it up
    rank = CkptdStorageReader(tmp_path)
    state = {"w": torch.zeros(64), "i": -1}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, rank.read_metadata(), False)  # this rank found step 1
    plans = coordinator.prepare_global_plan([rank.prepare_local_plan(planner.create_local_plan())])
    rank.read_data(planner.finish_plan(plans[0]), planner).wait()
    assert rank.step == 0 and state["i"] == 0 and torch.equal(state["w"], _state(0)["w"])  # it read step 1
