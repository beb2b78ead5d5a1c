"""Failure scenarios on a 3-node cluster of network namespaces (``tests/cluster/cluster.py``): each runs the soak
job (one rank per node, every rank's daemon promoting to S3 and replicating to its buddy over the bridge with
a token) through a fault and ends byte for byte like the uninterrupted run of the same job on the same kind of
cluster (weights, optimizer state, the chained digest of every sample id, the loader state).

- node loss with replacement: every process of node 1 SIGKILLed and its disk deleted; a new node 1 (empty
  disk, same address) joins the running job and restores from its buddy's peer tier;
- partitioned from S3: node 1 cannot reach the S3 host for a while; training goes on (the local tier commits,
  the daemon's promotion lags), and after the heal the object tier catches up to the last step;
- buddy partitioned: node 1 is lost while the link to its buddy (node 2) is cut; the replacement cannot reach
  the peer tier and restores from S3;
- two nodes lost at once: nodes 1 and 2 (node 1's buddy, so node 1's replicas go with it) lose every process
  and their disks together; node 0 (the store host) survives; both replacements restore from what is left
  (node 1 from S3, node 2 from its replica on node 0 or from S3);
- partitioned from the store: node 2 is cut from node 0 (the store host, and rank 0's training traffic) for
  longer than the node timeout, then healed: its ranks are fenced (no step completed by a stale generation
  once a newer one completed one, no step completed twice with different data) and the job ends with a verdict.

Each prints the time from the fault to the next completed step, the steps lost and the bytes each live
daemon moved (uploaded to S3, replicated to its buddy, served to peers). Slow (minutes each on 2 cores): the
default run covers the harness itself (``test_cluster_harness.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cluster import Cluster, JobOptions, finals, progress, records, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.s3, pytest.mark.timeout(2400),
              pytest.mark.usefixtures("namespaces_available")]

NODES = 3
OPTIONS = JobOptions(steps=36, every=3, step_time_s=0.4, node_timeout_s=5.0, hang_timeout_s=120.0)
#: How long node 2 stays cut from the store host after the survivors left its generation (4 node timeouts).
STORE_CUT_HOLD_S = 4 * OPTIONS.node_timeout_s


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


def _bytes_moved(cluster: Cluster) -> str:
    """What each daemon alive now moved since it started (a replacement's counts start at its start)."""
    short = {"ckptd_promoted_bytes_total": "to S3", "ckptd_replicated_bytes_total": "to buddy",
             "ckptd_peer_served_bytes_total": "served to peers"}
    parts = []
    for index in sorted(cluster.daemons):
        counters = cluster.daemon_counters(index)
        moved = ", ".join(f"{label} {counters.get(name, 0) / 1e6:.2f} MB" for name, label in short.items())
        parts.append(f"{cluster.node(index)}: {moved if counters else 'no answer'}")
    return "; ".join(parts)


def _recovery_record(out: Path, rank: int, fault_at: float) -> dict[str, Any]:
    """What ``rank`` wrote on entering the first generation after the fault (the recovery's restore)."""
    return min((record for record in records(out, rank) if record["entered_at"] > fault_at),
               key=lambda record: record["entered_at"])


def _later_generations(out: Path, fault_at: float) -> dict[int, int]:
    """How many generations each rank entered after the recovery's (some rank failed again after the
    recovery); ranks that entered none are left out."""
    counts = {rank: sum(record["entered_at"] > fault_at for record in records(out, rank)) - 1 for rank in range(NODES)}
    return {rank: count for rank, count in counts.items() if count > 0}


def _report(name: str, seconds: float, lost: int, moved: str) -> None:
    print(f"\n{name}: {seconds:.1f} s from the fault to the next completed step, {lost} step(s) lost; "
          f"bytes moved: {moved}")


def _fencing_breaches(out: Path) -> list[str]:
    """Steps completed by a stale generation (after a newer generation completed one, or going back to an
    older generation on a rank) and steps completed twice with different sample streams."""
    lines = sorted((line[0], line[1], rank, line[2], line[3]) for rank in range(NODES) for line in progress(out, rank))
    breaches, newest, digests = [], -1, {}
    for at, generation, rank, step, digest in lines:
        if generation < newest:
            breaches.append(f"rank {rank} completed step {step} in generation {generation} at {at:.2f}, after "
                            f"generation {newest} completed a step")
        newest = max(newest, generation)
        if digests.setdefault((rank, step), digest) != digest:
            breaches.append(f"rank {rank} completed step {step} twice with different streams")
    return breaches


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
        moved = _bytes_moved(cluster)
    assert finals(out, NODES) == reference, "the run with a replaced node differs from the uninterrupted one"
    replaced = _recovery_record(out, 1, fault_at)
    assert replaced["tier"] is not None and replaced["tier"].startswith("peer"), replaced
    _report(f"node loss with replacement (later generations {_later_generations(out, fault_at)})", seconds,
            lost, moved)


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
        moved = _bytes_moved(cluster)
    assert finals(out, NODES) == reference
    assert all(records(out, rank)[0]["generation"] == 0 and len(records(out, rank)) == 1 for rank in range(NODES)), \
        "a partition from S3 restarted a rank"
    assert max(remote) == OPTIONS.steps and max(remote) > max(during)
    print(f"\npartitioned from S3: steps {during} on S3 during the cut at step {cut_at_step}, {remote} after; "
          f"bytes moved: {moved}")


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
        moved = _bytes_moved(cluster)
    assert finals(out, NODES) == reference
    replaced = _recovery_record(out, 1, fault_at)
    assert replaced["tier"] is not None and not replaced["tier"].startswith(("peer", "local", "memory")), replaced
    _report(f"buddy partitioned, restore from S3 (later generations {_later_generations(out, fault_at)})",
            seconds, lost, moved)


def test_two_nodes_lost_at_once_restore_from_what_is_left(tmp_path: Path, reference: list[bytes]) -> None:
    out = tmp_path / "out"
    with Cluster(tmp_path, nodes=NODES) as cluster:
        assert cluster.buddy(1) == 2  # node 1's replicas are lost with node 2
        cluster.start_daemons()
        cluster.start_job(OPTIONS, out)
        wait_until(lambda: any(step >= 6 for step in cluster.committed_remote_steps()), "step 6 on S3", 600, 0.5)
        steps_before = _last_step(out)
        fault_at = time.time()
        for index in (1, 2):
            cluster.lose_node(index)
        for index in (1, 2):
            found = f"node {index}'s supervisor sent no heartbeat"
            wait_until(lambda found=found: found in cluster.log("launch-node0"), f"node 0 to find node {index} lost",
                       120)
        for index in (1, 2):
            cluster.replace_node(index, OPTIONS, out)
        codes = cluster.wait_job(900)
        assert codes == [0] * NODES, cluster.log("launch")[-6000:]
        seconds, lost = _recovery(out, fault_at, steps_before)
        moved = _bytes_moved(cluster)
    assert finals(out, NODES) == reference, "the run with two replaced nodes differs from the uninterrupted one"
    tiers = {rank: _recovery_record(out, rank, fault_at)["tier"] for rank in (1, 2)}
    assert tiers[1] is not None and not tiers[1].startswith(("peer", "local", "memory")), tiers  # its buddy is gone
    assert tiers[2] is not None and not tiers[2].startswith(("local", "memory")), tiers
    _report(f"two nodes lost at once (restored from {tiers}; later generations "
            f"{_later_generations(out, fault_at)})", seconds, lost, moved)


def test_node_partitioned_from_the_store_is_fenced(tmp_path: Path, reference: list[bytes]) -> None:
    out = tmp_path / "out"
    with Cluster(tmp_path, nodes=NODES) as cluster:
        cluster.start_daemons()
        cluster.start_job(OPTIONS, out)
        wait_until(lambda: _last_step(out) >= 6, "step 6", 600, 0.2)
        steps_before = _last_step(out)
        fault_at = time.time()
        cluster.partition(2, "store")
        wait_until(lambda: "node 2's supervisor sent no heartbeat" in cluster.log("launch-node0"),
                   "node 0 to find node 2 lost", 120)
        wait_until(lambda: "rank 0 leaves generation 0" in cluster.log("launch-node0"),
                   "rank 0 to leave the generation node 2 is in", 300)
        time.sleep(STORE_CUT_HOLD_S)  # the survivors wait in the new generation while node 2 is still cut off
        cut_s = time.time() - fault_at
        cluster.heal(2, "store")
        codes = cluster.wait_job(900)
        logs = cluster.log("launch")
        seconds, lost = _recovery(out, fault_at, steps_before)
        moved = _bytes_moved(cluster)
    breaches = _fencing_breaches(out)
    entered = {rank: [(record["generation"], record["pid"], record["restored"]) for record in records(out, rank)]
               for rank in range(NODES)}
    print(f"\npartitioned from the store: cut {cut_s:.1f} s at step {steps_before}; exit codes {codes}; "
          f"(generation, pid, restored step) entered by each rank {entered}")
    assert not breaches, breaches
    assert codes == [0] * NODES, logs[-6000:]
    assert finals(out, NODES) == reference, "the run with a node cut from the store differs from the uninterrupted one"
    _report("partitioned from the store", seconds, lost, moved)
