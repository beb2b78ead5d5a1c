"""A restarted job owns its interrupted promotions (issue 26, part 4): a training process is killed with
SIGKILL while its upload of step 5 is in flight, and the job starts again on a new, empty local directory.
Its restart says once where it resumes and why, replaces its own interrupted remote step 5 instead of
refusing it, ends with exit 0 and a ``close()`` that raises nothing, and every remote step verifies. Two
different jobs (two run ids) on one prefix are still refused with the message of the conflict."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptd.cli.main import cli
from ckptd.format.layout import step_file
from ckptd.promotion.ownership import claim_name
from ckptd.stepio.step_reader import verify_step
from test_promotion_support import object_tier

pytestmark = pytest.mark.s3

#: One training process: restores, then trains ``steps`` steps saving every 5th; its state depends on its pid
#: (another start saves other bytes at the same step numbers, as a real restart does: data order, timers).
#: With ``kill_at`` > 0 it kills itself with SIGKILL once the upload of that step has its rank index up and
#: its pack not yet (a real kill -9, mid-upload).
_CHILD = r"""
import json, os, signal, sys, torch, ckptd
root, url, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
steps, kill_at, wait_at = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
generator = torch.Generator().manual_seed(os.getpid())
state = {"weights": torch.randn(40_000, generator=generator), "bias": torch.randn(1000, generator=generator)}
with ckptd.CheckpointManager(root, remote=url, storage_options=options, capture_rng=False, daemon="off",
                             policy=ckptd.Policy(keep_local=2)) as manager:
    start = manager.restore(state) or 0
    print("START", start, flush=True)
    if kill_at:
        promoting = []
        manager.uploader.promoter.on_phase = lambda phase: (
            os.kill(os.getpid(), signal.SIGKILL) if phase == "chunks" and promoting[-1] == kill_at else None)
        original = manager.uploader.promoter.promote
        def promote(step, **kwargs):
            promoting.append(step)
            return original(step, **kwargs)
        manager.uploader.promoter.promote = promote
    for step in range(start + 1, steps + 1):
        state["weights"].add_(0.5)
        if step % 5 == 0:
            manager.save(step, state)
            if step == kill_at:
                manager.wait_uploads()  # killed in there
            if step == wait_at:  # promoted before a newer step can supersede it in the queue
                try:
                    manager.wait_uploads()
                except ckptd.CkptdError as error:
                    print("WAIT-FAILED", type(error).__name__, error, flush=True)
print("DONE", flush=True)
"""


def _train(root: Path, url: str, options: dict[str, Any], steps: int, *, kill_at: int = 0, wait_at: int = 0,
           run_id: str | None = None, **settings: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CKPTD_LOG_LEVEL="WARNING", AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               **{f"CKPTD_{name.upper()}": value for name, value in settings.items()})
    env.pop("CKPTD_RUN_ID", None)
    if run_id is not None:
        env["CKPTD_RUN_ID"] = run_id
    return subprocess.run([sys.executable, "-c", _CHILD, str(root), url, json.dumps(options), str(steps),
                           str(kill_at), str(wait_at)], capture_output=True, text=True, timeout=240, env=env)


def _killed_mid_upload(tmp_path: Path, url: str, options: dict[str, Any], *, run_id: str | None = None) -> None:
    first = _train(tmp_path / "first-node", url, options, 20, kill_at=5, run_id=run_id)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert "START 0" in first.stdout and "DONE" not in first.stdout


def test_a_restart_on_an_empty_directory_replaces_its_own_interrupted_promotion(tmp_path: Path, s3_server,
                                                                                s3_bucket) -> None:
    url = f"s3://{s3_bucket}/run"
    options = s3_server.storage_options
    remote = object_tier(s3_bucket, options)
    _killed_mid_upload(tmp_path, url, options)
    assert remote.committed_steps() == [], "killed before its first upload committed"
    left = remote.list_files(5)
    assert claim_name(0) in left and "rank-00000.index.json" in left, f"the interrupted promotion left {left}"

    again = _train(tmp_path / "new-node", url, options, 20, wait_at=5)  # another node: an empty directory
    assert again.returncode == 0, again.stderr[-3000:]
    assert "START 0" in again.stdout and "DONE" in again.stdout
    said = [line for line in again.stderr.splitlines() if "holds only an interrupted promotion of step 5" in line]
    assert len(said) == 1, again.stderr[-3000:]
    assert "S3 holds only an interrupted promotion of step 5: starting from step 0" in said[0]
    assert "CommitError" not in again.stderr and "Traceback" not in again.stderr, again.stderr[-3000:]

    steps = remote.committed_steps()
    assert 5 in steps and steps[-1] == 20, steps
    for step in steps:
        assert list(verify_step(remote, step)) == [], f"step {step} on S3 verifies"
        assert claim_name(0) not in remote.list_files(step), "a committed step keeps no claim"
    outcome = CliRunner().invoke(cli, ["verify", url, "--endpoint-url", s3_server.endpoint_url],
                                 env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    assert outcome.exit_code == 0, outcome.output
    assert "all intact" in outcome.output


def test_two_jobs_with_their_own_run_ids_on_one_prefix_are_still_refused(tmp_path: Path, s3_server,
                                                                         s3_bucket) -> None:
    url = f"s3://{s3_bucket}/run"
    options = s3_server.storage_options
    remote = object_tier(s3_bucket, options)
    _killed_mid_upload(tmp_path, url, options, run_id="job-a")
    claim = json.loads(remote.read_bytes(step_file(5, claim_name(0))))
    assert claim["run_id"] == "job-a"

    other = _train(tmp_path / "job-b", url, options, 5, run_id="job-b")
    assert other.returncode != 0, "job b cannot promote step 5 over job a's: its close reports it"
    assert "another promotion of step 5 with different content" in other.stderr, other.stderr[-3000:]
    assert "job 'job-a'" in other.stderr, "the refusal names the job that holds the step"
    assert "belong to another job on this prefix (job-a)" in other.stderr, other.stderr[-3000:]
    assert 5 not in remote.committed_steps(), "job a's interrupted step is not replaced by job b"
    assert json.loads(remote.read_bytes(step_file(5, claim_name(0))))["run_id"] == "job-a"


def test_a_promotion_whose_owner_lease_is_live_on_another_host_is_never_taken_over(tmp_path: Path, s3_server,
                                                                                   s3_bucket) -> None:
    # the same job's claim from another host cannot tell a crashed promotion from a live one (a node cut off
    # from the store but still uploading); its owner lease can: while it is refreshed, nothing is replaced
    from ckptd.promotion.lease import STEP_OWNERS_PREFIX
    from ckptd.format.layout import step_dir
    from ckptd.tiers.upload_owners import UploadOwner

    url = f"s3://{s3_bucket}/run"
    options = s3_server.storage_options
    remote = object_tier(s3_bucket, options)
    _killed_mid_upload(tmp_path, url, options)
    claim = json.loads(remote.read_bytes(step_file(5, claim_name(0))))
    remote.write_bytes(step_file(5, claim_name(0)), json.dumps({**claim, "host": "node-7"}).encode())
    live = UploadOwner(key=step_dir(5), host="node-7", pid=4242, refreshed=0.0, lease_s=3600.0)
    remote.write_bytes(f"{STEP_OWNERS_PREFIX}/{step_dir(5)}/node-7-4242-live.json", live.to_json_bytes())
    before = {name: remote.read_bytes(step_file(5, name)) for name in remote.list_files(5)}

    again = _train(tmp_path / "new-node", url, options, 20, wait_at=5, s3_upload_owner_lease_s="1",
                   promotion_owner_poll_s="0.2")
    assert again.returncode == 0 and "DONE" in again.stdout, again.stderr[-3000:]
    refused = [line for line in again.stdout.splitlines() if line.startswith("WAIT-FAILED")]
    assert refused and "another promotion of step 5 with different content" in refused[0], again.stdout[-3000:]
    assert 5 not in remote.committed_steps()
    assert {name: remote.read_bytes(step_file(5, name)) for name in remote.list_files(5)} == before, \
        "the live promotion's objects are untouched"
    assert remote.committed_steps()[-1] == 20, "the later steps are promoted"
