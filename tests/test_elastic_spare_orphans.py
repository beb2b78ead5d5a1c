"""No process outlives its ``ckptd launch`` supervisor: a supervisor stopped with SIGTERM or SIGKILL takes
its ranks and its waiting warm spare with it (each dies with its parent), so none keeps training or waits
on a store that is gone.

A real ``ckptd launch --spares 1`` of the 2-rank gloo test job (:mod:`harness.elastic_training`), long
enough to be running when the supervisor gets the signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.elastic_runs import WORLD
from harness.processes import process_alive

pytestmark = pytest.mark.multirank


def _wait_for(condition, what: str, timeout_s: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.parametrize("signal_name", ["SIGTERM", pytest.param("SIGKILL", marks=pytest.mark.slow)])
def test_a_stopped_supervisor_leaves_no_rank_and_no_spare_behind(tmp_path: Path, signal_name: str) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", str(WORLD), "--spares", "1",
               "-m", "harness.elastic_training", "--root", str(tmp_path / "ckpt"), "--out", str(out),
               "--steps", "100000", "--every", "100000"]
    log = (tmp_path / "launch.log").open("wb")
    supervisor = subprocess.Popen(command, stdout=log, stderr=log, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        _wait_for(lambda: list(out.glob("spare-*.json")) and all((out / f"rank{rank}-gen0.json").exists()
                                                                  for rank in range(WORLD)),
                  "the ranks and the warm spare to start")
        pids = [json.loads(path.read_text())["pid"] for path in out.glob("spare-*.json")]
        pids += [json.loads((out / f"rank{rank}-gen0.json").read_text())["pid"] for rank in range(WORLD)]
        assert all(process_alive(pid) for pid in pids), pids
        supervisor.send_signal(getattr(signal, signal_name))
        supervisor.wait(timeout=60)
        _wait_for(lambda: not any(process_alive(pid) for pid in pids), f"ranks and spare {pids} to end with the supervisor")
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        log.close()
