"""Shared-memory segments: staging buffers the trainer fills and the writer process reads.

A :class:`Segment` is a file in the RAM-backed ``/dev/shm`` (the temporary directory where that does not
exist), mapped into memory. The trainer's :class:`~ckptd.state.staging.Stager` allocates each staging
buffer of the writer process's mode in its own segment (:func:`shared_empty`); the writer process maps a
segment by name the first time a save names it (:class:`SegmentCache`). The trainer removes a segment's
file when it frees the buffer (a writer process started after a crash of the previous one maps it again by
name). When the trainer dies, its writer process sees its pipe close and removes the trainer's segment
files (:func:`remove_segments_of`); files left all the same are removed by the next writer process of the
machine (:func:`remove_orphans`), once the process that made them is gone.

Segments start on a page boundary, so the writer sends them to disk with direct I/O without a copy.
Training thread (allocation), writer process (mapping); no thread of its own.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import mmap
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd.errors import ConfigError

if TYPE_CHECKING:
    import torch

#: Every segment's file name starts with it, then the creating process's id and its owner token.
PREFIX = "ckptd-staging-"
#: The owner files' names start with it, then the token (see the module docstring).
OWNER_PREFIX = "ckptd-owner-"
#: An owner file being created (locked, then renamed to its name); one left by a process that died in
#: between is removed once it is this old and unlocked.
_CREATING_PREFIX = ".ckptd-owner-creating-"
_CREATING_STALE_S = 60.0

_owner_lock = threading.Lock()
#: This process's owner: (pid, token, {directory: descriptor holding the shared lock}). A child made by
#: fork() inherits the descriptors (so the lock stays held while it lives) but takes an owner of its own.
_owner: tuple[int, str, dict[str, int]] | None = None


def segment_directory() -> Path:
    """Where segments live: ``/dev/shm`` where it is a writable directory, else the temporary directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


@dataclass
class Segment:
    """One mapped segment: its file name (in :func:`segment_directory`), size and mapping."""

    name: str
    size: int
    memory: mmap.mmap


def _owner_token(directory: Path) -> str:
    """This process's owner token, its owner file in ``directory`` created and locked (shared) if needed."""
    global _owner
    with _owner_lock:
        if _owner is None or _owner[0] != os.getpid():
            _owner = (os.getpid(), uuid.uuid4().hex[:16], {})
        pid, token, held = _owner
        key = str(directory)
        if key not in held:
            # locked before it has its name, so no reaper ever sees it unlocked while this process lives
            creating = directory / f"{_CREATING_PREFIX}{token}"
            fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                os.rename(creating, directory / f"{OWNER_PREFIX}{token}")
            except BaseException:
                os.close(fd)
                creating.unlink(missing_ok=True)
                raise
            held[key] = fd  # open until the process exits: the lock says it lives
        return token


@atexit.register
def _remove_own_owner_files() -> None:
    """At exit: this process's owner files that no segment file names any more go (the others stay, for
    the writer process or the next one to remove with their segments)."""
    with _owner_lock:
        if _owner is None or _owner[0] != os.getpid():
            return
        _, token, held = _owner
        for key in list(held):
            directory = Path(key)
            try:
                named = any(entry.name.startswith(PREFIX) and f"-{token}-" in entry.name
                            for entry in os.scandir(directory))
                if not named:
                    (directory / f"{OWNER_PREFIX}{token}").unlink(missing_ok=True)
            except OSError:
                pass


def _reserve(fd: int, size: int, directory: Path) -> None:
    """Give the file ``size`` bytes, reserved now where the file system can (tmpfs: its pages), so that a
    full ``directory`` fails here and not with SIGBUS at the first write into the mapping."""
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                free = ""
                try:
                    stats = os.statvfs(directory)
                    free = (f" ({stats.f_bavail * stats.f_frsize} of {stats.f_blocks * stats.f_frsize} bytes "
                            "free)")
                except OSError:
                    pass
                raise ConfigError(
                    f"cannot reserve {size} bytes of shared memory in {directory}{free} for a staging buffer "
                    f"of the writer process ({os.strerror(error.errno)})", path=str(directory),
                    hint="give the container a larger /dev/shm (docker run --shm-size=..., e.g. twice the "
                         "checkpointed state), or set CKPTD_WRITER_MODE=thread to stage in ordinary memory"
                ) from error
            if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
                raise
            # a file system without fallocate: nothing can be reserved, only sized
    os.ftruncate(fd, size)


def create_segment(size: int, *, directory: Path | None = None) -> Segment:
    """Create and map a new segment of ``size`` bytes (at least one page) in this process, its memory
    reserved (:class:`~ckptd.errors.ConfigError` when ``directory``, by default :func:`segment_directory`,
    has too little room). ``directory`` other than the default: tests only (the writer process maps
    segments from the default one)."""
    size = max(size, mmap.PAGESIZE)
    directory = segment_directory() if directory is None else directory
    token = _owner_token(directory)
    name = f"{PREFIX}{os.getpid()}-{token}-{uuid.uuid4().hex[:16]}"
    path = directory / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _reserve(fd, size, directory)
        memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return Segment(name, size, memory)


def remove_segment_file(name: str) -> None:
    """Remove a segment's file (its memory stays mapped where it is mapped); missing is fine."""
    (segment_directory() / name).unlink(missing_ok=True)


def shared_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Segment]:
    """An uninitialised CPU tensor in a new segment of its own, and the segment. The tensor keeps the
    mapping alive; the segment's file stays until the writer process maps it (or :func:`remove_segment_file`)."""
    import math

    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    segment = create_segment(nbytes)
    tensor = torch.frombuffer(segment.memory, dtype=torch.uint8, count=nbytes) if nbytes else \
        torch.empty(0, dtype=torch.uint8)
    return tensor.view(dtype).view(shape), segment


class SegmentCache:
    """The writer process's mappings, by segment name: mapped (and their files removed) on first use,
    dropped when a save no longer names them."""

    def __init__(self) -> None:
        self._mapped: dict[str, mmap.mmap] = {}

    def view(self, name: str, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` of segment ``name``, mapping it first if needed."""
        memory = self._mapped.get(name)
        if memory is None:
            memory = self._mapped[name] = self._map(name)
        return memoryview(memory)[offset:offset + length]

    @staticmethod
    def _map(name: str) -> mmap.mmap:
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"not a staging segment name: {name!r}")
        path = segment_directory() / name
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            memory = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return memory

    def keep_only(self, names: set[str]) -> None:
        """Unmap every segment not in ``names`` (its buffer was dropped or replaced by the trainer)."""
        for name in [name for name in self._mapped if name not in names]:
            memory = self._mapped.pop(name)
            try:
                memory.close()
            except BufferError:  # a view still exists; the mapping goes with its last reference
                pass

    def close(self) -> None:
        self.keep_only(set())


def _owner_gone(directory: Path, token: str) -> bool:
    """Whether the owner ``token`` of segment files in ``directory`` is gone: its owner file is missing (its
    segments outlived it) or nobody holds its lock. Never judged by pid (see the module docstring)."""
    try:
        fd = os.open(directory / f"{OWNER_PREFIX}{token}", os.O_RDONLY)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held (shared) by a live process, whatever its PID namespace
    finally:
        os.close(fd)  # the exclusive lock, when taken, goes with it
    return True


def _remove_unowned(directory: Path, prefix: str) -> list[str]:
    """Remove the segment files starting with ``prefix`` whose owner is gone, then those owners' files
    (and owner files left half-made long ago); returns the segment names removed."""
    removed: list[str] = []
    try:
        names = [entry.name for entry in os.scandir(directory)]
    except OSError:
        return removed
    gone: dict[str, bool] = {}
    for name in names:
        if not name.startswith(prefix) or not name.startswith(PREFIX):
            continue
        parts = name[len(PREFIX):].split("-")
        if len(parts) != 3:
            continue  # not named after an owner: nothing says whether its creator lives; left alone
        token = parts[1]
        if token not in gone:
            gone[token] = _owner_gone(directory, token)
        if gone[token]:
            (directory / name).unlink(missing_ok=True)
            removed.append(name)
    now = time.time()
    for name in names:
        if name.startswith(OWNER_PREFIX):
            token = name[len(OWNER_PREFIX):]
            if prefix != PREFIX and token not in gone:
                continue  # an owner of other segments than the ones asked about
        elif name.startswith(_CREATING_PREFIX):
            try:
                if now - (directory / name).stat().st_mtime < _CREATING_STALE_S:
                    continue
            except OSError:
                continue
        else:
            continue
        # unlinked while locked exclusively (the lock goes when the descriptor closes)
        try:
            fd = os.open(directory / name, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            (directory / name).unlink(missing_ok=True)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def remove_segments_of(pid: int, *, directory: Path | None = None) -> list[str]:
    """Remove the segment files made by process ``pid`` whose owner is gone (the writer process, once its
    trainer is gone; a live process of another PID namespace with the same pid keeps its files); returns
    their names."""
    directory = segment_directory() if directory is None else directory
    return _remove_unowned(directory, f"{PREFIX}{pid}-")


def remove_orphans(*, directory: Path | None = None) -> list[str]:
    """Remove the segment files whose creating process is gone (it died before a writer removed them),
    and the owner files of processes gone; returns the segment names removed."""
    directory = segment_directory() if directory is None else directory
    return _remove_unowned(directory, PREFIX)
