"""``ckptd launch --checkpoint-on-stop``: SIGTERM to one supervisor first has every rank save one agreed step
(one its policy would not save), commit it locally and on the object tier (S3, moto's server, promoted
in-process), then the job stops (exit 15); a new launch on the same roots resumes from that step and ends
with the weights, optimizer state and sample ids of an uninterrupted run, byte for byte.

Two supervisors (``--nnodes 2``, one rank each, each with its own root) stand in for two nodes; real
processes, a real SIGTERM. ``--every 1000`` and ``--remote-every 1000``: no step but the stop's is saved.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from ckptd.embedded_s3 import EmbeddedS3
from ckptd.stepio.step_reader import verify_step
from harness.elastic_runs import WORLD, finals, launch_job, record, start_job, wait_until
from ckptd.tiers import open_tier
from ckptd.tiers.local import LocalTier

pytestmark = [pytest.mark.multirank, pytest.mark.s3]

JOB, STEPS = "harness.elastic_tiered_training", "40"


def test_a_stop_with_checkpoint_saves_one_agreed_step_everywhere_and_the_next_launch_resumes_bit_for_bit(
        tmp_path: Path, s3_server: EmbeddedS3, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    remote = f"s3://{s3_bucket}/run"
    settings = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    tiers = ("--remote", remote, "--endpoint-url", s3_server.endpoint_url, "--remote-every", "1000")
    reference = start_job(tmp_path / "reference", "--steps", STEPS, nodes=WORLD)
    job = start_job(tmp_path / "run", *tiers, "--steps", STEPS, "--every", "1000", "--step-sleep", "0.1",
                    nodes=WORLD, module=JOB, settings=settings, extra=("--checkpoint-on-stop", "--stop-timeout", "90"))
    out = tmp_path / "run" / "out"
    tier = open_tier(remote, storage_options=s3_options)
    try:
        # both ranks train (their first step completed), a few steps before the end
        wait_until(lambda: all((record(out, rank, 0) or {}).get("first_step_at") for rank in range(WORLD)),
                   "both ranks to complete a step", 300)
        job.supervisors[1].send_signal(signal.SIGTERM)
        code = job.wait(300)
        assert reference.wait(300) == 0, reference.log()[-4000:]
        log = job.log()
        assert code == 15, log[-4000:]
        assert log.count("ckptd: error: the job stopped: node 1's supervisor got SIGTERM") == WORLD, log[-4000:]
        assert not list(out.glob("rank*-final.json")), "no rank may finish a stopped job"
        committed = [LocalTier(tmp_path / "run" / f"ckpt-node{rank}" / f"rank{rank}").committed_steps()
                     for rank in range(WORLD)]
        # one step, the same on both ranks, saved though the policy saves none before step 1000
        assert committed[0] == committed[1] and len(committed[0]) == 1, (committed, log[-4000:])
        stop_step = committed[0][0]
        assert 1 < stop_step < int(STEPS), stop_step
        for rank in range(WORLD):
            assert f"rank {rank} saved step {stop_step} before the job stops" in log, log[-4000:]
        assert tier.committed_steps() == [stop_step], (tier.committed_steps(), log[-4000:])
        assert list(verify_step(tier, stop_step)) == [], "the stop's step on S3 is not intact"
        # a new launch resumes from it (without the flag: a plain resume) and ends as an uninterrupted run
        resumed = launch_job(tmp_path / "run", *tiers, "--steps", STEPS, "--every", "1000", nodes=WORLD,
                             module=JOB, settings=settings, timeout_s=300)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert [record(out, rank, 0)["restored"] for rank in range(WORLD)] == [stop_step] * WORLD  # type: ignore[index]
        assert finals(out) == finals(tmp_path / "reference" / "out"), "the resumed run differs"
        assert "Traceback" not in log, log[-4000:]
    finally:
        job.kill()
        reference.kill()
        tier.close()
