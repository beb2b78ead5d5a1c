"""Two managers on one directory: the second fails with LockedError and a clear message, in the same
process or another one, without touching the first's files; the first keeps saving and restoring."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.errors import LockedError
from ckptd.format.layout import TEMP_MARKER
from ckptd.testing import tamper
from ckptd.testing.compare import assert_same_state
from harness.crash import CrashInjector, KillAt
from harness.fixtures import ManagerFactory, checkpoint_dir, crash_injector, manager_factory  # noqa: F401
from harness.workloads import open_manager, save_steps, synthetic_state, synthetic_template

NBYTES = 256 * 1024


def test_second_manager_in_the_same_process_is_locked_out(manager_factory: ManagerFactory,
                                                          checkpoint_dir: Path) -> None:
    first = manager_factory()
    first.save(1, synthetic_state(1, NBYTES), force=True)
    first.wait()
    data_file = tamper.data_path(checkpoint_dir, 2)
    in_flight = data_file.with_name(f"{data_file.name}{TEMP_MARKER}inflight")
    in_flight.parent.mkdir()
    in_flight.write_bytes(b"a write of the first manager in progress")

    with pytest.raises(LockedError) as caught:
        manager_factory()
    message = str(caught.value)
    assert "another checkpoint manager" in message and f"pid {os.getpid()}" in message
    assert str(checkpoint_dir) in message
    assert in_flight.exists(), "the locked-out manager removed the first manager's temporary file"

    first.save(2, synthetic_state(2, NBYTES), force=True)
    first.wait()
    assert first.committed_steps() == [1, 2]
    for step in (1, 2):
        live = synthetic_template(NBYTES)
        assert first.restore(live, step=step) == step
        assert_same_state(live, synthetic_state(step, NBYTES))


def test_second_manager_in_another_process_is_locked_out(manager_factory: ManagerFactory, checkpoint_dir: Path,
                                                         crash_injector: CrashInjector) -> None:
    first = manager_factory()
    first.save(1, synthetic_state(1, NBYTES), force=True)
    first.wait()
    child = crash_injector.run(open_manager, str(checkpoint_dir))
    assert child.value.startswith("LockedError: another checkpoint manager"), child.value
    assert f"pid {os.getpid()}" in child.value

    first.close()  # the lock goes with the manager: now another process may open the directory
    assert crash_injector.run(open_manager, str(checkpoint_dir)).value == "opened"
    reopened = manager_factory()
    live = synthetic_template(NBYTES)
    assert reopened.restore(live) == 1
    assert_same_state(live, synthetic_state(1, NBYTES))


def test_lock_of_a_killed_manager_is_released(manager_factory: ManagerFactory, checkpoint_dir: Path,
                                              crash_injector: CrashInjector) -> None:
    child = crash_injector.run(save_steps, str(checkpoint_dir), 1, 1, NBYTES, kill_at=KillAt("committed"))
    assert child.killed
    survivor = manager_factory()
    assert survivor.committed_steps() == [1]


_TRAINER_WITH_A_WORKER = """
import os, sys, time
import torch, ckptd
manager = ckptd.CheckpointManager(sys.argv[1])
manager.save(1, {"w": torch.ones(4)}, force=True)
manager.wait()
worker = os.fork()  # what a DataLoader worker is: a forked child that outlives its parent by seconds
if worker == 0:
    time.sleep(60)
    os._exit(0)
print(worker, flush=True)
time.sleep(60)
"""


def test_a_killed_trainers_forked_worker_does_not_hold_the_lock(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from ckptd.tiers.local import LocalTier

    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER_WITH_A_WORKER, str(tmp_path / "ckpt")],
                               stdout=subprocess.PIPE, text=True)
    worker = int(trainer.stdout.readline())
    try:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        os.kill(worker, 0)  # the worker still lives
        successor = LocalTier(tmp_path / "ckpt")
        successor.acquire_lock(0)  # raises LockedError while the worker holds the lock
        successor.release_locks()
    finally:
        os.kill(worker, signal.SIGKILL)
        trainer.stdout.close()
