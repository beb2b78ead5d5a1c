"""A rank that dies after a save is agreed but before it commits the step in its own directory.

Real ``ckptd launch`` runs of the 2-rank gloo test job (:mod:`harness.elastic_training`): rank 1's
writer SIGKILLs its process once step S is agreed and committed in rank 0's directory, just before it
writes its own commit marker (``--kill-phase before-commit-marker``). Its files of step S are complete;
the replacement finishes the commit with the agreed manifest, and every rank restores step S (the survivor
from memory). Each run ends with the weights, optimizer state and sample ids of an uninterrupted run, byte
for byte. A directory that lost its files (in-process ranks, fast) still gets NoIntactCheckpointError.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.format.layout import MANIFEST_NAME, RANKS_HERE_NAME, step_dir
from harness.elastic_runs import WORLD, finals, generations, launch_job
from ckptd.testing.multirank import run_multirank
from ckptd.tiers.local import LocalTier

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def reference(elastic_reference: list[bytes]) -> list[bytes]:
    return elastic_reference


@pytest.mark.parametrize("step", [2, 6], ids=["first-save", "a-later-save"])
def test_a_commit_interrupted_by_a_rank_death_is_finished_and_restored_on_every_rank(
        tmp_path: Path, reference: list[bytes], step: int) -> None:
    result = launch_job(tmp_path, "--kill-rank", "1", "--kill-step", str(step), "--kill-phase",
                        "before-commit-marker", max_restarts=1)
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    assert finals(out) == reference, "the recovered run differs from the uninterrupted one"
    records = {rank: generations(out, rank) for rank in range(WORLD)}
    assert sorted(records[0]) == sorted(records[1]) == [0, 1], records
    assert records[0][1]["pid"] == records[0][0]["pid"], "the survivor was restarted"
    recovered = {rank: records[rank][1] for rank in range(WORLD)}
    assert {record["restored"] for record in recovered.values()} == {step}, recovered
    assert recovered[0]["tier"] == "memory", "the survivor restores the agreed step from its staged copy"
    assert recovered[1]["tier"].startswith("local "), recovered[1]
    assert f"rank 1: step {step} was agreed, but the rank that owned" in result.stderr
    assert "set-aside" not in result.stderr, "no committed step is set aside"


def _save(rank: int, world_size: int, roots: list[str]) -> None:
    manager = ckptd.CheckpointManager(roots[rank], capture_rng=False)
    manager.save(1, {"weights": torch.full((64,), float(rank))}, force=True)
    manager.close()


def _restore(rank: int, world_size: int, roots: list[str]) -> str:
    manager = ckptd.CheckpointManager(roots[rank], capture_rng=False)
    try:
        step = manager.restore({"weights": torch.zeros(64)})
    except ckptd.NoIntactCheckpointError as error:
        return f"NoIntactCheckpointError: {error}"
    finally:
        manager.close()
    return f"restored {step}"


def _restore_weights(rank: int, world_size: int, roots: list[str]) -> tuple[int | None, bytes]:
    manager = ckptd.CheckpointManager(roots[rank], capture_rng=False)
    state = {"weights": torch.zeros(64)}
    try:
        step = manager.restore(state)
    finally:
        manager.close()
    return step, state["weights"].numpy().tobytes()


def test_a_whole_job_restart_finishes_a_first_save_whose_commit_one_directory_lacks(tmp_path: Path) -> None:
    # the on-disk state a rank leaves when it dies between the agreement and its own commit marker: its files
    # complete, no manifest (nor the list of the ranks it holds) beside them; every rank restarts (torchrun)
    roots = [str(tmp_path / f"rank{rank}") for rank in range(WORLD)]
    run_multirank(_save, WORLD, roots, timeout_s=120)
    for name in (MANIFEST_NAME, RANKS_HERE_NAME):
        (Path(roots[1]) / step_dir(1) / name).unlink()
    assert LocalTier(Path(roots[1]), create=False).committed_steps() == []
    restored = run_multirank(_restore_weights, WORLD, roots, timeout_s=120)
    for rank, (step, weights) in enumerate(restored):
        assert step == 1 and weights == torch.full((64,), float(rank)).numpy().tobytes(), (rank, step)
    assert LocalTier(Path(roots[1]), create=False).committed_steps() == [1]
    manifests = [(Path(root) / step_dir(1) / MANIFEST_NAME).read_bytes() for root in roots]
    assert manifests[0] == manifests[1], "the directory is committed with the manifest every rank agreed on"


def test_a_directory_that_lost_its_files_of_the_step_is_not_taken_for_an_interrupted_commit(tmp_path: Path) -> None:
    roots = [str(tmp_path / f"rank{rank}") for rank in range(WORLD)]
    run_multirank(_save, WORLD, roots, timeout_s=120)
    shutil.rmtree(Path(roots[1]) / step_dir(1))  # rank 1's disk lost the step: nothing to finish there
    outcomes = run_multirank(_restore, WORLD, roots, timeout_s=120)
    assert all(outcome.startswith("NoIntactCheckpointError") for outcome in outcomes), outcomes
    assert LocalTier(Path(roots[0]), create=False).committed_steps() == [1], "the survivor's step is kept"
    assert LocalTier(Path(roots[1]), create=False).committed_steps() == []
