"""Staging buffers prepared in the background (after a restore, or on the first step not saved) hold
exactly what a save stages; a save that comes while the preparation still runs stops it and stages
correctly; a preparation never touches buffers in use."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.errors import ConfigError
from ckptd.policy import Policy
from ckptd.state import staging
from ckptd.state.staging import Stager
from ckptd.testing.compare import assert_same_state
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from ckptd.tiers import direct_io


def state_of(seed: int, sizes: tuple[int, ...] = (300_000, 70_001, 1_000_000, 17)) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(size, generator=generator) for i, size in enumerate(sizes)}


class SlowPreparation:
    """Wraps the real pre-faulting allocation of the preparing thread: each buffer takes ``delay``
    longer, and the test can see how many were made and on which thread. ``held``: each buffer is made
    only once ``release_when`` (set by the test once it has the stager) returns true, at most 60 s later."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay: float, *, held: bool = False) -> None:
        self.real, self.delay, self.held = direct_io.prefaulted_empty, delay, held
        self.release_when: Callable[[], bool] | None = None
        self.made = 0
        self.threads: set[str] = set()
        self.started = threading.Event()
        monkeypatch.setattr(staging, "prefaulted_empty", self)

    def __call__(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        self.started.set()
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        deadline = time.monotonic() + 60
        while self.held and not (self.release_when and self.release_when()) and time.monotonic() < deadline:
            time.sleep(0.005)
        self.made += 1
        return self.real(shape, dtype)

    def hold_until_told_to_stop(self, stager: Stager) -> None:
        """Hold each buffer until someone asks ``stager`` to stop preparing (a save or a release does)."""
        self.release_when = stager._stop_preparing.is_set


def test_prepared_buffers_are_the_ones_a_save_stages_into(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = SlowPreparation(monkeypatch, delay=0.0)
    source = state_of(1)
    stager = Stager(pin=False)
    assert stager.prepare(source) == 4
    assert stager.wait_prepared(30)
    assert slow.threads == {"ckptd-stager-prepare"}
    assert stager.held_bytes == sum(t.numel() * 4 for t in source.values())
    prepared = {name: buffer.data_ptr() for name, buffer in stager._prepared.items()}
    staged = stager.stage(source)
    assert {name: buffer.data_ptr() for name, buffer in staged.tensors.items()} == prepared
    assert_same_state(staged.tensors, source)
    assert stager.prepare(source) == 0, "buffers that fit are not prepared again"
    assert stager.wait_prepared(30) and slow.made == 4


def test_a_stage_while_preparing_stops_the_preparation_and_stages_every_byte(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slow = SlowPreparation(monkeypatch, delay=0.0, held=True)
    source = state_of(2, sizes=(200_000,) * 6)
    stager = Stager(pin=False)
    slow.hold_until_told_to_stop(stager)
    assert stager.prepare(source) == 6
    assert slow.started.wait(10)
    staged = stager.stage(source)  # the preparing thread is busy with its first buffer
    assert not stager.preparing, "stage returns only once the preparing thread stopped"
    assert 1 <= slow.made < 6 and stager.prepared_allocations == slow.made
    assert_same_state(staged.tensors, source)
    assert stager.held_bytes == sum(t.numel() * 4 for t in source.values()), "nothing prepared is left over"
    changed = {name: tensor + 1 for name, tensor in source.items()}
    assert_same_state(stager.stage(changed).tensors, changed)


def test_a_preparation_for_other_shapes_leaves_the_staged_copy_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    SlowPreparation(monkeypatch, delay=0.0)
    stager = Stager(pin=False)
    first = state_of(3)
    staged = stager.stage(first)
    expected = {name: tensor.clone() for name, tensor in first.items()}
    grown = {**first, "t1": torch.randn(90_000), "new": torch.randn(50_000)}
    assert stager.prepare(grown) == 2  # only the names whose buffer does not fit
    assert stager.wait_prepared(30)
    assert_same_state(staged.tensors, expected)  # the memory tier still holds the last save
    assert_same_state(stager.stage(grown).tensors, grown)
    assert stager.held_bytes == sum(t.numel() * 4 for t in grown.values())


def test_a_state_over_the_staging_budget_prepares_nothing() -> None:
    stager = Stager(budget_bytes=1 << 20, pin=False)
    too_big = state_of(4, sizes=(300_000,))
    assert stager.prepare(too_big) == 0 and not stager.preparing
    assert stager.held_bytes == 0
    with pytest.raises(ConfigError, match="staging budget"):
        stager.stage(too_big)


def test_release_stops_a_running_preparation(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = SlowPreparation(monkeypatch, delay=0.0, held=True)
    stager = Stager(pin=False)
    slow.hold_until_told_to_stop(stager)
    stager.prepare(state_of(5, sizes=(100_000,) * 5))
    assert slow.started.wait(10)
    stager.release()
    assert not stager.preparing and stager.held_bytes == 0 and slow.made < 5


def test_manager_prepares_after_restore_and_the_save_stages_the_saved_bytes(
        manager_factory: ManagerFactory, checkpoint_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh run: ``restore`` finds nothing and starts preparing; the first save comes while the
    preparation is still running (no race), and the step restores to the saved bytes."""
    slow = SlowPreparation(monkeypatch, delay=0.0, held=True)
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(400, 300), torch.nn.Linear(300, 200))
    state: dict[str, Any] = {"model": model}
    manager = manager_factory()
    assert manager.restore(state) is None
    stager = manager._saver.stager
    slow.hold_until_told_to_stop(stager)
    assert stager.preparing and slow.started.wait(60)
    assert manager.save(1, state, force=True)
    assert not stager.preparing
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # after the save returned: must not reach the checkpoint
    manager.wait()
    manager.close()
    fresh = torch.nn.Sequential(torch.nn.Linear(400, 300), torch.nn.Linear(300, 200))
    restorer = manager_factory(checkpoint_dir)
    assert restorer.restore({"model": fresh}) == 1
    assert_same_state(dict(fresh.state_dict()), expected)
    assert slow.made >= 1


def test_manager_prepares_on_the_first_step_it_does_not_save(
        manager_factory: ManagerFactory, checkpoint_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer has state only after its first step: the first step not saved prepares its buffers
    too, and the first saved step stages into them."""
    slow = SlowPreparation(monkeypatch, delay=0.0)
    torch.manual_seed(7)
    model = torch.nn.Linear(500, 400)
    optimizer = torch.optim.Adam(model.parameters())
    state: dict[str, Any] = {"model": model, "optim": optimizer}
    manager = manager_factory(policy=Policy(every_steps=3, keep_local=None))
    assert manager.restore(state) is None
    stager = manager._saver.stager
    assert stager.wait_prepared(30)
    after_restore = slow.made
    assert after_restore == 2  # the model's weight and bias; the optimizer has no state yet
    model(torch.randn(2, 500)).sum().backward()
    optimizer.step()
    assert not manager.save(1, state)  # not saved; prepares the optimizer's new tensors
    assert stager.wait_prepared(30)
    assert slow.made == after_restore + 6  # step, exp_avg and exp_avg_sq of the weight and of the bias
    prepared = {buffer.data_ptr() for buffer in stager._prepared.values()}
    assert not manager.save(2, state)  # once only
    assert stager.wait_prepared(30) and slow.made == after_restore + 6
    model(torch.randn(2, 500)).sum().backward()
    optimizer.step()
    assert manager.save(3, state)
    assert prepared <= {buffer.data_ptr() for buffer in stager._buffers.values()}
    expected_model = {name: value.clone() for name, value in model.state_dict().items()}
    expected_optim = {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}
    manager.wait()
    manager.close()
    fresh = torch.nn.Linear(500, 400)
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    assert manager_factory(checkpoint_dir).restore({"model": fresh, "optim": fresh_optimizer}) == 3
    assert_same_state(dict(fresh.state_dict()), expected_model)
    assert_same_state(fresh_optimizer.state_dict()["state"], expected_optim)


def test_a_state_that_cannot_be_flattened_prepares_nothing_and_a_step_not_saved_still_returns(
        manager_factory: ManagerFactory) -> None:
    """Preparing is an optimisation: a value that fails to pickle is reported by the save, not by a step
    the policy does not save."""
    manager = manager_factory(policy=Policy(every_steps=5, keep_local=None), allow_pickle=True)
    state = {"lock": threading.Lock(), "weight": torch.randn(100_000)}
    assert not manager.save(1, state)
    stager = manager._saver.stager
    assert not stager.preparing and stager.held_bytes == 0
    with pytest.raises(TypeError, match="pickle"):
        manager.save(5, state)
