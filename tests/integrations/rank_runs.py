"""Running a test script once per rank, as torchrun starts a job on one node: each process gets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE`` and a free ``MASTER_PORT`` on loopback (one process alone gets none of them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ckptd.testing import free_port


def run_ranks(script: Path, config_file: Path, *, world_size: int, env: dict[str, str],
              timeout_s: float) -> list[subprocess.CompletedProcess[str]]:
    """``python script config_file`` on ``world_size`` ranks; the finished processes, by rank (killed past
    ``timeout_s``)."""
    if world_size > 1:
        env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size))
    children = [subprocess.Popen([sys.executable, str(script), str(config_file)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)) if world_size > 1 else env)
                for rank in range(world_size)]
    finished = []
    try:
        for child in children:
            stdout, stderr = child.communicate(timeout=timeout_s)
            finished.append(subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return finished
