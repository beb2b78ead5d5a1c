"""Node loss, tier by tier: two "nodes" (two daemons, two roots) and one object store.

Node A's daemon promotes its root to S3 and replicates it to node B's daemon. Node A's local root is then
wiped and a fresh process restores on A: it reads from B's daemon (the peer tier), bytes equal. B is then
SIGKILLed too and another fresh process restores on A from S3, bytes equal, naming the peer tier it could not
reach. A replica with a flipped bit on B is caught by the restore's chunk check and that chunk is read from S3
instead. Every restore runs in a new process into new memory, as after a real node replacement.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.daemon_process import DaemonProcess, run_trainer, wait_until, write_config
from ckptd.testing.tamper import chunk_location, flip_bit, index_path, read_json
from ckptd.tiers import open_tier
from ckptd.tiers.local import LocalTier

pytestmark = pytest.mark.s3

#: A fresh process restoring ``root`` with the given object tier and peer URL; prints what it restored.
RESTORER = """
import json, sys, ckptd
from harness.daemon_process import trainer_state
root, remote, peer, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
state = {key: value.new_zeros(value.shape) for key, value in trainer_state(0).items()}
with ckptd.CheckpointManager(root, remote=remote, peer=peer, storage_options=options, daemon="off",
                             capture_rng=False) as manager:
    step = manager.restore(state)
    expected = trainer_state(step)
    print(json.dumps({"step": step, "tier": manager.last_restore.tier,
                      "kinds": [tier.kind for tier in manager.tiers],
                      "chunks_by_tier": manager.last_restore.chunks_by_tier,
                      "events": [[event.tier, event.chunk] for event in manager.last_restore.events],
                      "equal": all(state[key].equal(expected[key]) for key in expected)}))
"""


def _restore_in_fresh_process(root: Path, remote: str, peer: str, options: dict[str, Any], token: str) -> dict[str, Any]:
    environment = {**os.environ, "CKPTD_PEER_TOKEN": token}
    done = subprocess.run([sys.executable, "-c", RESTORER, str(root), remote, peer, json.dumps(options)],
                          capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "log": done.stderr}


@dataclass(frozen=True)
class LostNode:
    """Node A after its loss: its root (empty again), what it restores from, and node B's running daemon."""

    root: Path
    remote: str
    peer: str
    token: str
    buddy: DaemonProcess
    #: Node B's copy of A's root, as B's daemon keeps it and serves it on ``peer``.
    replicas: Path


@contextlib.contextmanager
def _node_a_lost(tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> Iterator[LostNode]:
    """Node A's daemon promotes steps 1-3 that a trainer commits on A to S3 and replicates them to node B's
    daemon; then node A is lost (its daemon SIGKILLed, its root wiped). Yields while B's daemon runs; it is
    killed on leaving, if still running."""
    token = "peer-token-of-this-test-0123456789abcdef"
    remote = f"s3://{s3_bucket}/run1"
    b_state = tmp_path / "b-state"
    (tmp_path / "b-root").mkdir()
    b_config = write_config(tmp_path / "b.toml", [{"name": "other", "local": str(tmp_path / "b-root")}],
                            state_dir=str(b_state), listen="127.0.0.1:0", node_id="node-b", peer_token=token,
                            scrub_interval_s=0, keep_peer=3)  # B keeps all three steps it is sent
    a_root, a_state = tmp_path / "a-root", tmp_path / "a-state"
    a_root.mkdir()
    with DaemonProcess(b_config, b_state) as buddy:
        buddy_address = buddy.wait_ready()["http"]
        a_config = write_config(tmp_path / "a.toml", [{"name": "run1", "local": str(a_root), "remote": remote,
                                                       "storage_options": s3_options}],
                                state_dir=str(a_state), listen="127.0.0.1:0", node_id="node-a", peer_token=token,
                                buddy=f"peer://{buddy_address}", poll_interval_s=0.2, retry_backoff_s=0.2,
                                scrub_interval_s=0)
        replicas = b_state / "replicas" / "node-a" / "run1"
        with DaemonProcess(a_config, a_state) as daemon:
            daemon.wait_ready()
            assert run_trainer(a_root, 1, 3, keep_local=None) == [1, 2, 3]
            object_tier = open_tier(remote, storage_options=s3_options)
            try:
                wait_until(lambda: object_tier.committed_steps() == [1, 2, 3]
                           and replicas.is_dir() and LocalTier(replicas).committed_steps() == [1, 2, 3],
                           180, "steps 1-3 promoted to S3 and replicated to node-b")
            except AssertionError as error:  # say what the daemons did (this wait timed out twice under load)
                raise AssertionError(f"{error}\nnode-a's daemon:\n{daemon.log()[-6000:]}\n"
                                     f"node-b's daemon:\n{buddy.log()[-3000:]}") from None
            finally:
                object_tier.close()
            daemon.kill()  # node A is lost: its daemon and its NVMe
        shutil.rmtree(a_root)
        a_root.mkdir()
        yield LostNode(root=a_root, remote=remote, peer=f"peer://{buddy_address}/replicas/node-a/run1", token=token,
                       buddy=buddy, replicas=replicas)


def test_a_lost_node_restores_from_its_buddy_then_from_s3_when_the_buddy_is_gone_too(
        tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    with _node_a_lost(tmp_path, s3_bucket, s3_options) as lost:
        from_peer = _restore_in_fresh_process(lost.root, lost.remote, lost.peer, s3_options, lost.token)
        assert from_peer["kinds"] == ["local", "peer", "object"]
        assert from_peer["step"] == 3 and from_peer["equal"], from_peer
        assert from_peer["tier"].startswith("peer "), from_peer

        lost.buddy.kill()  # node B is gone too
    shutil.rmtree(lost.root)
    lost.root.mkdir()
    from_s3 = _restore_in_fresh_process(lost.root, lost.remote, lost.peer, s3_options, lost.token)
    assert from_s3["step"] == 3 and from_s3["equal"], from_s3
    assert from_s3["tier"].startswith("object "), from_s3
    assert "peer" in from_s3["log"] and "cannot be used for this restore" in from_s3["log"], from_s3["log"]


def test_a_bad_chunk_of_the_buddys_replica_is_read_from_s3_instead(
        tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any]) -> None:
    with _node_a_lost(tmp_path, s3_bucket, s3_options) as lost:
        data_file, offset, length = chunk_location(lost.replicas, 3, "weights")
        before = data_file.read_bytes()
        flip_bit(data_file, offset + length // 2, bit=5)  # B's disk rots under the replica: same size, one bit
        assert data_file.read_bytes() != before and len(data_file.read_bytes()) == len(before)
        digest = read_json(index_path(lost.replicas, 3))["tensors"]["weights"]["chunks"][0][4]

        restored = _restore_in_fresh_process(lost.root, lost.remote, lost.peer, s3_options, lost.token)

        assert restored["step"] == 3 and restored["equal"], "the restore returned the bytes that were saved"
        assert restored["tier"].startswith("peer "), restored
        assert [(tier.split()[0], chunk) for tier, chunk in restored["events"]] == [("peer", digest)], restored
        assert "fails its digest" in restored["log"] and "trying the next tier" in restored["log"], restored["log"]
        by_kind = {label.split()[0]: count for label, count in restored["chunks_by_tier"].items()}
        assert by_kind.get("object") == 1 and by_kind.get("peer", 0) >= 1, restored
        assert data_file.read_bytes() != before, "a restore never writes a buddy's replica"
