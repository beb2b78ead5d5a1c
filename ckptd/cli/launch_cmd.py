"""``ckptd launch``: torchrun's options; one supervisor per node that restarts only the rank that failed."""

from __future__ import annotations

import logging
import socket
import sys

import click

from ckptd.errors import ConfigError


def _endpoint(value: str | None, nnodes: int) -> tuple[str, int]:
    """(host, port) of ``--rdzv-endpoint``; on one node without it, a free loopback port."""
    if value is None:
        if nnodes > 1:
            raise ConfigError("--rdzv-endpoint is required with --nnodes > 1",
                              hint="pass the node-rank-0 host and a free port, e.g. --rdzv-endpoint node0:29400")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            return "127.0.0.1", int(probe.getsockname()[1])
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--rdzv-endpoint {value!r} is not HOST:PORT")
    return host, int(port)


@click.command("launch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--nproc-per-node", type=int, default=1, show_default=True, envvar="CKPTD_NPROC_PER_NODE",
              help="Ranks on this node. [env: CKPTD_NPROC_PER_NODE]")
@click.option("--nnodes", type=int, default=1, show_default=True, envvar="CKPTD_NNODES",
              help="Nodes (supervisors) in the job. [env: CKPTD_NNODES]")
@click.option("--node-rank", type=int, default=0, show_default=True, envvar="CKPTD_NODE_RANK",
              help="This node's rank; node 0 hosts the job's store. [env: CKPTD_NODE_RANK]")
@click.option("--rdzv-endpoint", default=None, envvar="CKPTD_RDZV_ENDPOINT",
              help="HOST:PORT of the job's c10d TCPStore, hosted by node 0 (default on one node: a free "
                   "loopback port). [env: CKPTD_RDZV_ENDPOINT]")
@click.option("--max-restarts", type=int, default=3, show_default=True, envvar="CKPTD_MAX_RESTARTS",
              help="Rank restarts the whole job may spend; the next failure stops it. [env: CKPTD_MAX_RESTARTS]")
@click.option("--max-restarts-per-rank", type=int, default=None, envvar="CKPTD_MAX_RESTARTS_PER_RANK",
              help="Restarts each rank may spend (default: only --max-restarts bounds them); the rank's next "
                   "failure stops the job (exit 12). [env: CKPTD_MAX_RESTARTS_PER_RANK]")
@click.option("--hang-timeout", type=float, default=300.0, show_default=True, envvar="CKPTD_HANG_TIMEOUT",
              help="Seconds without a heartbeat after which a rank is killed and replaced (0: never). "
                   "[env: CKPTD_HANG_TIMEOUT]")
@click.option("--crash-loop", type=int, default=3, show_default=True, envvar="CKPTD_CRASH_LOOP",
              help="Failures in a row with no training step completed in between that stop the job (exit 14; "
                   "0: never). [env: CKPTD_CRASH_LOOP]")
@click.option("--restart-backoff", type=float, default=1.0, show_default=True, envvar="CKPTD_RESTART_BACKOFF",
              help="Seconds before restarting a rank that failed with no step completed since the last "
                   "failure (of the job, or of that rank since its restart), doubled at each such failure. "
                   "[env: CKPTD_RESTART_BACKOFF]")
@click.option("--spares", type=int, default=0, show_default=True, envvar="CKPTD_SPARES",
              help="Warm spares per node: processes that import torch and run the script's setup_fn (see "
                   "ckptd.elastic.run), then wait to take a failed rank's place. [env: CKPTD_SPARES]")
@click.option("--preload/--no-preload", default=True, show_default=True, envvar="CKPTD_PRELOAD",
              help="Fork every rank and spare from one process per node that imported torch (and "
                   "torch._dynamo, which the first optimizer build imports) once: a replacement without a "
                   "warm spare skips those seconds. The script runs as __main__ in the forked process; "
                   "variables that libraries read when they are imported (OMP_NUM_THREADS, ...) come from the "
                   "launch's environment. --no-preload starts each rank as a new interpreter. "
                   "[env: CKPTD_PRELOAD]")
@click.option("--node-timeout", type=float, default=30.0, show_default=True, envvar="CKPTD_NODE_TIMEOUT",
              help="Seconds without a heartbeat from a node's supervisor after which the other nodes take it for "
                   "lost and wait for a new supervisor with its --node-rank. [env: CKPTD_NODE_TIMEOUT]")
@click.option("--checkpoint-on-stop", is_flag=True, envvar="CKPTD_CHECKPOINT_ON_STOP",
              help="SIGTERM or SIGINT to a supervisor first has every rank save and commit one agreed step (on "
                   "every tier it reaches within --stop-timeout), then stops the job; a new launch resumes from "
                   "it. Pass it to every node's supervisor. [env: CKPTD_CHECKPOINT_ON_STOP]")
@click.option("--stop-timeout", type=float, default=120.0, show_default=True, envvar="CKPTD_STOP_TIMEOUT",
              help="With --checkpoint-on-stop: seconds the ranks get for the final checkpoint before SIGTERM. "
                   "[env: CKPTD_STOP_TIMEOUT]")
@click.option("-m", "--module", "as_module", is_flag=True, help="Run SCRIPT as a module (python -m SCRIPT).")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch(nproc_per_node: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None, max_restarts: int,
           max_restarts_per_rank: int | None, hang_timeout: float, crash_loop: int, restart_backoff: float,
           spares: int, preload: bool, node_timeout: float, checkpoint_on_stop: bool, stop_timeout: float,
           as_module: bool, script: str, script_args: tuple[str, ...]) -> None:
    """Start a training script on every rank of this node and restart only the rank that fails.

    A supervisor started with the --node-rank of a lost node (and the job's --rdzv-endpoint) joins the
    running job in its place. SIGTERM or SIGINT to any supervisor stops the whole job gracefully (exit 15;
    with --checkpoint-on-stop after every rank saved one agreed step);
    see ckptd.elastic.supervisor for every exit code."""
    from ckptd.elastic.supervisor import LaunchSpec, Supervisor  # imports torch: only when the command runs

    logging.basicConfig(level=logging.INFO, format="ckptd launch: %(message)s", stream=sys.stderr)
    host, port = _endpoint(rdzv_endpoint, nnodes)
    command = (sys.executable, "-u", *(("-m", script) if as_module else (script,)), *script_args)
    spec = LaunchSpec(command=command, nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                      rdzv_host=host, rdzv_port=port, max_restarts=max_restarts,
                      max_restarts_per_rank=max_restarts_per_rank, hang_timeout_s=hang_timeout,
                      crash_loop=crash_loop, restart_backoff_s=restart_backoff, spares=spares,
                      node_timeout_s=node_timeout, checkpoint_on_stop=checkpoint_on_stop,
                      stop_timeout_s=stop_timeout, preload=preload)
    Supervisor(spec).run()
