"""Node-local, node-shared and job-shared local directories on real gloo ranks.

Each rank's local root is its own (one NVMe per node), shared by the ranks of its "node", or shared by the
whole job. Several roots on one machine stand in for several nodes; one rank of the shared layouts reaches
its directory through a symbolic link, so only the directory's identity, not its path string, can tell
which ranks share it. After saves with ``keep_local=1`` every directory holds exactly the kept step; a
fresh job restores the saved bytes on every rank; with the object tier, ranks on nodes that lost their
disks restore from S3 and ``repopulate_local=True`` commits the step on every node; a rank killed during a
save leaves no directory listing the step it was saving.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptd
from ckptd.cli.main import cli
from ckptd.config import override
from ckptd.errors import WorkerError
from ckptd.format.layout import TEMP_MARKER, rank_index_name, step_dir
from ckptd.tiers.local import LocalTier
from ckptd.testing import run_multirank

pytestmark = pytest.mark.multirank

#: (layout, world size) -> each rank's "node" (ranks of one node share a directory in the shared layouts).
CASES = [("node-local", 2), ("node-local", 4), ("job-shared", 2), ("job-shared", 4), ("2-nodes-x-2-ranks", 4)]


def _roots(tmp_path: Path, layout: str, world_size: int) -> list[str]:
    if layout == "node-local":
        groups = list(range(world_size))
    elif layout == "job-shared":
        groups = [0] * world_size
    else:
        groups = [rank // 2 for rank in range(world_size)]
    roots = []
    for rank, group in enumerate(groups):
        real = tmp_path / f"node{group}"
        real.mkdir(exist_ok=True)
        if rank > 0 and groups[rank - 1] == group:  # a second path to the same directory
            alias = tmp_path / f"alias-rank{rank}"
            if not alias.exists():
                alias.symlink_to(real, target_is_directory=True)
            roots.append(str(alias))
        else:
            roots.append(str(real))
    return roots


def _directories(roots: list[str]) -> list[Path]:
    return sorted({Path(root).resolve() for root in roots})


def _state(rank: int, step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return {"weights": torch.randn(257, 31, generator=generator),
            "moments": torch.randn(4096, generator=generator).to(torch.bfloat16),
            "info": {"rank": rank, "step": step}}


def _save_steps(rank: int, world_size: int, roots: list[str], steps: list[int], remote: str | None,
                options: dict[str, Any] | None) -> dict[str, bytes]:
    manager = ckptd.CheckpointManager(roots[rank], policy=ckptd.Policy(keep_local=1, keep_remote=None),
                                      remote=remote, storage_options=options, capture_rng=False)
    for step in steps:
        state = _state(rank, step)
        assert manager.save(step, state)
    manager.wait_uploads() if remote else manager.wait()
    layout = manager.sharing.layout
    manager.close()
    last = _state(rank, steps[-1])
    return {"weights": last["weights"].numpy().tobytes(),
            "moments": last["moments"].view(torch.int16).numpy().tobytes(), "layout": layout.encode()}


def _restore(rank: int, world_size: int, roots: list[str], remote: str | None, options: dict[str, Any] | None,
             repopulate: bool) -> dict[str, Any]:
    manager = ckptd.CheckpointManager(roots[rank], remote=remote, storage_options=options,
                                      repopulate_local=repopulate, capture_rng=False)
    state = {"weights": torch.zeros(257, 31), "moments": torch.zeros(4096, dtype=torch.bfloat16), "info": {}}
    step = manager.restore(state)
    tier = manager.last_restore.tier if manager.last_restore else None
    manager.close()
    return {"step": step, "tier": tier, "info": state["info"], "weights": state["weights"].numpy().tobytes(),
            "moments": state["moments"].view(torch.int16).numpy().tobytes()}


def _assert_only_step(directory: Path, step: int) -> None:
    tier = LocalTier(directory, create=False)
    assert tier.committed_steps() == [step], (directory, tier.committed_steps())
    assert tier.list_step_numbers() == [step], (directory, tier.list_step_numbers())
    leftovers = [p for p in directory.rglob("*") if TEMP_MARKER in p.name]
    assert not leftovers, leftovers


@pytest.mark.parametrize(("layout", "world_size"), CASES)
def test_keep_local_bounds_every_directory_and_restore_is_exact(tmp_path: Path, layout: str,
                                                                world_size: int) -> None:
    roots = _roots(tmp_path, layout, world_size)
    saved = run_multirank(_save_steps, world_size, roots, [1, 2, 3, 4], None, None, timeout_s=120)
    expected_layout = {"node-local": "node-local", "job-shared": "job-shared",
                       "2-nodes-x-2-ranks": "mixed"}[layout]
    assert {s["layout"].decode() for s in saved} == {expected_layout}
    directories = _directories(roots)
    assert len(directories) == {"node-local": world_size, "job-shared": 1, "2-nodes-x-2-ranks": 2}[layout]
    for directory in directories:
        _assert_only_step(directory, 4)

    restored = run_multirank(_restore, world_size, roots, None, None, False, timeout_s=120)
    for rank, (got, want) in enumerate(zip(restored, saved)):
        assert got["step"] == 4
        assert got["info"] == {"rank": rank, "step": 4}
        assert got["weights"] == want["weights"] and got["moments"] == want["moments"]
    _assert_cli_sees_each_directory(roots, world_size, step=4)


def _assert_cli_sees_each_directory(roots: list[str], world_size: int, *, step: int) -> None:
    """``ckptd ls`` and ``ckptd verify`` on each node's directory: the ranks it holds, intact; a missing
    index of a rank it holds is found."""
    runner = CliRunner()
    for directory in _directories(roots):
        here = sorted(rank for rank, root in enumerate(roots) if Path(root).resolve() == directory)
        listed = runner.invoke(cli, ["ls", str(directory), "--json"])
        assert listed.exit_code == 0, listed.output
        (copy,) = json.loads(listed.output)
        assert copy["state"] == "committed" and copy["ranks"] == world_size
        assert copy["ranks_here"] == (None if len(here) == world_size else here)
        verified = runner.invoke(cli, ["verify", str(directory)])
        assert verified.exit_code == 0, verified.output
    damaged = _directories(roots)[-1]
    victim = max(rank for rank, root in enumerate(roots) if Path(root).resolve() == damaged)
    (damaged / step_dir(step) / rank_index_name(victim)).unlink()
    verified = runner.invoke(cli, ["verify", str(damaged)])
    assert verified.exit_code == 4 and rank_index_name(victim) in verified.output, verified.output


@pytest.mark.s3
@pytest.mark.parametrize(("layout", "world_size"), [("node-local", 2), ("2-nodes-x-2-ranks", 4)])
def test_nodes_that_lost_their_disks_restore_from_s3_and_repopulate_every_node(
        tmp_path: Path, s3_bucket: str, s3_options: dict[str, Any], layout: str, world_size: int) -> None:
    roots = _roots(tmp_path, layout, world_size)
    remote = f"s3://{s3_bucket}/run"
    saved = run_multirank(_save_steps, world_size, roots, [1, 2], remote, s3_options, timeout_s=180)
    for directory in _directories(roots):  # every node loses its disk
        shutil.rmtree(directory)
        directory.mkdir()

    restored = run_multirank(_restore, world_size, roots, remote, s3_options, True, timeout_s=180)
    for got, want in zip(restored, saved):
        assert got["step"] == 2 and got["tier"].startswith("object")
        assert got["weights"] == want["weights"] and got["moments"] == want["moments"]
    for directory in _directories(roots):
        assert LocalTier(directory, create=False).committed_steps() == [2], directory

    local_only = run_multirank(_restore, world_size, roots, None, None, False, timeout_s=120)
    for got, want in zip(local_only, saved):
        assert got["step"] == 2 and got["tier"].startswith("local")
        assert got["weights"] == want["weights"] and got["moments"] == want["moments"]


def _die_while_saving(rank: int, world_size: int, roots: list[str], victim: int) -> None:
    from ckptd.stepio import rank_writer

    with override(commit_timeout_s=8.0):
        manager = ckptd.CheckpointManager(roots[rank], policy=ckptd.Policy(keep_local=1), capture_rng=False)
        assert manager.save(1, _state(rank, 1))
        manager.wait()
        if rank == victim:
            real_add = rank_writer.RankWriter.add

            def add_then_die(self: Any, name: str, tensor: torch.Tensor) -> None:
                real_add(self, name, tensor)
                os.kill(os.getpid(), signal.SIGKILL)  # a real crash in the middle of writing step 2

            rank_writer.RankWriter.add = add_then_die  # type: ignore[method-assign]
        manager.save(2, _state(rank, 2))
        manager.wait()  # the survivors' step 2 fails: the victim never reports


@pytest.mark.parametrize(("layout", "world_size"), [("node-local", 2), ("2-nodes-x-2-ranks", 4)])
def test_a_rank_killed_during_a_save_leaves_no_directory_listing_that_step(tmp_path: Path, layout: str,
                                                                           world_size: int) -> None:
    roots = _roots(tmp_path, layout, world_size)
    with pytest.raises(WorkerError) as failure:
        run_multirank(_die_while_saving, world_size, roots, world_size - 1, timeout_s=90)
    assert world_size - 1 in failure.value.failures
    for directory in _directories(roots):
        assert LocalTier(directory, create=False).committed_steps() == [1], directory

    restored = run_multirank(_restore, world_size, roots, None, None, False, timeout_s=120)
    for rank, got in enumerate(restored):
        expected = _state(rank, 1)
        assert got["step"] == 1
        assert got["weights"] == expected["weights"].numpy().tobytes()


def _one_commit_fails_then_train_on(rank: int, world_size: int, roots: list[str]) -> list[str]:
    from ckptd.tiers import atomicity

    manager = ckptd.CheckpointManager(roots[rank], policy=ckptd.Policy(keep_local=None), capture_rng=False)
    if rank == 1:
        real_commit = atomicity.DirectoryCommit.commit
        failed: list[int] = []

        def commit_fails_once(self: Any, step: int, *args: Any, **kwargs: Any) -> None:
            if step == 2 and not failed:
                failed.append(step)
                raise ckptd.StorageError("injected: the manifest could not be written", step=step)
            real_commit(self, step, *args, **kwargs)

        atomicity.DirectoryCommit.commit = commit_fails_once  # type: ignore[method-assign]
    errors = []
    for step in (1, 2, 3, 4):
        try:  # the loop goes on after a failed save, as the Saver's docstring allows
            manager.save(step, _state(rank, step))
        except ckptd.CkptdError as error:
            errors.append(f"step {step}: {error}")
    try:
        manager.wait()
    except ckptd.CkptdError as error:
        errors.append(f"wait: {error}")
    manager.close()
    return errors


def test_a_commit_that_fails_on_one_node_does_not_shift_the_ranks_commit_rounds(tmp_path: Path) -> None:
    roots = _roots(tmp_path, "node-local", 2)
    errors = run_multirank(_one_commit_fails_then_train_on, 2, roots, timeout_s=120)
    assert any("injected" in error for error in errors[1]), errors
    # step 2 is committed where its owner wrote the manifest (node 0), not on node 1; 3 and 4 everywhere
    assert LocalTier(Path(roots[0]), create=False).committed_steps() == [1, 2, 3, 4]
    assert LocalTier(Path(roots[1]), create=False).committed_steps() == [1, 3, 4]
    restored = run_multirank(_restore, 2, roots, None, None, False, timeout_s=120)
    for rank, got in enumerate(restored):
        expected = _state(rank, 4)
        assert got["step"] == 4 and got["info"] == {"rank": rank, "step": 4}
        assert got["weights"] == expected["weights"].numpy().tobytes()
    runner = CliRunner()
    for directory in _directories(roots):
        verified = runner.invoke(cli, ["verify", str(directory)])
        assert verified.exit_code == 0, verified.output


def _restore_step(rank: int, world_size: int, roots: list[str], step: int) -> str:
    manager = ckptd.CheckpointManager(roots[rank], capture_rng=False)
    state = {"weights": torch.zeros(257, 31), "moments": torch.zeros(4096, dtype=torch.bfloat16), "info": {}}
    try:
        manager.restore(state, step=step)
    except ckptd.NotFoundError as error:
        outcome = f"NotFoundError: {error}"
    else:
        outcome = "restored"
    with pytest.raises(ckptd.NoIntactCheckpointError):  # the ranks' store rounds are still in step
        manager.restore(state)
    manager.close()
    return outcome


def test_restore_of_a_step_one_node_lacks_fails_on_every_rank_at_once(tmp_path: Path) -> None:
    roots = _roots(tmp_path, "node-local", 2)
    run_multirank(_save_steps, 2, roots, [1, 2], None, None, timeout_s=120)
    shutil.rmtree(Path(roots[1]) / step_dir(2))  # node 1 lost step 2
    outcomes = run_multirank(_restore_step, 2, roots, 2, timeout_s=60)
    for outcome in outcomes:
        assert outcome.startswith("NotFoundError") and "rank 1" in outcome, outcomes
