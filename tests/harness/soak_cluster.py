"""The processes of the soak run (``benchmarks/soak.py``): nodes standing in for machines on one host.

A :class:`SoakCluster` holds moto's S3 server behind a :class:`~ckptd.testing.fault_proxy.FaultProxy`
(every client, trainers and daemons, talks to S3 through the proxy; the driver's own checks go to moto
directly), and ``nodes`` :class:`SoakNode` s. Each node has a directory of its own (its "disk": the local
checkpoint root of its ranks and its daemon's state and socket), a real ``ckptd daemon`` (promotion to the
shared S3 prefix and replication to the next node's daemon, its buddy, over the peer API with a token),
and, while the job runs, a ``ckptd launch`` supervisor of ``ranks_per_node`` ranks of
:mod:`harness.soak_job`. Node 0's supervisor hosts the job's store.

Losing a node (:meth:`SoakCluster.lose_node`) SIGKILLs its supervisor (its ranks die with it) and its
daemon and deletes its directory; :meth:`SoakCluster.restore_node` gives it back empty (the directories a
provisioning step creates, a new daemon with the same node id and port). Logs live outside the nodes'
directories, so a lost node's logs survive it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ckptd.embedded_s3 import EmbeddedS3
from harness.daemon_process import DaemonProcess, write_config
from ckptd.testing.fault_proxy import FaultProxy
from ckptd.testing.multirank import free_port
from harness.soak_job import write_dataset
from harness.processes import process_alive

#: The bucket and prefix the job's object tier lives in.
BUCKET, PREFIX = "soak", "run"
#: A token for the daemons' peer API, made up for this run (never a real credential).
PEER_TOKEN = "ckptd-soak-peer-token-0123456789abcdef"
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class JobOptions:
    """What every incarnation of the soak job is started with."""

    every: int = 3
    step_time_s: float = 0.0
    seed: int = 0
    keep_remote: int = 5
    hang_timeout_s: float = 120.0


@dataclass
class SoakNode:
    """One stand-in machine: its directory, daemon and (while the job runs) supervisor."""

    index: int
    directory: Path
    ranks: tuple[int, ...]
    port: int
    daemon: DaemonProcess | None = None
    supervisor: subprocess.Popen[bytes] | None = None
    _supervisor_log: IO[bytes] | None = field(default=None, repr=False)
    daemon_starts: int = 0

    @property
    def node_id(self) -> str:
        return f"node{self.index}"

    @property
    def checkpoint_root(self) -> Path:
        """The job's ``--root``: rank r writes ``<root>/rank<r>``."""
        return self.directory / "ckpt"

    def rank_root(self, rank: int) -> Path:
        return self.checkpoint_root / f"rank{rank}"

    @property
    def state_dir(self) -> Path:
        return self.directory / "state"

    @property
    def socket(self) -> Path:
        return self.state_dir / "daemon.sock"

    def replica_root(self, source: SoakNode, rank: int) -> Path:
        """Where this node's daemon keeps the replicas of ``source``'s root of ``rank``."""
        return self.state_dir / "replicas" / source.node_id / f"rank{rank}"


class SoakCluster:
    """The soak run's S3, fault proxy and nodes (see the module docstring); use as a context manager."""

    def __init__(self, workdir: Path, *, nodes: int = 2, ranks_per_node: int = 1, options: JobOptions,
                 proxy_seed: int = 0, stall_s: float = 2.0) -> None:
        self.workdir, self.options = workdir, options
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.out = workdir / "out"
        self.nodes = [SoakNode(n, workdir / f"node{n}", tuple(range(n * ranks_per_node, (n + 1) * ranks_per_node)),
                               free_port()) for n in range(nodes)]
        self.s3 = EmbeddedS3().start()
        self.s3.create_bucket(BUCKET)
        self.proxy = FaultProxy(self.s3.endpoint_url, fraction=0.0, seed=proxy_seed, stall_s=stall_s).start()
        # a client that gives up on a stalled request resets its connection: not worth a traceback each time
        self.proxy._server.handle_error = lambda request, address: None  # type: ignore[union-attr]
        self.manifest = write_dataset(workdir / "data")
        self.incarnation = -1
        self.stop_file = workdir / "stop-at"

    # --- S3 ----------------------------------------------------------------------------------------
    @property
    def remote(self) -> str:
        return f"s3://{BUCKET}/{PREFIX}"

    @property
    def direct_options(self) -> dict[str, Any]:
        """s3fs options that reach moto without the fault proxy (the driver's checks)."""
        return dict(self.s3.storage_options)

    @property
    def proxied_options(self) -> dict[str, Any]:
        return self.proxy.storage_options(self.s3.storage_options)

    # --- daemons -----------------------------------------------------------------------------------
    def _buddy(self, node: SoakNode) -> SoakNode:
        return self.nodes[(node.index + 1) % len(self.nodes)]

    def start_daemon(self, node: SoakNode, *, wait: bool = True) -> None:
        """Start (or start again) ``node``'s daemon and (``wait``) wait until it is ready."""
        for rank in node.ranks:
            node.rank_root(rank).mkdir(parents=True, exist_ok=True)
        node.state_dir.mkdir(parents=True, exist_ok=True)
        roots = [{"name": f"rank{rank}", "local": str(node.rank_root(rank)), "remote": self.remote,
                  "remote_every_steps": 1, "replicate_every_steps": 1, "keep_remote": self.options.keep_remote,
                  "storage_options": self.proxied_options} for rank in node.ranks]
        buddy = self._buddy(node)
        options: dict[str, Any] = {"buddy": f"peer://127.0.0.1:{buddy.port}"} if buddy is not node else {}
        config = write_config(self.logs / f"daemon-{node.node_id}.toml", roots, node_id=node.node_id,
                              state_dir=str(node.state_dir), socket=str(node.socket),
                              listen=f"127.0.0.1:{node.port}", peer_token=PEER_TOKEN, poll_interval_s=0.5,
                              retry_backoff_s=0.5, scrub_interval_s=300, keep_peer=2, drain_timeout_s=10,
                              **options)
        if node.daemon is not None:
            node.daemon.kill()
        node.daemon = DaemonProcess(config, node.state_dir, env=_CREDENTIALS)
        node.daemon_starts += 1
        if wait:
            node.daemon.wait_ready(timeout_s=120)

    def start_daemons(self) -> None:
        """Start every node's daemon, side by side, and wait until all are ready."""
        for node in self.nodes:
            self.start_daemon(node, wait=False)
        for node in self.nodes:
            assert node.daemon is not None
            node.daemon.wait_ready(timeout_s=120)

    def kill_daemon(self, node: SoakNode) -> None:
        """SIGKILL ``node``'s daemon; it stays down until :meth:`start_daemon`."""
        assert node.daemon is not None
        node.daemon.kill()
        node.daemon = None

    def daemon_alive(self, node: SoakNode) -> bool:
        return node.daemon is not None and node.daemon.process.poll() is None

    # --- the job -----------------------------------------------------------------------------------
    def _environment(self, node: SoakNode) -> dict[str, str]:
        return dict(os.environ, **_CREDENTIALS, OMP_NUM_THREADS="1", CKPTD_ELASTIC_REJOIN_TIMEOUT_S="60",
                    CKPTD_PEER_TOKEN=PEER_TOKEN, CKPTD_DAEMON_SOCKET=str(node.socket))

    def start_job(self) -> int:
        """Start a new incarnation of the job (one supervisor per node, a new store); returns its number."""
        self.incarnation += 1
        endpoint = f"127.0.0.1:{free_port()}"
        self.out.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            command = [sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", str(len(node.ranks)),
                       "--nnodes", str(len(self.nodes)), "--node-rank", str(node.index), "--rdzv-endpoint", endpoint,
                       "--max-restarts", "1000", "--hang-timeout", str(self.options.hang_timeout_s),
                       "-m", "harness.soak_job", "--root", str(node.checkpoint_root), "--out", str(self.out),
                       "--data", str(self.manifest), "--cache", str(node.directory / "cache"),
                       "--stop-file", str(self.stop_file), "--every", str(self.options.every),
                       "--seed", str(self.options.seed), "--step-time", str(self.options.step_time_s),
                       "--remote", self.remote, "--endpoint-url", self.proxy.endpoint_url,
                       "--incarnation", str(self.incarnation)]
            node._supervisor_log = open(self.logs / f"launch-{node.node_id}-inc{self.incarnation}.log", "wb")
            node.supervisor = subprocess.Popen(command, stdout=node._supervisor_log, stderr=subprocess.STDOUT,
                                               env=self._environment(node))
        return self.incarnation

    def supervisor_codes(self) -> list[int | None]:
        return [node.supervisor.poll() if node.supervisor is not None else None for node in self.nodes]

    def kill_supervisor(self, node: SoakNode, timeout_s: float = 60.0) -> None:
        """SIGKILL ``node``'s supervisor and wait until it and its ranks are gone (they die with it)."""
        supervisor = node.supervisor
        if supervisor is None:
            return
        ranks = [int(line.split()[-1]) for line in _child_pids(supervisor.pid)]
        if supervisor.poll() is None:
            supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(timeout_s)
        deadline = time.monotonic() + timeout_s
        while any(process_alive(pid) for pid in ranks):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks {ranks} of {node.node_id} outlived their supervisor")
            time.sleep(0.05)
        node.supervisor = None
        if node._supervisor_log is not None:
            node._supervisor_log.close()

    def wait_job(self, timeout_s: float) -> list[int | None]:
        """Wait for every supervisor to exit (SIGKILL after ``timeout_s``); their exit codes."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            if node.supervisor is None:
                continue
            try:
                node.supervisor.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for line in _child_pids(node.supervisor.pid):  # the stacks of the ranks that hang, into the log
                    os.kill(int(line.split()[-1]), signal.SIGUSR1)
                time.sleep(2.0)
                node.supervisor.kill()
                node.supervisor.wait()
        codes = self.supervisor_codes()
        for node in self.nodes:
            node.supervisor = None
            if node._supervisor_log is not None:
                node._supervisor_log.close()
        return codes

    # --- node loss ---------------------------------------------------------------------------------
    def lose_node(self, node: SoakNode) -> None:
        """The node is gone: supervisor (with its ranks), daemon and disk."""
        self.kill_supervisor(node)
        if node.daemon is not None:
            self._keep_daemon_log(node)
            node.daemon.kill()
            node.daemon = None
        shutil.rmtree(node.directory)

    def restore_node(self, node: SoakNode) -> None:
        """The node is back, empty: its directories and a new daemon (same node id and address)."""
        node.directory.mkdir(parents=True)
        self.start_daemon(node)

    def _keep_daemon_log(self, node: SoakNode) -> None:
        if node.daemon is not None and node.daemon.log_path.exists():
            shutil.copy(node.daemon.log_path, self.logs / f"{node.node_id}-{node.daemon.log_path.name}")

    # --- end ---------------------------------------------------------------------------------------
    def stop_processes(self) -> None:
        """Stop every supervisor (SIGKILL, if any is left) and daemon (SIGTERM); S3 stays up."""
        for node in self.nodes:
            if node.supervisor is not None:
                self.kill_supervisor(node)
            if node.daemon is not None:
                self._keep_daemon_log(node)
                if node.daemon.process.poll() is None:
                    node.daemon.terminate(timeout_s=30)
                else:
                    node.daemon.kill()
                node.daemon = None

    def close(self) -> None:
        self.stop_processes()
        self.proxy.stop()
        self.s3.stop()

    def __enter__(self) -> SoakCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _child_pids(pid: int) -> list[str]:
    """``ppid pid`` lines of the direct children of ``pid`` (read from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid:
                children.append(f"{pid} {entry}")
    return children
