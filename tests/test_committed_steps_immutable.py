"""A committed step is immutable: a later save into it (CheckpointManager or DCP), a failed save, or a DCP
commit that lacks some rank's entry never changes or deletes its files, and the step restores its bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptd
from ckptd.dcp import CkptdStorageReader, CkptdStorageWriter
from ckptd.errors import AlreadyCommittedError, PickleRefusedError, WorkerError
from ckptd.format.layout import step_dir
from ckptd.testing import run_multirank


def _digests(root: Path, step: int) -> dict[str, str]:
    directory = root / step_dir(step)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 70, generator=generator), "b": torch.randn(70, generator=generator)}


def _restored(root: Path, step: int) -> dict[str, torch.Tensor]:
    state = {"w": torch.zeros(300, 70), "b": torch.zeros(70)}
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.restore(state, step=step) == step
    return state


def _commit_step_5(manager: ckptd.CheckpointManager, root: Path, state: dict[str, Any]) -> dict[str, str]:
    """Save and commit ``state`` as step 5; returns the digests of its files."""
    manager.save(5, state)
    manager.wait()
    return _digests(root, 5)


def test_a_resave_of_a_committed_step_is_refused_and_the_step_keeps_its_bytes(tmp_path: Path) -> None:
    original = _state(1)
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        before = _commit_step_5(manager, tmp_path, original)
        manager.save(5, _state(2), force=True)
        with pytest.raises(AlreadyCommittedError, match="already committed") as refused:
            manager.wait()
        assert refused.value.step == 5
        manager.save(6, _state(3))  # the manager goes on working
    assert _digests(tmp_path, 5) == before
    restored = _restored(tmp_path, 5)
    assert torch.equal(restored["w"], original["w"]) and torch.equal(restored["b"], original["b"])


def test_a_failed_save_of_an_unsupported_value_leaves_the_committed_step(tmp_path: Path) -> None:
    original = _state(1)
    with ckptd.CheckpointManager(tmp_path, capture_rng=False) as manager:
        before = _commit_step_5(manager, tmp_path, original)
        with pytest.raises(PickleRefusedError):
            manager.save(5, {**_state(2), "opaque": object()}, force=True)
    assert _digests(tmp_path, 5) == before
    assert torch.equal(_restored(tmp_path, 5)["w"], original["w"])


def _fail_then_resave(rank: int, world_size: int, root: str) -> tuple[dict[str, str], list[str]]:
    from ckptd.stepio import rank_writer

    manager = ckptd.CheckpointManager(root, capture_rng=False, policy=ckptd.Policy(keep_local=None))
    manager.save(3, _state(10 + rank))
    manager.wait()
    committed = _digests(Path(root), 3)
    outcomes = []
    real_add = rank_writer.RankWriter.add
    if rank == 1:  # an injected write error on one rank, in the directory that holds committed step 3
        def fail(self: Any, name: str, tensor: torch.Tensor) -> None:
            raise OSError(28, "No space left on device")

        rank_writer.RankWriter.add = fail  # type: ignore[method-assign]
    for step in (4, 3):  # a new step that fails on rank 1, then a re-save of the committed step
        manager.save(step, _state(20 + rank), force=True)
        try:
            manager.wait()
        except WorkerError as error:
            outcomes.append(str(error))
        else:
            outcomes.append("no error")
        rank_writer.RankWriter.add = real_add  # type: ignore[method-assign]
    manager.close()
    return committed, outcomes


@pytest.mark.multirank
def test_failed_saves_on_two_ranks_leave_the_committed_step_restorable(tmp_path: Path) -> None:
    results = run_multirank(_fail_then_resave, 2, str(tmp_path), timeout_s=120)
    committed = results[0][0]
    for _, (failed_new, refused) in results:
        assert "rank 1" in failed_new and "No space left" in failed_new, failed_new
        assert "already committed" in refused, refused
    assert _digests(tmp_path, 3) == committed
    assert not (tmp_path / step_dir(4)).exists() or "manifest.json" not in _digests(tmp_path, 4)
    for rank in range(2):
        expected = _state(10 + rank)
        got = run_multirank(_restore_rank, 2, str(tmp_path), timeout_s=120)[rank]
        assert got == (expected["w"].numpy().tobytes(), expected["b"].numpy().tobytes())


def _restore_rank(rank: int, world_size: int, root: str) -> tuple[bytes, bytes]:
    state = {"w": torch.zeros(300, 70), "b": torch.zeros(70)}
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        assert manager.restore(state) == 3
    return state["w"].numpy().tobytes(), state["b"].numpy().tobytes()


def test_a_second_dcp_save_into_a_committed_step_fails_and_deletes_nothing(tmp_path: Path) -> None:
    original = _state(1)
    dcp.save(dict(original), storage_writer=CkptdStorageWriter(tmp_path, step=4))
    before = _digests(tmp_path, 4)
    with pytest.raises(CheckpointException) as refused:
        dcp.save(_state(2), storage_writer=CkptdStorageWriter(tmp_path, step=4))
    assert isinstance(refused.value.failures[0][0], AlreadyCommittedError), refused.value.failures
    assert _digests(tmp_path, 4) == before
    loaded = {"w": torch.zeros(300, 70), "b": torch.zeros(70)}
    dcp.load(loaded, storage_reader=CkptdStorageReader(tmp_path, step=4))
    assert torch.equal(loaded["w"], original["w"]) and torch.equal(loaded["b"], original["b"])


def _dcp_without_collectives(rank: int, world_size: int, root: str) -> str:
    state = {f"rank{rank}": torch.full((64,), float(rank + 1))}
    try:
        dcp.save(state, storage_writer=CkptdStorageWriter(root, step=9), use_collectives=False)
    except Exception as error:  # noqa: BLE001 - DCP may wrap the writer's CommitError
        return f"{type(error).__name__}: {error}"
    return "committed"


@pytest.mark.multirank
def test_a_dcp_save_without_collectives_commits_once_and_a_second_one_changes_nothing(tmp_path: Path) -> None:
    outcomes = run_multirank(_dcp_without_collectives, 2, str(tmp_path), timeout_s=120)
    assert outcomes == ["committed", "committed"], outcomes
    assert (tmp_path / step_dir(9) / "manifest.json").exists()
    before = _digests(tmp_path, 9)
    again = run_multirank(_dcp_without_collectives, 2, str(tmp_path), timeout_s=120)
    assert all(outcome != "committed" for outcome in again), again
    assert _digests(tmp_path, 9) == before


def test_steps_newer_than_the_restored_one_are_set_aside_whole_and_can_be_saved_again(tmp_path: Path) -> None:
    from ckptd.manager.directories import SET_ASIDE_DIRECTORY
    from ckptd.testing.tamper import chunk_location, flip_bit

    with ckptd.CheckpointManager(tmp_path, policy=ckptd.Policy(keep_local=None), capture_rng=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    before = _digests(tmp_path, 3)
    path, offset, _ = chunk_location(tmp_path, 3, "w")
    flip_bit(path, offset + 17)  # step 3 is committed but not intact
    damaged = _digests(tmp_path, 3)

    state = {"w": torch.zeros(300, 70), "b": torch.zeros(70)}
    with ckptd.CheckpointManager(tmp_path, policy=ckptd.Policy(keep_local=None), capture_rng=False) as manager:
        assert manager.restore(state) == 2
        assert manager.committed_steps() == [1, 2]
        (kept,) = [path for path in (tmp_path / SET_ASIDE_DIRECTORY).iterdir() if path.is_dir()]  # and its record
        assert kept.name.startswith(step_dir(3))
        assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(kept.iterdir())} == damaged
        assert damaged != before
        manager.save(3, _state(33))  # training goes on from step 2 and saves step 3 again
    assert torch.equal(_restored(tmp_path, 3)["w"], _state(33)["w"])
