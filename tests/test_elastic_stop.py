"""SIGTERM to one supervisor of a ``ckptd launch`` job stops the whole job gracefully: the other nodes'
supervisors learn of it through the store, every rank leaves at its next step and exits with code 15,
every supervisor exits with code 15 (JobStoppedError) naming the node and the signal, and the committed
steps stay: a new launch on the same roots ends with the weights, optimizer state and sample ids of an
uninterrupted run, byte for byte.

Two supervisors (``--nnodes 2``, one rank each) stand in for two nodes; real processes, real SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from harness.elastic_runs import (WORLD, finals, launch_job, record, staged_steps,
                                       start_job, wait_until)
from harness.processes import process_alive
from ckptd.tiers.local import LocalTier

pytestmark = pytest.mark.multirank

STEPS = "24"


@pytest.mark.parametrize("node", [pytest.param(1, marks=pytest.mark.slow), 0], ids=["sigterm-node1", "sigterm-node0-the-store-host"])
def test_sigterm_to_one_supervisor_stops_every_rank_cleanly_and_keeps_the_committed_steps(tmp_path: Path,
                                                                                          node: int) -> None:
    reference = start_job(tmp_path / "reference", "--steps", STEPS, nodes=WORLD) if node == 1 else None
    job = start_job(tmp_path, "--steps", STEPS, "--step-sleep", "0.1", nodes=WORLD)
    out = tmp_path / "out"
    try:
        pids = [wait_until(lambda rank=rank: record(out, rank, 0), f"rank {rank} to start", 300)["pid"]
                for rank in range(WORLD)]
        wait_until(lambda: all(max(staged_steps(out, rank), default=0) >= 6 for rank in range(WORLD)), "a few saves", 300)
        job.supervisors[node].send_signal(signal.SIGTERM)
        code = job.wait(300)
        if reference is not None:
            assert reference.wait(300) == 0, reference.log()[-4000:]
    finally:
        job.kill()
        if reference is not None:
            reference.kill()
    log = job.log()
    assert code == 15, log[-4000:]
    assert log.count(f"ckptd: error: the job stopped: node {node}'s supervisor got SIGTERM") == WORLD, log[-4000:]
    for rank, pid in enumerate(pids):
        assert f"rank {rank} stops with the job" in log, log[-4000:]
        assert re.search(rf"rank {rank} \(pid {pid}\) exited with code 15", log), log[-4000:]
        assert not process_alive(pid)
    assert not list(out.glob("rank*-final.json")), "no rank may finish a stopped job"
    assert "Traceback" not in log, log[-4000:]
    committed = [LocalTier(tmp_path / f"ckpt-node{rank}" / f"rank{rank}").committed_steps() for rank in range(WORLD)]
    assert all(committed) and max(committed[0]) < int(STEPS), committed
    if reference is None:
        return
    # the committed steps are intact: a new launch resumes from them and ends as an uninterrupted run
    resumed = launch_job(tmp_path, "--steps", STEPS, nodes=WORLD, timeout_s=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert finals(out) == finals(tmp_path / "reference" / "out")
    restored = {record(out, rank, 0)["restored"] for rank in range(WORLD)}  # type: ignore[index]
    assert len(restored) == 1 and restored.pop() in set(committed[0]) & set(committed[1])
    assert os.path.exists(out / "rank0-final.json")
