"""``cpu_policy``: the daemon's copy threads (workers, maintenance, the object tier's I/O threads) are reniced
(``nice``, the default) or also put on ``SCHED_IDLE`` (``idle``); the main and HTTP threads are left alone.
Read from the kernel (``/proc/PID/task/*/stat``) of a real daemon subprocess against moto's server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptd.daemon.config import load_config
from ckptd.errors import ConfigError
from harness.daemon_process import DaemonProcess, write_config

SCHED_IDLE = 5


def _threads(pid: int) -> list[tuple[int, int]]:
    """(nice, scheduling policy) of every thread of process ``pid``."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rpartition(")")[2].split()
        found.append((int(fields[16]), int(fields[38])))
    return found


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")
@pytest.mark.parametrize("policy", ["nice", "idle"])
def test_copy_threads_follow_cpu_policy(tmp_path, s3_bucket, s3_options, policy):
    state = tmp_path / "state"
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(tmp_path / "root"),
                                                      "remote": f"s3://{s3_bucket}/p", "storage_options": s3_options}],
                          state_dir=str(state), listen="127.0.0.1:0", scrub_interval_s=0, cpu_policy=policy)
    with DaemonProcess(config, state, env={"CKPTD_BACKGROUND_NICE": "10"}) as daemon:
        daemon.wait_ready()
        # two workers, maintenance, and at least one S3 I/O thread (started at start by the client set-up)
        daemon.wait_for(lambda: sum(entry[0] == 15 for entry in _threads(daemon.process.pid)) >= 4, 20,
                        "the copy threads started")
        threads = _threads(daemon.process.pid)
        daemon.terminate()
    lowered = [entry for entry in threads if entry[0] == 15]
    normal = [entry for entry in threads if entry[0] == 0]
    assert normal and all(entry[1] != SCHED_IDLE for entry in normal), threads
    if policy == "idle":
        assert all(entry[1] == SCHED_IDLE for entry in lowered), threads
    else:
        assert not any(entry[1] == SCHED_IDLE for entry in threads), threads


def test_unknown_cpu_policy_is_one_clear_error(tmp_path):
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(tmp_path / "root")}],
                          state_dir=str(tmp_path / "state"), cpu_policy="realtime")
    with pytest.raises(ConfigError, match="cpu_policy"):
        load_config(config)
