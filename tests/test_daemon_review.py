"""Review fixes of the daemon core, each against a real :class:`~ckptd.daemon.service.Daemon` in this process
(moto's S3 server over HTTP for the object tier): the daemon keeps its pins apart from the in-process
uploader's, a task that can never succeed ends failed for good (not retried forever), and the scrub is wired
to the daemon's stop event and metrics."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.daemon.config import load_config
from ckptd.daemon.roots import DAEMON_PIN_DIRECTORY
from ckptd.daemon.service import INTEGRITY_ATTEMPTS, Daemon
from ckptd.errors import StorageError
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.promotion.pinning import PIN_DIRECTORY, PinnedSteps
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier
from harness.daemon_process import trainer_state, wait_until

pytestmark = pytest.mark.s3


def _commit(root: Path, steps: list[int]) -> None:
    """Commit ``steps`` in ``root`` with the library (no object tier, no daemon)."""
    with ckptd.CheckpointManager(root, capture_rng=False) as manager:
        for step in steps:
            manager.save(step, trainer_state(step))
            manager.wait()


def _config(tmp_path: Path, root: Path, remote: str | None, s3_options: dict[str, Any] | None,
            **options: Any) -> Any:
    overrides = {"state_dir": str(tmp_path / "state"), "node_id": "node-a", "listen": "127.0.0.1:0", "watch": "poll",
                 "poll_interval_s": 0.1, "retry_backoff_s": 0.05, "scrub_interval_s": 0, "name": "run1",
                 "local": str(root), "remote": remote, **options}
    if s3_options is not None:
        overrides["s3_endpoint_url"] = s3_options["client_kwargs"]["endpoint_url"]
    return load_config(None, overrides, {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})


@pytest.fixture
def running(monkeypatch) -> Iterator[list[Daemon]]:
    """Daemons a test started, stopped at the end whatever happened (s3fs reads the test server's keys from
    the environment, as a deployed daemon would)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    daemons: list[Daemon] = []
    yield daemons
    for daemon in daemons:
        daemon.stop(5.0)


def _start(daemons: list[Daemon], config: Any) -> Daemon:
    daemon = Daemon(config)
    daemons.append(daemon)
    daemon.start()
    return daemon


def _states(daemon: Daemon, kind: str) -> dict[int, tuple[str, int, float | None]]:
    assert daemon.journal is not None
    return {task.step: (task.state, task.attempts, task.retry_at) for task in daemon.journal.tasks(kind=kind)}


def test_daemon_pins_are_apart_from_the_in_process_uploaders(tmp_path, s3_bucket, s3_options, running):
    root = tmp_path / "root"
    _commit(root, [1, 2])
    local = LocalTier(root)
    uploader_pins = PinnedSteps(local)  # a trainer that fell back to in-process promotion pinned step 2
    uploader_pins.pin(2, local.list_files(2))
    daemon = _start(running, _config(tmp_path, root, f"s3://{s3_bucket}/run1", s3_options))
    assert daemon.describe_root("run1")["pin_directory"] == DAEMON_PIN_DIRECTORY != PIN_DIRECTORY
    wait_until(lambda: [state for state, _, _ in _states(daemon, "promote").values()] == ["done", "done"], 60,
               "steps 1 and 2 promoted")
    assert ObjectTier(f"s3://{s3_bucket}/run1", storage_options=s3_options).committed_steps() == [1, 2]
    assert uploader_pins.pinned() == [2], "the daemon dropped the in-process uploader's pin of step 2"
    assert sorted(name for name in local.list_files(2)) == sorted(uploader_pins.tier.list_files(2))
    daemon_pins = PinnedSteps(local, DAEMON_PIN_DIRECTORY)
    assert daemon_pins.pinned() == [], "the daemon left its own pins"
    uploader_pins.unpin(2)  # the uploader finishing never touches a pin of the daemon's either
    assert (root / step_dir(2)).is_dir() and daemon_pins.tier.root.name == DAEMON_PIN_DIRECTORY


def _flip_a_data_byte(root: Path, step: int) -> None:
    data = [path for path in (root / step_dir(step)).iterdir()
            if not path.name.endswith((".idx", ".json")) and path.stat().st_size > 0]
    assert data, sorted(path.name for path in (root / step_dir(step)).iterdir())
    with open(data[0], "r+b") as handle:
        handle.seek(data[0].stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0x01]))


def test_a_corrupt_local_step_fails_for_good_and_the_next_steps_go_on(tmp_path, s3_bucket, s3_options, running):
    root = tmp_path / "root"
    _commit(root, [1, 2])
    _flip_a_data_byte(root, 1)
    daemon = _start(running, _config(tmp_path, root, f"s3://{s3_bucket}/run1", s3_options))
    wait_until(lambda: _states(daemon, "promote").get(2, ("",))[0] == "done", 60, "step 2 promoted")
    wait_until(lambda: _states(daemon, "promote")[1][::2] == ("failed", None), 30, "step 1 failed for good")
    state, attempts, retry_at = _states(daemon, "promote")[1]
    assert retry_at is None and attempts == INTEGRITY_ATTEMPTS, f"{attempts} attempts, next at {retry_at}"
    errors = daemon.status()["errors"]
    assert [(error["step"], error["retry_at"]) for error in errors] == [(1, None)], errors
    assert "failed for good" in errors[0]["error"] and "step 1" in errors[0]["error"], errors[0]
    assert ObjectTier(f"s3://{s3_bucket}/run1", storage_options=s3_options).committed_steps() == [2]
    assert daemon.stop(5.0) == []
    running.remove(daemon)
    again = _start(running, _config(tmp_path, root, f"s3://{s3_bucket}/run1", s3_options))
    wait_until(lambda: _states(again, "promote")[1] == ("failed", INTEGRITY_ATTEMPTS + 1, None), 30,
               "one more attempt at the restart, failed for good again")


def _metric(daemon: Daemon, name: str, tier: str) -> float:
    body, _ = daemon.metrics.render()
    for line in body.decode().splitlines():
        if line.startswith(f'{name}{{tier="{tier}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_bad_chunk_no_tier_can_mend_is_a_scrub_failure(tmp_path, running):
    root = tmp_path / "root"
    _commit(root, [1])
    _flip_a_data_byte(root, 1)
    daemon = _start(running, _config(tmp_path, root, None, None, scrub_interval_s=0.5))
    wait_until(lambda: _metric(daemon, "ckptd_scrub_failures_total", "local") >= 1, 60,
               "the unrepaired chunk counted as a scrub failure")
    assert _metric(daemon, "ckptd_repairs_total", "local") == 0.0
    assert any(error["where"] == "scrub" for error in daemon.status()["recent_errors"])


def test_sigterm_ends_a_scrub_pause_at_once(tmp_path, running):
    root = tmp_path / "root"
    _commit(root, [1])
    # one byte per second: the pass would pause for longer than any drain deadline
    daemon = _start(running, _config(tmp_path, root, None, None, scrub_interval_s=0.5, scrub_bytes_per_s=1.0))
    assert daemon.journal is not None
    wait_until(lambda: daemon.journal.get_state("last_scrub", 0.0) > 0, 60, "a scrub pass to start")
    maintainer = next(thread for thread in threading.enumerate() if thread.name == "ckptd-daemon-maintain")
    assert daemon.stop(30.0) == []  # a deadline only a pause that ignores the stop reaches
    running.remove(daemon)
    assert not maintainer.is_alive(), "the scrub's pacing pause held the daemon past its drain deadline"


def test_a_pin_a_crash_left_half_dropped_is_removed_at_start(tmp_path, running):
    root = tmp_path / "root"
    _commit(root, [1, 2])
    local = LocalTier(root)
    pins = PinnedSteps(local, DAEMON_PIN_DIRECTORY)
    pins.pin(1, local.list_files(1))
    local.delete_step(1)  # retention deleted the step; the pin alone holds its bytes
    (pins.tier.root / step_dir(1) / MANIFEST_NAME).unlink()  # killed while unpinning: manifest gone first
    assert pins.pinned() == [] and pins.held_bytes(1) > 0
    _start(running, _config(tmp_path, root, None, None))
    assert not (pins.tier.root / step_dir(1)).exists(), "a half-dropped pin was left holding disk"
    assert local.committed_steps() == [2]


def test_a_commit_the_daemon_could_not_pin_is_not_answered_as_taken(tmp_path, s3_bucket, s3_options, running):
    root, other = tmp_path / "root", tmp_path / "other"
    _commit(root, [1])
    _commit(other, [1, 2])
    daemon = _start(running, _config(tmp_path, root, f"s3://{s3_bucket}/run1", s3_options))
    wait_until(lambda: _states(daemon, "promote").get(1, ("",))[0] == "done", 60, "step 1 promoted")
    pins = root / DAEMON_PIN_DIRECTORY
    # the task is journaled done before its pin is dropped (a pin left by a kill in between goes at the next start)
    wait_until(lambda: not any(pins.iterdir()), 30, "step 1's pin dropped")
    pins.rmdir()
    pins.write_text("not a directory\n")  # every pin now fails
    shutil.copytree(other / step_dir(2), tmp_path / "incoming")
    (tmp_path / "incoming").rename(root / step_dir(2))
    with pytest.raises(StorageError, match="could not pin"):
        daemon.notice_commit("run1", 2)  # the trainer must keep its own pin of step 2
    assert 2 not in _states(daemon, "promote")
    pins.unlink()
    assert daemon.notice_commit("run1", 2) is True
    wait_until(lambda: _states(daemon, "promote").get(2, ("",))[0] == "done", 60, "step 2 promoted")


def test_a_pin_no_tier_wants_any_more_is_dropped_at_start(tmp_path, running):
    root = tmp_path / "root"
    _commit(root, [1])
    local = LocalTier(root)
    pins = PinnedSteps(local, DAEMON_PIN_DIRECTORY)
    pins.pin(1, local.list_files(1))  # journaled for a tier the new config no longer has (journal lost too)
    daemon = _start(running, _config(tmp_path, root, None, None))
    assert daemon.journal is not None and daemon.journal.tasks() == []
    assert pins.pinned() == [], "a pin with no task to wait for was kept"
    assert local.committed_steps() == [1]


def test_a_trainer_after_a_daemon_was_sigkilled_promotes_in_process(tmp_path, s3_bucket, s3_options):
    from ckptd.manager.daemon_link import DaemonLink
    from harness.daemon_process import DaemonProcess, write_config

    root, state = tmp_path / "root", tmp_path / "state"
    config = write_config(tmp_path / "daemon.toml", [{"name": "run1", "local": str(root),
                                                      "remote": f"s3://{s3_bucket}/run1", "storage_options": s3_options}],
                          state_dir=str(state), listen="127.0.0.1:0", node_id="node-a", scrub_interval_s=0)
    with DaemonProcess(config, state) as daemon:
        killed = daemon.wait_ready()["pid"]
        daemon.kill()
    assert (root / ".ckptd-daemon.json").is_file(), "the SIGKILL left no stale state file to test with"
    assert DaemonLink.find(root) is None
    with ckptd.CheckpointManager(root, remote=f"s3://{s3_bucket}/run1", storage_options=s3_options,
                                 capture_rng=False) as manager:
        manager.save(1, trainer_state(1))
        manager.wait()
        manager.wait_uploads()
        assert not manager.daemon_promotes
    assert ObjectTier(f"s3://{s3_bucket}/run1", storage_options=s3_options).committed_steps() == [1]
    with DaemonProcess(config, state) as daemon:  # a restarted daemon replaces the stale files
        started = daemon.wait_ready()["pid"]
        assert started != killed and json.loads((root / ".ckptd-daemon.json").read_text())["pid"] == started
        link = DaemonLink.find(root)
        assert link is not None and link.promotes
        link.close()
        assert daemon.terminate() == 0


def test_an_object_tier_that_is_down_does_not_hold_replication(tmp_path, running):
    token = "token-of-the-review-test-0123456789"
    node_b = tmp_path / "b"
    daemon_b = _start(running, _config(node_b, node_b / "root", None, None, node_id="node-b", peer_token=token))
    root = tmp_path / "root"
    _commit(root, [1, 2])
    down = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}  # nothing listens on the discard port
    daemon = _start(running, _config(tmp_path, root, "s3://bucket-down/run1", down, peer_token=token,
                                     buddy=f"peer://127.0.0.1:{daemon_b.http_port}"))
    wait_until(lambda: [state for state, _, _ in _states(daemon, "replicate").values()] == ["done", "done"], 60,
               "both steps replicated while the object tier is down")
    assert all(state in ("pending", "running", "failed") for state, _, _ in _states(daemon, "promote").values())
    replicas = LocalTier(node_b / "state" / "replicas" / "node-a" / "run1")
    assert replicas.committed_steps() == [1, 2]
    for step in (1, 2):
        for name in LocalTier(root).list_files(step):
            assert replicas.read_bytes(f"{step_dir(step)}/{name}") == LocalTier(root).read_bytes(
                f"{step_dir(step)}/{name}"), name
    assert PinnedSteps(LocalTier(root), DAEMON_PIN_DIRECTORY).pinned() == [1, 2], "promotion still needs the pins"


def test_daemon_json_names_the_daemon_only_once_every_root_does(tmp_path, running, monkeypatch):
    """Regression: clients and tests take the state_dir's ``daemon.json`` to mean that every root's
    ``.ckptd-daemon.json`` names this daemon, so it is written after all of them; a root whose file still named
    a daemon killed before (pid 1 here) at that moment sent its trainer to a socket nobody serves."""
    from ckptd.daemon import service
    from harness.daemon_process import write_config

    roots = [tmp_path / "root-a", tmp_path / "root-b"]
    for root in roots:
        root.mkdir()
        (root / service.ROOT_FILE).write_text(json.dumps({"pid": 1}))  # left by a SIGKILLed daemon
    seen: list[dict[str, Any]] = []
    real_write = service.write_file_atomically

    def watched(path: Path, data: bytes, **options: Any) -> None:
        real_write(path, data, **options)
        if path.name == service.STATE_FILE and json.loads(path.read_text())["pid"] == os.getpid():
            seen.append({root.name: json.loads((root / service.ROOT_FILE).read_text())["pid"] for root in roots})

    monkeypatch.setattr(service, "write_file_atomically", watched)
    config = write_config(tmp_path / "daemon.toml", [{"name": root.name, "local": str(root)} for root in roots],
                          state_dir=str(tmp_path / "state"), node_id="node-a", listen="127.0.0.1:0", watch="poll",
                          scrub_interval_s=0)
    _start(running, load_config(config, environ={}))
    assert seen == [{"root-a": os.getpid(), "root-b": os.getpid()}], seen
