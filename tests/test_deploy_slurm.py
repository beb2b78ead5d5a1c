"""deploy/slurm/ckptd-train.sbatch: its launch line, run as srun would run it on each node of an allocation.

The test reads the batch script itself: the ``bash -c`` body of its ``srun`` line runs once per "node" (two
processes here, with the Slurm variables srun sets: SLURM_NNODES, SLURM_NODEID, SLURM_JOB_ID) and the
rendezvous variables the script's own lines derive from the allocation. The job, a torchrun-style DDP
script, must end with the bytes of the same script under ``torchrun --standalone`` with as many ranks.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.testing import free_port

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "deploy" / "slurm" / "ckptd-train.sbatch"
SCRIPT = Path(__file__).with_name("scripts") / "torchrun_ddp_snapshot.py"
STEPS, EVERY = "12", "4"


def _script_lines() -> list[str]:
    return SBATCH.read_text(encoding="utf-8").splitlines()


def _launch_body() -> str:
    """The command srun runs on every node: the ``bash -c`` body of the script's srun line."""
    [line] = [line for line in _script_lines() if line.startswith("srun ")]
    words = shlex.split(line)
    return words[words.index("-c") + 1]


def _exports() -> str:
    """The script's lines that derive the rendezvous settings from the allocation."""
    return "\n".join(line for line in _script_lines() if line.startswith("export "))


def _environment(**slurm: str) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", **slurm}


def test_the_rendezvous_comes_from_the_allocation() -> None:
    derived = subprocess.run(
        ["bash", "-c", f"set -eu\n{_exports()}\necho $CKPTD_RDZV_ENDPOINT $CKPTD_NPROC_PER_NODE $CKPTD_MAX_RESTARTS"],
        env=_environment(SLURM_JOB_ID="123456", SLURM_GPUS_ON_NODE="8", RDZV_HOST="node017"),
        capture_output=True, text=True, timeout=60, check=True)
    assert derived.stdout.split() == [f"node017:{20000 + 123456 % 10000}", "8", "3"]
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in _exports()


def test_the_launch_line_on_two_nodes_trains_as_torchrun_does_on_one(tmp_path: Path) -> None:
    reference = tmp_path / "torchrun"
    reference.mkdir()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(SCRIPT), str(reference), STEPS, EVERY], env=_environment(), check=True,
                   capture_output=True, timeout=240)

    out = tmp_path / "slurm"
    out.mkdir()
    port = free_port()
    nodes = []
    for node in range(2):
        environment = _environment(SLURM_NNODES="2", SLURM_NODEID=str(node), SLURM_JOB_ID="4242",
                                   CKPTD_RDZV_ENDPOINT=f"127.0.0.1:{port}",
                                   CKPTD_NPROC_PER_NODE="1", CKPTD_MAX_RESTARTS="3")
        log = open(tmp_path / f"node{node}.log", "wb")  # noqa: SIM115 - closed below
        nodes.append((subprocess.Popen(["bash", "-c", _launch_body(), "ckptd-node", str(SCRIPT), str(out), STEPS,
                                        EVERY], env=environment, stdout=log, stderr=subprocess.STDOUT), log))
    for node, (process, log) in enumerate(nodes):
        try:
            process.wait(timeout=240)
        finally:
            if process.poll() is None:
                process.kill()
            log.close()
        assert process.returncode == 0, (tmp_path / f"node{node}.log").read_text()[-3000:]
    for rank in range(2):
        steps = [int(line.split()[1]) for line in (out / f"progress-rank{rank}").read_text().splitlines()]
        assert steps == list(range(1, int(STEPS) + 1))
    assert (out / "final.json").read_bytes() == (reference / "final.json").read_bytes()
