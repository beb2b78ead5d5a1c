"""A whole node of a running ``ckptd launch`` job is lost (its supervisor, then its ranks, and its local root)
and a new supervisor started with the same ``--node-rank`` and rendezvous joins the LIVE job in its place:
the other node's supervisor and ranks keep their processes, the generation goes up, the new rank restores
from the peer tier (the buddy holding the lost node's replicas) while the survivor restores from memory or
its local disk, and the job ends with the weights, optimizer state and sample ids of an uninterrupted run,
byte for byte.

Two supervisors (``--nnodes 2``, one rank each, each with its own root) stand in for two nodes. The buddy
is the daemon's real peer endpoints (:class:`~harness.peer_server.PeerServer`); standing in for node
1's daemon, a thread of this test copies node 1's committed steps to it while node 1 runs
(:func:`~ckptd.promotion.replicate.replicate_step`, the daemon's replication). Node 0's supervisor finds the
loss by node 1's missing supervisor heartbeat (``--node-timeout``), before the replacement is started.
"""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

import pytest

from ckptd.daemon.peer_store import PeerNamespaces
from ckptd.errors import CkptdError
from ckptd.promotion.replicate import replicate_step
from harness.elastic_runs import WORLD, finals, generations, record, start_job, wait_until
from harness.peer_server import PeerServer
from ckptd.tiers.local import LocalTier
from ckptd.tiers.peer import PeerTier
from harness.processes import process_alive

pytestmark = pytest.mark.multirank

JOB, TOKEN, STEPS = "harness.elastic_tiered_training", "node-replacement-test-token", "24"


class _Replicator(threading.Thread):
    """Node 1's daemon, as far as this test needs it: copies each step committed in ``source`` to ``buddy``."""

    def __init__(self, source: Path, buddy: PeerTier) -> None:
        super().__init__(daemon=True)
        self.source, self.buddy, self.copied = source, buddy, set[int]()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            if not self.source.exists():
                continue
            try:
                for step in sorted(set(LocalTier(self.source).committed_steps()) - self.copied):
                    replicate_step(LocalTier(self.source), self.buddy, step)
                    self.copied.add(step)
            except (CkptdError, OSError):  # a step retired or half-written meanwhile: look again
                pass


def test_a_lost_node_is_replaced_in_the_live_job_and_the_run_ends_bit_for_bit(tmp_path: Path) -> None:
    buddy_server = PeerServer(PeerNamespaces({}, tmp_path / "buddy-replicas"), token=TOKEN)
    buddy_server.start()
    settings = {"CKPTD_PEER_TOKEN": TOKEN}
    peer = f"peer://127.0.0.1:{buddy_server.port}/replicas/node{{node}}/rank{{rank}}"
    reference = start_job(tmp_path / "reference", "--steps", STEPS, nodes=WORLD, module=JOB, settings=settings)
    # steps long enough for node 1 to be lost mid-run, not while the ranks close at the end
    job = start_job(tmp_path / "run", "--peer", peer, "--steps", STEPS, "--step-sleep", "0.2", nodes=WORLD,
                    module=JOB, settings=settings, extra=("--node-timeout", "1.5"))
    out = tmp_path / "run" / "out"
    buddy = PeerTier(f"peer://127.0.0.1:{buddy_server.port}/replicas/node1/rank1", token=TOKEN)
    replicator = _Replicator(tmp_path / "run" / "ckpt-node1" / "rank1", buddy)
    replicator.start()
    try:
        first = [wait_until(lambda rank=rank: record(out, rank, 0), f"rank {rank} to start", 300)
                 for rank in range(WORLD)]
        wait_until(lambda: any(step >= 6 for step in replicator.copied), "node 1's step 6 on the buddy", 300)
        # node 1 is lost: its supervisor first, then its rank (it dies with its supervisor), then its disk
        job.supervisors[1].send_signal(signal.SIGKILL)
        job.supervisors[1].wait()
        wait_until(lambda: not process_alive(first[1]["pid"]), "node 1's rank to die with its supervisor")
        replicator.stopping.set()
        replicator.join()
        shutil.rmtree(tmp_path / "run" / "ckpt-node1")
        # node 0 finds the loss by the missing supervisor heartbeat (no collective timeout involved)
        wait_until(lambda: "node 1's supervisor sent no heartbeat" in job.log(), "node 0 to find node 1 lost", 30)
        job.start(1)  # the replacement node: same --node-rank, same rendezvous, an empty root
        code = job.wait(300)
        assert code == 0, job.log()[-6000:]
        assert reference.wait(300) == 0, reference.log()[-4000:]
    finally:
        replicator.stopping.set()
        job.kill()
        reference.kill()
        buddy.close()
        buddy_server.stop()
    log = job.log()
    assert finals(out) == finals(tmp_path / "reference" / "out"), "the run with a replaced node differs"
    assert "node 1 joins the running job in place of a lost supervisor" in log, log[-4000:]
    survivor, replaced = generations(out, 0), generations(out, 1)
    # node 0 raised the generation on finding the loss, the replacement raised it again on joining
    last = max(survivor)
    assert last >= 2 and {record["pid"] for record in survivor.values()} == {first[0]["pid"]}, \
        f"node 0's rank was restarted: {survivor}\n{log[-4000:]}"
    assert sorted(replaced) == [0, last] and replaced[last]["pid"] != first[1]["pid"], replaced
    assert replaced[last]["restart_count"] == 1, replaced[last]
    assert survivor[last]["restored"] == replaced[last]["restored"] is not None
    assert replaced[last]["tier"].startswith("peer "), replaced[last]
    assert survivor[last]["tier"] == "memory" or survivor[last]["tier"].startswith("local "), survivor[last]


@pytest.mark.slow
def test_a_second_supervisor_for_a_live_node_takes_its_place_and_the_first_stops(tmp_path: Path) -> None:
    # node 1's supervisor is alive when another one is started with its --node-rank: the newer one joins as
    # a replacement, the older one sees it, stops its rank and exits 12; the job ends bit for bit
    reference = start_job(tmp_path / "reference", "--steps", STEPS, nodes=WORLD)
    job = start_job(tmp_path / "run", "--steps", STEPS, "--step-sleep", "0.2", nodes=WORLD)
    out = tmp_path / "run" / "out"
    try:
        first = [wait_until(lambda rank=rank: record(out, rank, 0), f"rank {rank} to start", 300)
                 for rank in range(WORLD)]
        older = job.supervisors[1]
        job.start(1)
        assert older.wait(timeout=120) == 12, job.log()[-4000:]
        code = job.wait(300)
        assert code == 0, job.log()[-6000:]
        assert reference.wait(300) == 0, reference.log()[-4000:]
    finally:
        job.kill()
        reference.kill()
    log = job.log()
    assert "a newer supervisor with --node-rank 1 joined the job" in log, log[-4000:]
    assert not process_alive(first[1]["pid"]), "the older supervisor's rank still runs"
    assert finals(out) == finals(tmp_path / "reference" / "out")
    survivor, replaced = generations(out, 0), generations(out, 1)
    assert {record["pid"] for record in survivor.values()} == {first[0]["pid"]}, survivor
    assert replaced[max(replaced)]["pid"] != first[1]["pid"] and max(replaced) >= 1
