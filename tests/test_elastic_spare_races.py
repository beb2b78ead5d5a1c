"""Warm spares when things go wrong around them: a rank handed to a spare still in its setup waits for it;
a spare that died while waiting is dropped and the failed rank gets a new process; two ranks failing at once with one spare: one takes the spare, the other a new
process. Every run ends with the weights, optimizer state and sample ids of an uninterrupted run, byte for
byte, and leaves no spare running.

Real ``ckptd launch --spares 1`` runs of the 2-rank gloo test job (:mod:`harness.elastic_training`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.elastic_runs import WORLD, finals, generations, launch_job
from harness.processes import process_alive

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def reference(elastic_reference: list[bytes]) -> list[bytes]:
    return elastic_reference


def _spares_started(stderr: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"started warm spare \d+ \(pid (\d+)\)", stderr)]


@pytest.mark.slow
def test_a_spare_that_died_while_waiting_is_dropped_and_the_rank_gets_a_new_process(
        tmp_path: Path, reference: list[bytes]) -> None:
    result = launch_job(tmp_path, "--kill-rank", "1", "--kill-step", "7", "--kill-phase", "before-step",
                        "--kill-when-spare-ready", "--kill-spare-first", extra=("--spares", "1"))
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == reference, "the recovered run differs from the uninterrupted one"
    dead = _spares_started(result.stderr)[0]  # spare 0, the one the victim killed
    assert (out / f"spare-{dead}.json").exists(), "the spare killed had finished its setup"
    assert f"warm spare 0 (pid {dead}) exited with code -9 before it was needed; dropped" in result.stderr
    victim = generations(out, 1)
    assert sorted(victim) == [0, 1] and victim[1]["restored"] == 6, victim
    assert f"started rank 1 (pid {victim[1]['pid']}) in generation 1" in result.stderr, "a new process for the rank"
    assert "handed rank 1 to warm spare" not in result.stderr
    assert not any(process_alive(pid) for pid in _spares_started(result.stderr)), "a spare outlived the job"


@pytest.mark.slow
def test_two_ranks_failing_at_once_with_one_spare_get_the_spare_and_a_new_process(
        tmp_path: Path, reference: list[bytes]) -> None:
    result = launch_job(tmp_path, "--kill-rank", "1", "--also-kill-rank", "0", "--kill-step", "7", "--kill-phase",
                        "before-step", "--kill-when-spare-ready", extra=("--spares", "1"))
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == reference, "the recovered run differs from the uninterrupted one"
    records = {rank: generations(out, rank) for rank in range(WORLD)}
    spares = {json.loads(path.read_text())["pid"] for path in out.glob("spare-*.json")}
    newest = {rank: by_generation[max(by_generation)] for rank, by_generation in records.items()}
    assert all(record["restored"] == 6 for record in newest.values()), newest
    assert all(record["pid"] != records[rank][0]["pid"] for rank, record in newest.items()), "a rank kept its pid"
    handed = [int(rank) for rank in re.findall(r"handed rank (\d) to warm spare 0", result.stderr)]
    assert len(handed) == 1 and newest[handed[0]]["pid"] in spares, (handed, newest, spares)
    other = 1 - handed[0]
    assert f"started rank {other} (pid {newest[other]['pid']})" in result.stderr, "the other rank: a new process"
    assert not any(process_alive(pid) for pid in _spares_started(result.stderr)), "a spare outlived the job"


def test_a_rank_handed_to_a_spare_still_in_its_setup_is_recovered_once_the_setup_ends(
        tmp_path: Path, reference: list[bytes]) -> None:
    # the spare's setup ends only once the supervisor handed it the failed rank: it was not ready when taken
    result = launch_job(tmp_path, "--kill-rank", "1", "--kill-step", "7", "--kill-phase", "before-step",
                        "--spare-setup-until-assigned", extra=("--spares", "1"))
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == reference, "the recovered run differs from the uninterrupted one"
    spare = _spares_started(result.stderr)[0]
    victim = generations(out, 1)
    assert sorted(victim) == [0, 1] and victim[1]["pid"] == spare, (victim, spare)
    assert f"handed rank 1 to warm spare 0 (pid {spare}) in generation 1" in result.stderr
    killed_at = json.loads((out / "rank1-killed.json").read_text())["at"]
    assert json.loads((out / f"spare-{spare}.json").read_text())["ready_at"] > killed_at
    assert not any(process_alive(pid) for pid in _spares_started(result.stderr)), "a spare outlived the job"
