"""Small files written atomically outside a checkpoint: the dataset manifest (``ckptd data index --out``) and
the daemon's state files (``daemon.json`` and each root's ``.ckptd-daemon.json``).

- A failure names the file for what it is ("cannot write the dataset manifest", "the daemon state file") and
  says what to do; it never speaks of the checkpoint tier (``keep_local``, committed steps).
- The fsync of the directory after the rename is best effort where the file system cannot do it at all
  (EINVAL, EACCES, ...): a re-saved manifest is in place and a daemon starts there.
- When the directory fsync fails otherwise (EIO) after the file replaced an existing one, the new file stays
  (the old copy went with the rename) and the error says its directory entry may not be durable; a file that
  was new is unlinked again, so nothing half-committed is left.

Faults are injected by wrapping the real ``os.fsync``: only the fsync of the chosen directory fails.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptd.cli.main import cli
from ckptd.daemon.config import load_config
from ckptd.daemon.service import ROOT_FILE, STATE_FILE, Daemon
from ckptd.data import index_dataset, load_dataset_manifest, save_dataset_manifest
from ckptd.errors import DiskFullError, StorageError
from ckptd.format.layout import TEMP_MARKER
from harness.daemon_process import write_config

CHECKPOINT_WORDS = ("keep_local", "committed steps", "tier local")


def fail_directory_fsync(monkeypatch: pytest.MonkeyPatch, error: int, directory: Path) -> list[int]:
    """Make the fsync of ``directory`` (and of no other file) raise ``OSError(error)``; the list returned
    grows by one errno per refused call."""
    real_fsync = os.fsync
    target = os.stat(directory)
    refused: list[int] = []

    def fsync(fd: int) -> None:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode) and (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
            refused.append(error)
            raise OSError(error, f"{os.strerror(error)} (injected)")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return refused


def _shards(directory: Path, samples: int) -> Path:
    data = directory / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "shard-0.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(samples)))
    return data


def _index(data: Path, out: Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["data", "index", str(data), "--format", "jsonl", "--out", str(out)])
    return result.exit_code, result.output


def _leftovers(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if TEMP_MARKER in name)


@pytest.mark.parametrize("error", [errno.EINVAL, errno.EACCES])
def test_a_manifest_is_re_saved_where_its_directory_cannot_be_fsynced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    out = tmp_path / "manifests" / "data.json"
    data = _shards(tmp_path, 4)
    assert _index(data, out)[0] == 0
    _shards(tmp_path, 7)  # the shard grew: the re-index replaces the manifest
    refused = fail_directory_fsync(monkeypatch, error, out.parent)
    code, output = _index(data, out)
    assert refused, "the directory fsync was never attempted: the test no longer reaches it"
    assert code == 0, output
    assert load_dataset_manifest(out).total_samples == 7
    assert _leftovers(out.parent) == []


def test_an_eio_after_replacing_a_manifest_keeps_the_new_one_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "data.json"
    data = _shards(tmp_path, 4)
    assert _index(data, out)[0] == 0
    _shards(tmp_path, 7)
    refused = fail_directory_fsync(monkeypatch, errno.EIO, tmp_path)
    code, output = _index(data, out)
    assert refused == [errno.EIO]
    assert code == StorageError.exit_code, output
    text = " ".join(output.split())
    assert "cannot write the dataset manifest" in text and str(out) in text, text
    assert "in place" in text and "may not be durable" in text and "Input/output error" in text, text
    assert "--out" in text, "the hint says what to do"
    assert not any(word in text for word in CHECKPOINT_WORDS), text
    monkeypatch.undo()
    assert load_dataset_manifest(out).total_samples == 7, "the manifest that replaced the old one was lost"
    assert _leftovers(tmp_path) == []


def test_an_eio_on_a_new_manifest_leaves_no_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = index_dataset(str(_shards(tmp_path, 3)), "jsonl").manifest
    out = tmp_path / "data.json"
    fail_directory_fsync(monkeypatch, errno.EIO, tmp_path)
    with pytest.raises(StorageError) as raised:
        save_dataset_manifest(manifest, out)
    message = str(raised.value)
    assert message.startswith("cannot write the dataset manifest: committing (fsync of the directory) failed"), message
    assert raised.value.path == str(out) and raised.value.tier is None
    assert not out.exists(), "a manifest whose name may not survive a power loss was left as if written"
    assert _leftovers(tmp_path) == []


def test_a_manifest_on_a_full_disk_is_a_disk_full_error_about_the_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = index_dataset(str(_shards(tmp_path, 3)), "jsonl").manifest
    out = tmp_path / "data.json"
    out.write_text("the old manifest\n")
    real_pwrite, old = os.pwrite, os.stat(out)

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        if os.fstat(fd).st_dev == old.st_dev and os.fstat(fd).st_ino != old.st_ino:  # a new file beside it
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(StorageError) as raised:
        save_dataset_manifest(manifest, out)
    monkeypatch.undo()
    message = str(raised.value)
    assert isinstance(raised.value, DiskFullError), message
    assert "cannot write the dataset manifest" in message and "free space" in message, message
    assert not any(word in message for word in CHECKPOINT_WORDS), message
    assert out.read_text() == "the old manifest\n"
    assert _leftovers(tmp_path) == []


def _daemon(tmp_path: Path) -> tuple[Callable[[], Daemon], Path, list[Path]]:
    """(a factory of the daemon, its state_dir, its two roots), all directories made beforehand."""
    state, roots = tmp_path / "state", [tmp_path / "root-a", tmp_path / "root-b"]
    for directory in (state, *roots):
        directory.mkdir()
    config_file = write_config(tmp_path / "daemon.toml", [{"name": root.name, "local": str(root)} for root in roots],
                               state_dir=str(state), node_id="node-a", listen="127.0.0.1:0", watch="poll",
                               scrub_interval_s=0)
    return lambda: Daemon(load_config(config_file, environ={})), state, roots


def _pid_in(path: Path) -> int | None:
    try:
        return json.loads(path.read_text())["pid"]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("error", [errno.EINVAL, errno.EPERM])
def test_a_daemon_starts_where_no_directory_can_be_fsynced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    make, state, roots = _daemon(tmp_path)
    (state / STATE_FILE).write_text(json.dumps({"pid": 1}))  # a stale one, replaced at start
    refused = fail_directory_fsync(monkeypatch, error, state)
    daemon = make()
    try:
        daemon.start()
        assert refused, "the state_dir's fsync was never attempted"
        assert [_pid_in(path) for path in (state / STATE_FILE, *(root / ROOT_FILE for root in roots))] \
            == [os.getpid()] * 3
    finally:
        daemon.stop(5.0)


def test_an_eio_on_the_state_dir_keeps_the_new_state_file_and_names_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make, state, roots = _daemon(tmp_path)
    (state / STATE_FILE).write_text(json.dumps({"pid": 1}))
    fail_directory_fsync(monkeypatch, errno.EIO, state)
    daemon = make()
    try:
        with pytest.raises(StorageError) as raised:
            daemon.start()
        assert _pid_in(state / STATE_FILE) == os.getpid(), "the state file that replaced the stale one was lost"
    finally:
        daemon.stop(5.0)
    message = str(raised.value)
    assert message.startswith("cannot write the daemon state file: the new file is in place"), message
    assert "may not be durable" in message and str(state / STATE_FILE) in message, message
    assert "state_dir" in message, "the hint says what to do"
    assert not any(word in message for word in CHECKPOINT_WORDS), message
    assert _leftovers(state) == []
