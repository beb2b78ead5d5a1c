"""Review regressions for the store clock and the read-only root (fault matrix rows 7 and 30).

- The store's ``Date`` may come in any of HTTP's three date formats; the asctime one carries no zone
  and means UTC. Read as this machine's local time it put the store's clock hours ahead west of UTC, so
  a collector took live uploads and in-flight steps for hours old.
- A root opened without the writer lock because its file system was read-only must not write without the
  lock once the file system is writable again (``mount -o remount,rw``): a second manager may hold it.
- A commit undone after its directory fsync failed unlinks only its own file, never one another writer
  renamed over the name meanwhile (the race is injected around the real ``fsync_directory``).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from ckptd.errors import LockedError
from harness.fixtures import ManagerFactory, checkpoint_dir, manager_factory  # noqa: F401
from harness.workloads import synthetic_state
from harness.write_faults import ErrnoRule, FaultyDisk
from ckptd.tiers.s3_errors import http_date

STAMP = 784111777.0  # Sun, 06 Nov 1994 08:49:37 GMT


@pytest.mark.parametrize("zone", ["UTC", "America/New_York", "Asia/Tokyo"])
@pytest.mark.parametrize("value", ["Sun, 06 Nov 1994 08:49:37 GMT", "Sunday, 06-Nov-94 08:49:37 GMT",
                                   "Sun Nov  6 08:49:37 1994", "Sun, 06 Nov 1994 08:49:37 -0000"])
def test_every_http_date_format_is_read_as_utc(zone: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        assert http_date(value) == STAMP
    finally:
        monkeypatch.undo()
        time.tzset()


READ_ONLY = [ErrnoRule(operation, errno.EROFS, times=None) for operation in ("open", "write", "rename", "fsync")]


def test_a_root_writable_again_takes_the_writer_lock_before_it_writes(
        checkpoint_dir: Path, manager_factory: ManagerFactory) -> None:
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    with FaultyDisk(rules=READ_ONLY):
        unlocked = manager_factory(checkpoint_dir)  # opened without the lock: the root was read-only
    other = manager_factory(checkpoint_dir)  # remounted read-write: a second manager takes the lock
    with pytest.raises(LockedError):
        unlocked.save(1, synthetic_state(1, 64 * 1024), force=True)
        unlocked.wait()
    assert other.committed_steps() == []
    other.save(2, synthetic_state(2, 64 * 1024), force=True)
    other.wait()
    other.close()
    unlocked.save(3, synthetic_state(3, 64 * 1024), force=True)  # the other is gone: the lock is free now
    unlocked.wait()
    assert unlocked.committed_steps() == [2, 3]
    unlocked.close()
    assert sorted(os.listdir(checkpoint_dir)).count("step-000000000001") == 0


def test_an_undone_rename_never_unlinks_a_file_another_writer_put_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory fsync after a rename fails (EIO), so the commit is undone by unlinking the final name;
    if another writer renamed its own file over that name meanwhile, its file stays."""
    from ckptd.errors import StorageError
    from ckptd.tiers import local as local_module

    tier = local_module.LocalTier(tmp_path / "root", create=True)
    final = tier.root / "step-000000000001" / "shared.json"
    tier.write_bytes("step-000000000001/other.json", b"made durable first")  # the directory exists
    real_fsync_directory = local_module.fsync_directory

    def racing_then_failing(directory: Path) -> None:
        theirs = directory / "theirs.tmp"
        theirs.write_bytes(b"theirs")
        os.replace(theirs, final)  # the other writer's commit lands between our rename and our fsync
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(local_module, "fsync_directory", racing_then_failing)
    with pytest.raises(StorageError, match="fsync of the directory"):
        tier.write_bytes("step-000000000001/shared.json", b"mine")
    monkeypatch.setattr(local_module, "fsync_directory", real_fsync_directory)
    assert final.read_bytes() == b"theirs"
