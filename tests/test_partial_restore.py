"""Partial restore (``restore(state, keys=[...])``) and the errors for a state that does not fit a step.

A partial restore reads no tensor it was not asked for: proven by damaging every chunk of the step on
disk, so that reading any of them would fail its digest check, and by counting the chunks each tier
supplied (``last_restore.chunks_by_tier``). Real files, a real manager, no mocks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.testing import run_multirank
from ckptd.testing.tamper import chunk_records, flip_bit, index_path, read_json, step_path

WIDTH = 8


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(WIDTH, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, WIDTH)).sum().backward()
    optim.step()  # the optimizer now holds momentum tensors too
    return model, optim


def _save(root: Path, steps: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Saves ``steps`` of a small run (config, step counter, model, optimizer); returns each step's weights."""
    model, optim = _model(0)
    state: dict[str, Any] = {"config": {"width": WIDTH, "name": "tiny"}, "step": 0, "model": model, "optim": optim}
    saved = {}
    with ckptd.CheckpointManager(root, codec="raw") as manager:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            state["step"] = step
            manager.save(step, state, force=True)
            saved[step] = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        manager.wait()
    return saved


def _damage_every_chunk(root: Path, step: int) -> int:
    """Flips one bit in every stored chunk of ``step`` (rank 0); returns how many chunks there are."""
    files = read_json(index_path(root, step))["data_files"]
    records = chunk_records(root, step)
    for _, (offset, *_, part) in records:
        flip_bit(step_path(root, step) / files[part][0], offset)
    return len(records)


def test_partial_restore_reads_the_values_and_no_tensor(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ckpt"
    saved = _save(root, [1, 2])
    assert _damage_every_chunk(root, 2) >= 4  # reading any tensor of step 2 now fails its digest check
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    with ckptd.CheckpointManager(root) as manager:
        state: dict[str, Any] = {}
        assert manager.restore(state, keys=["config", "step"]) == 2
        assert state == {"config": {"width": WIDTH, "name": "tiny"}, "step": 2}
        report = manager.last_restore
        assert report.keys == ("config", "step")
        assert report.chunks_by_tier == {} and report.tiers == [] and report.events == []
        assert torch.equal(torch.get_rng_state(), rng_before), "a partial restore leaves the RNG states alone"

        # the config decides the model; the full restore then finds step 2's tensors bad and says so
        model, optim = _model(7)
        assert model.in_features == state["config"]["width"]
        state.update(model=model, optim=optim)
        with caplog.at_level(logging.WARNING, logger="ckptd"):
            assert manager.restore(state) == 1
    assert state["step"] == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[1][name])
    warned = [r.getMessage() for r in caplog.records if "'config', 'step'" in r.getMessage()]
    assert warned and "from step 2" in warned[0] and "from step 1" in warned[0], [r.getMessage() for r in caplog.records]


def test_partial_restore_of_one_object_reads_only_its_chunks(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved = _save(root, [1])
    model_chunks = sum(1 for name, _ in chunk_records(root, 1) if name.startswith("model/"))
    all_chunks = len(chunk_records(root, 1))
    assert 0 < model_chunks < all_chunks
    model, optim = _model(5)
    optim_before = {k: v.clone() for k, v in optim.state_dict()["state"][0].items()}
    with ckptd.CheckpointManager(root) as manager:
        state: dict[str, Any] = {"model": model, "optim": optim}
        assert manager.restore(state, keys=["model"]) == 1
        assert manager.last_restore.chunks_by_tier == {manager.local.label: model_chunks}
        assert manager.last_restore.tiers == [manager.local.label]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[1][name])
    assert set(state) == {"model", "optim"}
    for name, tensor in optim.state_dict()["state"][0].items():
        assert torch.equal(tensor, optim_before[name]), "the optimizer was not asked for and is unchanged"


def _committed_bytes(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("step-*/*"))}


def test_a_key_the_checkpoint_lacks_is_named(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, [1])
    before = _committed_bytes(root)
    with ckptd.CheckpointManager(root) as manager:
        state: dict[str, Any] = {"config": None}
        with pytest.raises(ckptd.ResumeMismatchError) as caught:
            manager.restore(state, keys=["config", "learning_rate"])
        text = str(caught.value)
        assert "'learning_rate'" in text and "not in the checkpoint" in text, text
        assert "step 1" in text and "tier local" in text and "'config', 'step', 'model', 'optim'" in text, text
        assert caught.value.exit_code == 9
        assert state == {"config": None}, "nothing is loaded from a step that does not fit"

        model, optim = _model(3)
        scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1)
        live = {"config": {}, "step": 0, "model": model, "optim": optim, "scheduler": scheduler}
        with pytest.raises(ckptd.ResumeMismatchError) as caught:
            manager.restore(live)
        text = str(caught.value)
        assert "live state has key(s) 'scheduler'" in text and "step 1" in text, text
        assert "keys=[" in text, "the message says how to load the saved keys alone"
        assert manager.committed_steps() == [1]
    assert _committed_bytes(root) == before, "a failed restore changes no committed step"


def test_one_key_given_as_a_string_is_that_key(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, [1])
    with ckptd.CheckpointManager(root) as manager:
        state: dict[str, Any] = {}
        assert manager.restore(state, keys="config") == 1
        assert state == {"config": {"width": WIDTH, "name": "tiny"}}
        assert manager.last_restore.keys == ("config",)


def test_an_object_the_live_state_lacks_is_named_not_nonetype(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save(root, [1])
    with ckptd.CheckpointManager(root) as manager:
        state: dict[str, Any] = {"config": {}, "step": 0}
        with pytest.raises(ckptd.ResumeMismatchError) as caught:
            manager.restore(state)
        text = str(caught.value)
        assert "'model', 'optim'" in text and "live state has no value there" in text, text
        assert "NoneType" not in text and "step 1" in text, text
        assert state == {"config": {}, "step": 0}
        with pytest.raises(ckptd.ResumeMismatchError) as caught:  # a partial restore of an object needs it too
            manager.restore(state, keys=["model"])
        assert "'model'" in str(caught.value) and "'optim'" not in str(caught.value)


def test_plain_values_are_snapshots_taken_at_save_time(tmp_path: Path) -> None:
    config = {"lr": 0.1, "schedule": [1, 2]}
    state: dict[str, Any] = {"config": config, "step": 1}
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        manager.save(1, state, force=True)
        config["lr"] = 0.5  # changed right after save() returned, before the write finished
        config["schedule"].append(3)
        state["step"] = 2
        manager.wait()
    with ckptd.CheckpointManager(tmp_path / "ckpt", capture_rng=False) as manager:
        restored: dict[str, Any] = {}
        assert manager.restore(restored, keys=["config", "step"]) == 1
    assert restored == {"config": {"lr": 0.1, "schedule": [1, 2]}, "step": 1}


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Each rank saves its own config and model, restores its config alone, then rank 1 alone lacks the
    model in a full restore: every rank must raise, naming the rank and the key."""
    policy = ckptd.Policy(keep_local=None)
    model, optim = _model(rank)
    with ckptd.CheckpointManager(root, policy=policy, capture_rng=False) as manager:
        manager.save(1, {"config": {"rank": rank}, "model": model, "optim": optim}, force=True)
        manager.wait()
    with ckptd.CheckpointManager(root, policy=policy, capture_rng=False) as manager:
        partial: dict[str, Any] = {}
        step = manager.restore(partial, keys=["config"])
        read = dict(manager.last_restore.chunks_by_tier)
        live: dict[str, Any] = {"config": {}, "optim": optim}
        if rank == 0:
            live["model"] = model
        try:
            manager.restore(live)
            error = ""
        except ckptd.ResumeMismatchError as caught:
            error = str(caught)
    return {"step": step, "config": partial, "read": read, "error": error}


@pytest.mark.multirank
def test_partial_restore_and_a_mismatch_on_one_rank_on_two_gloo_ranks(tmp_path: Path) -> None:
    results = run_multirank(_two_ranks, 2, str(tmp_path / "ckpt"), timeout_s=120)
    for rank, result in enumerate(results):
        assert result["step"] == 1 and result["config"] == {"config": {"rank": rank}}
        assert result["read"] == {}, "the config needs no tensor"
        assert "rank 1: " in result["error"] and "'model'" in result["error"], result["error"]
        assert "rank 0: " not in result["error"], result["error"]


def test_a_plain_value_saved_where_the_live_state_has_an_object_is_named(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        manager.save(1, {"model": {"weight": torch.ones(2)}, "step": 1}, force=True)
    model, _ = _model(1)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        state: dict[str, Any] = {"model": model, "step": 0}
        with pytest.raises(ckptd.ResumeMismatchError) as caught:
            manager.restore(state)
    text = str(caught.value)
    assert "'model'" in text and "Linear" in text and "plain dict" in text and "step 1" in text, text
    assert state["model"] is model, "the live object is kept, not replaced by the saved dict"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])
