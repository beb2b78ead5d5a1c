"""A whole node of a ``ckptd launch`` job is lost (its supervisor, its ranks and its local root); the job
restarts on a fresh node and ends with the weights, optimizer state and sample ids of an uninterrupted
run, byte for byte: restored from the peer tier (the buddy holding the lost node's replicas), and, with
the buddy gone too, from S3 (moto's server).

Two supervisors (``--nnodes 2``, one rank each, each with its own local root) stand in for two nodes. The
launcher replaces failed ranks, not a lost supervisor: the node's loss ends the job, and the job is
started again (new supervisors, a new job store) on the same checkpoints, node 1 on an empty root. The
buddy is the daemon's real peer endpoints (:class:`~ckptd.testing.peer_server.PeerServer`). Standing in
for node 1's daemon, this test copies node 1's committed steps, while node 1 is still up, to the buddy and
to node 1's prefix on S3 with :func:`~ckptd.promotion.replicate.replicate_step` (the daemon's replication).
The ranks themselves do not promote: with in-process promotion, rank 0 of the restarted job waited in its
``close`` for rank 1 to promote the previous job's pinned steps with it, which rank 1's new root never had.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.peer_store import PeerNamespaces
from ckptd.embedded_s3 import EmbeddedS3
from ckptd.promotion.replicate import replicate_step
from ckptd.testing.multirank import free_port
from ckptd.testing.peer_server import PeerServer
from ckptd.tiers import open_tier
from ckptd.tiers.local import LocalTier
from ckptd.tiers.peer import PeerTier

pytestmark = [pytest.mark.multirank, pytest.mark.s3]

NODES, TOKEN, KILL_STEP = 2, "node-loss-test-token", 6
JOB = "ckptd.testing.elastic_tiered_training"


def _start_job(root: Path, out: Path, *job_args: str, environment: dict[str, str]) -> list[subprocess.Popen[str]]:
    """Two supervisors (node 0 hosts the job store), one rank each; node n keeps checkpoints in ckpt-node<n>."""
    endpoint = f"127.0.0.1:{free_port()}"
    return [subprocess.Popen(
        [sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", "1", "--nnodes", str(NODES),
         "--node-rank", str(node), "--rdzv-endpoint", endpoint, "--max-restarts", "0", "--hang-timeout", "120",
         "-m", JOB, "--root", str(root / f"ckpt-node{node}"), "--out", str(out), *job_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment) for node in range(NODES)]


def _finish(supervisors: list[subprocess.Popen[str]], timeout_s: float = 120) -> str:
    """Wait for every supervisor; their stderr. Fails unless all exit 0 within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        outputs = [supervisor.communicate(timeout=max(1.0, deadline - time.monotonic()))[1]
                   for supervisor in supervisors]
    except subprocess.TimeoutExpired:
        for supervisor in supervisors:
            supervisor.kill()
        raise AssertionError(f"the job did not end in {timeout_s:g} s:\n" +
                             "".join(supervisor.communicate()[1] for supervisor in supervisors)[-6000:]) from None
    log = "".join(outputs)
    assert [supervisor.returncode for supervisor in supervisors] == [0] * NODES, log[-4000:]
    return log


def _kill(supervisors: list[subprocess.Popen[str]]) -> None:
    for supervisor in supervisors:
        if supervisor.returncode is None:  # not yet waited for
            supervisor.kill()
            supervisor.communicate()


def _wait(condition: Callable[[], Any], what: str, timeout_s: float = 90) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def _process_state(pid: int) -> str | None:
    """The state letter of a process (``T``: stopped), None once it is gone (or a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None
    return None if state == "Z" else state


def _finals(out: Path) -> list[bytes]:
    return [(out / f"rank{rank}-final.json").read_bytes() for rank in range(NODES)]


@pytest.fixture(scope="module")
def environment() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", CKPTD_ELASTIC_REJOIN_TIMEOUT_S="60", CKPTD_PEER_TOKEN=TOKEN,
                AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")


def test_a_lost_node_restarts_on_a_fresh_root_from_the_peer_or_from_s3_and_ends_bit_for_bit(
        tmp_path: Path, environment: dict[str, str], s3_server: EmbeddedS3, s3_bucket: str,
        s3_options: dict[str, Any]) -> None:
    remote, replicas = f"s3://{s3_bucket}/run1", tmp_path / "buddy-replicas"
    buddy = PeerServer(PeerNamespaces({}, replicas), token=TOKEN)
    buddy.start()
    # the uninterrupted run, alongside
    uninterrupted = _start_job(tmp_path / "reference", tmp_path / "reference" / "out", environment=environment)
    try:
        peer = f"peer://127.0.0.1:{buddy.port}/replicas/node{{node}}/rank{{rank}}"
        first = tmp_path / "first"
        # rank 1 (node 1) stops itself once its save of KILL_STEP is committed, holding the job still
        job = _start_job(tmp_path, first, "--peer", peer, "--kill-rank", "1", "--kill-step", str(KILL_STEP),
                         "--kill-signal", "STOP", "--kill-phase", "after-commit", environment=environment)
        try:
            pids = [_wait(lambda rank=rank: (first / f"rank{rank}-gen0.json").exists() and
                          json.loads((first / f"rank{rank}-gen0.json").read_text())["pid"], f"rank {rank} to start")
                    for rank in range(NODES)]
            _wait(lambda: _process_state(pids[1]) == "T", f"rank 1 to stop after committing step {KILL_STEP}")
            # node 1's daemon has replicated its committed steps to the buddy and promoted them to S3
            lost_root = tmp_path / "ckpt-node1"
            node1 = LocalTier(lost_root / "rank1")
            targets = [PeerTier(f"peer://127.0.0.1:{buddy.port}/replicas/node1/rank1", token=TOKEN),
                       open_tier(f"{remote}/rank1", storage_options=s3_options)]
            try:
                for target in targets:
                    for step in node1.committed_steps():
                        replicate_step(node1, target, step)
                    assert KILL_STEP in target.committed_steps(), target.label
            finally:
                for target in targets:
                    target.close()
            # node 1 is lost: its supervisor (its rank dies with it) and its disk
            job[1].send_signal(signal.SIGKILL)
            _wait(lambda: _process_state(pids[1]) is None, "node 1's rank to die with its supervisor")
            shutil.rmtree(lost_root)
        finally:
            _kill(job)  # the launcher does not replace a lost supervisor: the job ends
        _wait(lambda: all(_process_state(pid) is None for pid in pids), "every rank of the lost job to exit")

        # two restarts of the lost job, side by side on copies of node 0's root, node 1 on an empty one:
        # one with the buddy up, one whose buddy is gone too (nothing listens at its address)
        runs = {"peer": tmp_path, "s3": tmp_path / "buddy-gone"}
        shutil.copytree(tmp_path / "ckpt-node0", runs["s3"] / "ckpt-node0")
        gone = f"peer://127.0.0.1:{free_port()}/replicas/node{{node}}/rank{{rank}}"
        jobs = {survives: _start_job(root, root / "second", "--peer", peer if survives == "peer" else gone,
                                     "--remote", f"{remote}/rank{{rank}}", "--endpoint-url", s3_server.endpoint_url,
                                     "--remote-every", "1000", environment=environment)
                for survives, root in runs.items()}
        logs = {survives: _finish(job) for survives, job in jobs.items()}
        _finish(uninterrupted)
    finally:
        _kill(uninterrupted)
        buddy.stop()
    reference = _finals(tmp_path / "reference" / "out")
    for survives, root in runs.items():
        second = root / "second"
        assert _finals(second) == reference, f"the job restarted from the {survives} tier differs from the " \
                                             "uninterrupted run"
        records = [json.loads((second / f"rank{rank}-gen0.json").read_text()) for rank in range(NODES)]
        assert [record["restored"] for record in records] == [KILL_STEP] * NODES, records
        assert records[0]["tier"].startswith("local "), records[0]
        expected = "peer " if survives == "peer" else "object "
        assert records[1]["tier"].startswith(expected), (records[1], logs[survives][-3000:])
