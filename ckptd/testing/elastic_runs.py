"""Running the elastic test job (:mod:`ckptd.testing.elastic_training`) under a real ``ckptd launch`` and
reading what its ranks wrote, for the ``tests/test_elastic_*.py`` files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ckptd.testing.multirank import free_port

#: Ranks of the test jobs.
WORLD = 2


def launch_job(root: Path, *job_args: str, max_restarts: int = 3, hang_timeout: float = 60.0, nodes: int = 1,
               extra: tuple[str, ...] = (), settings: dict[str, str] | None = None,
               timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
    """``ckptd launch`` of the test job with WORLD ranks; with ``nodes=2`` two supervisors (one rank each)
    stand in for two nodes: node 0 hosts the store, each keeps its ranks' checkpoints in its own root.
    ``extra``: more launcher options; ``settings``: more environment variables (``CKPTD_*``) for the
    supervisors and their ranks. Returns the exit code (the same on every supervisor) and their output."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_ELASTIC_REJOIN_TIMEOUT_S="60")
    environment.update(settings or {})
    endpoint = f"127.0.0.1:{free_port()}"
    commands = []
    for node in range(nodes):
        placement = ["--nproc-per-node", str(WORLD)] if nodes == 1 else [
            "--nproc-per-node", str(WORLD // nodes), "--nnodes", str(nodes), "--node-rank", str(node),
            "--rdzv-endpoint", endpoint]
        commands.append([sys.executable, "-m", "ckptd.cli.main", "launch", *placement,
                         "--max-restarts", str(max_restarts), "--hang-timeout", str(hang_timeout), *extra,
                         "-m", "ckptd.testing.elastic_training", "--root", str(root / f"ckpt-node{node}"),
                         "--out", str(root / "out"), *job_args])
    supervisors = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=environment) for command in commands]
    try:
        outputs = [supervisor.communicate(timeout=timeout_s) for supervisor in supervisors]
    finally:
        for supervisor in supervisors:
            if supervisor.poll() is None:
                supervisor.kill()
                supervisor.wait()
    codes = {supervisor.returncode for supervisor in supervisors}
    assert len(codes) == 1, f"the supervisors disagree on the outcome: exit codes {codes}"
    return subprocess.CompletedProcess(commands[0], codes.pop(), "".join(o for o, _ in outputs),
                                       "".join(e for _, e in outputs))


def finals(out: Path) -> list[bytes]:
    """Each rank's final weights, optimizer state and sample ids, as the bytes it wrote."""
    return [(out / f"rank{rank}-final.json").read_bytes() for rank in range(WORLD)]


def generations(out: Path, rank: int) -> dict[int, dict[str, Any]]:
    """The records ``rank`` wrote for each generation it joined, by generation."""
    records = {}
    for path in out.glob(f"rank{rank}-gen*.json"):
        record = json.loads(path.read_text())
        records[record["generation"]] = record
    return records


def staged(out: Path, rank: int) -> dict[int, list[int]]:
    """The steps each process of ``rank`` staged (saves that returned True), by generation."""
    path = out / f"rank{rank}-staged.json"
    return {int(g): steps for g, steps in json.loads(path.read_text()).items()} if path.exists() else {}
