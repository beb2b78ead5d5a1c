"""A lost node is replaced in the live job while the ranks promote in-process to a shared object tier (S3,
moto's server; no daemon, no peer tier), and the step every rank agrees on is older than the survivor's
newest steps: those are set aside, the one rank 0 was promoting among them included. Rank 0's uploader
had announced that step and waits for the lost rank's share of it, which never comes: the set-aside
ends that wait at once (before: rank 0 waited ``CKPTD_COMMIT_TIMEOUT_S``, and its ``close`` with it), the
job ends with the weights, optimizer state and sample ids of an uninterrupted run, byte for byte, and the
object tier holds only intact steps, the last one included.

Two supervisors (``--nnodes 2``, one rank each, each with its own root) stand in for two nodes. Rank 1
stops itself (SIGSTOP) once its save of step ``KILL_STEP`` is committed and S3 holds a committed step, while
rank 0 waits for its share of the step rank 0 announced last; node 1 is then lost whole (its supervisor SIGKILLed, its rank dies with it, its root wiped)
and a new supervisor with ``--node-rank 1`` joins the live job; its rank restores from S3.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from ckptd.embedded_s3 import EmbeddedS3
from ckptd.format.layout import step_file
from ckptd.promotion.promoter import promoted_marker_name
from ckptd.stepio.step_reader import verify_step
from harness.elastic_runs import WORLD, finals, generations, record, start_job, wait_until
from ckptd.tiers import open_tier
from harness.processes import process_state

pytestmark = [pytest.mark.multirank, pytest.mark.s3]

JOB, STEPS, KILL_STEP = "harness.elastic_tiered_training", "20", 8


def _waited_for(tier: Any) -> int | None:
    """The step whose share of rank 0 is on S3 and rank 1's is not (rank 0 waits for it to commit the step)."""
    committed = set(tier.committed_steps())
    for step in range(KILL_STEP, 0, -1):
        if step not in committed and tier.exists(step_file(step, promoted_marker_name(0))) \
                and not tier.exists(step_file(step, promoted_marker_name(1))):
            return step
    return None


def test_a_node_replaced_behind_the_object_tier_ends_bit_for_bit_without_waiting_for_its_lost_share(
        tmp_path: Path, s3_server: EmbeddedS3, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    remote = f"s3://{s3_bucket}/run"
    # a commit wait that outlasts the job's deadline: a survivor waiting for the lost share cannot end in time;
    # the ranks log at INFO level
    settings = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "CKPTD_COMMIT_TIMEOUT_S": "900", "CKPTD_TEST_LOG_LEVEL": "INFO"}
    reference = start_job(tmp_path / "reference", "--steps", STEPS, nodes=WORLD)
    job = start_job(tmp_path / "run", "--remote", remote, "--endpoint-url", s3_server.endpoint_url, "--steps", STEPS,
                    "--step-sleep", "0.1", "--kill-rank", "1", "--kill-step", str(KILL_STEP), "--kill-signal", "STOP",
                    "--kill-phase", "after-commit", "--kill-once-promoted", nodes=WORLD, module=JOB, settings=settings,
                    extra=("--node-timeout", "1.5"))
    out = tmp_path / "run" / "out"
    tier = open_tier(remote, storage_options=s3_options)
    try:
        first = [wait_until(lambda rank=rank: record(out, rank, 0), f"rank {rank} to start", 300)
                 for rank in range(WORLD)]
        wait_until(lambda: process_state(first[1]["pid"]) == "T", f"rank 1 to stop after committing step {KILL_STEP}",
                   300)
        # rank 0 announced a step and promoted its share; rank 1 stopped before promoting its own
        waited = wait_until(lambda: _waited_for(tier), "rank 0 to wait for rank 1's share of a step on S3", 120)
        job.supervisors[1].send_signal(signal.SIGKILL)
        job.supervisors[1].wait()
        wait_until(lambda: process_state(first[1]["pid"]) is None, "node 1's rank to die with its supervisor")
        shutil.rmtree(tmp_path / "run" / "ckpt-node1")
        wait_until(lambda: "node 1's supervisor sent no heartbeat" in job.log(), "node 0 to find node 1 lost", 60)
        job.start(1)
        code = job.wait(240)
        assert code == 0, job.log()[-6000:]
        assert reference.wait(300) == 0, reference.log()[-4000:]
        log = job.log()
        assert finals(out) == finals(tmp_path / "reference" / "out"), "the run with a replaced node differs"
        survivor, replaced = generations(out, 0), generations(out, 1)
        last = max(survivor)
        assert {entry["pid"] for entry in survivor.values()} == {first[0]["pid"]}, survivor
        agreed = survivor[last]["restored"]
        assert agreed == replaced[last]["restored"] and agreed is not None and agreed < waited, (survivor, replaced)
        assert replaced[last]["tier"].startswith("object "), replaced[last]
        assert f"step {waited} is newer than the restored step {agreed}" in log, log[-4000:]
        # rank 0's wait for the lost share ended with the set-aside (the ranks log at INFO level here)
        assert f"step {waited} is not promoted to object {remote}: the local tier no longer holds this step as it " \
               "was read (set aside when training went back to an older step" in log, log[-4000:]
        # the object tier holds only intact steps, the last one among them
        committed = tier.committed_steps()
        assert max(committed) == int(STEPS), (committed, log[-4000:])
        for step in committed:
            assert list(verify_step(tier, step)) == [], f"step {step} on S3 is not intact"
    finally:
        job.kill()
        reference.kill()
        tier.close()
    assert "Traceback" not in log, log[-4000:]
    assert os.path.exists(out / "rank1-final.json")
