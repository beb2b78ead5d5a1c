"""Asynchronous saving: staging semantics, back-pressure, stored background errors, the writer thread,
the memory tier, and a real SIGKILL while the background write runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.errors import ConfigError, StorageError
from ckptd.stepio import rank_writer
from ckptd.format.layout import step_dir
from ckptd.state.staging import Stager


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Blocks the background write of chosen steps until released; can also fail chosen steps."""
    control: dict[str, Any] = {"block": set(), "fail": set(), "release": threading.Event(),
                               "entered": threading.Event()}
    original = rank_writer.RankWriter.add

    def gated(self: Any, name: str, tensor: torch.Tensor) -> Any:
        if self.step in control["block"]:
            control["entered"].set()
            control["release"].wait(30)
        if self.step in control["fail"]:
            raise StorageError("injected failure", path=f"{step_dir(self.step)}/rank-00000.data", step=self.step)
        return original(self, name, tensor)

    monkeypatch.setattr(rank_writer.RankWriter, "add", gated)
    return control


def test_state_may_change_right_after_save_returns(tmp_path: Path, gate: dict[str, Any]) -> None:
    state = {"w": torch.randn(1000), "n": torch.arange(50)}
    expected = {k: _bytes(v) for k, v in state.items()}
    gate["block"].add(1)
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        assert manager.save(1, state)
        assert gate["entered"].wait(10)  # the background write has started and is held
        state["w"].mul_(-3.0)
        state["n"].zero_()
        gate["release"].set()
        manager.wait()
        assert manager.committed_steps() == [1]
    loaded = {"w": torch.zeros(1000), "n": torch.zeros(50, dtype=torch.int64)}
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        assert manager.restore(loaded) == 1
        assert manager.last_restore.tier.startswith("local")
    assert {k: _bytes(v) for k, v in loaded.items()} == expected


def test_busy_skip_skips_and_busy_wait_waits(tmp_path: Path, gate: dict[str, Any]) -> None:
    state = {"w": torch.ones(10)}
    gate["block"].add(1)
    with ckptd.CheckpointManager(tmp_path / "skip", policy=ckptd.Policy(on_busy="skip", keep_local=None),
                                 capture_rng=False) as manager:
        assert manager.save(1, state)
        assert gate["entered"].wait(10)
        assert manager.save(2, state) is False
        gate["release"].set()
        manager.wait()
        assert manager.save(3, state)
        manager.wait()
        assert manager.committed_steps() == [1, 3]
    gate["release"].clear()
    gate["entered"].clear()
    with ckptd.CheckpointManager(tmp_path / "wait", policy=ckptd.Policy(on_busy="wait", keep_local=None),
                                 capture_rng=False) as manager:
        assert manager.save(1, state)
        assert gate["entered"].wait(10)
        threading.Timer(0.2, gate["release"].set).start()
        assert manager.save(2, state)  # returns only after step 1 is written and step 2 staged
        assert gate["release"].is_set(), "save(2) returned while step 1 was still held"
        manager.wait()
        assert manager.committed_steps() == [1, 2]


def test_background_error_is_raised_on_the_next_call_and_the_save_after_works(tmp_path: Path,
                                                                             gate: dict[str, Any]) -> None:
    state = {"w": torch.ones(10)}
    gate["fail"].add(2)
    with ckptd.CheckpointManager(tmp_path, policy=ckptd.Policy(keep_local=None), capture_rng=False) as manager:
        assert manager.save(1, state)
        assert manager.save(2, state)  # the failure happens in the background
        with pytest.raises(StorageError) as caught:
            manager.save(3, state)
        assert caught.value.step == 2 and "rank-00000.data" in str(caught.value)
        assert manager.save(4, state)
        manager.wait()
        assert manager.committed_steps() == [1, 4]


def test_writer_thread_is_named_and_stops_on_close(tmp_path: Path) -> None:
    manager = ckptd.CheckpointManager(tmp_path, capture_rng=False)
    names = [t.name for t in threading.enumerate()]
    assert "ckptd-writer-rank0" in names
    manager.save(1, {"w": torch.ones(3)})
    manager.close()
    assert (tmp_path / step_dir(1) / "manifest.json").exists()  # close waited for the write
    assert "ckptd-writer-rank0" not in [t.name for t in threading.enumerate()]


def test_stager_reuses_its_buffers_and_respects_the_budget() -> None:
    stager = Stager(budget_bytes=4096)
    source = {"a": torch.randn(100), "b": torch.arange(20)}
    first = stager.stage(source)
    pointers = {k: v.data_ptr() for k, v in first.tensors.items()}
    source["a"].add_(1.0)
    second = stager.stage(source)
    assert stager.allocations == 2
    assert {k: v.data_ptr() for k, v in second.tensors.items()} == pointers
    assert _bytes(second.tensors["a"]) == _bytes(source["a"])
    assert not second.tensors["a"].is_pinned()  # no CUDA here: never pinned
    with pytest.raises(ConfigError, match="staging budget"):
        stager.stage({"big": torch.zeros(2048)})


def test_restore_in_the_same_process_reads_the_memory_tier(tmp_path: Path) -> None:
    state = {"w": torch.randn(100)}
    expected = _bytes(state["w"])
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        manager.save(5, state)
        state["w"].zero_()
        assert manager.restore(state) == 5
        assert manager.last_restore.tier == "memory"
    assert _bytes(state["w"]) == expected


_CRASHING_CHILD = textwrap.dedent("""
    import sys, time, torch, ckptd
    from pathlib import Path
    from ckptd.tiers import local
    root, marker = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(3)
    state = {"w": torch.randn(4096), "step": 0}
    manager = ckptd.CheckpointManager(root, capture_rng=False)
    manager.save(1, state)
    manager.wait()
    original = local.AtomicFile.write
    def slow_write(self, data):
        offset = original(self, data)
        if "step-000000000002" in str(self.final):
            marker.write_text("writing")
            time.sleep(60)
        return offset
    local.AtomicFile.write = slow_write
    state["w"].add_(1.0)
    state["step"] = 2
    manager.save(2, state)
    time.sleep(60)
""")


def test_sigkill_during_background_write_leaves_previous_step_restorable(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    root = tmp_path / "ckpt"
    child = subprocess.Popen([sys.executable, "-c", _CRASHING_CHILD, str(root), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None, "the child exited before writing step 2"
            assert time.monotonic() < deadline, "the child never started writing step 2"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    assert (root / step_dir(2)).is_dir()  # a half-written step exists, uncommitted
    torch.manual_seed(3)
    expected = _bytes(torch.randn(4096))
    state = {"w": torch.zeros(4096), "step": -1}
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.committed_steps() == [1]
        assert manager.restore(state) == 1
    assert _bytes(state["w"]) == expected and state["step"] == 0
    assert not any(".tmp-" in p.name for p in (root / step_dir(2)).iterdir())  # cleaned on start
