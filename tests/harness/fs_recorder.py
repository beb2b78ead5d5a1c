"""Record the file-system operations ckptd performs under one directory (for crash replay, row 4).

:func:`record` is a context manager that wraps the ``os`` functions ckptd's file layer calls
(:mod:`ckptd.tiers.local`, :mod:`ckptd.tiers.direct_io`, pathlib's ``mkdir``/``unlink``/``rmdir``, which call
``os`` at run time): ``open``, ``write``, ``pwrite``, ``ftruncate``, ``fsync``, ``fdatasync``, ``rename``,
``replace``, ``link``, ``unlink``, ``remove``, ``mkdir``, ``rmdir`` and ``close``. Every call still performs the
real operation; a call on a path under the recorded root (or on a descriptor opened there) is also
logged as an :class:`FsOp`, in the order the calls completed (one lock around call and log, so the log
is a valid order of the operations even when the write pool's threads run them at once).

Files are tracked by identity, not name: a file created during the recording gets a new ``file_id``, a
hard link shares its source's, and a rename moves the name. The files present when the recording starts
are the :class:`Snapshot` (their bytes, ids and the directories), the state every crash state starts
from. Written bytes are kept (crash replay needs them) with their xxh3-64 digest for display.

Operations outside ``os`` (the built-in ``open``, ``mmap``) are not seen; :func:`replay_everything` in
:mod:`harness.crash_states` checks that replaying the whole log reproduces the real directory byte
for byte, so a missed operation shows up as a test failure.
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

#: Operation kinds that change a directory's entries (made durable by an fsync of that directory).
DIRECTORY_OPS = frozenset({"create", "mkdir", "rmdir", "rename", "link", "unlink"})
#: Operation kinds that change a file's bytes or size (made durable by an fsync of that file).
DATA_OPS = frozenset({"write", "truncate"})


@dataclass(frozen=True)
class FsOp:
    """One recorded operation. ``path`` (and ``target`` for rename/link) are relative to the root, in
    POSIX form ("" is the root itself). ``file_id`` names the file a data op or fsync acts on, or the file
    a directory op creates, moves or removes (-1 for directories). ``data`` holds a write's bytes."""

    index: int
    kind: str
    path: str
    target: str = ""
    file_id: int = -1
    fd: int = -1
    offset: int = 0
    length: int = 0
    flags: int = 0
    direct: bool = False
    data: bytes | None = field(default=None, repr=False)
    digest: str = ""
    thread: str = ""

    @property
    def directory(self) -> str:
        """The directory whose entries a directory op changes (a rename's destination directory; the
        fsynced directory of a ``dirsync``)."""
        if self.kind == "dirsync":
            return self.path
        name = self.target if self.kind in ("rename", "link") else self.path
        return _parent(name)

    def describe(self) -> str:
        """One line: what the operation did."""
        where = f"{self.path} -> {self.target}" if self.target else (self.path or ".")
        extra = ""
        if self.kind == "write":
            extra = f" @{self.offset}+{self.length}{' O_DIRECT' if self.direct else ''} xxh3={self.digest}"
        elif self.kind == "truncate":
            extra = f" to {self.length}"
        return f"#{self.index} {self.kind} {where}{extra}"


@dataclass
class Snapshot:
    """The tree under the root when the recording started: directories, and each file's id and bytes."""

    directories: set[str]
    files: dict[str, int]
    contents: dict[int, bytes]

    @classmethod
    def take(cls, root: Path, first_id: int = 0) -> Snapshot:
        directories, files, contents = {""}, {}, {}
        by_inode: dict[int, int] = {}
        next_id = first_id
        for current, dirnames, filenames in os.walk(root):
            relative = _relative_to(Path(current), root)
            for name in dirnames:
                directories.add(_join(relative, name))
            for name in filenames:
                path = Path(current) / name
                info = path.lstat()
                if not stat.S_ISREG(info.st_mode):
                    continue
                if info.st_ino not in by_inode:
                    by_inode[info.st_ino] = next_id
                    contents[next_id] = path.read_bytes()
                    next_id += 1
                files[_join(relative, name)] = by_inode[info.st_ino]
        return cls(directories, files, contents)


@dataclass
class Trace:
    """What :func:`record` saw: the starting snapshot and the operations, in order."""

    root: Path
    snapshot: Snapshot
    ops: list[FsOp] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(1 for op in self.ops if op.kind == kind)

    def summary(self) -> str:
        kinds = sorted({op.kind for op in self.ops})
        return ", ".join(f"{self.count(kind)} {kind}" for kind in kinds)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _join(directory: str, name: str) -> str:
    return f"{directory}/{name}" if directory else name


def _relative_to(path: Path, root: Path) -> str:
    relative = path.relative_to(root).as_posix()
    return "" if relative == "." else relative


class _Recorder:
    """The state behind one :func:`record`: the live namespace (name -> file id) and open descriptors."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))
        self.snapshot = Snapshot.take(self.root)
        self.trace = Trace(self.root, self.snapshot)
        self.names: dict[str, int] = dict(self.snapshot.files)
        self.next_id = max(self.snapshot.contents, default=-1) + 1
        #: fd -> (file id, relative path, direct) for files; (-1, relative path, False) for directories.
        self.fds: dict[int, tuple[int, str, bool]] = {}
        #: fd -> inode it was opened on: a number closed behind the recorder's back and reused is not tracked.
        self.inodes: dict[int, int] = {}
        self.lock = threading.RLock()

    def relative(self, path: Any, dir_fd: int | None = None) -> str | None:
        """``path`` relative to the root, or None when it lies outside."""
        raw = os.fsdecode(os.fspath(path))
        if dir_fd is not None and not os.path.isabs(raw):
            raw = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), raw)
        absolute = os.path.abspath(raw)
        parent, name = os.path.split(absolute)
        resolved = os.path.join(os.path.realpath(parent), name) if name else os.path.realpath(parent)
        root = str(self.root)
        if resolved == root:
            return ""
        if resolved.startswith(root + os.sep):
            return resolved[len(root) + 1:]
        return None

    def log(self, kind: str, path: str, **fields: Any) -> None:
        data = fields.get("data")
        if data is not None:
            fields["digest"] = xxhash.xxh3_64_hexdigest(data)
            fields["length"] = len(data)
        self.trace.ops.append(FsOp(index=len(self.trace.ops), kind=kind, path=path,
                                   thread=threading.current_thread().name, **fields))

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def file_of(self, relative: str) -> int:
        """The id of the file named ``relative`` (a file that existed before the snapshot under a name the
        recorder never saw gets a fresh id with empty contents: :func:`replay_everything` would show it)."""
        if relative not in self.names:
            self.names[relative] = self.new_id()
            self.snapshot.contents[self.names[relative]] = b""
        return self.names[relative]

    def move(self, source: str, target: str, *, keep_source: bool) -> int:
        """Update the namespace for a rename (or a link when ``keep_source``); returns the file id moved
        (-1 for a directory)."""
        if source in self.names:
            file_id = self.names[source]
            self.names[target] = file_id
            if not keep_source:
                del self.names[source]
            return file_id
        prefix = source + "/"
        for name in [n for n in self.names if n.startswith(prefix)]:
            self.names[target + name[len(source):]] = self.names.pop(name)
        return -1


_ACTIVE: _Recorder | None = None
_REAL = {name: getattr(os, name) for name in (
    "open", "write", "pwrite", "ftruncate", "fsync", "fdatasync", "rename", "replace", "link", "unlink",
    "remove", "mkdir", "rmdir", "close")}


def _wrapped_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
    recorder = _ACTIVE
    relative = recorder.relative(path, dir_fd) if recorder is not None else None
    if recorder is None or relative is None:
        return _REAL["open"](path, flags, mode, dir_fd=dir_fd)
    with recorder.lock:
        existed = os.path.lexists(os.path.join(recorder.root, relative))
        fd = _REAL["open"](path, flags, mode, dir_fd=dir_fd)
        info = os.fstat(fd)
        recorder.inodes[fd] = info.st_ino
        if stat.S_ISDIR(info.st_mode):
            recorder.fds[fd] = (-1, relative, False)
            return fd
        if not existed:
            file_id = recorder.new_id()
            recorder.names[relative] = file_id
            recorder.log("create", relative, file_id=file_id, flags=flags)
        else:
            file_id = recorder.file_of(relative)
            if flags & os.O_TRUNC:
                recorder.log("truncate", relative, file_id=file_id, length=0, flags=flags)
        direct = bool(flags & getattr(os, "O_DIRECT", 0))
        recorder.fds[fd] = (file_id, relative, direct)
        return fd


def _tracked(fd: int) -> tuple[_Recorder, tuple[int, str, bool]] | None:
    recorder = _ACTIVE
    if recorder is None or fd not in recorder.fds:
        return None
    try:
        if os.fstat(fd).st_ino != recorder.inodes[fd]:
            return None
    except OSError:
        return None
    return recorder, recorder.fds[fd]


def _direct_now(fd: int, opened_direct: bool) -> bool:
    """Whether a descriptor writes with O_DIRECT now (ckptd turns it off on file systems that refuse it)."""
    return opened_direct and bool(_fcntl_flags(fd) & getattr(os, "O_DIRECT", 0))


def _fcntl_flags(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETFL)


def _wrapped_pwrite(fd: int, data: Any, offset: int) -> int:
    found = _tracked(fd)
    if found is None:
        return _REAL["pwrite"](fd, data, offset)
    recorder, (file_id, relative, direct) = found
    with recorder.lock:
        written = _REAL["pwrite"](fd, data, offset)
        recorder.log("write", relative, file_id=file_id, fd=fd, offset=offset,
                     data=bytes(memoryview(data).cast("B")[:written]), direct=_direct_now(fd, direct))
        return written


def _wrapped_write(fd: int, data: Any) -> int:
    found = _tracked(fd)
    if found is None:
        return _REAL["write"](fd, data)
    recorder, (file_id, relative, direct) = found
    with recorder.lock:
        offset = os.fstat(fd).st_size if _fcntl_flags(fd) & os.O_APPEND else os.lseek(fd, 0, os.SEEK_CUR)
        written = _REAL["write"](fd, data)
        recorder.log("write", relative, file_id=file_id, fd=fd, offset=offset,
                     data=bytes(memoryview(data).cast("B")[:written]), direct=_direct_now(fd, direct))
        return written


def _wrapped_ftruncate(fd: int, length: int) -> None:
    found = _tracked(fd)
    if found is None:
        return _REAL["ftruncate"](fd, length)
    recorder, (file_id, relative, _) = found
    with recorder.lock:
        _REAL["ftruncate"](fd, length)
        recorder.log("truncate", relative, file_id=file_id, fd=fd, length=length)
    return None


def _sync(name: str) -> Any:
    def wrapped(fd: int) -> None:
        found = _tracked(fd)
        if found is None:
            return _REAL[name](fd)
        recorder, (file_id, relative, _) = found
        with recorder.lock:
            _REAL[name](fd)
            if file_id < 0:
                recorder.log("dirsync", relative, fd=fd)
            else:
                recorder.log("fsync", relative, file_id=file_id, fd=fd)
        return None
    wrapped.__name__ = name
    return wrapped


def _wrapped_close(fd: int) -> None:
    recorder = _ACTIVE
    if recorder is None or fd not in recorder.fds:
        return _REAL["close"](fd)
    with recorder.lock:
        _REAL["close"](fd)
        del recorder.fds[fd]
        recorder.inodes.pop(fd, None)
    return None


def _two_paths(name: str, keep_source: bool) -> Any:
    def wrapped(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        recorder = _ACTIVE
        source = recorder.relative(src, kwargs.get("src_dir_fd")) if recorder is not None else None
        target = recorder.relative(dst, kwargs.get("dst_dir_fd")) if recorder is not None else None
        if recorder is None or source is None or target is None:
            if recorder is not None and (source is None) != (target is None):
                raise NotImplementedError(f"os.{name} across the recorded root ({src} -> {dst}) is not modelled")
            return _REAL[name](src, dst, *args, **kwargs)
        with recorder.lock:
            _REAL[name](src, dst, *args, **kwargs)
            file_id = recorder.move(source, target, keep_source=keep_source)
            recorder.log("link" if keep_source else "rename", source, target=target, file_id=file_id)
        return None
    wrapped.__name__ = name
    return wrapped


def _one_path(name: str, kind: str) -> Any:
    def wrapped(path: Any, *args: Any, **kwargs: Any) -> None:
        recorder = _ACTIVE
        relative = recorder.relative(path, kwargs.get("dir_fd")) if recorder is not None else None
        if recorder is None or relative is None:
            return _REAL[name](path, *args, **kwargs)
        with recorder.lock:
            _REAL[name](path, *args, **kwargs)
            file_id = recorder.names.pop(relative, -1) if kind == "unlink" else -1
            recorder.log(kind, relative, file_id=file_id)
        return None
    wrapped.__name__ = name
    return wrapped


_WRAPPERS = {
    "open": _wrapped_open, "write": _wrapped_write, "pwrite": _wrapped_pwrite, "ftruncate": _wrapped_ftruncate,
    "fsync": _sync("fsync"), "fdatasync": _sync("fdatasync"), "close": _wrapped_close,
    "rename": _two_paths("rename", False), "replace": _two_paths("replace", False),
    "link": _two_paths("link", True), "unlink": _one_path("unlink", "unlink"),
    "remove": _one_path("remove", "unlink"), "mkdir": _one_path("mkdir", "mkdir"),
    "rmdir": _one_path("rmdir", "rmdir"),
}
_install_lock = threading.Lock()


@contextmanager
def record(root: str | os.PathLike[str]) -> Iterator[Trace]:
    """Record every file-system operation under ``root`` while the block runs (all threads of this
    process); yields the :class:`Trace`, complete when the block ends. One recording at a time."""
    global _ACTIVE
    with _install_lock:
        if _ACTIVE is not None:
            raise RuntimeError("a file-system recording is already running in this process")
        recorder = _ACTIVE = _Recorder(Path(root))
        for name, wrapper in _WRAPPERS.items():
            setattr(os, name, wrapper)
    try:
        yield recorder.trace
    finally:
        with _install_lock:
            for name, real in _REAL.items():
                setattr(os, name, real)
            _ACTIVE = None
