"""The daemon's journal (SQLite WAL) and commit watcher, in-process: task states survive reopening, a task
left running runs again, claims honour retry times; the watcher reports a step when its manifest appears,
with inotify and by polling, and never a pinned copy or an uncommitted step."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest

from ckptd.daemon.journal import Journal
from ckptd.daemon.watcher import CommitWatcher
from ckptd.format.layout import MANIFEST_NAME, step_dir
from harness.daemon_process import wait_until


def test_tasks_are_unique_and_survive_reopening(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite3")
    assert journal.enqueue("promote", "run1", 5, "s3://b/x") is True
    assert journal.enqueue("promote", "run1", 5, "s3://b/x") is False
    assert journal.enqueue("replicate", "run1", 5, "peer://h:1/replicas/n/run1") is True
    journal.close()
    connection = sqlite3.connect(tmp_path / "journal.sqlite3")
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    connection.close()
    again = Journal(tmp_path / "journal.sqlite3")
    assert [(task.kind, task.step, task.state) for task in again.tasks()] == [
        ("promote", 5, "pending"), ("replicate", 5, "pending")]
    assert again.open_tasks("run1", 5) == 2 and again.open_steps("run1") == [5]
    with pytest.raises(ValueError, match="unknown task kind"):
        again.enqueue("upload", "run1", 5, "x")


def test_claim_order_failure_retry_and_requeue(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite3")
    for step in (3, 1, 2):
        journal.enqueue("promote", "run1", step, "s3://b/x")
    journal.enqueue("replicate", "run1", 1, "peer://h:1/r")
    first = journal.claim(["promote"])
    assert first is not None and (first.step, first.state, first.attempts) == (1, "running", 1)
    journal.fail(first.id, "object tier down", retry_at=time.time() + 3600)
    second = journal.claim(["promote"])
    assert second is not None and second.step == 2  # step 1 waits for its retry time
    assert journal.claim(["promote"], now=time.time() + 7200).step == 1  # due now: lowest step first
    journal.finish(second.id, {"bytes": 7})
    assert journal.depth()["promote"] == {"pending": 1, "running": 1, "done": 1, "failed": 0, "skipped": 0}
    assert journal.done_steps("promote", "run1") == [2]
    # a daemon killed with tasks running: they run again at the next start, each once
    journal.close()
    restarted = Journal(tmp_path / "journal.sqlite3")
    assert restarted.requeue_running() == 1
    assert {task.step for task in restarted.tasks(kind="promote") if task.state == "pending"} == {1, 3}
    errors = restarted.recent_errors()
    assert errors == []  # the failed task was claimed again, so it is no longer failed
    claimed = restarted.claim(["promote"])
    restarted.fail(claimed.id, "still down", retry_at=time.time() + 60)
    assert [(error.step, error.error, error.attempts) for error in restarted.recent_errors()] == [(1, "still down", 3)]
    running = restarted.claim(["replicate"])
    assert running is not None and running.step == 1
    assert restarted.skip_open("run1", 1, "released") == 1  # the failed promote; the running replicate stays
    assert restarted.open_tasks("run1", 1) == 1
    restarted.set_state("last_scrub", 12.5)
    restarted.close()
    assert Journal(tmp_path / "journal.sqlite3").get_state("last_scrub") == 12.5


def test_claims_from_several_threads_never_hand_out_a_task_twice(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite3")
    for step in range(40):
        journal.enqueue("promote", "run1", step, "s3://b/x")
    claimed: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        while (task := journal.claim(["promote"])) is not None:
            with lock:
                claimed.append(task.step)
            journal.finish(task.id)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(claimed) == list(range(40))
    journal.close()


def _commit(root: Path, step: int) -> None:
    """Commit a step the way the local tier does: files first, the manifest linked into place last."""
    directory = root / step_dir(step)
    directory.mkdir(parents=True)
    (directory / "rank-00000.idx").write_bytes(b"index")
    temporary = directory / "manifest.json.tmp-1"
    temporary.write_bytes(b"{}")
    import os

    os.link(temporary, directory / MANIFEST_NAME)
    temporary.unlink()


@pytest.mark.parametrize("mode", ["inotify", "poll"])
def test_watcher_reports_committed_steps_only(tmp_path, mode):
    root = tmp_path / "root"
    root.mkdir()
    _commit(root, 1)
    (root / step_dir(2)).mkdir()  # uncommitted: no manifest
    (root / step_dir(2) / "rank-00000.idx").write_bytes(b"x")
    seen: list[tuple[str, int]] = []
    watcher = CommitWatcher({"run1": root}, lambda name, step: seen.append((name, step)), mode=mode,
                            poll_interval_s=0.1 if mode == "poll" else 30.0)
    watcher.start()
    try:
        assert watcher.mode == mode
        assert seen == [("run1", 1)]  # the start scan
        _commit(root, 3)
        _commit(root / ".promoting", 4)  # a pinned copy is not a commit of the root
        wait_until(lambda: ("run1", 3) in seen, 10, f"step 3 reported ({mode})")
        time.sleep(0.3)
        assert {step for _, step in seen} == {1, 3}
    finally:
        watcher.stop()
