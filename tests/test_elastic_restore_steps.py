"""Which step a recovery restores, and from where: two saves in memory, and the restore check's rollback.

Real ``ckptd launch`` runs of the 2-rank gloo test job (:mod:`harness.elastic_training`), a real
SIGKILL of rank 1; every run ends with the weights, optimizer state and sample ids of an uninterrupted run,
byte for byte.

The poisoned step is saved through the manager with NaN weights (correct hashes, committed on every tier
of rank 0) while the live model keeps training on its own weights: the honest reference for a run that
rolls back from it is the uninterrupted run, since replaying the steps after the older step from its
restored state (weights, optimizer, data position, RNG) must give the same bytes as having trained them
once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.elastic_runs import WORLD, finals, generations, launch_job, staged

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def reference(elastic_reference: list[bytes]) -> list[bytes]:
    return elastic_reference


def _recovered(out: Path) -> dict[int, dict]:
    """Generation 1's record of each rank, after checking that only rank 1 was restarted."""
    records = {rank: generations(out, rank) for rank in range(WORLD)}
    assert sorted(records[0]) == sorted(records[1]) == [0, 1], records
    assert records[0][1]["pid"] == records[0][0]["pid"], "the survivor was restarted"
    assert records[1][1]["pid"] != records[1][0]["pid"] and records[1][1]["restart_count"] == 1
    return {rank: records[rank][1] for rank in range(WORLD)}


def test_a_rank_dead_before_its_newest_save_commits_survivors_restore_the_older_save_from_memory(
        tmp_path: Path, reference: list[bytes]) -> None:
    # rank 1 dies at step 6 before saving it: the survivor has staged step 6 (its newest save), which can
    # never commit; every rank agrees on step 4, which the survivor still holds in memory
    result = launch_job(tmp_path, "--kill-rank", "1", "--kill-step", "6", "--kill-phase",
                        "before-save-committed")
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == reference
    assert staged(out, 0)[0][-1] == 6, f"the survivor's newest save is step 6: {staged(out, 0)}"
    recovered = _recovered(out)
    assert {record["restored"] for record in recovered.values()} == {4}, recovered
    assert recovered[0]["tier"] == "memory", "the survivor must read the save before its newest from memory"
    assert recovered[1]["tier"].startswith("local "), recovered[1]


def test_a_poisoned_step_rolls_back_to_an_older_step_and_ends_bit_for_bit(tmp_path: Path,
                                                                            reference: list[bytes]) -> None:
    # rank 0's step 6 holds NaN weights in memory and on disk; rank 1 dies once step 6 is committed
    result = launch_job(tmp_path, "--poison-rank", "0", "--poison-step", "6", "--poison-how", "saved",
                        "--kill-rank", "1", "--kill-step", "6", "--kill-phase", "after-commit")
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == reference, "the rolled-back run differs from the uninterrupted one"
    recovered = _recovered(out)
    assert {record["restored"] for record in recovered.values()} == {4}, recovered
    assert recovered[0]["tier"] == "memory", "the survivor rolls back to the older save it holds in memory"
    log = result.stderr
    # memory first, then the disk behind it (whose copy loads, hashes verified, with the NaN values), then step 4;
    # rank 1, whose own copy was fine, rolls back with it
    for rank in range(WORLD):
        assert (f"rank {rank}: restore check: step 6 is poisoned in memory on rank(s) [0] (rank 0 (read from "
                "memory): tensor 'model/0.weight' has 512 non-finite value(s) of 512") in log, log[-4000:]
        assert f"rank {rank}: restore check: step 6 is poisoned (rank 0 (read from local " in log
        assert f"rank {rank}: restore check: step 6 is poisoned" in log and "rolling back to step 4" in log
    assert log.count("step 6 is newer than the restored step 4: kept as .set-aside/") == WORLD, \
        "the poisoned step is set aside on every rank, so that training saves step 6 again"


def test_a_copy_poisoned_in_memory_is_read_again_from_disk(tmp_path: Path, reference: list[bytes]) -> None:
    # rank 0's staged copy of committed step 6 is damaged in RAM; its disk copy is good
    result = launch_job(tmp_path, "--poison-rank", "0", "--poison-step", "6", "--poison-how", "memory",
                        "--kill-rank", "1", "--kill-step", "6", "--kill-phase", "after-commit")
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == reference
    recovered = _recovered(out)
    assert {record["restored"] for record in recovered.values()} == {6}, recovered
    assert recovered[0]["tier"].startswith("local "), "the survivor reads step 6 again from its disk"
    assert "rank 0: restore check: step 6 is poisoned in memory on rank(s) [0]" in result.stderr
    assert "rolling back" not in result.stderr and "set-aside" not in result.stderr


def test_the_default_restore_check_names_the_non_finite_tensors_and_passes_finite_ones() -> None:
    import torch

    from ckptd.elastic import finite_tensors

    model = torch.nn.Linear(3, 2)
    state = {"model": model, "ids": torch.tensor([1, 2]), "empty": torch.empty(0), "lr": 0.1}
    assert finite_tensors(state) is None
    with torch.no_grad():
        model.weight[0, 1] = float("nan")
        model.bias[1] = float("-inf")
    found = finite_tensors(state)
    assert found == ("tensor 'model/weight' has 1 non-finite value(s) of 6; "
                     "tensor 'model/bias' has 1 non-finite value(s) of 2"), found
