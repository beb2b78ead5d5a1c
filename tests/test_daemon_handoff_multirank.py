"""The hand-off to the node daemon on a real two-rank gloo job that shares one local directory.

Every rank finds the daemon, and the ranks agree that it promotes; no rank sends a request of its own to S3;
the daemon promotes the steps its ``remote_every_steps`` asks for, holding both ranks' files, and each rank
releases its pins of the steps the daemon does not take, so that nothing stays pinned.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.promotion.pinning import PinnedSteps
from ckptd.stepio.step_reader import load_step_manifest, verify_step
from ckptd.testing import run_multirank
from harness.daemon_process import DaemonProcess, wait_until, write_config
from ckptd.tiers import open_tier
from ckptd.tiers.atomicity import ranks_held
from ckptd.tiers.local import LocalTier

pytestmark = [pytest.mark.s3, pytest.mark.multirank]


def _train(rank: int, world_size: int, root: str, remote: str, options: dict[str, Any]) -> dict[str, Any]:
    import ckptd

    sent: collections.Counter[str] = collections.Counter()
    with ckptd.CheckpointManager(root, remote=remote, storage_options=options, capture_rng=False,
                                 policy=ckptd.Policy(keep_local=2)) as manager:
        manager.remote.on_request(lambda request, **_: sent.update([request.method]))
        promotes = manager.daemon_promotes
        for step in range(1, 5):
            manager.save(step, {f"rank{rank}": torch.full((32 * 1024,), float(rank * 100 + step))})
            manager.wait()
        manager.wait_uploads()
        uploaded = [report.step for report in manager.upload_reports]
    return {"promotes": promotes, "sent": dict(sent), "uploaded": uploaded}


@pytest.fixture
def node(tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    remote = f"s3://{s3_bucket}/run1"
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root), "remote": remote,
                                                      "remote_every_steps": 2, "storage_options": s3_options}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", poll_interval_s=0.2,
                          retry_backoff_s=0.2, scrub_interval_s=0)
    with DaemonProcess(config, state, env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}) \
            as daemon:
        daemon.wait_ready()
        yield {"daemon": daemon, "root": root, "remote": remote, "options": s3_options}


def test_two_ranks_hand_their_steps_to_the_daemon_and_leave_no_pin(node, monkeypatch):
    monkeypatch.delenv("CKPTD_DAEMON_SOCKET", raising=False)
    results = run_multirank(_train, 2, str(node["root"]), node["remote"], node["options"], timeout_s=120)
    assert results == [{"promotes": True, "sent": {}, "uploaded": []}] * 2, results  # no rank uploads itself
    remote = open_tier(node["remote"], storage_options=node["options"])
    wait_until(lambda: remote.committed_steps() == [2, 4], 60,
               f"the daemon to promote steps 2 and 4; log:\n{node['daemon'].log()}")
    for step in (2, 4):
        manifest = load_step_manifest(remote, step)
        assert manifest.world_size == 2 and set(ranks_held(remote, step, manifest)) == {0, 1}
        assert list(verify_step(remote, step)) == []
    pins = PinnedSteps(LocalTier(node["root"]))
    wait_until(lambda: pins.pinned() == [] and not any((node["root"] / ".promoting").glob("step-*/*")), 30,
               f"every pin released (steps 1 and 3 not taken, 2 and 4 promoted): {os.listdir(node['root'])}")
