"""The demo's elastic phase: the job of :mod:`ckptd.demo.elastic_training` on 2 ranks under ``ckptd launch``,
uninterrupted and then with a warm spare (``--spares``) and one rank SIGKILLed mid-run; prints the recovery
and compares the two runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from ckptd.errors import CkptdError

WORLD = 2
#: The rank the demo kills (not rank 0, which hosts nothing: any rank may die).
VICTIM = 1


@dataclass(frozen=True)
class Recovery:
    """What the supervisor and the ranks recorded of one recovery."""

    killed_step: int
    restored_step: int
    old_pid: int
    new_pid: int
    replacement_tier: str
    survivor_tiers: dict[int, str]
    #: Seconds from the SIGKILL to the first step every rank completed after recovery.
    seconds: float


def _launch(job_args: list[str], environment: dict[str, str], spares: int) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", str(WORLD), "--max-restarts", "1",
               "--hang-timeout", "60", "--spares", str(spares), "-m", "ckptd.demo.elastic_training", *job_args]
    return subprocess.run(command, capture_output=True, text=True, check=False, env=environment, timeout=600)


def _records(out: Path, rank: int) -> dict[int, dict[str, Any]]:
    records = (json.loads(path.read_text()) for path in out.glob(f"rank{rank}-gen*.json"))
    return {record["generation"]: record for record in records}


def _recovery(out: Path) -> Recovery:
    killed = json.loads((out / f"rank{VICTIM}-killed.json").read_text())
    records = {rank: _records(out, rank) for rank in range(WORLD)}
    if any(1 not in by_generation for by_generation in records.values()):
        raise CkptdError("the killed run did not recover into generation 1", path=str(out))
    victim = records[VICTIM]
    return Recovery(killed_step=killed["step"], restored_step=victim[1]["restored"] or 0,
                    old_pid=victim[0]["pid"], new_pid=victim[1]["pid"], replacement_tier=victim[1]["tier"] or "none",
                    survivor_tiers={rank: by[1]["tier"] or "none" for rank, by in records.items() if rank != VICTIM},
                    seconds=max(by[1]["first_step_at"] for by in records.values()) - killed["at"])


def run_elastic_phase(work: Path, manifest: Path, *, steps: int, kill_step: int, every: int, spares: int = 1) -> bool:
    """Run both elastic runs in ``work`` (the killed one with ``spares`` warm spares), print what happens,
    return whether they match bit for bit."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--data", str(manifest), "--cache", str(work / "cache"), "--steps", str(steps), "--every", str(every)]
    click.echo(f"[4/4] elastic: {steps} steps on {WORLD} ranks under `ckptd launch` (gloo), uninterrupted, then "
               f"with {spares} warm spare(s) and rank {VICTIM} killed by SIGKILL after step {kill_step}")
    runs, logs = {}, {}
    for name, extra, spares_here in (("uninterrupted", [], 0),
                                     ("killed", ["--kill-rank", str(VICTIM), "--kill-step", str(kill_step)], spares)):
        out = work / name
        done = _launch(common + ["--ckpt", str(work / f"{name}-ckpt"), "--out", str(out), *extra], environment,
                       spares_here)
        if done.returncode != 0:
            raise CkptdError(f"the {name} elastic run failed with exit code {done.returncode}: "
                             f"{done.stderr.strip().splitlines()[-1:] or ''}")
        logs[name] = done.stderr
        runs[name] = [json.loads((out / f"rank{rank}-final.json").read_text()) for rank in range(WORLD)]
    recovery = _recovery(work / "killed")
    for line in logs["killed"].splitlines():
        if "restarting it alone" in line or "to warm spare" in line:
            click.echo(f"      {line}")
    survivors = ", ".join(f"rank {rank} from {tier}" for rank, tier in recovery.survivor_tiers.items())
    replaced_by = "a warm spare" if spares > 0 else "a new process"
    click.echo(f"      the supervisor replaced only rank {VICTIM}, by {replaced_by} (pid {recovery.old_pid} -> "
               f"{recovery.new_pid}); the survivor kept its process")
    click.echo(f"      restored step {recovery.restored_step}: rank {VICTIM} from {recovery.replacement_tier}, "
               f"{survivors}; steps lost: {recovery.killed_step - recovery.restored_step}; time to recover "
               f"(SIGKILL to the next completed step): {recovery.seconds:.2f} s")
    equal = runs["killed"] == runs["uninterrupted"]
    verdict = "EQUAL, bit for bit" if equal else "DIFFERENT"
    click.echo(f"result: elastic run with a killed rank vs uninterrupted run: samples, weights and optimizer state "
               f"of every rank {verdict}")
    return equal
