"""Several data files per rank and direct I/O: large chunks go to parallel data files written with
O_DIRECT (aligned, zero-padded), small ones are packed into the first file; a file system that refuses
direct I/O gets buffered writes instead; checkpoints of format version 1 (one data file) still read."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.config import override, settings
from ckptd.errors import IntegrityError
from ckptd.stepio import step_reader
from ckptd.format.records import FORMAT_VERSION
from ckptd.stepio.step_reader import ChunkSource, StepReader, load_step_manifest, load_rank_index, verify_step
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from ckptd.tiers import direct_io
from ckptd.tiers.direct_io import aligned_empty
from ckptd.tiers.local import AtomicFile, LocalTier

CHUNK = 1024 * 1024
STEP = 3


def mixed_state(seed: int) -> dict[str, torch.Tensor]:
    """Large tensors with unaligned tails, a bf16 one, small ones and a zero-dim counter."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * CHUNK // 4 + 333, generator=generator),  # 3 chunks + an unaligned tail
        "bf16": torch.randn(CHUNK + 77, generator=generator).to(torch.bfloat16),
        "bytes": torch.randint(0, 256, (2 * CHUNK + 5,), dtype=torch.uint8, generator=generator),
        "bias": torch.randn(17, generator=generator),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(tensor) for name, tensor in state.items()}


def save_one(manager_factory: ManagerFactory, state: dict[str, torch.Tensor], **manager_options: Any) -> None:
    manager = manager_factory(**manager_options)
    manager.save(STEP, state, force=True)
    manager.wait()
    manager.close()


def index_of(root: Path) -> dict[str, Any]:
    return tamper.read_json(tamper.index_path(root, STEP))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_large_chunks_go_to_parallel_aligned_files_and_small_ones_are_packed(
        manager_factory: ManagerFactory, checkpoint_dir: Path, codec: str) -> None:
    state = mixed_state(1)
    with override(chunk_bytes=CHUNK, io_threads=3, direct_io_min_bytes=64 * 1024):
        save_one(manager_factory, state, codec=codec)
    index = index_of(checkpoint_dir)
    assert index["format_version"] == FORMAT_VERSION == 3
    files = index["data_files"]
    assert 2 <= len(files) <= 4, "file 0 for small chunks and up to io_threads parallel files"
    assert files[0][2:] == ["packed"] and all(len(item) == 2 for item in files[1:]), "file 0 is the pack"
    for name, size, *_ in files:
        assert (tamper.step_path(checkpoint_dir, STEP) / name).stat().st_size == size
    for tensor, record in index["tensors"].items():
        for offset, length, *_, part in record["chunks"]:
            if state[tensor].nbytes >= settings().pack_below_bytes:  # the last, short chunk too
                assert part >= 1 and offset % direct_io.ALIGNMENT == 0, f"{tensor}: large chunk in a parallel file"
            else:
                assert part == 0, f"{tensor}: small tensor packed into the first file"
    assert list(verify_step(LocalTier(checkpoint_dir), STEP)) == []
    restored = zeros_like(state)
    assert manager_factory().restore(restored) == STEP
    assert_same_state(restored, state)


def test_every_chunk_direct_pads_each_one_to_the_alignment(manager_factory: ManagerFactory,
                                                           checkpoint_dir: Path) -> None:
    state = mixed_state(2)
    with override(chunk_bytes=CHUNK, io_threads=2, direct_io_min_bytes=0, pack_below_bytes=0):
        save_one(manager_factory, state)
    index = index_of(checkpoint_dir)
    assert index["data_files"][0][1] == 0, "nothing is packed when every chunk goes direct"
    chunks = [chunk for record in index["tensors"].values() for chunk in record["chunks"]]
    assert all(offset % direct_io.ALIGNMENT == 0 for offset, *_ in chunks)
    restored = zeros_like(state)
    assert manager_factory().restore(restored) == STEP
    assert_same_state(restored, state)


def test_direct_write_of_unaligned_memory_and_length_pads_with_zeros(tmp_path: Path) -> None:
    payload = os.urandom(20 * direct_io.ALIGNMENT + 123)
    backing = bytearray(len(payload) + 1)
    backing[1:] = payload
    unaligned = memoryview(backing)[1:]  # starts one byte past wherever bytearray put it
    aligned = aligned_empty((len(payload),), torch.uint8)
    aligned.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert direct_io.address(memoryview(aligned.numpy())) % direct_io.ALIGNMENT == 0

    handle = AtomicFile(tmp_path / "data", direct=True)
    first = handle.reserve(len(payload))
    second = handle.reserve(len(payload))
    handle.write_at(second, memoryview(aligned.numpy()))
    handle.write_at(first, unaligned)
    handle.commit()
    stored = (tmp_path / "data").read_bytes()
    padded = direct_io.align_up(len(payload))
    assert (first, second) == (0, padded) and len(stored) == 2 * padded
    assert stored[:len(payload)] == payload == stored[padded:padded + len(payload)]
    assert stored[len(payload):padded] == bytes(padded - len(payload))


def save_refused_and_restore(manager_factory: ManagerFactory, checkpoint_dir: Path,
                             monkeypatch: pytest.MonkeyPatch, refused: list[Any], *, seed: int) -> None:
    """Save with every chunk meant for direct I/O while the patched refusal is in place, then, unpatched,
    check that the refusal happened and that the step verifies and restores bit for bit."""
    state = mixed_state(seed)
    with override(chunk_bytes=CHUNK, io_threads=2, direct_io_min_bytes=0):
        save_one(manager_factory, state)
    monkeypatch.undo()
    assert refused or not direct_io.AVAILABLE
    assert list(verify_step(LocalTier(checkpoint_dir), STEP)) == []
    restored = zeros_like(state)
    assert manager_factory().restore(restored) == STEP
    assert_same_state(restored, state)


def test_file_system_that_refuses_direct_open_gets_buffered_files(manager_factory: ManagerFactory,
                                                                  checkpoint_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real_open, refused = os.open, []

    def open_like_tmpfs(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_like_tmpfs)
    save_refused_and_restore(manager_factory, checkpoint_dir, monkeypatch, refused, seed=3)


def test_file_system_that_refuses_direct_writes_gets_buffered_writes(manager_factory: ManagerFactory,
                                                                     checkpoint_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    refused = []

    def refuse(fd: int, data: Any, offset: int) -> None:
        refused.append(offset)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_io, "pwrite_direct", refuse)
    save_refused_and_restore(manager_factory, checkpoint_dir, monkeypatch, refused, seed=4)


def downgrade_to_version_1(root: Path, step: int) -> None:
    """Rewrite a single-data-file step in the layout of format version 1, with consistent digests."""
    (name, size), = tamper.read_json(tamper.index_path(root, step))["data_files"]

    def index_v1(index: dict[str, Any]) -> None:
        del index["data_files"]
        index.update(format_version=1, data_file=name, data_size=size)
        for record in index["tensors"].values():
            record["chunks"] = [chunk[:5] for chunk in record["chunks"]]

    def manifest_v1(manifest: dict[str, Any]) -> None:
        manifest["format_version"] = 1
        entry = manifest["ranks"][0]
        del entry["data_files"]
        entry.update(data_file=name, data_size=size)

    tamper.rewrite_index(root, step, index_v1)  # also records the new index size and digest
    tamper.rewrite_manifest(root, step, manifest_v1)


def test_format_version_1_checkpoints_still_restore_and_verify(manager_factory: ManagerFactory,
                                                               checkpoint_dir: Path) -> None:
    state = mixed_state(5)
    # everything in one data file, and no pack (format 1 has none)
    with override(chunk_bytes=CHUNK, direct_io_min_bytes=1 << 40, pack_below_bytes=0):
        save_one(manager_factory, state)
    downgrade_to_version_1(checkpoint_dir, STEP)
    assert tamper.read_json(tamper.manifest_path(checkpoint_dir, STEP))["format_version"] == 1
    assert list(verify_step(LocalTier(checkpoint_dir), STEP)) == []
    restored = zeros_like(state)
    assert manager_factory().restore(restored) == STEP
    assert_same_state(restored, state)
    tamper.flip_bit(tamper.data_path(checkpoint_dir, STEP), 100)
    problems = list(verify_step(LocalTier(checkpoint_dir), STEP))
    assert len(problems) == 1 and tamper.data_path(checkpoint_dir, STEP).name in problems[0].path


@pytest.mark.parametrize("misalign", [0, 1])
def test_direct_reads_fill_aligned_and_unaligned_buffers_up_to_an_unaligned_end(tmp_path: Path,
                                                                               misalign: int) -> None:
    payload = os.urandom(20 * direct_io.ALIGNMENT + 4321)  # the file ends off the alignment
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "data").write_bytes(payload)
    tier = LocalTier(tmp_path)
    target = aligned_empty((len(payload) + misalign,), torch.uint8)
    out = memoryview(target.numpy())[misalign:]
    with override(direct_io_min_bytes=0):
        tier.read_into("step/data", 0, out)
        assert bytes(out) == payload
        tail = memoryview(bytearray(len(payload) - direct_io.ALIGNMENT))
        tier.read_into("step/data", direct_io.ALIGNMENT, tail)
        assert bytes(tail) == payload[direct_io.ALIGNMENT:]


def test_file_system_that_refuses_direct_reads_is_read_through_the_page_cache(
        manager_factory: ManagerFactory, checkpoint_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = mixed_state(6)
    with override(chunk_bytes=CHUNK, io_threads=2, direct_io_min_bytes=0):
        save_one(manager_factory, state)
        refused = []

        def refuse(fd: int, out: memoryview, offset: int) -> int:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(direct_io, "pread_direct", refuse)
        restored = zeros_like(state)
        assert manager_factory().restore(restored) == STEP
    assert refused or not direct_io.AVAILABLE
    assert_same_state(restored, state)


def test_aligned_tensors_start_their_own_storage_on_a_page() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.complex64, torch.int64):
        tensor = aligned_empty((64, 1024), dtype)
        assert tensor.data_ptr() % direct_io.ALIGNMENT == 0 and tensor.storage_offset() == 0
        assert tensor.shape == (64, 1024) and tensor.dtype == dtype
    state = torch.get_rng_state()  # reads its argument's storage from the start
    staged = aligned_empty(tuple(state.shape), state.dtype)
    staged.copy_(state)
    torch.set_rng_state(staged)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_failed_read_returns_only_after_every_read_of_the_tensor_stopped(
        manager_factory: ManagerFactory, checkpoint_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = mixed_state(7)
    with override(chunk_bytes=CHUNK):
        save_one(manager_factory, state)
    tier = LocalTier(checkpoint_dir)
    reader = StepReader([ChunkSource(tier, load_rank_index(tier, load_step_manifest(tier, STEP), 0))])
    real_read, calls, calls_lock = step_reader.read_chunk, [], threading.Lock()
    another_started, late = threading.Event(), threading.Event()

    def first_fails_others_slow(source: Any, chunk: Any, out: memoryview, *, tensor: str = "?") -> None:
        with calls_lock:
            calls.append(chunk)
            first = len(calls) == 1
        if first:
            another_started.wait(60)  # the failure comes while another read of the tensor runs, however slow
            raise IntegrityError("injected", path="x")
        another_started.set()
        time.sleep(0.3)  # only paces: a correct reader waits for this read whenever the failure reaches it
        real_read(source, chunk, out, tensor=tensor)
        late.set()

    monkeypatch.setattr(step_reader, "read_chunk", first_fails_others_slow)
    with override(read_threads=4), pytest.raises(IntegrityError, match="injected"):
        reader.read_tensor("big", torch.zeros_like(state["big"]))
    assert len(calls) > 1 and late.is_set(), "no read of the tensor may still be running after the error"
