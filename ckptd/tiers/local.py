"""The local tier: a directory on node-local disk (a path or a ``file://`` URL).

Files are committed the file-system way: write to a temporary name in the same directory, fsync the
file, rename it over the final name, fsync the directory (and, after creating a directory, the
directory holding it: see :func:`make_directory`). A crash at any moment leaves either the old
state or the new one plus a temporary file, which :meth:`LocalTier.remove_temporaries` deletes on the
next start. A per-rank lock file (``flock``) keeps two writers of the same rank out of one directory; forked
children (DataLoader workers) close their copies, so the lock ends with the process that took it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec

from ckptd._types import Buffer
from ckptd.config import settings
from ckptd.errors import (AlreadyCommittedError, ConfigError, DiskFullError, IntegrityError, LockedError,
                          NotFoundError, StorageError, UnsafePathError)
from ckptd.format.layout import TEMP_MARKER, parse_step_dir, step_dir
from ckptd.tiers import direct_io
from ckptd.tiers.base import StorageTier, TierCapabilities
from ckptd.tiers.confined import confined_path

log = logging.getLogger("ckptd.tiers")

#: errno values of an fsync of a directory that cannot be done at all (not a failed write-back: EIO).
_UNSYNCABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EINVAL})
#: errno values of file systems that refuse hard links (FAT, some FUSE and network mounts).
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK})


def local_root(url: str) -> Path:
    """The directory a local path or ``file://`` URL names."""
    fs, path = fsspec.core.url_to_fs(url)
    if "file" not in fs.protocol and "local" not in fs.protocol:
        raise ConfigError(f"{url!r} is not a local path", hint="give a directory or a file:// URL")
    return Path(path)


def _step_of(path: Path | str) -> int | None:
    """The step a path of the local tier belongs to (a step directory or a file in one), if any."""
    where = Path(path)
    step = parse_step_dir(where.name)
    return step if step is not None else parse_step_dir(where.parent.name)


_KEPT = "older committed steps were kept"
#: What failed when a file replaced an existing one and only the fsync of its directory then failed.
_REPLACED_NOT_DURABLE = ("the new file is in place (it replaced the old one) but its directory entry may not be "
                        "durable: the fsync of the directory")


def _storage_error(exc: OSError, path: Path | str, what: str) -> StorageError:
    """The ckptd error for a failed file-system call, naming the file, its step and the tier."""
    where = {"path": str(path), "step": _step_of(path), "tier": "local"}
    if exc.errno == errno.ENOSPC:
        return DiskFullError(f"disk full while {what}", **where, hint=f"free space or lower keep_local; {_KEPT}")
    if exc.errno == errno.EDQUOT:
        return DiskFullError(f"disk full (quota exceeded) while {what}", **where,
                             hint=f"raise the quota, free space or lower keep_local; {_KEPT}")
    hint = None
    if exc.errno == errno.EROFS:
        hint = f"the file system is read-only (remounted after errors?): fix it or move the local tier; {_KEPT}"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        hint = (f"this process (uid {os.geteuid()}) may not write there: make the directory writable for it "
                f"or pass another local directory; {_KEPT}")
    elif exc.errno == errno.EIO and what.startswith(("fsync", "committing (fsync")):
        # After a failed fsync the kernel may have dropped the dirty pages and a second fsync "succeeds":
        # the bytes are unknown, so the file is never fsynced again and trusted.
        hint = ("the disk reported a write-back error, so the file's bytes may be lost: the step was not "
                f"committed and is not retried (check the disk, e.g. dmesg); save a new step; {_KEPT}")
    elif exc.errno == errno.EIO and what.startswith(_REPLACED_NOT_DURABLE):
        hint = "the disk reported an I/O error (check it, e.g. dmesg), then write the file again"
    return StorageError(f"{what} failed: {exc.strerror or exc}", **where, hint=hint)


#: How :class:`AtomicFile` turns a failed file-system call into an error: (the error, the path, what was
#: being done) -> the :class:`StorageError` to raise. The default, :func:`_storage_error`, speaks of the
#: checkpoint tier; :func:`write_file_atomically` with ``what=`` speaks of the caller's file instead.
ErrorFactory = Callable[[OSError, Path, str], StorageError]


def _small_file_error(file: Path, what: str, hint: str | None) -> ErrorFactory:
    """An :data:`ErrorFactory` for ``file`` when it is not part of a checkpoint (a dataset manifest, a
    daemon's state file): the message names ``what`` the file is and its path (also where its directory
    failed), the hint says what the errno calls for and then ``hint`` (the caller's advice)."""

    def error(exc: OSError, path: Path, doing: str) -> StorageError:
        cause = None
        kind: type[StorageError] = StorageError
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            kind = DiskFullError
            cause = "the file system is full (or the quota exceeded): free space there"
        elif exc.errno == errno.EROFS:
            cause = "the file system is read-only"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            cause = f"this process (uid {os.geteuid()}) may not write there"
        elif exc.errno == errno.EIO:
            cause = "the disk reported an I/O error (check it, e.g. dmesg)"
        advice = "; ".join(part for part in (cause, hint) if part) or None
        return kind(f"cannot write the {what}: {doing} failed: {exc.strerror or exc}", path=str(file),
                    hint=advice)

    return error


def file_in_the_way(directory: Path) -> Path | None:
    """``directory`` itself, or the nearest of its parents, when it exists and is not a directory (so
    ``directory`` cannot be one); None otherwise."""
    for path in (directory, *directory.parents):
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError:  # not reachable (ENOTDIR of a file above, EACCES): a parent decides
            continue
        return None if stat.S_ISDIR(mode) else path
    return None


def fsync_directory(directory: Path) -> None:
    """fsync a directory, making the names created, renamed or removed in it durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_directory(directory: Path) -> None:
    """Create ``directory`` and its missing parents durably: after each ``mkdir`` the directory holding the
    new one is fsynced, since fsyncing files inside a new directory, or the directory itself, does not
    make its own name durable (a power loss could take a committed step's whole directory away).

    When ``directory`` already exists its parent is fsynced too: the process that created it may have
    been killed before its fsync (a kill keeps the entry in the page cache, not on disk), and the files
    committed into it now are only as durable as its name. That fsync is best effort where it cannot be
    done at all (:data:`_UNSYNCABLE`: a parent this process may not open, such as a directory made for
    it by an administrator with mode ``--x``; a read-only file system; one that cannot fsync
    directories), so that such a root still opens for restores: whoever made the directory there did."""
    missing = []
    current = directory
    while not current.is_dir():
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            if not path.is_dir():
                raise
        fsync_directory(path.parent)
    if not missing:
        try:
            fsync_directory(directory.parent)
        except OSError as exc:
            if exc.errno not in _UNSYNCABLE:
                raise


def _unlink_if_same_file(path: Path, written: os.stat_result) -> None:
    """Unlink ``path`` only while it is still the file ``written`` describes: another writer may have
    renamed its own file over the name since."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return
    if (now.st_dev, now.st_ino) == (written.st_dev, written.st_ino):
        path.unlink(missing_ok=True)


class AtomicFile:
    """A file written piece by piece under a temporary name and renamed into place on :meth:`commit`.

    :meth:`write` appends from one thread. For parallel writing, threads claim ranges with
    :meth:`reserve` and fill them with :meth:`write_at` (both thread-safe); the owner calls
    :meth:`commit` or :meth:`abort` only after every :meth:`write_at` has returned.

    With ``direct=True`` the file is written with direct I/O where the file system allows it (see
    :mod:`ckptd.tiers.direct_io`): only through :meth:`reserve` and :meth:`write_at`, every range
    reserved in multiples of :data:`~ckptd.tiers.direct_io.ALIGNMENT` and zero-padded to its end.
    """

    def __init__(self, final: Path, *, direct: bool = False, error: ErrorFactory = _storage_error) -> None:
        self.final = final
        self._error = error
        self.temporary = final.with_name(f"{final.name}{TEMP_MARKER}{uuid.uuid4().hex[:12]}")
        self.size = 0
        self.aligned = direct
        self._reserve_lock = threading.Lock()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self._fd: int | None
            if direct:
                self._fd, self.direct = direct_io.open_direct(self.temporary, flags)
            else:
                self._fd, self.direct = os.open(self.temporary, flags, 0o644), False
        except OSError as exc:
            raise self._error(exc, final, "creating a file") from exc

    def write(self, data: Buffer) -> int:
        """Append bytes; returns the offset they start at."""
        if self.aligned:
            raise RuntimeError("a direct-I/O file is written with reserve() and write_at()")
        offset = self.size
        view = memoryview(data).cast("B")
        try:
            direct_io.pwrite_all(self._fd, view, offset)  # type: ignore[arg-type]
        except OSError as exc:
            self.abort()
            raise self._error(exc, self.final, "writing") from exc
        self.size += len(view)
        return offset

    def reserve(self, length: int) -> int:
        """Claim ``length`` bytes (rounded up to the alignment on a direct file) at the end of the file
        for :meth:`write_at`; returns their offset."""
        if self.aligned:
            length = direct_io.align_up(length)
        with self._reserve_lock:
            offset = self.size
            self.size += length
        return offset

    def write_at(self, offset: int, data: Buffer) -> None:
        """Write bytes into a range claimed with :meth:`reserve`. Several threads may write different
        ranges at once; on failure the file is left for the owner to :meth:`abort`."""
        if self.direct:
            try:
                direct_io.pwrite_direct(self._fd, data, offset)  # type: ignore[arg-type]
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise self._error(exc, self.final, "writing") from exc
                direct_io.stop_direct(self._fd)  # type: ignore[arg-type]
                self.direct = False
        try:
            direct_io.pwrite_all(self._fd, memoryview(data).cast("B"), offset)  # type: ignore[arg-type]
        except OSError as exc:
            raise self._error(exc, self.final, "writing") from exc

    def commit(self, *, sync_directory: bool = True, if_absent: bool = False) -> None:
        """fsync, rename over the final name, fsync the directory (unless the caller syncs it once after
        committing several files).

        With ``if_absent=True`` an existing final file is kept and :class:`AlreadyCommittedError` raised:
        the temporary is hard-linked to the final name, which the kernel refuses atomically when the name
        exists, and then unlinked.

        The directory fsync is best effort where it cannot be done at all (:data:`_UNSYNCABLE`, as in
        :func:`make_directory`: a directory this process may not open for reading, a file system that cannot
        fsync directories). When it fails otherwise (EIO), a file that was new is unlinked again (the commit
        did not happen; nothing was there before), but a file that replaced an existing one stays: the old
        copy went with the rename, so unlinking would lose both. Then the error says that the new file is in
        place but its directory entry may not be durable (after a power loss the old copy may be back)."""
        phase, placed, replaced = "fsync of the file", False, False
        try:
            if self.aligned:  # the last range may have been written unpadded, through the page cache
                os.ftruncate(self._fd, self.size)  # type: ignore[arg-type]
            os.fsync(self._fd)  # type: ignore[arg-type]
            written = os.fstat(self._fd)  # type: ignore[arg-type]
            os.close(self._fd)  # type: ignore[arg-type]
            self._fd = None
            phase = "renaming into place"
            if if_absent:
                self._link_into_place()
            else:
                replaced = os.path.lexists(self.final)
                os.replace(self.temporary, self.final)
            placed = True
            if sync_directory:
                phase = "fsync of the directory"
                self._sync_directory()
        except OSError as exc:
            self.abort()
            if placed and replaced:
                raise self._error(exc, self.final, _REPLACED_NOT_DURABLE) from exc
            if placed:  # the rename may not survive a power loss: the commit did not happen
                _unlink_if_same_file(self.final, written)
            where = self.final.parent if phase == "fsync of the directory" else self.final
            raise self._error(exc, where, f"committing ({phase})") from exc

    def _sync_directory(self) -> None:
        try:
            fsync_directory(self.final.parent)
        except OSError as exc:
            if exc.errno not in _UNSYNCABLE:
                raise
            log.debug("the directory of %s cannot be fsynced (%s); its entry is as durable as the file system "
                      "makes it", self.final, exc.strerror)

    def _link_into_place(self) -> None:
        try:
            os.link(self.temporary, self.final)
        except FileExistsError:
            self.abort()
            raise AlreadyCommittedError("the file already exists and is never replaced", path=str(self.final),
                                        tier="local", hint="a committed step is immutable; save a new step") \
                from None
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            # File systems without hard links: check, then rename (not race-free between two writers).
            if self.final.exists():
                self.abort()
                raise AlreadyCommittedError("the file already exists and is never replaced",
                                            path=str(self.final), tier="local",
                                            hint="a committed step is immutable; save a new step") from None
            os.replace(self.temporary, self.final)
            return
        self.temporary.unlink()

    def abort(self) -> None:
        """Close and delete the temporary file; the final name is untouched."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.temporary.unlink(missing_ok=True)


def write_file_atomically(path: Path, data: Buffer, *, if_absent: bool = False, sync_directory: bool = True,
                          what: str | None = None, hint: str | None = None) -> None:
    """Write a whole small file (a record, a state file) through :class:`AtomicFile`: a temporary name,
    fsync, rename into place, fsync of the directory (unless the caller syncs it once after writing several
    files; see :meth:`AtomicFile.commit` for a directory that cannot be fsynced). With ``if_absent=True`` an
    existing file is kept and :class:`AlreadyCommittedError` raised.

    Failures raise :class:`StorageError` (:class:`DiskFullError` when the disk is full) naming the file. By
    default the error speaks of the checkpoint's local tier; a caller writing another kind of file names it
    with ``what`` (``"dataset manifest"``: "cannot write the dataset manifest: ...") and says what to do with
    ``hint``. When the file replaced an existing one and only the directory fsync failed, the new file stays
    in place and the error says so."""
    error = _storage_error if what is None else _small_file_error(path, what, hint)
    handle = AtomicFile(path, error=error)
    handle.write(data)
    handle.commit(if_absent=if_absent, sync_directory=sync_directory)


class LocalTier(StorageTier):
    """Checkpoints in a directory on local disk."""

    kind = "local"
    capabilities = TierCapabilities(conditional_put=True, node_local=True)

    def __init__(self, url: str | os.PathLike[str], *, create: bool = True) -> None:
        super().__init__(str(url))
        self.root = local_root(str(url))
        blocker = file_in_the_way(self.root)
        if blocker is not None:
            what = "is a file" if blocker == self.root else f"lies under {blocker}, which is a file"
            raise StorageError(f"the local checkpoint root {what}, not a directory", path=str(self.root),
                               tier="local", hint="pass a directory (a checkpoint root holds step-* directories)")
        if not create and not self.root.is_dir():
            raise NotFoundError("checkpoint directory does not exist", path=str(self.root), tier="local",
                                hint="check the path")
        try:
            make_directory(self.root)
        except OSError as exc:
            raise _storage_error(exc, self.root, "creating the checkpoint directory") from exc
        self._locks: dict[int, int] = {}
        #: Ranks opened without their writer lock (the root was read-only); taken before the next write.
        self._unlocked: set[int] = set()
        self._unlocked_guard = threading.Lock()
        #: Step directories made durable by :meth:`open_file`, with the inode they had then.
        self._durable_directories: dict[Path, int] = {}
        self._durable_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None = None,
                 create: bool = False) -> LocalTier:
        return cls(url, create=create)

    def _path(self, path: str) -> Path:
        return confined_path(self.root, path, tier=self.label)

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._path(path), "rb") as handle:
                handle.seek(offset)
                if length is None:
                    return handle.read()
                # a bound above the size (a metadata read's) must not allocate the whole bound first
                return handle.read(max(0, min(length, os.fstat(handle.fileno()).st_size - offset)))
        except FileNotFoundError as exc:
            raise NotFoundError("file not found", path=path, tier=self.label) from exc
        except OSError as exc:
            raise _storage_error(exc, path, "reading") from exc

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        """Large reads at aligned offsets use direct I/O where the file system allows it (see
        :mod:`ckptd.tiers.direct_io`), others the page cache."""
        options = settings()
        direct = (options.direct_io and offset % direct_io.ALIGNMENT == 0
                  and len(buffer) >= options.direct_io_min_bytes)
        try:
            if direct:
                fd, direct = direct_io.open_direct(self._path(path), os.O_RDONLY)
            else:
                fd = os.open(self._path(path), os.O_RDONLY)
        except FileNotFoundError as exc:
            raise NotFoundError("file not found", path=path, tier=self.label) from exc
        try:
            done = self._read_direct(fd, offset, buffer) if direct else None
            if done is None:
                done = direct_io.pread_full(fd, buffer, offset)
        finally:
            os.close(fd)
        if done < len(buffer):
            raise IntegrityError("file is shorter than its index says", path=path, tier=self.label,
                                 expected=str(offset + len(buffer)), actual=str(offset + done))

    @staticmethod
    def _read_direct(fd: int, offset: int, buffer: memoryview) -> int | None:
        """Bytes of ``buffer`` filled by a direct read; None when the file system refuses direct reads
        (the descriptor is then switched to the page cache)."""
        try:
            return direct_io.pread_direct(fd, buffer, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            direct_io.stop_direct(fd)
            return None

    def size(self, path: str) -> int:
        try:
            return self._path(path).stat().st_size
        except FileNotFoundError as exc:
            raise NotFoundError("file not found", path=path, tier=self.label) from exc

    def exists(self, path: str) -> bool:
        try:
            return self._path(path).is_file()
        except UnsafePathError as error:  # a linked manifest: the step is not committed here
            log.warning("%s", error)
            return False

    def list_step_numbers(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except OSError as exc:
            raise _storage_error(exc, self.root, "listing") from exc
        steps = (parse_step_dir(name) for name in names)
        return sorted(step for step in steps if step is not None and self._is_real_directory(step_dir(step)))

    def _is_real_directory(self, name: str) -> bool:
        """Whether ``name`` under the root is a directory and not a symbolic link to one."""
        try:
            return stat.S_ISDIR(os.lstat(self.root / name).st_mode)
        except OSError:
            return False

    def list_files(self, step: int) -> list[str]:
        directory = self.root / step_dir(step)
        if not self._is_real_directory(step_dir(step)):
            return []
        return sorted(name for name in os.listdir(directory) if TEMP_MARKER not in name)

    def age_s(self, path: str) -> float | None:
        try:
            return time.time() - self._path(path).stat().st_mtime
        except OSError:
            return None

    def step_modified(self, step: int) -> float | None:
        directory = self.root / step_dir(step)
        try:
            return max([directory.stat().st_mtime] + [entry.stat().st_mtime for entry in directory.iterdir()])
        except OSError:
            return None

    def open_file(self, path: str, *, direct: bool = False) -> AtomicFile:
        """Start writing a file that becomes visible only on :meth:`AtomicFile.commit` (with direct I/O
        where possible when ``direct``; see :class:`AtomicFile`)."""
        target = self._path(path)
        self._lock_before_writing()
        try:
            self._make_durable_directory(target.parent)
        except OSError as exc:
            raise _storage_error(exc, target.parent, "creating a step directory") from exc
        return AtomicFile(target, direct=direct)

    def _make_durable_directory(self, directory: Path) -> None:
        """:func:`make_directory`, once per directory (and again if it was removed and made anew)."""
        try:
            inode = os.stat(directory).st_ino
        except FileNotFoundError:
            inode = None
        if inode is not None and self._durable_directories.get(directory) == inode:
            return
        with self._durable_lock:
            make_directory(directory)
            self._durable_directories[directory] = os.stat(directory).st_ino

    def write_bytes(self, path: str, data: Buffer, *, if_absent: bool = False) -> None:
        if if_absent and self.exists(path):  # early answer; the hard link in commit() is the real check
            self._refuse_unless_identical(path, data)
            return
        handle = self.open_file(path)
        handle.write(data)
        try:
            handle.commit(if_absent=if_absent)
        except AlreadyCommittedError:
            self._refuse_unless_identical(path, data)

    def delete_files(self, paths: list[str]) -> None:
        self._lock_before_writing()
        parents = set()
        for path in paths:
            target = self._path(path)
            try:
                target.unlink(missing_ok=True)
            except OSError as exc:
                raise _storage_error(exc, target, "deleting") from exc
            parents.add(target.parent)
        for parent in parents:
            if parent.is_dir():
                try:
                    fsync_directory(parent)
                except OSError as exc:
                    raise _storage_error(exc, parent, "fsync of the directory after deleting") from exc

    def remove_step_dir(self, step: int) -> None:
        directory = self.root / step_dir(step)
        if not directory.is_dir():
            return
        self._durable_directories.pop(directory, None)
        for leftover in directory.iterdir():
            leftover.unlink(missing_ok=True)
        try:
            directory.rmdir()
        except OSError:
            pass  # another rank is still writing into it

    def remove_temporaries(self, name_prefixes: tuple[str, ...]) -> list[str]:
        """Delete temporary files left by a crash whose names start with one of the prefixes."""
        removed = []
        for step in self.list_step_numbers():
            directory = self.root / step_dir(step)
            for name in os.listdir(directory):
                if TEMP_MARKER in name and name.startswith(name_prefixes):
                    (directory / name).unlink(missing_ok=True)
                    removed.append(f"{step_dir(step)}/{name}")
        return removed

    # --- writer lock -------------------------------------------------------------------------
    def acquire_lock(self, rank: int) -> None:
        """Take the writer lock of ``rank`` in this directory, or raise LockedError."""
        lock_path = self.root / f".lock-rank-{rank:05d}"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno == errno.EROFS:  # nobody writes through a read-only mount: restores may go on
                if rank not in self._unlocked:
                    log.warning("%s is on a read-only file system: opened without the writer lock of rank %d; "
                                "restores work, saves fail until it is writable", self.root, rank)
                self._unlocked.add(rank)
                return
            raise _storage_error(exc, lock_path, "creating the lock file") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockedError(
                f"another checkpoint manager ({holder}) is writing rank {rank} in this directory",
                path=str(self.root), tier="local",
                hint="stop the other job or give this one its own directory") from None
        try:  # who holds the lock, for the error of a second manager; best effort (the disk may be full)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        except OSError:
            pass
        self._locks[rank] = fd
        self._unlocked.discard(rank)
        _LOCK_HOLDERS.add(self)

    def _lock_before_writing(self) -> None:
        """Take the writer locks skipped because the root was read-only, before anything is written: a file
        system remounted read-write may meanwhile have let another manager take them (LockedError)."""
        if not self._unlocked:
            return
        with self._unlocked_guard:
            for rank in sorted(self._unlocked):
                self.acquire_lock(rank)

    def _drop_inherited_locks(self) -> None:
        """In a forked child: close the inherited lock descriptors without unlocking (an unlock would
        release the parent's lock, which the child shares), so the lock ends with the process that took
        it and not with its last DataLoader worker."""
        for fd in self._locks.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._locks.clear()

    def release_locks(self) -> None:
        for fd in self._locks.values():
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._locks.clear()

    def close(self) -> None:
        self.release_locks()


#: Tiers holding writer locks in this process; a forked child closes its copies of their descriptors.
_LOCK_HOLDERS: weakref.WeakSet[LocalTier] = weakref.WeakSet()


def _close_locks_in_child() -> None:
    for tier in list(_LOCK_HOLDERS):
        tier._drop_inherited_locks()
    _LOCK_HOLDERS.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)
