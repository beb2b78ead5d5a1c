"""Running the elastic test job (:mod:`harness.elastic_training`) under a real ``ckptd launch`` and
reading what its ranks wrote, for the ``tests/test_elastic_*.py`` files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.testing.multirank import free_port

#: Ranks of the test jobs.
WORLD = 2


@dataclass
class Job:
    """A running ``ckptd launch`` job of the test job: one supervisor per node, each logging to its own file."""

    root: Path
    commands: dict[int, list[str]]
    environment: dict[str, str]
    supervisors: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)

    def start(self, node: int) -> subprocess.Popen[bytes]:
        """Start (or start again, in place of a lost one) the supervisor of ``node``."""
        log = self.root / f"launch-node{node}-{len(self.logs)}.log"
        self.logs.append(log)
        with log.open("wb") as sink:
            process = subprocess.Popen(self.commands[node], stdout=sink, stderr=sink, env=self.environment)
        self.supervisors[node] = process
        return process

    def log(self) -> str:
        """Every supervisor's output so far (their ranks' included), in start order."""
        return "".join(path.read_text(errors="replace") for path in self.logs if path.exists())

    def wait(self, timeout_s: float = 180.0) -> int:
        """Wait for every supervisor; their exit code (the same on every one). Kills them all past
        ``timeout_s`` and fails."""
        deadline = time.monotonic() + timeout_s
        try:
            for process in self.supervisors.values():
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end in {timeout_s:g} s:\n{self.log()[-6000:]}") from None
        codes = {process.returncode for process in self.supervisors.values()}
        assert len(codes) == 1, f"the supervisors disagree on the outcome: exit codes {codes}\n{self.log()[-4000:]}"
        return codes.pop()

    def kill(self) -> None:
        for process in self.supervisors.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def start_job(root: Path, *job_args: str, max_restarts: int = 3, hang_timeout: float = 60.0, nodes: int = 1,
              extra: tuple[str, ...] = (), settings: dict[str, str] | None = None,
              module: str = "harness.elastic_training", world: int = WORLD) -> Job:
    """Start ``ckptd launch`` of the test job (``module``) with ``world`` ranks; with ``nodes=2`` two supervisors
    (``world // nodes`` ranks each) stand in for two nodes: node 0 hosts the store, each keeps its ranks' checkpoints in
    its own root (``root/ckpt-node<n>``). ``extra``: more launcher options; ``settings``: more environment
    variables (``CKPTD_*``) for the supervisors and their ranks."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", CKPTD_ELASTIC_REJOIN_TIMEOUT_S="60")
    environment.update(settings or {})
    endpoint = f"127.0.0.1:{free_port()}"
    commands = {}
    for node in range(nodes):
        placement = ["--nproc-per-node", str(world)] if nodes == 1 else [
            "--nproc-per-node", str(world // nodes), "--nnodes", str(nodes), "--node-rank", str(node),
            "--rdzv-endpoint", endpoint]
        commands[node] = [sys.executable, "-m", "ckptd.cli.main", "launch", *placement,
                          "--max-restarts", str(max_restarts), "--hang-timeout", str(hang_timeout), *extra,
                          "-m", module, "--root", str(root / f"ckpt-node{node}"), "--out", str(root / "out"),
                          *job_args]
    root.mkdir(parents=True, exist_ok=True)
    job = Job(root, commands, environment)
    for node in range(nodes):
        job.start(node)
    return job


def launch_job(root: Path, *job_args: str, timeout_s: float = 180.0,
               **options: Any) -> subprocess.CompletedProcess[str]:
    """:func:`start_job`, waited for: the exit code (the same on every supervisor) and their output (all of
    it in ``stderr``)."""
    job = start_job(root, *job_args, **options)
    try:
        code = job.wait(timeout_s)
    finally:
        job.kill()
    return subprocess.CompletedProcess(job.commands[0], code, "", job.log())


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = 90.0) -> Any:
    """Poll ``condition`` until it returns something true and return that; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def record(out: Path, rank: int, generation: int) -> dict[str, Any] | None:
    """What ``rank`` wrote on joining ``generation`` (None before it did)."""
    path = out / f"rank{rank}-gen{generation}.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def finals(out: Path, world: int = WORLD) -> list[bytes]:
    """Each of the ``world`` ranks' final weights, optimizer state and sample ids, as the bytes it wrote."""
    return [(out / f"rank{rank}-final.json").read_bytes() for rank in range(world)]


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


def staged_steps(out: Path, rank: int) -> list[int]:
    """The steps ``rank`` of a launched job staged, from its ``rank<N>-staged.json`` ([] before it wrote one)."""
    try:
        return [step for steps in json.loads((out / f"rank{rank}-staged.json").read_text()).values() for step in steps]
    except (FileNotFoundError, json.JSONDecodeError):
        return []
