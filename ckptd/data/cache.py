"""The local shard cache: a directory of whole shards with a size limit, shared by processes.

Entries are named ``<digest>-<flattened path>``, so two versions of a shard never collide and datasets
with identical shards share them. Writes go to a temporary name and are renamed into place; a per-entry
``flock`` keeps concurrent loaders (ranks on one node, DataLoader workers, prefetch threads) from
fetching the same shard twice; a loader waits for another one's download at most
``CKPTD_DATA_CACHE_LOCK_TIMEOUT_S`` (then DeadlineError naming the entry). When a new shard would push
the cache over its limit, the least recently used entries are deleted first. Readers hold a shard's
bytes in memory, so deleting an entry never breaks a process that is reading it.

The cache does not verify anything itself; :mod:`ckptd.data.fetch` does, on every open.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ckptd.config import settings
from ckptd.data.manifest import ShardRecord
from ckptd.errors import ConfigError, DeadlineError, StorageError

log = logging.getLogger("ckptd.data")

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_TEMP = ".tmp-"
_LOCKS = ".locks"
_SPACE_LOCK = ".space.lock"
QUARANTINE_DIR = "quarantine"
_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.05


def _flock_within(fd: int, timeout_s: float | None) -> bool:
    """Take an exclusive ``flock`` on ``fd``, waiting at most ``timeout_s`` (None: no limit); returns
    whether it was taken. flock has no timed form, so a held lock is polled with a growing pause."""
    if timeout_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    deadline = time.monotonic() + max(0.0, timeout_s)
    pause = _POLL_FIRST_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX_S)


def default_cache_dir() -> Path:
    """``CKPTD_DATA_CACHE_DIR``, or ``~/.cache/ckptd/shards``."""
    configured = settings().data_cache_dir
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ckptd" / "shards"


def entry_name(record: ShardRecord) -> str:
    """File name of a shard in the cache."""
    flat = _UNSAFE.sub("_", record.path.replace("/", "__"))
    return f"{record.digest}-{flat[-150:]}"


class ShardCache:
    """Whole shards on local disk under ``directory``, at most ``limit_bytes`` in total; a lock is waited
    for at most ``lock_timeout_s`` seconds (default ``CKPTD_DATA_CACHE_LOCK_TIMEOUT_S``)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, limit_bytes: int | None = None, *,
                 lock_timeout_s: float | None = None) -> None:
        options = settings()
        self.directory = Path(directory) if directory is not None else default_cache_dir()
        self.limit_bytes = options.data_cache_bytes if limit_bytes is None else limit_bytes
        self.lock_timeout_s = options.data_cache_lock_timeout_s if lock_timeout_s is None else lock_timeout_s
        if self.limit_bytes < 1:
            raise ConfigError(f"the shard cache limit must be positive, got {self.limit_bytes}",
                              hint="set CKPTD_DATA_CACHE_BYTES or cache_bytes=")
        try:
            (self.directory / _LOCKS).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the shard cache: {exc}", path=str(self.directory),
                               hint="pick a writable cache_dir (CKPTD_DATA_CACHE_DIR)") from exc

    def path(self, entry: str) -> Path:
        return self.directory / entry

    @contextlib.contextmanager
    def _flock(self, name: str, what: str, timeout_s: float | None) -> Iterator[None]:
        path = self.directory / _LOCKS / name
        with open(path, "a+b") as handle:
            if not _flock_within(handle.fileno(), timeout_s):
                raise DeadlineError(
                    f"gave up after {timeout_s:g} s waiting for the lock of {what}: another loader (a rank on "
                    "this node, a DataLoader worker or a prefetch thread) still holds it", path=str(path),
                    hint="a download of that shard may hang; raise CKPTD_DATA_CACHE_LOCK_TIMEOUT_S if the "
                    "shard is only slow to fetch")
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def lock(self, entry: str, timeout_s: float | None = None) -> contextlib.AbstractContextManager[None]:
        """Hold the entry's lock (across processes and threads) for a check-then-fetch; waits for another
        holder at most ``timeout_s`` (default :attr:`lock_timeout_s`), then raises
        :class:`~ckptd.errors.DeadlineError` naming the entry."""
        return self._flock(f"{entry}.lock", f"shard cache entry {entry}",
                           self.lock_timeout_s if timeout_s is None else timeout_s)

    def contains(self, entry: str) -> bool:
        return self.path(entry).is_file()

    def read(self, entry: str) -> bytes | None:
        """The cached bytes, or None when the entry is absent. Marks the entry as recently used."""
        target = self.path(entry)
        try:
            data = target.read_bytes()
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            os.utime(target)
        return data

    def store(self, entry: str, data: bytes) -> None:
        """Write an entry atomically, evicting least recently used entries to stay under the limit."""
        if len(data) > self.limit_bytes:
            raise ConfigError(f"shard {entry} ({len(data)} bytes) is larger than the whole shard cache "
                              f"({self.limit_bytes} bytes)", path=str(self.directory),
                              hint="raise CKPTD_DATA_CACHE_BYTES or cache_bytes=")
        temporary = self.directory / f"{entry}{_TEMP}{uuid.uuid4().hex[:8]}"
        try:
            temporary.write_bytes(data)
            with self._flock(_SPACE_LOCK, "the shard cache's space accounting", self.lock_timeout_s):
                # eviction and commit are one step for every writer
                self._make_room(len(data), keep=entry)
                os.replace(temporary, self.path(entry))
        except DeadlineError:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        except OSError as exc:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise StorageError(f"writing shard {entry} into the cache failed: {exc}",
                               path=str(self.directory), hint="free disk space or lower the cache limit") from exc

    def discard(self, entry: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(entry).unlink()

    def quarantine(self, entry: str, data: bytes) -> Path:
        """Keep bad bytes aside for inspection (outside the size accounting) and drop the entry."""
        self.discard(entry)
        folder = self.directory / QUARANTINE_DIR
        folder.mkdir(exist_ok=True)
        target = folder / entry
        target.write_bytes(data)
        return target

    def entries(self) -> list[tuple[str, int, float]]:
        """(name, size, last use) of every committed entry."""
        found = []
        for child in self.directory.iterdir():
            if child.name.startswith(".") or _TEMP in child.name or not child.is_file():
                continue
            with contextlib.suppress(FileNotFoundError):
                stat = child.stat()
                found.append((child.name, stat.st_size, stat.st_mtime))
        return found

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def _make_room(self, incoming: int, keep: str) -> None:
        entries = sorted(self.entries(), key=lambda item: item[2])
        used = sum(size for _, size, _ in entries)
        for name, size, _ in entries:
            if used + incoming <= self.limit_bytes:
                break
            if name == keep:
                continue
            self.discard(name)
            used -= size
            log.debug("evicted %s (%d bytes) from the shard cache", name, size)

    def clear(self) -> None:
        """Delete every entry (not the quarantine)."""
        for name, _, _ in self.entries():
            self.discard(name)
        shutil.rmtree(self.directory / _LOCKS, ignore_errors=True)
        (self.directory / _LOCKS).mkdir(exist_ok=True)
