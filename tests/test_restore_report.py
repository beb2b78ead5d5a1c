"""``CheckpointManager.last_restore`` names every tier that supplied chunks: a step read partly from the
local tier and partly from the object tier (moto's S3 server on loopback) after one local chunk was
damaged, and a step read from the memory tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.testing.tamper import chunk_location, chunk_records, flip_bit


def _state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(256, generator=generator) for name in ("a", "b", "c", "d")} | {"step": seed}


@pytest.mark.s3
def test_a_step_read_partly_local_partly_remote_names_both_tiers(tmp_path: Path, s3_bucket: str,
                                                                  s3_options: dict[str, Any]) -> None:
    root, url = tmp_path / "local", f"s3://{s3_bucket}/run"
    saved = _state(1)
    with ckptd.CheckpointManager(root, remote=url, storage_options=s3_options, codec="raw",
                                 capture_rng=False) as manager:
        manager.save(1, saved, force=True)
        manager.wait_uploads()
        assert manager.remote.committed_steps() == [1]
    chunks = len(chunk_records(root, 1))
    path, offset, _ = chunk_location(root, 1, "c")
    flip_bit(path, offset + 3)  # the local copy of one chunk of "c" is now bad

    live = {name: torch.zeros(256) for name in "abcd"} | {"step": 0}
    with ckptd.CheckpointManager(root, remote=url, storage_options=s3_options, capture_rng=False) as manager:
        assert manager.restore(live) == 1
        report = manager.last_restore
        local, remote = manager.local.label, manager.remote.label
    assert report.tier == local
    assert report.tiers == [local, remote]
    assert report.chunks_by_tier == {local: chunks - 1, remote: 1}
    assert [(event.tensor, event.tier) for event in report.events] == [("c", local)]
    for name in "abcd":
        assert torch.equal(live[name], saved[name]), name


def test_a_step_read_from_the_memory_tier_names_it(tmp_path: Path) -> None:
    state = _state(2)
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(1, state, force=True)
        manager.wait()
        expected = {name: state[name].clone() for name in "abcd"}
        for name in "abcd":
            state[name].zero_()
        assert manager.restore(state) == 1
        assert manager.last_restore.tiers == ["memory"]
        assert manager.last_restore.chunks_by_tier == {"memory": 4}
    for name in "abcd":
        assert torch.equal(state[name], expected[name])
