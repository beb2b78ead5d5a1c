"""GC never takes a step a live promoter is promoting (the step owner lease, ckptd.promotion.lease).

Against a real daemon subprocess (whose object-tier writes are slowed and announced by
``harness.slow_daemon``) and moto's S3 server: the daemon is frozen (SIGSTOP) right before it writes
the manifest of the step it promotes, with every chunk already uploaded; ``ckptd gc --abandoned-after 0``
runs as its own process; the daemon goes on (SIGCONT) and the step commits and verifies. A record whose
owner is dead protects nothing, so leftovers of a killed promoter still go.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptd.format.layout import MANIFEST_NAME, step_dir, step_file
from ckptd.promotion.gc import collect_garbage
from ckptd.promotion.lease import STEP_OWNERS_PREFIX, live_step_owners, step_owner_lease
from ckptd.stepio.step_reader import verify_step
from harness.daemon_process import DaemonProcess, run_trainer, write_config
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.upload_owners import UploadOwner

pytestmark = pytest.mark.s3


def _gc(url: str, s3_options: dict[str, Any]) -> dict[str, Any]:
    endpoint = s3_options["client_kwargs"]["endpoint_url"]
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    result = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "gc", url, "--abandoned-after", "0", "--json",
                             "--endpoint-url", endpoint], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_gc_with_abandoned_after_0_during_a_slow_promotion_leaves_the_step_to_commit(tmp_path: Path, s3_bucket,
                                                                                      s3_options) -> None:
    root, state = tmp_path / "root", tmp_path / "state"
    root.mkdir()
    url = f"s3://{s3_bucket}/run1"
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root), "remote": url,
                                                      "storage_options": s3_options}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", poll_interval_s=0.2,
                          retry_backoff_s=0.2, scrub_interval_s=0)
    manifest_write = f"write object {step_file(1, MANIFEST_NAME)}"
    with DaemonProcess(config, state, slow_writes_s=0.2) as daemon:
        daemon.wait_ready()
        assert run_trainer(root, 1, 1) == [1]
        daemon.wait_event(lambda line: line == manifest_write, timeout_s=120)
        # every chunk and index of step 1 is uploaded; the commit waits behind the announced write
        os.kill(daemon.process.pid, signal.SIGSTOP)
        try:
            remote = ObjectTier(url, storage_options=s3_options)
            assert remote.committed_steps() == [] and remote.list_files(1), "step 1 is in flight"
            assert [owner.pid for owner in live_step_owners(remote, 1)] == [daemon.process.pid]
            report = _gc(url, s3_options)
        finally:
            os.kill(daemon.process.pid, signal.SIGCONT)
        assert report["abandoned_steps"] == [] and report["in_flight_steps"] == [1], report
        assert report["deleted_chunks"] == 0, "no chunk of the in-flight step was swept"
        daemon.wait_for(lambda: remote.committed_steps() == [1], 120, "step 1 to commit on the object tier")
        assert list(verify_step(remote, 1)) == [], "the committed step is whole"
        daemon.wait_for(lambda: not remote.list_objects(STEP_OWNERS_PREFIX), 60, "the owner record to be removed")


def test_a_dead_owner_protects_nothing_and_a_live_one_protects_its_step(tmp_path: Path, s3_bucket, s3_options) -> None:
    remote = ObjectTier(f"s3://{s3_bucket}/leftovers", storage_options=s3_options)
    for step in (1, 2):
        remote.write_bytes(step_file(step, "rank-00000.index.json"), b"{}")
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = UploadOwner.mine(step_dir(1))
    dead = UploadOwner(dead.key, dead.host, int(finished.stdout), dead.refreshed, dead.lease_s)
    remote.write_bytes(f"{STEP_OWNERS_PREFIX}/{step_dir(1)}/dead.json", dead.to_json_bytes())
    assert live_step_owners(remote, 1) == []
    with step_owner_lease(remote, 2):
        assert [owner.pid for owner in live_step_owners(remote, 2)] == [os.getpid()]
        report = collect_garbage(remote, abandoned_after_s=0)
        assert report.abandoned_steps == (1,) and report.in_flight_steps == (2,)
    assert remote.list_files(1) == [] and remote.list_files(2) == ["rank-00000.index.json"]
    assert live_step_owners(remote, 2) == [], "the lease's record is gone once the block ends"
    assert collect_garbage(remote, abandoned_after_s=0).abandoned_steps == (2,)
