"""Unmodified torchrun-style scripts (``tests/scripts/torchrun_*.py``: ``env://`` init, DDP, their own snapshot
file, no ckptd import) under ``ckptd launch``: a SIGKILL of one rank restarts the whole group, as torchrun
does, each attempt with a fresh rendezvous store (so ``env://`` init works every time); each kill costs one
restart, the log says once at start which recovery applies and, at each failure, who failed and what was
restarted; the job ends with the final weights and optimizer state of an uninterrupted run, byte for byte.

Kills land at seeded steps (the test SIGKILLs the rank's process once its progress file reaches the step).
The default run kills twice in each script; the slow one 20 times across both (5 runs of 2 kills each).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.elastic_runs import wait_until

pytestmark = pytest.mark.multirank

SCRIPTS_DIR = Path(__file__).parent / "scripts"
#: script, its arguments after OUT, and its number of steps
SCRIPTS = {"ddp-steps": ("torchrun_ddp_snapshot.py", ("30", "5"), 30),
           "epochs": ("torchrun_epochs_snapshot.py", ("4",), 32)}
CKPTD = (sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", "2")
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


def _progress(out: Path, rank: int) -> list[tuple[int, int, float]]:
    path = out / f"progress-rank{rank}"
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            lines.append((int(parts[0]), int(parts[1]), float(parts[2])))
    return lines


@dataclass
class Run:
    code: int
    log: str
    out: Path
    #: Seconds from each SIGKILL until every rank completed a step in a process started after it.
    recoveries: list[float] = field(default_factory=list)


def run_with_kills(root: Path, script: str, kills: list[tuple[int, int]], *, launcher: tuple[str, ...] = CKPTD,
                   max_restarts: int = 3, step_sleep: float = 0.05, timeout_s: float = 240.0) -> Run:
    """Run ``script`` under ``launcher`` with 2 ranks and SIGKILL rank r once it completed step s, for each
    (r, s) of ``kills`` in turn (each after the previous one's recovery). Rank r holds after step s until it
    is killed, so that the kill lands there however fast the job runs."""
    name, arguments, _ = SCRIPTS[script]
    out = root / "out"
    out.mkdir(parents=True)
    for victim, step in kills:
        (out / f"hold-rank{victim}-step{step}").touch()
    log = root / "launch.log"
    environment = dict(os.environ, OMP_NUM_THREADS="1", STEP_SLEEP=str(step_sleep))
    with log.open("wb") as sink:
        process = subprocess.Popen([*launcher, "--max-restarts", str(max_restarts), str(SCRIPTS_DIR / name),
                                    str(out), *arguments], stdout=sink, stderr=sink, env=environment)
    killed_at, recoveries, killed_pids = 0.0, [], set()
    before: set[int] = set()  # the processes that ran before the latest kill (under a group restart all end)
    try:
        for victim, step in kills:
            def reached() -> tuple[int, float] | None:
                for pid, done, when in reversed(_progress(out, victim)):
                    if when > killed_at and done >= step and pid not in killed_pids and pid not in before:
                        return pid, when
                return None

            pid, _ = wait_until(reached, f"rank {victim} to complete step {step}", timeout_s)
            os.kill(pid, signal.SIGKILL)
            killed_at = time.time()
            (out / f"hold-rank{victim}-step{step}").unlink()  # its replacement goes on past the step
            killed_pids.add(pid)
            before = {seen for rank in range(2) for seen, _, _ in _progress(out, rank)}

            def recovered() -> float | None:
                # every rank completed a step in a process started after the kill (whole-group restarts)
                firsts = [min((when for pid_, _, when in _progress(out, rank) if pid_ not in before), default=None)
                          for rank in range(2)]
                return None if None in firsts else max(firsts) - killed_at

            recoveries.append(wait_until(recovered, f"the job to train again after killing rank {victim}", timeout_s))
        code = process.wait(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return Run(code, log.read_text(errors="replace"), out, recoveries)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each script's final.json of an uninterrupted run under ckptd launch."""
    finals = {}
    for script in SCRIPTS:
        run = run_with_kills(tmp_path_factory.mktemp(f"reference-{script}"), script, [], step_sleep=0.0)
        assert run.code == 0, run.log[-4000:]
        finals[script] = (run.out / "final.json").read_text()
    return finals


def _kills(seed: int, script: str, count: int = 2) -> list[tuple[int, int]]:
    chooser = random.Random(seed)
    total = SCRIPTS[script][2]
    steps = sorted(chooser.sample(range(3, total - 2), count))
    return [(chooser.randrange(2), step) for step in steps]


def _check(run: Run, kills: list[tuple[int, int]], reference: str) -> None:
    assert run.code == 0, run.log[-6000:]
    assert (run.out / "final.json").read_text() == reference, "the final snapshot differs from an uninterrupted run"
    restarts = re.findall(r"rank (\d) \(pid \d+\) killed by signal SIGKILL .*restarting the whole group .*"
                          r"\(restart (\d+) of \d+\)", run.log)
    assert [int(rank) for rank, _ in restarts] == [rank for rank, _ in kills], run.log[-6000:]
    assert [int(spent) for _, spent in restarts] == list(range(1, len(kills) + 1)), "a kill cost more than one restart"
    assert run.log.count("recovery: the whole group, as torchrun") == 1, run.log[:3000]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_sigkill_restarts_the_group_once_and_the_run_ends_bit_for_bit(
        tmp_path: Path, references: dict[str, str], script: str) -> None:
    kills = _kills(11, script)
    run = run_with_kills(tmp_path, script, kills)
    _check(run, kills, references[script])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_twenty_seeded_sigkills_across_both_scripts(tmp_path: Path, references: dict[str, str], script: str,
                                                    seed: int) -> None:
    kills = _kills(seed, script)
    run = run_with_kills(tmp_path, script, kills, max_restarts=2)
    _check(run, kills, references[script])
