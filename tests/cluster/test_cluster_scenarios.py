"""Failure scenarios on a 3-node cluster of network namespaces (``tests/cluster/cluster.py``): each runs the soak
job (one rank per node, every rank's daemon promoting to S3 and replicating to its buddy over the bridge with
a token) through a fault and ends byte for byte like the uninterrupted run of the same job on the same kind of
cluster (weights, optimizer state, the chained digest of every sample id, the loader state).

- node loss with replacement: every process of node 1 SIGKILLed and its disk deleted; a new node 1 (empty
  disk, same address) joins the running job and restores from its buddy's peer tier;
- partitioned from S3: node 1 cannot reach the S3 host for a while; training goes on (the local tier commits,
  the daemon's promotion lags), and after the heal the object tier catches up to the last step;
- buddy partitioned: node 1 is lost while the link to its buddy (node 2) is cut; the replacement cannot reach
  the peer tier and restores from S3.

Each prints the time from the fault to the next completed step and the steps lost. Slow (minutes each on
2 cores): the default run covers the harness itself (``test_cluster_harness.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster import Cluster, JobOptions, finals, progress, records, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.s3, pytest.mark.timeout(2400),
              pytest.mark.usefixtures("namespaces_available")]

NODES = 3
OPTIONS = JobOptions(steps=36, every=3, step_time_s=0.4, node_timeout_s=5.0, hang_timeout_s=120.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, namespaces_available: None) -> list[bytes]:
    """The uninterrupted run's final records, on a cluster of its own."""
    work = tmp_path_factory.mktemp("reference")
    with Cluster(work, nodes=NODES) as cluster:
        cluster.start_daemons()
        cluster.start_job(OPTIONS, work / "out")
        codes = cluster.wait_job(900)
        assert codes == [0] * NODES, cluster.log("launch")[-6000:]
    return finals(work / "out", NODES)


def _last_step(out: Path) -> int:
    return max((line[2] for rank in range(NODES) for line in progress(out, rank)), default=0)


def _replica_steps(cluster: Cluster, holder: int, source: int) -> list[int]:
    from ckptd.tiers.local import LocalTier

    path = cluster.disk(holder) / "state" / "replicas" / cluster.node(source) / f"rank{source}"
    try:
        return sorted(LocalTier(path).committed_steps()) if path.is_dir() else []
    except Exception:  # noqa: BLE001 - a replica being written: look again
        return []


def _recovery(out: Path, fault_at: float, steps_before: int) -> tuple[float, int]:
    """(seconds from the fault to the first step completed after it in a later generation, steps lost)."""
    generation_before = max(line[1] for rank in range(NODES) for line in progress(out, rank) if line[0] <= fault_at)
    after = [line for rank in range(NODES) for line in progress(out, rank) if line[1] > generation_before]
    first = min(after, key=lambda line: line[0])
    return first[0] - fault_at, steps_before - (first[2] - 1)


def _report(name: str, seconds: float, lost: int) -> None:
    print(f"\n{name}: {seconds:.1f} s from the fault to the next completed step, {lost} step(s) lost")


def test_node_loss_with_replacement(tmp_path: Path, reference: list[bytes]) -> None:
    out = tmp_path / "out"
    with Cluster(tmp_path, nodes=NODES) as cluster:
        cluster.start_daemons()
        cluster.start_job(OPTIONS, out)
        wait_until(lambda: any(step >= 6 for step in _replica_steps(cluster, 2, 1)), "node 1's step 6 on its buddy",
                   600, 0.2)
        steps_before = _last_step(out)
        fault_at = time.time()
        killed = cluster.lose_node(1)
        assert len(killed) >= 3, killed  # the supervisor, its rank and the daemon at least
        wait_until(lambda: "node 1's supervisor sent no heartbeat" in cluster.log("launch-node0"),
                   "node 0 to find node 1 lost", 120)
        cluster.replace_node(1, OPTIONS, out)
        codes = cluster.wait_job(900)
        assert codes == [0] * NODES, cluster.log("launch")[-6000:]
        seconds, lost = _recovery(out, fault_at, steps_before)
    assert finals(out, NODES) == reference, "the run with a replaced node differs from the uninterrupted one"
    replaced = records(out, 1)[-1]
    assert replaced["tier"] is not None and replaced["tier"].startswith("peer"), replaced
    _report("node loss with replacement", seconds, lost)


def test_partitioned_from_s3_catches_up_after_the_heal(tmp_path: Path, reference: list[bytes]) -> None:
    out = tmp_path / "out"
    with Cluster(tmp_path, nodes=NODES) as cluster:
        cluster.start_daemons()
        cluster.start_job(OPTIONS, out)
        wait_until(lambda: cluster.committed_remote_steps(), "a first step on S3", 600, 0.5)
        cluster.partition(1, "s3")
        cut_at_step = _last_step(out)
        # training goes on on the local tier while node 1's share of every newer step cannot reach S3
        more = min(cut_at_step + 6, OPTIONS.steps)
        wait_until(lambda: _last_step(out) >= more, "more steps while partitioned", 600, 0.2)
        during = cluster.committed_remote_steps()
        assert max(during) <= cut_at_step + 3, (during, cut_at_step)  # at most one save was in flight
        cluster.heal(1, "s3")
        codes = cluster.wait_job(900)
        assert codes == [0] * NODES, cluster.log("launch")[-6000:]
        wait_until(lambda: OPTIONS.steps in cluster.committed_remote_steps(), "the last step on S3 after the heal",
                   300, 0.5)
        remote = cluster.committed_remote_steps()
    assert finals(out, NODES) == reference
    assert all(records(out, rank)[0]["generation"] == 0 and len(records(out, rank)) == 1 for rank in range(NODES)), \
        "a partition from S3 restarted a rank"
    assert max(remote) == OPTIONS.steps and max(remote) > max(during)
    print(f"\npartitioned from S3: steps {during} on S3 during the cut at step {cut_at_step}, {remote} after")


def test_buddy_partitioned_restore_falls_back_to_s3(tmp_path: Path, reference: list[bytes]) -> None:
    out = tmp_path / "out"
    with Cluster(tmp_path, nodes=NODES) as cluster:
        cluster.start_daemons()
        cluster.start_job(OPTIONS, out)
        wait_until(lambda: any(step >= 6 for step in cluster.committed_remote_steps()), "step 6 on S3", 600, 0.5)
        steps_before = _last_step(out)
        fault_at = time.time()
        cluster.lose_node(1)
        cluster.partition(1, "buddy")  # the replacement cannot reach node 2, which holds its replicas
        wait_until(lambda: "node 1's supervisor sent no heartbeat" in cluster.log("launch-node0"),
                   "node 0 to find node 1 lost", 120)
        cluster.replace_node(1, OPTIONS, out)
        codes = cluster.wait_job(900)
        assert codes == [0] * NODES, cluster.log("launch")[-6000:]
        seconds, lost = _recovery(out, fault_at, steps_before)
    assert finals(out, NODES) == reference
    replaced = records(out, 1)[-1]
    assert replaced["tier"] is not None and not replaced["tier"].startswith(("peer", "local", "memory")), replaced
    _report("buddy partitioned, restore from S3", seconds, lost)
