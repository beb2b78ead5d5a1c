"""Node 0 of a ``ckptd launch`` job hosts the job's store; when it is lost (its supervisor SIGKILLed, its
rank dies with it) the job ends: node 1's supervisor stops its rank and exits 12 with a message that says
node 0 and the store are lost and what to do (start the job again on every node). Done that way, the job
resumes from the newest step committed on both ranks and ends with the weights, optimizer state and sample
ids of an uninterrupted run, byte for byte. There is no store fail-over.

Two supervisors (``--nnodes 2``, one rank each, each with its own root) stand in for two nodes.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from harness.elastic_runs import (WORLD, finals, launch_job, record, staged_steps,
                                       start_job, wait_until)
from harness.processes import process_alive

pytestmark = pytest.mark.multirank

STEPS = "24"


def test_losing_node_0_ends_the_job_with_a_message_saying_what_to_do_and_a_restart_resumes_bit_for_bit(
        tmp_path: Path) -> None:
    reference = start_job(tmp_path / "reference", "--steps", STEPS, nodes=WORLD)
    job = start_job(tmp_path, "--steps", STEPS, "--step-sleep", "0.2", nodes=WORLD)
    out = tmp_path / "out"
    try:
        pids = [wait_until(lambda rank=rank: record(out, rank, 0), f"rank {rank} to start", 300)["pid"]
                for rank in range(WORLD)]
        wait_until(lambda: all(max(staged_steps(out, rank), default=0) >= 6 for rank in range(WORLD)), "a few saves", 300)
        job.supervisors[0].send_signal(signal.SIGKILL)
        job.supervisors[0].wait()
        assert job.supervisors[1].wait(timeout=120) == 12, job.log()[-4000:]
        assert reference.wait(300) == 0, reference.log()[-4000:]
    finally:
        job.kill()
        reference.kill()
    log = job.log()
    assert "ckptd: error: node 1: the job's store at 127.0.0.1:" in log, log[-4000:]
    assert "node 0 is lost, and with it the job" in log and "this node stopped its ranks [1]" in log, log[-4000:]
    assert "start the job again: `ckptd launch` with the same options on every node" in log, log[-4000:]
    assert not any(process_alive(pid) for pid in pids), "a rank of the lost job still runs"
    assert not list(out.glob("rank*-final.json")), "no rank may finish a job that lost its store"
    # what the message says to do: the job resumes from the newest step both ranks committed
    resumed = launch_job(tmp_path, "--steps", STEPS, nodes=WORLD, timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert finals(out) == finals(tmp_path / "reference" / "out"), "the restarted job differs"
    restored = {record(out, rank, 0)["restored"] for rank in range(WORLD)}  # type: ignore[index]
    assert len(restored) == 1 and restored.pop() is not None, "the restarted job did not resume from a step"
