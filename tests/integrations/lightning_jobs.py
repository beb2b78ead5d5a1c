"""Starting, killing and reading the child runs of ``lightning_run.py`` for the Lightning integration tests.

Each job is a real process (its own session, so that a SIGKILL of the group takes every DDP rank at once)
with its own rendezvous port. :func:`trained_batches` joins a killed run's batch log with its resumed run's
the way training saw them: the batches before the restored step, then the resumed run's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUN = Path(__file__).with_name("lightning_run.py")
_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now and not given to another job of this process."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def start(config: dict[str, Any]) -> subprocess.Popen[bytes]:
    """One job (rank 0 here; Lightning starts the other ranks) in a new session."""
    Path(config["out"]).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    return subprocess.Popen([sys.executable, str(RUN), json.dumps(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finish(child: subprocess.Popen[bytes], config: dict[str, Any]) -> dict[str, Any]:
    """Wait for a job to end well; its summary."""
    output, _ = child.communicate(timeout=300)
    assert child.returncode == 0, output.decode()[-4000:]
    return json.loads((Path(config["out"]) / "summary.json").read_text())


def kill_when_ready(child: subprocess.Popen[bytes], config: dict[str, Any], committed: Path) -> None:
    """Wait until the job blocks (``ready``) with the step whose manifest is ``committed`` on disk, then
    SIGKILL its whole process group."""
    ready = Path(config["out"]) / "ready"
    deadline = time.monotonic() + 240
    while not (ready.exists() and committed.exists()):
        assert child.poll() is None, child.communicate()[0].decode()[-4000:]
        assert time.monotonic() < deadline, "the job never committed the step"
        time.sleep(0.1)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL


def batch_log(out: Path, rank: int) -> list[dict[str, Any]]:
    """The ``{"step", "hash"}`` of every batch the rank trained, in order (all runs into ``out``)."""
    path = out / f"batches-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trained_batches(out: Path, rank: int, restored_step: int) -> list[dict[str, Any]]:
    """The batches a killed-and-resumed run trained for good: those of the killed run before
    ``restored_step``, then every batch of the resumed run (which starts again at ``restored_step``)."""
    entries = batch_log(out, rank)
    resumed_at = next(index for index in range(1, len(entries))
                      if entries[index]["step"] <= entries[index - 1]["step"])
    assert entries[resumed_at]["step"] == restored_step, entries[resumed_at]
    return [entry for entry in entries[:resumed_at] if entry["step"] < restored_step] + entries[resumed_at:]
