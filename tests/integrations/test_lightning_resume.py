"""Lightning through ``CkptdCheckpointIO``: train, SIGKILL right after a committed save, resume in a new
process with ``ckpt_path="last"``, and end with the weights of an uninterrupted run, bit for bit.

CPU arithmetic with one thread and ``deterministic=True`` is reproducible, and ckptd restores the RNG
states with the checkpoint, so the shuffled ``DataLoader`` draws the same order after the resume: the
comparison is exact (no tolerance). Each run is a real child process (``lightning_run.py``); the kill is a
real SIGKILL; S3 is moto's server over HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.testing.compare import state_differences

RUN = Path(__file__).with_name("lightning_run.py")
EPOCHS, STEPS_PER_EPOCH = 4, 8


def _config(root: Path, **extra: Any) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    return {"out": str(root), "local": str(root / "ckpt"), "dirpath": str(root / "lightning"),
            "max_epochs": EPOCHS, **extra}


def _start(config: dict[str, Any]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(RUN), json.dumps(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)


def _train(config: dict[str, Any]) -> dict[str, Any]:
    child = _start(config)
    output, _ = child.communicate(timeout=240)
    assert child.returncode == 0, output.decode()[-4000:]
    return json.loads((Path(config["out"]) / "summary.json").read_text())


def _weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    return torch.load(Path(config["out"]) / "weights.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of an uninterrupted run."""
    config = _config(tmp_path_factory.mktemp("reference"))
    summary = _train(config)
    assert summary["global_step"] == EPOCHS * STEPS_PER_EPOCH and summary["started"]["global_step"] == 0
    kept = sorted(name for name in os.listdir(config["local"]) if name.startswith("step-"))
    assert kept == [step_dir(EPOCHS * STEPS_PER_EPOCH)], "steps save_top_k removed are deleted from ckptd"
    return _weights(config)


def test_sigkill_after_a_committed_save_then_resume_last_matches_uninterrupted(tmp_path: Path, reference) -> None:
    killed_at = 2 * STEPS_PER_EPOCH
    config = _config(tmp_path, block_after_step=killed_at)
    child = _start(config)
    manifest = Path(config["local"]) / step_dir(killed_at) / MANIFEST_NAME
    deadline = time.monotonic() + 180
    while not ((tmp_path / "ready").exists() and manifest.exists()):
        assert child.poll() is None, child.communicate()[0].decode()[-4000:]
        assert time.monotonic() < deadline, "the child never committed the step"
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert not (tmp_path / "weights.pt").exists()
    pointer = json.loads((Path(config["dirpath"]) / "last.ckpt").read_text())
    assert pointer["step"] == killed_at

    summary = _train(_config(tmp_path, ckpt_path="last"))
    started = summary["started"]
    assert started["restored_step"] == killed_at and [tier.split()[0] for tier in started["tiers"]] == ["local"]
    assert (started["global_step"], started["epoch"]) == (killed_at, 2), "loop state restored"
    assert started["lr"] == pytest.approx(0.01 * 0.8 ** 2), "LR scheduler restored"
    assert started["adam_steps"] == [float(killed_at)] * 4, "optimizer state restored"
    assert summary["data_state"] == {"loaders_made": 1, "note": "tiny"}, "data module state restored"
    assert summary["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert state_differences(_weights(config), reference) == []


def test_resume_with_the_local_directory_lost_restores_from_s3(tmp_path: Path, reference, s3_bucket: str,
                                                               s3_options: dict[str, Any]) -> None:
    remote = f"s3://{s3_bucket}/lightning-run"
    first = _config(tmp_path, remote=remote, storage_options=s3_options, max_epochs=2)
    assert _train(first)["global_step"] == 2 * STEPS_PER_EPOCH
    shutil.rmtree(first["local"])  # the node's disk is gone; Lightning's pointer files survive elsewhere

    summary = _train(_config(tmp_path, remote=remote, storage_options=s3_options, ckpt_path="last"))
    started = summary["started"]
    assert started["restored_step"] == 2 * STEPS_PER_EPOCH
    assert [tier.split()[0] for tier in started["tiers"]] == ["object"], f"read from the object tier: {started['tiers']}"
    assert summary["data_state"] == {"loaders_made": 1, "note": "tiny"}
    assert state_differences(_weights(first), reference) == []
