"""Node 1 of a ``ckptd launch`` job is lost (supervisor, rank, local root) after both ranks committed steps
locally, before any of its steps left the node (no peer, no object tier): no step is intact on every rank.
A new node-1 supervisor joins the live job; every rank, the survivor too, starts afresh from its setup
(the survivor's committed steps are set aside, not deleted), never the survivor's trained state next to
the replacement's initial one, and the job ends with the weights, optimizer state and sample ids of an
uninterrupted run, byte for byte.

Two supervisors (``--nnodes 2``, one rank each, each with its own root) stand in for two nodes.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from harness.elastic_runs import WORLD, finals, generations, record, start_job, wait_until
from ckptd.tiers.local import LocalTier
from harness.processes import process_state

pytestmark = pytest.mark.multirank

STEPS = "16"


def test_a_node_lost_before_any_of_its_steps_left_it_restarts_every_rank_afresh_bit_for_bit(tmp_path: Path) -> None:
    reference = start_job(tmp_path / "reference", "--steps", STEPS, nodes=WORLD)
    job = start_job(tmp_path / "run", "--steps", STEPS, "--step-sleep", "0.3", nodes=WORLD,
                    extra=("--node-timeout", "1.5"))
    out, survivor_root = tmp_path / "run" / "out", tmp_path / "run" / "ckpt-node0" / "rank0"
    try:
        first = [wait_until(lambda rank=rank: record(out, rank, 0), f"rank {rank} to start", 300)
                 for rank in range(WORLD)]
        wait_until(lambda: survivor_root.exists() and max(LocalTier(survivor_root).committed_steps(), default=0) >= 4,
                   "step 4 committed", 300)
        job.supervisors[1].send_signal(signal.SIGKILL)
        job.supervisors[1].wait()
        wait_until(lambda: process_state(first[1]["pid"]) is None, "node 1's rank to die with its supervisor")
        held = LocalTier(survivor_root).committed_steps()
        assert held, "the survivor holds no committed step"
        shutil.rmtree(tmp_path / "run" / "ckpt-node1")
        wait_until(lambda: "node 1's supervisor sent no heartbeat" in job.log(), "node 0 to find node 1 lost", 60)
        job.start(1)
        code = job.wait(300)
        log = job.log()
        assert code == 0, log[-6000:]
        assert reference.wait(300) == 0, reference.log()[-4000:]
    finally:
        job.kill()
        reference.kill()
    assert finals(out) == finals(tmp_path / "reference" / "out"), "the run started afresh differs"
    survivor, replaced = generations(out, 0), generations(out, 1)
    last = max(survivor)
    assert {entry["pid"] for entry in survivor.values()} == {first[0]["pid"]}, survivor
    assert survivor[last]["restored"] is None and replaced[last]["restored"] is None, (survivor, replaced)
    assert "every rank starts afresh from its setup" in log, log[-4000:]
    # the survivor's committed steps of before the loss are kept aside, not deleted
    kept = sorted(path.name for path in (survivor_root / ".set-aside").iterdir())
    assert len(kept) >= len(held), (kept, held)
    assert "Traceback" not in log, log[-4000:]
