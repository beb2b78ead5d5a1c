"""Hang detection blames the rank that stopped: with 3 ranks, SIGSTOP of any one of them (each in turn) gets
that rank, and only it, killed and replaced; its two peers, blocked in a collective with it and as silent
in their training heartbeats, keep their processes (their alive keys go on, the stopped rank's do not).

The job (``tests/scripts/elastic_save_beats.py``) beats only at its saves, and the victim stops right after
the save of the step before, so it beat exactly as often as its peers: the count of beats cannot tell them
apart. The job ends byte for byte like an uninterrupted run, after one restart."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from harness.elastic_runs import Job

pytestmark = pytest.mark.multirank

WORLD = 3
STEPS = 12
SCRIPT = Path(__file__).parent / "scripts" / "elastic_save_beats.py"


def _launch(root: Path, *stop: str) -> tuple[int, str]:
    out = root / "out"
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "ckptd.cli.main", "launch", "--nproc-per-node", str(WORLD), "--max-restarts",
               "3", "--hang-timeout", "4", str(SCRIPT), str(root / "ckpt"), str(out), str(STEPS), *stop]
    # the process group's timeout is then 1.5 x 4 + 5 = 11 s: a survivor blocked in a collective with a peer that
    # left it (gloo does not end it when that peer leaves) leaves at that timeout, and is not killed meanwhile
    job = Job(root, {0: command}, dict(os.environ, OMP_NUM_THREADS="1", CKPTD_ELASTIC_REJOIN_TIMEOUT_S="60",
                                       CKPTD_ELASTIC_COLLECTIVE_TIMEOUT_S="1"))
    job.start(0)
    try:
        return job.wait(240), job.log()
    finally:
        job.kill()


def _finals(out: Path) -> list[str]:
    return [(out / f"rank{rank}-final.json").read_text() for rank in range(WORLD)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("hang-reference")
    code, log = _launch(root)
    assert code == 0, log[-4000:]
    return _finals(root / "out")


@pytest.mark.parametrize("victim", range(WORLD), ids=[f"sigstop-rank{rank}" for rank in range(WORLD)])
def test_only_the_stopped_rank_is_killed_and_replaced(tmp_path: Path, reference: list[str], victim: int) -> None:
    code, log = _launch(tmp_path, str(victim), "6")
    assert code == 0, log[-4000:]
    killed = re.findall(r"rank (\d+) \(pid \d+\) sent no heartbeat for [\d.]+ s .*: killing it", log)
    assert killed == [str(victim)], f"the supervisor killed ranks {killed} for rank {victim}'s hang:\n{log[-4000:]}"
    assert len(re.findall(r"restarting it alone in generation", log)) == 1, log[-4000:]
    for rank in range(WORLD):
        joined = dict(line.split() for line in (tmp_path / "out" / f"rank{rank}-pids.txt").read_text().splitlines())
        assert sorted(joined) == ["0", "1"], f"rank {rank} joined generations {sorted(joined)}"
        assert (joined["0"] == joined["1"]) != (rank == victim), f"rank {rank}: pids {joined}"
    assert _finals(tmp_path / "out") == reference, "the recovered run differs from an uninterrupted one"
