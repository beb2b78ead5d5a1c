"""A torchtitan-like loop (FSDP2 on a CPU gloo mesh of 2 real processes) that checkpoints with plain
``dcp.save``/``dcp.async_save`` and ckptd's plugins (:mod:`harness.dcp_training`): SIGKILL after a
committed save, resume in fresh processes, final weights equal to an uninterrupted run bit for bit;
the last step loads at world size 1, from the local root and, once promoted, from moto's S3 server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptd.dcp import CkptdStorageReader
from ckptd.format.layout import step_dir
from ckptd.promotion.promoter import promote_step
from harness.dcp_training import build_model, launch_ranks
from ckptd.tiers import open_tier
from ckptd.tiers.local import LocalTier

pytestmark = pytest.mark.multirank

STEPS, EVERY = 8, 2


def _run(root: Path, out: Path | None, *extra: str, kill_when_ready: Path | None = None) -> list[int]:
    argv = ["--root", str(root), "--steps", str(STEPS), "--save-every", str(EVERY), *extra]
    return launch_ranks(2, argv + (["--out", str(out)] if out else []), timeout_s=150,
                        kill_when_ready=None if kill_when_ready is None else str(kill_when_ready))


def _weights(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_async_saves_in_a_checkpoint_process_load_back_bit_for_bit(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert _run(tmp_path / "root", out, "--save-mode", "process", "--ids", "auto", "--check-saves") == [0, 0]
    result = _weights(out)
    assert result["checked_saves"] == [step_dir(s) for s in range(STEPS // EVERY)]  # each save its own step
    assert LocalTier(tmp_path / "root").committed_steps() == list(range(STEPS // EVERY))


@pytest.mark.slow
@pytest.mark.s3
def test_kill_after_a_committed_save_resumes_to_the_same_weights(tmp_path: Path, s3_bucket: str,
                                                                 s3_options: dict[str, Any]) -> None:
    reference = tmp_path / "reference.json"
    assert _run(tmp_path / "uninterrupted", reference, "--save-mode", "sync", "--check-saves") == [0, 0]
    expected = _weights(reference)
    assert expected["first_step"] == 1 and len(expected["checked_saves"]) == STEPS // EVERY

    root = tmp_path / "killed"
    assert _run(root, None, "--save-mode", "thread", "--kill-after", "4", "--ready-dir", str(tmp_path),
                kill_when_ready=tmp_path) == [-9, -9]
    assert LocalTier(root).committed_steps() == [2, 4]
    resumed = tmp_path / "resumed.json"
    assert _run(root, resumed, "--save-mode", "thread") == [0, 0]
    result = _weights(resumed)
    assert result["first_step"] == 5
    assert result["weights"] == expected["weights"]  # bit for bit: hex of every parameter's bytes

    model = build_model()  # world size 1, no process group: DCP reshards the FSDP2 shards into plain tensors
    state = {"app": {"model": model.state_dict()}, "train": {"step": -1}}
    dcp.load(state, checkpoint_id=str(root), storage_reader=CkptdStorageReader())
    assert state["train"]["step"] == STEPS
    assert {k: v.contiguous().view(torch.uint8).numpy().tobytes().hex() for k, v in model.state_dict().items()} \
        == expected["weights"]

    remote = open_tier(f"s3://{s3_bucket}/run", storage_options=s3_options)
    promote_step(LocalTier(root), remote, STEPS)  # type: ignore[arg-type]
    shutil.rmtree(root)
    from_s3 = build_model()
    for parameter in from_s3.parameters():
        parameter.data.zero_()
    dcp.load({"app": {"model": from_s3.state_dict()}}, storage_reader=CkptdStorageReader([remote], STEPS))
    assert {k: v.contiguous().view(torch.uint8).numpy().tobytes().hex() for k, v in from_s3.state_dict().items()} \
        == expected["weights"]
