"""harness.dcp_swap: test files written for DCP's FileSystemWriter/FileSystemReader run against
ckptd's plugins, in the pytest process and in the processes it spawns (as PyTorch's multi-process test
cases start their ranks). The inner test below is ckptd's own, in the style of PyTorch's DCP tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import harness

INNER_TEST = textwrap.dedent('''
    import multiprocessing
    import os

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter


    def _spawned(path):
        assert type(FileSystemWriter(path)).__module__ == "harness.dcp_swap"
        dcp.save({"w": torch.full((3,), 7.0)}, storage_writer=FileSystemWriter(path, thread_count=2))


    def test_writer_reader_and_checkpoint_id(tmp_path):
        path = str(tmp_path / "ckpt")
        dcp.save({"w": torch.arange(4.0), "n": 1}, storage_writer=FileSystemWriter(path, single_file_per_rank=False))
        state = {"w": torch.zeros(4), "n": 0}
        dcp.load(state, storage_reader=FileSystemReader(path))
        assert torch.equal(state["w"], torch.arange(4.0)) and state["n"] == 1
        dcp.save({"w": torch.ones(4), "n": 2}, checkpoint_id=path)  # auto-detected writer, same directory
        dcp.load(state, checkpoint_id=path)
        assert torch.equal(state["w"], torch.ones(4)) and state["n"] == 2
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "path"), "w") as handle:
            handle.write(path)


    def test_spawned_process_is_swapped_too(tmp_path):
        path = str(tmp_path / "spawned")
        process = multiprocessing.get_context("spawn").Process(target=_spawned, args=(path,))
        process.start()
        process.join(120)
        assert process.exitcode == 0
        state = {"w": torch.zeros(3)}
        dcp.load(state, storage_reader=FileSystemReader(path))
        assert torch.equal(state["w"], torch.full((3,), 7.0))
''')


def _run_inner(tmp_path: Path, swap: str, text: str = INNER_TEST) -> subprocess.CompletedProcess[str]:
    (tmp_path / "inner").mkdir(exist_ok=True)
    (tmp_path / "inner" / "test_inner.py").write_text(text)
    env = {"OUT": str(tmp_path / "out"), "CKPTD_DCP_SWAP": swap, "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(harness.TESTS_DIR)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "harness.dcp_swap", "-p", "no:cacheprovider",
                           "-o", "addopts=", "-q", "test_inner.py", "--basetemp", str(tmp_path / "base")],
                          cwd=tmp_path / "inner", env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.multirank
def test_swapped_classes_write_ckptd_steps_here_and_in_spawned_processes(tmp_path: Path) -> None:
    result = _run_inner(tmp_path, "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout and "3 saves committed" in result.stdout
    path = Path((tmp_path / "out" / "path").read_text())
    assert sorted(p.name for p in path.iterdir()) == ["step-000000000000", "step-000000000001"]
    assert (path / "step-000000000001" / "manifest.json").is_file()
    assert not (path / ".metadata").exists()


def test_without_the_swap_dcp_writes_its_own_files(tmp_path: Path) -> None:
    result = _run_inner(tmp_path, "0", INNER_TEST.split("\n\ndef test_spawned")[0])
    assert result.returncode == 0, result.stdout + result.stderr
    assert (Path((tmp_path / "out" / "path").read_text()) / ".metadata").is_file()
