"""``ckptd export``'s output directory and file layout: the current directory is never replaced, a
temporary left by a killed export (real SIGKILL) is removed by the next one unless a live export holds
it, every tensor's data starts at a multiple of its element size, float8_e8m0fnu is written as
``F8_E8M0``, a dtype error names the step, and ``ckptd restore`` to one safetensors file refuses two
entries with one dotted key instead of dropping one."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import ckptd
from ckptd.cli.main import cli
from ckptd.errors import ConfigError
from ckptd.export import ExportOptions, export_safetensors, save_tensors


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {"mask": torch.tensor([True, False, True]), "scale": torch.randn(3, generator=generator).half(),
            "w": torch.randn(5, 3, generator=generator), "count": torch.arange(3),
            "q": torch.randn(7, generator=generator).to(torch.float8_e4m3fn), "scalar": torch.tensor(1.5),
            "empty": torch.empty(0, 2, dtype=torch.float64)}


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(1, {"model": _weights()}, force=True)
    return tmp_path / "ckpt"


def _same(first: torch.Tensor, second: torch.Tensor) -> bool:
    return first.dtype == second.dtype and first.shape == second.shape and \
        first.reshape(-1).view(torch.uint8).numpy().tobytes() == second.reshape(-1).view(torch.uint8).numpy().tobytes()


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + length])


def _check_aligned(path: Path) -> None:
    sizes = {"F64": 8, "I64": 8, "F32": 4, "F16": 2, "BOOL": 1, "F8_E4M3": 1}
    entries = {key: value for key, value in _header(path).items() if key != "__metadata__"}
    assert entries, path
    for key, entry in entries.items():
        assert entry["data_offsets"][0] % sizes[entry["dtype"]] == 0, (key, entry)


def test_the_current_directory_is_never_replaced(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    inode = here.stat().st_ino
    result = CliRunner().invoke(cli, ["export", str(root), "--step", "1", "--key-prefix", "model", "--out", "."])
    assert result.exit_code == 2, result.output
    assert "current directory" in result.output and "--out ./model" in result.output
    assert here.stat().st_ino == inode and list(here.iterdir()) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt", "here"], "no temporary beside it"
    result = CliRunner().invoke(cli, ["export", str(root), "--step", "1", "--key-prefix", "model", "--out", "model"])
    assert result.exit_code == 0, result.output
    assert load_file(str(here / "model" / "model.safetensors")).keys() == _weights().keys()


_KILLED_EXPORT = """
import os, sys, time
from ckptd.export import ExportOptions, export_safetensors
def progress(nbytes):
    open(sys.argv[3], "w").close()
    time.sleep(600)
export_safetensors(sys.argv[1], 1, sys.argv[2], ExportOptions(key_prefix="model"), progress=progress)
"""


def test_a_killed_exports_temporary_is_removed_by_the_next_export(root: Path, tmp_path: Path) -> None:
    out, marker = tmp_path / "model", tmp_path / "writing"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_EXPORT, str(root), str(out), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the export did not start writing"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    left = [path for path in tmp_path.iterdir() if path.name.startswith(".model.tmp-")]
    assert len(left) == 1 and left[0].is_dir() and not out.exists()
    # a temporary a live export holds stays, and so do names that only look alike
    live = tmp_path / ".model.tmp-0123456789ab"
    live.mkdir()
    (tmp_path / ".model.tmp-notours").mkdir()
    (tmp_path / ".other.tmp-0123456789ab").mkdir()
    held = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        report = export_safetensors(str(root), 1, out, ExportOptions(key_prefix="model"))
    finally:
        os.close(held)
    assert report.files == ("model.safetensors",)
    assert not left[0].exists(), "the killed export's temporary is removed"
    assert live.is_dir() and (tmp_path / ".model.tmp-notours").is_dir() and (tmp_path / ".other.tmp-0123456789ab").is_dir()
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded.keys() == _weights().keys()
    assert all(_same(loaded[key], tensor) for key, tensor in _weights().items())


def test_every_tensor_starts_at_a_multiple_of_its_element_size(root: Path, tmp_path: Path) -> None:
    save_tensors(tmp_path / "one.safetensors", _weights())
    _check_aligned(tmp_path / "one.safetensors")
    export_safetensors(str(root), 1, tmp_path / "whole", ExportOptions(key_prefix="model"))
    _check_aligned(tmp_path / "whole" / "model.safetensors")
    export_safetensors(str(root), 1, tmp_path / "shards", ExportOptions(key_prefix="model", max_shard_size=40))
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _weights().values())
    for name in set(index["weight_map"].values()):
        _check_aligned(tmp_path / "shards" / name)
        loaded = load_file(str(tmp_path / "shards" / name))
        assert all(_same(tensor, _weights()[key]) for key, tensor in loaded.items())


def test_float8_e8m0_scales_are_written_as_f8_e8m0(tmp_path: Path) -> None:
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0]).to(torch.float8_e8m0fnu)
    save_tensors(tmp_path / "s.safetensors", {"scales": scales})
    assert _header(tmp_path / "s.safetensors")["scales"]["dtype"] == "F8_E8M0"
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as handle:
        back = handle.get_tensor("scales")
    assert back.dtype == torch.float8_e8m0fnu and torch.equal(back.view(torch.uint8), scales.view(torch.uint8))


def test_a_dtype_error_names_the_step(tmp_path: Path) -> None:
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(4, {"model": {"z": torch.ones(2, dtype=torch.complex128)}}, force=True)
    with pytest.raises(ConfigError, match="'z' has dtype complex128") as caught:
        export_safetensors(str(tmp_path / "ckpt"), 4, tmp_path / "out", ExportOptions(key_prefix="model"))
    assert caught.value.step == 4 and "--exclude" in str(caught.value)


def test_a_big_endian_host_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(ConfigError, match="big-endian"):
        save_tensors(tmp_path / "x.safetensors", {"w": torch.ones(2)})
    assert list(tmp_path.iterdir()) == []


def test_restore_to_safetensors_refuses_two_entries_with_one_key(tmp_path: Path) -> None:
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(3, {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}, "c": torch.arange(2)}, force=True)
    out = tmp_path / "rank0.safetensors"
    result = CliRunner().invoke(cli, ["restore", str(tmp_path / "ckpt"), "--step", "3", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "two entries of the state export to the key 'a.b'" in result.output and "step 3" in result.output
    assert not out.exists()
    whole = tmp_path / "rank0.pt"
    result = CliRunner().invoke(cli, ["restore", str(tmp_path / "ckpt"), "--step", "3", "--out", str(whole)])
    assert result.exit_code == 0, result.output
    state = torch.load(whole, weights_only=True)
    assert torch.equal(state["a.b"], torch.ones(2)) and torch.equal(state["a"]["b"], torch.zeros(2))


def test_two_large_tensors_in_a_row_are_never_held_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import weakref

    import ckptd.export.assembly as assembly

    big = {f"layer{number}": torch.randn(256, 1024, generator=torch.Generator().manual_seed(number))
           for number in range(3)}  # 1 MiB each, over the 500 kB shard size: none is read ahead
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(1, {"model": big}, force=True)
    live, peak = [0], [0]

    def tracked(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = real(shape, dtype)
        size = buffer.numel() * buffer.element_size()
        live[0] += size
        peak[0] = max(peak[0], live[0])
        weakref.finalize(buffer, lambda: live.__setitem__(0, live[0] - size))
        return buffer

    real = assembly.aligned_empty
    monkeypatch.setattr(assembly, "aligned_empty", tracked)
    export_safetensors(str(tmp_path / "ckpt"), 1, tmp_path / "out", ExportOptions(key_prefix="model",
                                                                                max_shard_size="500kB"))
    assert peak[0] == 256 * 1024 * 4, "one large tensor in memory at a time"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    for key, name in index["weight_map"].items():
        assert _same(load_file(str(tmp_path / "out" / name))[key], big[key])


def test_a_shard_size_in_bits_is_refused_not_read_as_bytes() -> None:
    from ckptd.export.hf_layout import parse_shard_size

    for bits in ("5Gb", "500mb", "2kb", "8b"):
        with pytest.raises(ConfigError, match="Hugging Face reads as bits"):
            parse_shard_size(bits)
    assert parse_shard_size("5GB") == parse_shard_size("5gB") == 5 * 10**9
    assert parse_shard_size("2gib") == parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size("500kB") == 500 * 10**3
