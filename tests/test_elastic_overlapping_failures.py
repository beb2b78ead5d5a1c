"""Failures that overlap: a replacement rank SIGKILLed during its own restore, and two of three ranks
SIGKILLed at once. The job recovers each time (the failed ranks are restarted alone, the survivor stays in
its process) and ends with the weights, optimizer state and sample ids of an uninterrupted run of the same
world size, byte for byte.

Real ``ckptd launch`` runs of the gloo test job (:mod:`harness.elastic_training`), 2 ranks, or 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.elastic_runs import finals, generations, launch_job

pytestmark = pytest.mark.multirank


def test_a_rank_killed_during_its_own_restore_is_restarted_again_and_the_run_ends_bit_for_bit(
        tmp_path: Path, elastic_reference: list[bytes]) -> None:
    # rank 1 dies once step 6 is committed; its replacement (generation 1) SIGKILLs itself at the first read
    # of a data file of its restore, once; the next replacement (generation 2) restores step 6 and finishes
    result = launch_job(tmp_path, "--kill-rank", "1", "--kill-step", "6", "--kill-phase", "after-commit",
                        "--kill-in-restore")
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == elastic_reference, "the run recovered twice differs from the uninterrupted one"

    killed = json.loads((out / "rank1-killed-in-restore.json").read_text())
    survivor, victim = generations(out, 0), generations(out, 1)
    assert killed["generation"] == 1 and killed["path"].endswith(".data"), killed
    # no rank finished the restore of generation 1 (it needs every rank's outcome): neither wrote its record
    assert sorted(victim) == [0, 2] and sorted(survivor) == [0, 2], (victim, survivor)
    assert len({victim[0]["pid"], killed["pid"], victim[2]["pid"]}) == 3, "every restart is a new process"
    assert survivor[2]["pid"] == survivor[0]["pid"] and survivor[2]["rejoined"] == 2, "the survivor was restarted"
    assert victim[2]["restart_count"] == 2 and victim[2]["restored"] == survivor[2]["restored"] == 6, victim[2]
    assert victim[2]["tier"].startswith("local ") and survivor[2]["tier"] == "memory", (victim[2], survivor[2])
    assert f"rank 1 (pid {victim[0]['pid']}) killed by signal SIGKILL in generation 0" in result.stderr
    assert f"rank 1 (pid {killed['pid']}) killed by signal SIGKILL in generation 1" in result.stderr
    assert "restarting it alone in generation 2" in result.stderr, result.stderr[-4000:]


def test_two_of_three_ranks_failing_at_once_are_restarted_alone_and_the_run_ends_bit_for_bit(
        tmp_path: Path, elastic_reference_three_ranks: list[bytes]) -> None:
    # ranks 0 (it decides the commits) and 2 die together once step 6 is committed; rank 1 survives in its
    # process. The supervisor may find both failures in one round (one new generation) or in two; either way
    # they are one failure of generation 0, not a crash loop
    result = launch_job(tmp_path, "--kill-rank", "2", "--also-kill-rank", "0", "--kill-step", "6", "--kill-phase",
                        "after-commit", world=3)
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out, 3) == elastic_reference_three_ranks, "the recovered run differs from the uninterrupted one"

    records = {rank: generations(out, rank) for rank in range(3)}
    newest = {rank: by_generation[max(by_generation)] for rank, by_generation in records.items()}
    assert {record["restored"] for record in newest.values()} == {6}, newest
    assert len({record["generation"] for record in newest.values()}) == 1, "the ranks finished in different generations"
    survivor = records[1]
    assert len(survivor) >= 2 and len({record["pid"] for record in survivor.values()}) == 1, "the survivor was restarted"
    assert newest[1]["restart_count"] == 0 and newest[1]["tier"] == "memory", newest[1]
    for victim in (0, 2):
        first = records[victim][0]
        assert newest[victim]["pid"] != first["pid"] and newest[victim]["restart_count"] == 1, (victim, newest[victim])
        assert newest[victim]["tier"].startswith("local "), (victim, newest[victim])
        # found in a later round, the second death still belongs to generation 0: one event, no back-off
        assert f"rank {victim} (pid {first['pid']}) killed by signal SIGKILL in generation 0" in result.stderr, \
            result.stderr[-4000:]
    assert result.stderr.count("restarting it alone in generation") == 2, result.stderr[-4000:]
    assert " in 1 s (restart" not in result.stderr, "two ranks dying together were taken for a crash loop"
