"""``make cluster-demo``: a 3-node ckptd cluster in network namespaces loses a node and replaces it.

Each node is a network namespace on a bridge (198.18.0.0/15) with its own disk, daemon (token, buddy
replication, promotion to moto's S3 in a namespace of its own) and ``ckptd launch`` supervisor. Mid-run every
process of node 1 is SIGKILLed and its disk deleted; a new node 1 joins the running job and restores from its
buddy. Then the same job runs uninterrupted on a fresh cluster, and the two runs' final weights, optimizer
state and sample streams are compared byte for byte. Exit 0 when they are equal, 1 when they differ, 2 when
namespaces cannot be made here (not root). Everything is removed at the end, also after a failure.

    python tests/cluster/demo.py [--workdir DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]  # tests/cluster, tests/harness

import harness  # noqa: E402

from cluster import Cluster, JobOptions, finals, progress, records, wait_until  # noqa: E402
from netns import sweep_stale, unavailable_reason  # noqa: E402

harness.reach_from_subprocesses()

NODES = 3


def _say(started: float, text: str) -> None:
    print(f"[{time.monotonic() - started:7.1f} s] {text}", flush=True)


def _run(workdir: Path, options: JobOptions, *, lose: bool, started: float) -> list[bytes]:
    out = workdir / "out"
    with Cluster(workdir, nodes=NODES) as cluster:
        hosts = ", ".join(f"{name} {host.address}" for name, host in cluster.network.hosts.items())
        _say(started, f"cluster up: {hosts}; daemons on {', '.join(cluster.daemon_addresses)}")
        cluster.start_daemons()
        cluster.start_job(options, out)
        _say(started, f"job started: {NODES} nodes, {options.steps} steps, a save every {options.every}")
        if lose:
            replicas = cluster.disk(2) / "state" / "replicas" / "node1" / "rank1"
            wait_until(lambda: replicas.is_dir() and len(list(replicas.glob("step-*"))) >= 2,
                       "node 1's steps on its buddy", 600, 0.2)
            step = max((line[2] for rank in range(NODES) for line in progress(out, rank)), default=0)
            killed = cluster.lose_node(1)
            _say(started, f"node 1 lost at step {step}: SIGKILL to {len(killed)} processes, disk deleted")
            wait_until(lambda: "node 1's supervisor sent no heartbeat" in cluster.log("launch-node0"),
                       "node 0 to notice", 120)
            _say(started, "node 0 noticed the loss; a new node 1 (empty disk) joins")
            cluster.replace_node(1, options, out)
        codes = cluster.wait_job(1200)
        if codes != [0] * NODES:
            print(cluster.log("launch")[-6000:])
            raise SystemExit(f"the job failed: exit codes {codes}")
        if lose:
            record = records(out, 1)[-1]
            _say(started, f"job done; node 1's replacement restored step {record['restored']} from {record['tier']}")
        else:
            _say(started, "uninterrupted job done")
        _say(started, f"steps on S3: {cluster.committed_remote_steps()}")
    return finals(out, NODES)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None, help="where the nodes' disks and logs go")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"cluster-demo: {reason}", file=sys.stderr)
        return 2
    sweep_stale()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ckptd-cluster-demo-"))
    options = JobOptions(steps=args.steps, every=3, step_time_s=0.4)
    started = time.monotonic()
    interrupted = _run(workdir / "interrupted", options, lose=True, started=started)
    reference = _run(workdir / "reference", options, lose=False, started=started)
    same = interrupted == reference
    _say(started, "byte for byte like the uninterrupted run" if same else "DIFFERENT from the uninterrupted run")
    print(f"logs: {workdir}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
