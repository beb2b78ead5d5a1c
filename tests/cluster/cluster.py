"""A ckptd cluster on one machine: N nodes and an S3 host, each in its own network namespace
(:class:`netns.Network`), talking over a bridge on 198.18.0.0/15.

- the **S3 host** runs moto's server bound to its own address (``http://<s3>:5000``), bucket ``cluster``;
- each **node** ``i`` has its own directory (its local disk: the checkpoint root of its ranks, its daemon's
  state and socket, its shard cache), a real ``ckptd daemon`` bound to an address of the node's own (its
  storage-network address, so that a fault can cut the daemons' traffic alone) with a peer token
  (promotion of every committed step to ``s3://cluster/run``, replication to the next node's daemon, its
  buddy), and, while the job runs, a ``ckptd launch`` supervisor of ``ranks_per_node`` ranks of the soak job
  (:mod:`harness.soak_job`: a data-parallel MLP on gloo over ``eth0``, verified shard loader, records in
  ``out``). Node 0's supervisor hosts the job's store (the **store host**).

Faults (on top of the network's): :meth:`Cluster.lose_node` kills every process of a node (SIGKILL) and deletes
its disk; :meth:`Cluster.replace_node` starts it again empty (a new daemon with the same id and address, and a
supervisor that joins the running job); link faults between a node and the store host, the S3 host or its
buddy are :meth:`Cluster.partition` / :meth:`Cluster.heal` by role.

Logs live in ``workdir/logs`` (outside the nodes' disks, so a lost node's logs survive it). The cluster
removes its namespaces on close, on ``with`` exit after a failure, and at interpreter exit.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.daemon_process import wait_until as daemon_wait_until
from netns import Network, NetworkError

BUCKET, PREFIX = "cluster", "run"
S3_PORT, DAEMON_PORT, STORE_PORT = 5000, 9470, 29400
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = 120.0, interval_s: float = 0.1) -> Any:
    """Poll ``condition`` until it returns something true and return that; AssertionError after ``timeout_s``
    (:func:`harness.daemon_process.wait_until` with the harness's argument order)."""
    return daemon_wait_until(condition, timeout_s, what, interval_s=interval_s)


@dataclass(frozen=True)
class JobOptions:
    """What the soak job is started with."""

    steps: int = 30
    every: int = 3
    step_time_s: float = 0.0
    seed: int = 0
    hang_timeout_s: float = 120.0
    node_timeout_s: float = 5.0


class Cluster:
    """The namespaces, S3, daemons and supervisors of one cluster (see the module docstring)."""

    def __init__(self, workdir: Path, *, nodes: int = 3, ranks_per_node: int = 1) -> None:
        from harness.soak_job import write_dataset

        self.workdir, self.node_count, self.ranks_per_node = workdir, nodes, ranks_per_node
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.network = Network()
        self.token = secrets.token_hex(24)  # made up for this cluster, never a real credential
        self.daemons: dict[int, Any] = {}
        self.supervisors: dict[int, Any] = {}
        self.incarnation = -1
        try:
            self.network.add_host("s3")
            for index in range(nodes):
                self.network.add_host(self.node(index))
            #: each daemon listens on an address of its own, so that a fault can cut the daemons' traffic
            #: (the storage network) and leave the ranks' (training) untouched
            self.daemon_addresses = [self.network.add_address(self.node(index)) for index in range(nodes)]
            self.manifest = write_dataset(workdir / "data")
            self._start_s3()
        except BaseException:
            self.close()
            raise

    # --- addresses and paths -----------------------------------------------------------------------
    @staticmethod
    def node(index: int) -> str:
        return f"node{index}"

    def address(self, host: str) -> str:
        return self.network.hosts[host].address

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.address('s3')}:{S3_PORT}"

    @property
    def remote(self) -> str:
        return f"s3://{BUCKET}/{PREFIX}"

    def disk(self, index: int) -> Path:
        return self.workdir / self.node(index)

    def buddy(self, index: int) -> int:
        return (index + 1) % self.node_count

    def ranks(self, index: int) -> range:
        return range(index * self.ranks_per_node, (index + 1) * self.ranks_per_node)

    def _environment(self, index: int | None = None) -> dict[str, str]:
        environment = dict(os.environ, **_CREDENTIALS, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
                           CKPTD_ELASTIC_REJOIN_TIMEOUT_S="60", CKPTD_PEER_TOKEN=self.token)
        if index is not None:
            environment["CKPTD_DAEMON_SOCKET"] = str(self.disk(index) / "state" / "daemon.sock")
        return environment

    # --- S3 ----------------------------------------------------------------------------------------
    def _start_s3(self) -> None:
        self.network.popen("s3", [sys.executable, "-m", "moto.server", "-H", self.address("s3"), "-p",
                                  str(S3_PORT)], env=self._environment(), log=self.logs / "moto.log")
        wait_until(lambda: self.s3_call("create_bucket", Bucket=BUCKET) is not None, "moto's server", 60, 0.3)

    def s3_call(self, method: str, **arguments: Any) -> Any:
        """Call a boto3 S3 client method from the S3 host (JSON in and out; None when the call failed)."""
        script = ("import boto3, json, sys\n"
                  f"client = boto3.client('s3', endpoint_url={self.endpoint_url!r}, region_name='us-east-1')\n"
                  "result = getattr(client, sys.argv[1])(**json.loads(sys.argv[2]))\n"
                  "result.pop('ResponseMetadata', None)\n"
                  "print(json.dumps(result, default=str))\n")
        result = self.network.run("s3", [sys.executable, "-c", script, method, json.dumps(arguments)],
                                  env=self._environment(), timeout_s=60)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def committed_remote_steps(self) -> list[int]:
        """The steps whose manifest is in the object tier (every rank's share promoted)."""
        listing = self.s3_call("list_objects_v2", Bucket=BUCKET, Prefix=f"{PREFIX}/") or {}
        steps = set()
        for entry in listing.get("Contents", []):
            parts = entry["Key"].split("/")
            if len(parts) == 3 and parts[1].startswith("step-") and parts[2] == "manifest.json":
                steps.add(int(parts[1].split("-")[1]))
        return sorted(steps)

    # --- daemons -----------------------------------------------------------------------------------
    def start_daemon(self, index: int) -> None:
        """Start ``index``'s daemon bound to its address with the peer token, and wait until it is ready."""
        from harness.daemon_process import write_config

        disk, state = self.disk(index), self.disk(index) / "state"
        for rank in self.ranks(index):
            (disk / "ckpt" / f"rank{rank}").mkdir(parents=True, exist_ok=True)
        state.mkdir(parents=True, exist_ok=True)
        token_file = self.workdir / f"token-{self.node(index)}"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        storage = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"}}
        roots = [{"name": f"rank{rank}", "local": str(disk / "ckpt" / f"rank{rank}"), "remote": self.remote,
                  "remote_every_steps": 1, "replicate_every_steps": 1, "storage_options": storage}
                 for rank in self.ranks(index)]
        options: dict[str, Any] = {}
        if self.node_count > 1:
            options["buddy"] = f"peer://{self.daemon_addresses[self.buddy(index)]}:{DAEMON_PORT}"
        config = write_config(self.logs / f"daemon-{self.node(index)}.toml", roots, node_id=self.node(index),
                              state_dir=str(state), socket=str(state / "daemon.sock"),
                              listen=f"{self.daemon_addresses[index]}:{DAEMON_PORT}",
                              peer_token_file=str(token_file), poll_interval_s=0.5, retry_backoff_s=0.5,
                              scrub_interval_s=0, keep_peer=3, drain_timeout_s=10, **options)
        (state / "daemon.json").unlink(missing_ok=True)
        process = self.network.popen(self.node(index), [sys.executable, "-m", "ckptd.cli.main", "daemon", "--config",
                                                        str(config)], env=self._environment(),
                                     log=self.logs / f"daemon-{self.node(index)}.log")
        self.daemons[index] = process

        def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"{self.node(index)}'s daemon exited with {process.returncode}:\n"
                                     f"{self.log('daemon-' + self.node(index))}")
            try:
                return json.loads((state / "daemon.json").read_text()).get("pid") is not None
            except (OSError, ValueError):
                return False
        wait_until(ready, f"{self.node(index)}'s daemon", 120)

    def start_daemons(self) -> None:
        for index in range(self.node_count):
            self.start_daemon(index)

    # --- the job -----------------------------------------------------------------------------------
    def supervisor_command(self, index: int, options: JobOptions, out: Path) -> list[str]:
        disk = self.disk(index)
        return [sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", str(self.ranks_per_node),
                "--nnodes", str(self.node_count), "--node-rank", str(index),
                "--rdzv-endpoint", f"{self.address(self.node(0))}:{STORE_PORT}", "--max-restarts", "100",
                "--hang-timeout", str(options.hang_timeout_s), "--node-timeout", str(options.node_timeout_s),
                "-m", "harness.soak_job", "--root", str(disk / "ckpt"), "--out", str(out),
                "--data", str(self.manifest), "--cache", str(disk / "cache"), "--steps", str(options.steps),
                "--every", str(options.every), "--seed", str(options.seed), "--step-time", str(options.step_time_s),
                "--remote", self.remote, "--endpoint-url", self.endpoint_url,
                "--incarnation", str(max(self.incarnation, 0))]

    def start_supervisor(self, index: int, options: JobOptions, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"launch-{self.node(index)}-{len(list(self.logs.glob(f'launch-{self.node(index)}-*')))}.log"
        self.supervisors[index] = self.network.popen(self.node(index), self.supervisor_command(index, options, out),
                                                     env=self._environment(index), log=log)

    def start_job(self, options: JobOptions, out: Path) -> None:
        """Start one supervisor per node (node 0 first: it hosts the store)."""
        self.incarnation += 1
        for index in range(self.node_count):
            self.start_supervisor(index, options, out)

    def wait_job(self, timeout_s: float = 300.0) -> list[int]:
        """Wait for every supervisor; their exit codes (AssertionError with the logs past ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        codes = []
        for index, process in sorted(self.supervisors.items()):
            try:
                codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - TimeoutExpired: report with the logs
                raise AssertionError(f"the job did not end in {timeout_s:g} s:\n{self.log('launch')[-6000:]}") \
                    from None
        return codes

    # --- faults ------------------------------------------------------------------------------------
    def lose_node(self, index: int) -> list[int]:
        """Every process of the node SIGKILLed (supervisor, ranks, daemon), then its disk deleted; the pids."""
        pids = self.network.kill_host(self.node(index))
        self.daemons.pop(index, None)
        self.supervisors.pop(index, None)
        shutil.rmtree(self.disk(index), ignore_errors=True)
        return pids

    def replace_node(self, index: int, options: JobOptions, out: Path) -> None:
        """The node back, empty: its daemon (same id and address) and a supervisor joining the running job."""
        self.disk(index).mkdir(parents=True, exist_ok=True)
        self.start_daemon(index)
        self.start_supervisor(index, options, out)

    def _role(self, index: int, role: str) -> str:
        if role == "s3":
            return "s3"
        if role == "store":
            return self.node(0)
        if role == "buddy":
            return self.node(self.buddy(index))
        raise NetworkError(f"unknown role {role!r}: one of s3, store, buddy")

    def partition(self, index: int, role: str) -> None:
        """Cut the link between node ``index`` and the S3 host, the store host (every connection both ways) or
        its buddy's daemon (what the node sends to it: replication and peer restores; the ranks' training
        traffic with the buddy stays up)."""
        if role == "buddy":
            self.network.cut_from(self.node(index), self.daemon_addresses[self.buddy(index)])
        else:
            self.network.partition(self.node(index), self._role(index, role))

    def heal(self, index: int, role: str) -> None:
        if role == "buddy":
            self.network.reconnect(self.node(index), self.daemon_addresses[self.buddy(index)])
        else:
            self.network.heal(self.node(index), self._role(index, role))

    # --- reading -----------------------------------------------------------------------------------
    def daemon_counters(self, index: int) -> dict[str, float]:
        """The byte counters of ``index``'s daemon since it started (``/metrics``, summed over its roots):
        ``ckptd_promoted_bytes_total`` (uploaded to S3), ``ckptd_replicated_bytes_total`` (sent to its buddy),
        ``ckptd_peer_served_bytes_total`` (served to peers: replicas read by restores); {} when it does not
        answer."""
        url = f"http://{self.daemon_addresses[index]}:{DAEMON_PORT}/metrics"
        script = ("import sys, urllib.request\n"
                  "request = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer ' + sys.argv[2]})\n"
                  "print(urllib.request.urlopen(request, timeout=30).read().decode())\n")
        result = self.network.run(self.node(index), [sys.executable, "-c", script, url, self.token], timeout_s=90)
        return parse_byte_counters(result.stdout) if result.returncode == 0 else {}

    def log(self, prefix: str) -> str:
        """Every log whose name starts with ``prefix``, in name order."""
        return "".join(path.read_text(errors="replace") for path in sorted(self.logs.glob(f"{prefix}*.log")))

    def close(self) -> None:
        self.network.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def finals(out: Path, world: int) -> list[bytes]:
    """Each rank's final weights, optimizer state, sample stream and loader state, as the bytes it wrote."""
    return [(out / f"rank{rank}-final.json").read_bytes() for rank in range(world)]


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    """What ``rank`` wrote on entering each generation of each incarnation, in time order."""
    found = [json.loads(path.read_text()) for path in out.glob(f"rank{rank}-inc*-gen*.json")]
    return sorted(found, key=lambda record: record["entered_at"])


def progress(out: Path, rank: int) -> list[tuple[float, int, int, str]]:
    """(time, generation, step, stream digest) of each step ``rank`` completed, in order."""
    path = out / f"rank{rank}-progress.log"
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        at, _incarnation, generation, step, digest = line.split()
        lines.append((float(at), int(generation), int(step), digest))
    return lines


def parse_byte_counters(metrics: str) -> dict[str, float]:
    """The ``*_bytes_total`` counters of a Prometheus text, each summed over its labels."""
    counters: dict[str, float] = {}
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if line.startswith("#") or not name.endswith("_bytes_total"):
            continue
        counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters
