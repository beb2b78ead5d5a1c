"""The daemon as a real subprocess: steps a trainer process commits reach the object tier (verified by
``ckptd verify``, restored bytes equal), also when the trainer is SIGKILLed right after its commit, and a
second daemon receives replicas whose bytes equal the local copy."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.daemon.roots import DAEMON_PIN_DIRECTORY
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.stepio.step_reader import verify_step
from ckptd.testing.compare import assert_same_state
from harness.daemon_process import DaemonProcess, run_trainer, trainer_state, wait_until, write_config

pytestmark = pytest.mark.s3


def _daemon_config(tmp_path: Path, name: str, bucket: str | None, s3_options: dict[str, Any] | None,
                   **options: Any) -> tuple[Path, Path, Path]:
    """(config file, state dir, local root) of a daemon called ``name``."""
    root, state = tmp_path / f"{name}-root", tmp_path / f"{name}-state"
    table: dict[str, Any] = {"name": "run1", "local": str(root)}
    if bucket is not None:
        table.update(remote=f"s3://{bucket}/run1", storage_options=s3_options)
    options.setdefault("listen", "127.0.0.1:0")
    options.setdefault("poll_interval_s", 0.2)
    config = write_config(tmp_path / f"{name}.toml", [table], state_dir=str(state), node_id=name, **options)
    return config, state, root


def _done(daemon: DaemonProcess, kind: str) -> list[int]:
    return sorted(task["step"] for task in daemon.tasks() if task["kind"] == kind and task["state"] == "done")


def _verify_cli(url: str, endpoint: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", url, "--endpoint-url", endpoint],
                          capture_output=True, text=True, timeout=120, env=env)


def _restored(tmp_path: Path, remote: str, s3_options: dict[str, Any], step: int) -> dict[str, torch.Tensor]:
    """Step ``step`` read back from the object tier alone (an empty local directory)."""
    state = {key: torch.zeros_like(value) for key, value in trainer_state(step).items()}
    empty = tmp_path / f"restore-{step}"
    with ckptd.CheckpointManager(empty, remote=remote, storage_options=s3_options, capture_rng=False) as manager:
        assert manager.restore(state, step) == step
    return state


def test_a_committed_step_is_promoted_and_verifies(tmp_path, s3_server, s3_bucket, s3_options):
    config, state, root = _daemon_config(tmp_path, "node-a", s3_bucket, s3_options)
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        assert (root / ".ckptd-daemon.json").is_file()
        assert run_trainer(root, 1, 2) == [1, 2]
        daemon.wait_for(lambda: _done(daemon, "promote") == [1, 2], 60, "steps 1 and 2 promoted")
        status = wait_until(lambda: (lambda doc: doc if doc["roots"]["run1"]["tiers"]["object"]["steps"] == [1, 2]
                                     else None)(daemon.get_json("/status")), 30, "the status to list both steps")
        assert status["roots"]["run1"]["tiers"]["object"]["lag_steps"] == 0
        assert status["roots"]["run1"]["pinned"] == []
        assert daemon.terminate() == 0
    assert not (root / ".ckptd-daemon.json").exists() and not (state / "daemon.json").exists()
    result = _verify_cli(f"s3://{s3_bucket}/run1", s3_server.endpoint_url)
    assert result.returncode == 0, result.stdout + result.stderr
    for step in (1, 2):
        assert_same_state(_restored(tmp_path, f"s3://{s3_bucket}/run1", s3_options, step), trainer_state(step))


def test_trainer_killed_right_after_its_commit_is_still_promoted(tmp_path, s3_server, s3_bucket, s3_options):
    config, state, root = _daemon_config(tmp_path, "node-a", s3_bucket, s3_options, watch="poll")
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        assert run_trainer(root, 1, 5, kill_after=3) == [1, 2, 3]
        daemon.wait_for(lambda: _done(daemon, "promote") == [1, 2, 3], 60, "steps 1-3 promoted after the trainer died")
        assert daemon.terminate() == 0
    assert (root / step_dir(3) / MANIFEST_NAME).is_file()
    assert not (root / step_dir(1)).exists(), "keep_local=2 deleted step 1: it was promoted from its pin"
    assert not [entry for entry in (root / DAEMON_PIN_DIRECTORY).iterdir() if entry.name.startswith("step-")]
    result = _verify_cli(f"s3://{s3_bucket}/run1", s3_server.endpoint_url)
    assert result.returncode == 0, result.stdout + result.stderr
    for step in (1, 3):
        assert_same_state(_restored(tmp_path, f"s3://{s3_bucket}/run1", s3_options, step), trainer_state(step))


def _tree(directory: Path) -> dict[str, bytes]:
    return {path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def test_replication_to_a_second_daemon_gives_equal_bytes(tmp_path, s3_bucket, s3_options):
    token = secrets.token_hex(16)
    config_b, state_b, _ = _daemon_config(tmp_path, "node-b", None, None, peer_token=token)
    with DaemonProcess(config_b, state_b) as daemon_b:
        buddy = daemon_b.wait_ready()["http"]
        config_a, state_a, root_a = _daemon_config(tmp_path, "node-a", s3_bucket, s3_options, peer_token=token,
                                                   buddy=f"peer://{buddy}")
        with DaemonProcess(config_a, state_a) as daemon_a:
            daemon_a.wait_ready()
            assert run_trainer(root_a, 1, 2, seed=5) == [1, 2]
            daemon_a.wait_for(lambda: _done(daemon_a, "replicate") == [1, 2], 60,
                       f"steps 1 and 2 replicated; log:\n{daemon_a.log()}")
            daemon_a.wait_for(lambda: _done(daemon_a, "promote") == [1, 2], 60, "steps 1 and 2 promoted")
            assert daemon_a.terminate() == 0
        replicas = state_b / "replicas" / "node-a" / "run1"
        for step in (1, 2):
            local, replica = _tree(root_a / step_dir(step)), _tree(replicas / step_dir(step))
            assert replica == local, f"step {step}: replica files {sorted(replica)} != local {sorted(local)}"
        assert daemon_b.terminate() == 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_buddy_that_is_down_does_not_hold_promotion_and_replication_resumes(tmp_path, s3_bucket, s3_options):
    token = secrets.token_hex(16)
    port = _free_port()
    config_a, state_a, root_a = _daemon_config(tmp_path, "node-a", s3_bucket, s3_options, peer_token=token,
                                               buddy=f"peer://127.0.0.1:{port}", retry_backoff_s=0.2)
    with DaemonProcess(config_a, state_a) as daemon_a:
        daemon_a.wait_ready()
        assert run_trainer(root_a, 1, 2, seed=9, keep_local=None) == [1, 2]
        daemon_a.wait_for(lambda: _done(daemon_a, "promote") == [1, 2], 60, "promotion while the buddy is down")
        failed = daemon_a.wait_for(lambda: [task for task in daemon_a.tasks()
                                            if task["kind"] == "replicate" and task["state"] == "failed"], 30,
                                   "a failed replication")
        assert failed[0]["error"]
        status = daemon_a.get_json("/status")
        assert any(error["kind"] == "replicate" for error in status["errors"]), status["errors"]
        assert status["roots"]["run1"]["pinned"] == [1, 2]  # kept until the replicas are made
        config_b, state_b, _ = _daemon_config(tmp_path, "node-b", None, None, peer_token=token,
                                              listen=f"127.0.0.1:{port}")
        with DaemonProcess(config_b, state_b) as daemon_b:
            daemon_b.wait_ready()
            daemon_a.wait_for(lambda: _done(daemon_a, "replicate") == [1, 2], 60, "replication once the buddy is up")
            replicas = state_b / "replicas" / "node-a" / "run1"
            for step in (1, 2):
                assert _tree(replicas / step_dir(step)) == _tree(root_a / step_dir(step))
            assert daemon_b.terminate() == 0
        daemon_a.wait_for(lambda: daemon_a.get_json("/status")["roots"]["run1"]["pinned"] == [], 30, "pins dropped")
        assert daemon_a.terminate() == 0


def test_pins_are_capped_while_the_object_tier_is_down(tmp_path):
    dead = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{_free_port()}", "region_name": "us-east-1"}}
    config, state, root = _daemon_config(tmp_path, "node-a", "bucket-down", dead, retry_backoff_s=0.2)
    env = {"CKPTD_PIN_MAX_STEPS": "2", "CKPTD_S3_RETRIES": "0", "CKPTD_S3_CONNECT_RETRIES": "0"}
    with DaemonProcess(config, state, env=env) as daemon:
        daemon.wait_ready()
        assert run_trainer(root, 1, 5, seed=4, keep_local=1) == [1, 2, 3, 4, 5]
        from ckptd.tiers.local import LocalTier
        assert LocalTier(root).committed_steps() == [5]
        # steps 1-4 are gone locally and held only by their pins: two of them (the oldest not being copied
        # at that moment) are released, the newest two and step 5 (still local: free) stay pinned
        rows = daemon.wait_for(lambda: (lambda tasks: tasks if sum(t["state"] == "skipped" for t in tasks) == 2
                                        else None)(daemon.tasks()), 30, "two pins released")
        skipped = sorted(task["step"] for task in rows if task["state"] == "skipped")
        assert all("pin cap" in task["error"] for task in rows if task["state"] == "skipped")
        assert not {4, 5} & set(skipped), skipped
        pinned = daemon.get_json("/status")["roots"]["run1"]["pinned"]
        assert pinned == sorted(set(range(1, 6)) - set(skipped)), (pinned, skipped)
        time.sleep(2.5)  # a maintenance pass later: nothing more released
        assert sum(task["state"] == "skipped" for task in daemon.tasks()) == 2
        assert any(task["state"] == "failed" and task["error"] for task in daemon.tasks())
        assert daemon.terminate() == 0


def test_the_daemon_applies_retention_on_each_tier(tmp_path, s3_bucket, s3_options):
    from ckptd.tiers.local import LocalTier
    from ckptd.tiers.object import ObjectTier

    token = secrets.token_hex(16)
    config_b, state_b, _ = _daemon_config(tmp_path, "node-b", None, None, peer_token=token, keep_peer=1)
    with DaemonProcess(config_b, state_b) as daemon_b:
        buddy = daemon_b.wait_ready()["http"]
        root_a, state_a = tmp_path / "node-a-root", tmp_path / "node-a-state"
        config_a = write_config(tmp_path / "node-a.toml", [{
            "name": "run1", "local": str(root_a), "remote": f"s3://{s3_bucket}/run1", "storage_options": s3_options,
            "keep_local": 1, "keep_remote": 1}], state_dir=str(state_a), node_id="node-a", listen="127.0.0.1:0",
            poll_interval_s=0.2, peer_token=token, buddy=f"peer://{buddy}")
        with DaemonProcess(config_a, state_a) as daemon_a:
            daemon_a.wait_ready()
            assert run_trainer(root_a, 1, 3, seed=6, keep_local=None) == [1, 2, 3]
            daemon_a.wait_for(lambda: _done(daemon_a, "promote") == _done(daemon_a, "replicate") == [1, 2, 3], 60,
                              "every step promoted and replicated")
            local = LocalTier(root_a)
            remote = ObjectTier(f"s3://{s3_bucket}/run1", storage_options=s3_options)
            replicas = LocalTier(state_b / "replicas" / "node-a" / "run1")
            daemon_a.wait_for(lambda: local.committed_steps() == [3] and remote.committed_steps() == [3], 30,
                              "keep_local=1 and keep_remote=1 applied")
            daemon_b.wait_for(lambda: replicas.committed_steps() == [3], 30, "keep_peer=1 applied on the buddy")
            assert list(verify_step(remote, 3)) == [] and list(verify_step(replicas, 3)) == []
            assert daemon_a.terminate() == 0
        assert daemon_b.terminate() == 0
