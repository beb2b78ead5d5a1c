"""A whole node of a ``ckptd launch`` job is lost (its supervisor, its ranks and its local root); the job
restarts on a fresh node and ends with the weights, optimizer state and sample ids of an uninterrupted
run, byte for byte: restored from the peer tier (the buddy holding the lost node's replicas), and, with
the buddy gone too, from S3 (moto's server).

Two supervisors (``--nnodes 2``, one rank each, each with its own local root) stand in for two nodes. The
launcher replaces failed ranks, not a lost supervisor: the node's loss ends the job, and the job is
started again (new supervisors, a new job store) on the same checkpoints, node 1 on an empty root. The
buddy is the daemon's real peer endpoints (:class:`~harness.peer_server.PeerServer`). The ranks
promote in-process to one S3 prefix shared by the job (rank 0 commits each step once both shares are
there). Standing in for node 1's daemon, this test copies node 1's committed steps, while node 1 is still
up, to the buddy with :func:`~ckptd.promotion.replicate.replicate_step` (the daemon's replication) and
promotes node 1's share of them to the shared prefix (what its stopped uploader had not finished), so that
rank 0 commits the step node 1 stopped after. Steps rank 0's root still holds pinned from the lost job are
settled by the restarted ranks (:mod:`ckptd.promotion.leftovers`): nobody waits in ``close`` for a share
node 1's new root never had.
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
from ckptd.promotion.promoter import Promoter
from ckptd.promotion.replicate import replicate_step
from ckptd.testing.multirank import free_port
from harness.peer_server import PeerServer
from ckptd.tiers import open_tier
from ckptd.tiers.local import LocalTier
from ckptd.tiers.peer import PeerTier
from harness.processes import process_state

pytestmark = [pytest.mark.multirank, pytest.mark.s3, pytest.mark.slow]

NODES, TOKEN, KILL_STEP, STEPS = 2, "node-loss-test-token", 6, 12
JOB = "harness.elastic_tiered_training"


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


def _copy_prefix(source: str, target: str, options: dict[str, Any]) -> None:
    """Copy every object of one S3 prefix to another (a second restart gets its own copy of the job's prefix)."""
    tiers = [open_tier(url, storage_options=options) for url in (source, target)]
    try:
        for stored in tiers[0].list_objects(""):  # type: ignore[attr-defined]
            tiers[1].write_bytes(stored.path, tiers[0].read_bytes(stored.path))
    finally:
        for tier in tiers:
            tier.close()


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
    s3_job = ("--remote", remote, "--endpoint-url", s3_server.endpoint_url)
    buddy = PeerServer(PeerNamespaces({}, replicas), token=TOKEN)
    buddy.start()
    # the uninterrupted run, alongside
    uninterrupted = _start_job(tmp_path / "reference", tmp_path / "reference" / "out", environment=environment)
    try:
        peer = f"peer://127.0.0.1:{buddy.port}/replicas/node{{node}}/rank{{rank}}"
        first = tmp_path / "first"
        # rank 1 (node 1) stops itself once its save of KILL_STEP is committed, holding the job still
        job = _start_job(tmp_path, first, "--peer", peer, *s3_job, "--kill-rank", "1", "--kill-step", str(KILL_STEP),
                         "--kill-signal", "STOP", "--kill-phase", "after-commit", environment=environment)
        try:
            pids = [_wait(lambda rank=rank: (first / f"rank{rank}-gen0.json").exists() and
                          json.loads((first / f"rank{rank}-gen0.json").read_text())["pid"], f"rank {rank} to start")
                    for rank in range(NODES)]
            _wait(lambda: process_state(pids[1]) == "T", f"rank 1 to stop after committing step {KILL_STEP}")
            # node 1's daemon has replicated its committed steps to the buddy and promoted its shares to S3
            lost_root = tmp_path / "ckpt-node1"
            node1 = LocalTier(lost_root / "rank1")
            buddy_tier = PeerTier(f"peer://127.0.0.1:{buddy.port}/replicas/node1/rank1", token=TOKEN)
            shared = open_tier(remote, storage_options=s3_options)
            try:
                for step in node1.committed_steps():
                    replicate_step(node1, buddy_tier, step)
                    Promoter(node1, shared).promote(step, ranks=[1], commits=False)  # type: ignore[arg-type]
                assert KILL_STEP in buddy_tier.committed_steps(), buddy_tier.label
                _wait(lambda: KILL_STEP in shared.committed_steps(), f"rank 0 to commit step {KILL_STEP} on S3")
            finally:
                buddy_tier.close()
                shared.close()
            # node 1 is lost: its supervisor (its rank dies with it) and its disk
            job[1].send_signal(signal.SIGKILL)
            _wait(lambda: process_state(pids[1]) is None, "node 1's rank to die with its supervisor")
            shutil.rmtree(lost_root)
        finally:
            _kill(job)  # the launcher does not replace a lost supervisor: the job ends
        _wait(lambda: all(process_state(pid) is None for pid in pids), "every rank of the lost job to exit")

        # two restarts of the lost job, side by side on copies of node 0's root and of the S3 prefix, node 1
        # on an empty root: one with the buddy up, one whose buddy is gone too (nothing listens at its address)
        runs = {"peer": tmp_path, "s3": tmp_path / "buddy-gone"}
        shutil.copytree(tmp_path / "ckpt-node0", runs["s3"] / "ckpt-node0")
        prefixes = {"peer": remote, "s3": f"{remote}-copy"}
        _copy_prefix(remote, prefixes["s3"], s3_options)
        gone = f"peer://127.0.0.1:{free_port()}/replicas/node{{node}}/rank{{rank}}"
        jobs = {survives: _start_job(root, root / "second", "--peer", peer if survives == "peer" else gone,
                                     "--remote", prefixes[survives], "--endpoint-url", s3_server.endpoint_url,
                                     environment=environment)
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
        promoted = open_tier(prefixes[survives], storage_options=s3_options)
        try:  # the restarted ranks promoted to the shared prefix, to the last step
            assert max(promoted.committed_steps()) == STEPS, (promoted.committed_steps(), logs[survives][-3000:])
        finally:
            promoted.close()
