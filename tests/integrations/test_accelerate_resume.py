"""A script in the shape of accelerate's checkpointing example, with its defaults (``DataLoader(shuffle=True,
num_workers=2)`` and nothing else), saving through CkptdAccelerate: SIGKILL in the middle of an epoch, resume in
a new process with ``hooks.restore()`` and a plain ``for batch in train_dataloader`` loop, compared with an
uninterrupted run without ckptd bit for bit: the hash and sample ids of every batch, the final weights, the
optimizer's and the scheduler's states. One process, two processes (gloo on CPU, as ``accelerate launch
--cpu --num_processes 2`` runs them), and accelerate's ``use_stateful_dataloader``. The runs are
:mod:`accelerate_run` (one interpreter per rank).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from accelerate_run import batches, final, run

pytestmark = pytest.mark.integrations

SAVE_EVERY = 4


def _reference(directory: Path, world_size: int, **config: Any) -> None:
    done = run(directory, world_size=world_size, save_every=SAVE_EVERY, **config)
    assert [process.returncode for process in done] == [0] * world_size, done[0].stderr[-3000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("reference-1")
    _reference(directory, 1)
    return directory


def _assert_equal_states(reference: dict[str, Any], resumed: dict[str, Any], rank: int) -> None:
    import torch

    weights, expected = resumed["model"], reference["model"]
    different = [name for name in expected if not torch.equal(weights[name], expected[name])]
    assert weights.keys() == expected.keys() and not different, f"rank {rank}: weights differ: {different}"
    ours, theirs = resumed["optimizer"], reference["optimizer"]
    assert ours["param_groups"] == theirs["param_groups"], f"rank {rank}: optimizer hyperparameters differ"
    assert ours["state"].keys() == theirs["state"].keys()
    for index, values in theirs["state"].items():
        for key, value in values.items():
            mine = ours["state"][index][key]
            assert torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value, \
                f"rank {rank}: optimizer state {index}/{key} differs"
    assert resumed["scheduler"] == reference["scheduler"], f"rank {rank}: scheduler state differs"


def _kill_and_resume(reference: Path, run_dir: Path, *, world_size: int, kill_at: int, restored: int,
                     steps_per_epoch: int, **config: Any) -> None:
    local = str(run_dir / "ckpt")
    killed = run(run_dir, world_size=world_size, save_every=SAVE_EVERY, local=local, kill_at=kill_at, **config)
    assert [process.returncode for process in killed] == [-signal.SIGKILL] * world_size, \
        [process.stderr[-2000:] for process in killed]
    assert (kill_at - 1) % steps_per_epoch, "the kill is in the middle of an epoch"
    for step in range(SAVE_EVERY, kill_at, SAVE_EVERY):  # save_state left the step marker and nothing else
        files = list((run_dir / "out" / f"step_{step}").iterdir())
        assert [path.name for path in files] == ["ckptd-step.json"] and files[0].stat().st_size < 64, files
    resumed = run(run_dir, world_size=world_size, save_every=SAVE_EVERY, local=local, resume=True, **config)
    assert [process.returncode for process in resumed] == [0] * world_size, resumed[0].stderr[-3000:]
    for rank in range(world_size):
        expected = batches(reference, 0, rank)
        assert len(expected) == 3 * steps_per_epoch
        assert batches(run_dir, 0, rank) == expected[:kill_at - 1], f"rank {rank}: the killed run trained otherwise"
        after = batches(run_dir, 1, rank)
        assert after and after[0]["step"] == restored + 1, f"rank {rank}: resumed from {after[:1]}"
        assert after == expected[restored:], f"rank {rank}: the batches after the restore differ"
        state = final(run_dir, 1, rank)
        assert state["resumed_from"] == restored
        _assert_equal_states(final(reference, 0, rank), state, rank)


@pytest.mark.parametrize(("kill_at", "restored", "options"), [
    (15, 12, {}),  # saved 2 batches into epoch 1
    (23, 20, {}),  # saved with the last batch of epoch 1: the next epoch draws its own order
    (15, 12, {"stateful": True}),  # use_stateful_dataloader: torchdata's loader skips itself, ckptd gives the order
    (15, 12, {"persistent_workers": True}),  # epoch 1 ran on epoch 0's workers, the resumed one on new ones
], ids=["mid-epoch", "end-of-epoch", "stateful-dataloader", "persistent-workers"])
def test_one_process_killed_mid_epoch_resumes_bit_for_bit(one_process: Path, tmp_path: Path, kill_at: int,
                                                          restored: int, options: dict[str, bool]) -> None:
    """10 batches an epoch, a save every 4 steps, killed in the middle of epoch 1 or 2. The uninterrupted run
    is the one without ckptd and with the plain loader (a stateful loader draws the same order; persistent
    workers draw no new seed after epoch 0, so their order differs from then on: they get their own)."""
    reference = one_process
    if options.get("persistent_workers"):
        reference = tmp_path / "reference"
        _reference(reference, 1, **options)
    _kill_and_resume(reference, tmp_path / "run", world_size=1, kill_at=kill_at, restored=restored,
                     steps_per_epoch=10, **options)


def test_two_processes_killed_mid_epoch_resume_bit_for_bit(tmp_path_factory: pytest.TempPathFactory,
                                                           tmp_path: Path) -> None:
    """2 gloo ranks, 5 batches an epoch each; saved at step 8 (3 batches into epoch 1), killed at step 12."""
    reference = tmp_path_factory.mktemp("reference-2")
    _reference(reference, 2)
    _kill_and_resume(reference, tmp_path, world_size=2, kill_at=12, restored=8, steps_per_epoch=5)
