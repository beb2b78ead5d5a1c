"""The daemon SIGKILLed in the middle of a promotion or a replication (its copies slowed by
``harness.slow_daemon`` so that the kill lands mid-copy, at a point drawn from a seed), then started
again: every step ends committed exactly once on each tier (one journal row done per step and tier, one
manifest version in a versioned bucket, the tier holds exactly the committed steps), each verifies, its
files equal the local copy, no pin is left. SIGTERM drains: the copy in flight completes, exit 0, the rest
stays journaled and nothing is half done."""

from __future__ import annotations

import random
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.roots import DAEMON_PIN_DIRECTORY
from ckptd.format.layout import MANIFEST_NAME, step_dir, step_file
from ckptd.promotion.pinning import PIN_DIRECTORY
from ckptd.stepio.step_reader import verify_step
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier
from harness.daemon_process import DaemonProcess, run_trainer, wait_until, write_config
from test_promotion_support import s3_client

pytestmark = pytest.mark.s3

STEPS = [1, 2, 3]


@pytest.fixture(scope="module")
def committed_root(tmp_path_factory) -> Path:
    """A local root in which a trainer process committed :data:`STEPS` (copied by each test)."""
    root = tmp_path_factory.mktemp("template") / "root"
    assert run_trainer(root, STEPS[0], len(STEPS), seed=3, keep_local=None) == STEPS
    assert LocalTier(root).committed_steps() == STEPS
    return root


def _config(tmp_path: Path, name: str, root: Path, *, remote: str | None = None,
            s3_options: dict[str, Any] | None = None, **options: Any) -> tuple[Path, Path]:
    state = tmp_path / f"{name}-state"
    table: dict[str, Any] = {"name": "run1", "local": str(root)}
    if remote is not None:
        table.update(remote=remote, storage_options=s3_options)
    config = write_config(tmp_path / f"{name}.toml", [table], state_dir=str(state), node_id=name,
                          listen="127.0.0.1:0", poll_interval_s=0.2, retry_backoff_s=0.2, **options)
    return config, state


def _tasks_by_step(daemon: DaemonProcess, kind: str) -> dict[int, list[dict[str, Any]]]:
    rows: dict[int, list[dict[str, Any]]] = {}
    for task in daemon.tasks():
        if task["kind"] == kind:
            rows.setdefault(task["step"], []).append(task)
    return rows


def _all_done(daemon: DaemonProcess, kind: str) -> bool:
    rows = _tasks_by_step(daemon, kind)
    return sorted(rows) == STEPS and all(task["state"] == "done" for tasks in rows.values() for task in tasks)


def _tree(directory: Path) -> dict[str, bytes]:
    return {path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def _kill_mid_copy(config: Path, state: Path, kind: str, seed: int) -> list[dict[str, Any]]:
    """Run the slow daemon, SIGKILL it right after (0-40 ms) its k-th write to a ``kind`` tier (k drawn from
    ``seed``); returns the journal as the kill left it."""
    chooser = random.Random(seed)
    writes = chooser.randint(1, 9)
    # each write waits 0.5 s after its announcement: far past the 0-40 ms, so that even a loaded machine's late
    # kill lands while a copy is still running
    with DaemonProcess(config, state, slow_writes_s=0.5) as daemon:
        daemon.wait_ready()
        daemon.wait_event(lambda line: line.startswith(f"write {kind} "), count=writes)
        time.sleep(chooser.uniform(0.0, 0.04))
        daemon.kill()
    left = daemon.tasks()
    assert any(task["state"] == "running" for task in left), f"the kill after write {writes} landed between tasks: {left}"
    return left


def _check_journal_once(daemon: DaemonProcess, kind: str, killed: list[dict[str, Any]]) -> None:
    rows = _tasks_by_step(daemon, kind)
    assert sorted(rows) == STEPS
    for step, tasks in rows.items():
        assert len(tasks) == 1 and tasks[0]["state"] == "done", (step, tasks)
    interrupted = [task["step"] for task in killed if task["state"] == "running"]
    assert all(rows[step][0]["attempts"] >= 2 for step in interrupted), "the interrupted task did not run again"


def _check_no_pins(root: Path) -> None:
    for pins in (root / PIN_DIRECTORY, root / DAEMON_PIN_DIRECTORY):
        assert not pins.exists() or not [entry for entry in pins.iterdir() if entry.name.startswith("step-")], \
            f"pins left: {sorted(p.name for p in pins.iterdir())}"


def _restart_until_done(config, state, kind: str, killed) -> None:
    """Start the daemon again after ``killed``; wait until every ``kind`` task is done, stop it (exit 0) and check
    that the journal did each task once."""
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        daemon.wait_for(lambda: _all_done(daemon, kind), 90, f"every {kind} task done after the restart")
        assert daemon.terminate() == 0
        _check_journal_once(daemon, kind, killed)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_killed_mid_promotion_commits_each_step_once(seed, tmp_path, committed_root, s3_server, s3_bucket,
                                                      s3_options):
    client = s3_client(s3_server)
    client.put_bucket_versioning(Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    root = tmp_path / "root"
    shutil.copytree(committed_root, root)
    config, state = _config(tmp_path, "node-a", root, remote=f"s3://{s3_bucket}/run1", s3_options=s3_options)
    killed = _kill_mid_copy(config, state, "object", seed)
    _restart_until_done(config, state, "promote", killed)
    remote = ObjectTier(f"s3://{s3_bucket}/run1", storage_options=s3_options)
    local = LocalTier(root)
    assert remote.committed_steps() == STEPS == local.committed_steps()
    manifests = [item["Key"] for item in client.list_objects_v2(Bucket=s3_bucket, Prefix="run1/").get("Contents", [])
                 if item["Key"].endswith("/" + MANIFEST_NAME)]
    assert manifests == [f"run1/{step_file(step, MANIFEST_NAME)}" for step in STEPS], "an orphan or missing manifest"
    for step in STEPS:
        versions = client.list_object_versions(Bucket=s3_bucket, Prefix=f"run1/{step_file(step, MANIFEST_NAME)}")
        assert len(versions.get("Versions", [])) == 1, f"step {step} was committed more than once on S3"
        assert list(verify_step(remote, step)) == [], f"step {step} does not verify on S3"
        for name in local.list_files(step):
            if name.endswith(".idx") or name == MANIFEST_NAME:
                assert remote.read_bytes(step_file(step, name)) == local.read_bytes(step_file(step, name)), name
    _check_no_pins(root)


@pytest.mark.parametrize("seed", [21, 22, 23])
def test_killed_mid_replication_commits_each_replica_once(seed, tmp_path, committed_root):
    token = secrets.token_hex(16)
    root_b = tmp_path / "root-b"
    # keep_peer (default 2) would let the buddy's upkeep retire step 1's replica before the check
    config_b, state_b = _config(tmp_path, "node-b", root_b, peer_token=token, keep_peer=len(STEPS))
    root = tmp_path / "root"
    shutil.copytree(committed_root, root)
    with DaemonProcess(config_b, state_b) as daemon_b:
        buddy = daemon_b.wait_ready()["http"]
        config, state = _config(tmp_path, "node-a", root, peer_token=token, buddy=f"peer://{buddy}")
        killed = _kill_mid_copy(config, state, "peer", seed)
        _restart_until_done(config, state, "replicate", killed)
        assert daemon_b.terminate() == 0
    replicas = LocalTier(state_b / "replicas" / "node-a" / "run1")
    assert replicas.committed_steps() == STEPS
    assert sorted(entry.name for entry in replicas.root.iterdir() if entry.name.startswith("step-")) == \
        [step_dir(step) for step in STEPS], "a step directory without its commit on the buddy"
    for step in STEPS:
        assert list(verify_step(replicas, step)) == [], f"replica of step {step} does not verify"
        assert _tree(replicas.root / step_dir(step)) == _tree(root / step_dir(step)), f"replica of step {step} differs"
    _check_no_pins(root)


def test_sigterm_drains_the_copy_in_flight(tmp_path, committed_root, s3_bucket, s3_options):
    root = tmp_path / "root"
    shutil.copytree(committed_root, root)
    config, state = _config(tmp_path, "node-a", root, remote=f"s3://{s3_bucket}/run1", s3_options=s3_options)
    remote = ObjectTier(f"s3://{s3_bucket}/run1", storage_options=s3_options)
    with DaemonProcess(config, state, slow_writes_s=0.3) as daemon:
        daemon.wait_ready()
        daemon.wait_event(lambda line: line.startswith("write object "))
        assert daemon.terminate(timeout_s=60) == 0
        rows = _tasks_by_step(daemon, "promote")
    states = {step: tasks[0]["state"] for step, tasks in rows.items()}
    assert states[1] == "done", f"the promotion in flight did not complete: {states}"
    assert all(state_ == "pending" for step, state_ in states.items() if step != 1), states
    assert not (state / "daemon.json").exists() and not (root / ".ckptd-daemon.json").exists()
    assert remote.committed_steps() == [1], "a step was committed that the drain did not finish, or none"
    assert list(verify_step(remote, 1)) == []
    assert not [path for path in remote.list_files(2) + remote.list_files(3)], "a later step was started"
    with DaemonProcess(config, state) as daemon:
        daemon.wait_ready()
        daemon.wait_for(lambda: _all_done(daemon, "promote"), 60, "the rest promoted after the restart")
        assert daemon.terminate() == 0
        assert all(len(tasks) == 1 for tasks in _tasks_by_step(daemon, "promote").values())
    assert remote.committed_steps() == STEPS
    _check_no_pins(root)
