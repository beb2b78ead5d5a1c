"""Fault injectors around the real file layer: hold or fail the writes of chosen steps, or make its
system calls fail with an errno.

:class:`WriteFaults` wraps :meth:`ckptd.tiers.local.AtomicFile.write_at` (the call that writes every
chunk of a step's data files) for as long as it is installed. A write into a chosen step's data file
either blocks until :meth:`WriteFaults.release` (``hang_steps``) or raises the
:class:`~ckptd.errors.StorageError` that a disk I/O error would raise (``fail_steps``); every other write
goes to the real file unchanged. It patches the class, so it acts on every tier of the process; install
it in the process (or the rank) whose writes should misbehave.

Use it as a context manager (it releases held writes and restores the real method on exit)::

    with WriteFaults(hang_steps={2}) as faults:
        manager.save(2, state)
        faults.entered.wait(10)     # the write of step 2 is now held
        ...
        faults.release()

:class:`FaultyDisk` goes one level lower: it stands in for the ``os`` module of the local tier, so that
the real ``write``/``pwrite``/``fsync``/``replace``/``link`` of chosen files fail with a chosen errno
(EIO, ENOSPC, EROFS, EDQUOT, ...) or writes run out of space after a byte budget. It needs no root and
no special file system; a real small tmpfs (:func:`harness.fixtures.mounted_tmpfs`) is the
root-only complement::

    with FaultyDisk(rules=[ErrnoRule("fsync", errno.EIO, step=2, name="rank-*.data")]) as disk:
        manager.save(2, state)      # fails with a StorageError naming the file, step 2 and the tier
"""

from __future__ import annotations

import collections
import errno
import fnmatch
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptd.errors import StorageError
from ckptd.format.layout import TEMP_MARKER, parse_step_dir, step_dir
from ckptd.tiers.local import AtomicFile


class WriteFaults:
    """Holds (``hang_steps``) or fails (``fail_steps``) writes into the data files of those steps."""

    def __init__(self, *, hang_steps: Iterable[int] = (), fail_steps: Iterable[int] = (),
                 hang_limit_s: float = 120.0) -> None:
        self.hang_dirs = {step_dir(step) for step in hang_steps}
        self.fail_dirs = {step_dir(step) for step in fail_steps}
        self.hang_limit_s = hang_limit_s
        #: Set when a write was first held.
        self.entered = threading.Event()
        self._released = threading.Event()
        self._original: Any = None
        #: Data files whose write failed on purpose.
        self.failed: list[str] = []

    def install(self) -> WriteFaults:
        if self._original is not None:
            return self
        original = self._original = AtomicFile.write_at
        faults = self

        def write_at(handle: AtomicFile, offset: int, data: Any) -> None:
            parent = handle.final.parent.name
            if parent in faults.fail_dirs:
                faults.failed.append(handle.final.name)
                raise StorageError("writing failed: [Errno 5] Input/output error (injected)",
                                   path=f"{parent}/{handle.final.name}", tier="local")
            if parent in faults.hang_dirs:
                faults.entered.set()
                faults._released.wait(faults.hang_limit_s)
            original(handle, offset, data)

        AtomicFile.write_at = write_at  # type: ignore[method-assign]
        return self

    def release(self) -> None:
        """Let held writes (and later ones) go on."""
        self._released.set()

    def uninstall(self) -> None:
        self.release()
        if self._original is not None:
            AtomicFile.write_at = self._original  # type: ignore[method-assign]
            self._original = None

    def __enter__(self) -> WriteFaults:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


# --- errno injection in the file layer ---------------------------------------------------------------
#: The calls of the file layer a rule can fail, by operation.
_OPERATIONS = {"open": ("open",), "write": ("write", "pwrite"), "fsync": ("fsync", "fdatasync"),
               "rename": ("replace", "rename", "link")}
#: Errors a file system gives only to calls that write (an open for reading still works).
_WRITE_ONLY_ERRORS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT})
_OPERATION_OF = {call: operation for operation, calls in _OPERATIONS.items() for call in calls}


@dataclass(frozen=True)
class ErrnoRule:
    """Fail a file-layer call with ``error`` (an errno value).

    ``operation``: ``"open"``, ``"write"`` (``write``/``pwrite``), ``"fsync"`` (``fsync``/``fdatasync``) or
    ``"rename"`` (``replace``/``rename``/``link``, matched on the target). ``step``: only files of that step
    directory (None: any). ``name``: an ``fnmatch`` pattern over the file's final name (its temporary
    suffix stripped); ``"."`` names the step directory itself (a directory fsync). ``skip``: matching
    calls let through first. ``times``: matching calls failed after those (None: every one).
    """

    operation: str
    error: int
    step: int | None = None
    name: str = "*"
    skip: int = 0
    times: int | None = 1

    def __post_init__(self) -> None:
        if self.operation not in _OPERATIONS:
            raise ValueError(f"unknown operation {self.operation!r}; choose from {sorted(_OPERATIONS)}")


def _whereabouts(path: Path) -> tuple[int | None, str]:
    """(step, name) of a path of the local tier: a step directory is (step, "."), a file in one is
    (step, final name); anything else has no step."""
    step = parse_step_dir(path.name)
    if step is not None and TEMP_MARKER not in path.name:
        return step, "."
    return parse_step_dir(path.parent.name), path.name.split(TEMP_MARKER, 1)[0]


class FaultyDisk:
    """Stands in for the ``os`` module inside :mod:`ckptd.tiers.local` and :mod:`ckptd.tiers.direct_io`:
    every call is the real one, except that

    - writes stop with ENOSPC once ``budget`` bytes are written (the last write partial, as on a real full
      disk; None: no budget);
    - a call that matches an :class:`ErrnoRule` raises ``OSError(rule.error)`` instead of running. An
      fsync failed with EIO also drops the file's unsynced bytes (it is overwritten with zeros, as Linux
      drops dirty pages after a writeback error: the "fsyncgate" lesson), so that trusting a retried
      fsync would restore wrong bytes.

    ``written`` counts the bytes that reached the disk; ``calls`` counts the calls of each operation on the
    tier's files (a dry run tells a rule's ``skip`` how far a save goes; opens that only read count as
    ``"open (reading)"``); ``injected`` lists (call, path,
    errno) of every failure raised on purpose. Install it with :meth:`install` (or ``with``); it patches module
    attributes, so it acts on every tier of the process (install it in the process, or rank, whose
    disk should fail). Thread-safe: the write pool's threads go through it at once.
    """

    def __init__(self, budget: int | None = None, rules: Iterable[ErrnoRule] = ()) -> None:
        self.budget, self.rules = budget, tuple(rules)
        self.written = 0
        self.calls: collections.Counter[str] = collections.Counter()
        self.injected: list[tuple[str, str, int]] = []
        self._seen = [0] * len(self.rules)
        self._paths: dict[int, Path] = {}
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    # --- install --------------------------------------------------------------------------------
    def install(self) -> FaultyDisk:
        from ckptd.tiers import direct_io, local

        if not self._saved:
            for module in (local, direct_io):
                self._saved.append((module, module.os))
                module.os = self  # type: ignore[assignment]
        return self

    def uninstall(self) -> None:
        for module, original in self._saved:
            module.os = original
        self._saved.clear()

    def __enter__(self) -> FaultyDisk:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # --- decisions ------------------------------------------------------------------------------
    def _check(self, call: str, path: Path | None, *, reading: bool = False) -> None:
        """Raise the error of the first rule that matches this call (``reading``: an open that only reads,
        which a read-only, full or over-quota file system still allows)."""
        if path is None:
            return
        step, name = _whereabouts(path)
        with self._lock:
            self.calls["open (reading)" if reading else _OPERATION_OF[call]] += 1
            for number, rule in enumerate(self.rules):
                if call not in _OPERATIONS[rule.operation] or (rule.step is not None and rule.step != step):
                    continue
                if reading and rule.error in _WRITE_ONLY_ERRORS:
                    continue
                if not fnmatch.fnmatchcase(name, rule.name):
                    continue
                self._seen[number] += 1
                seen = self._seen[number] - rule.skip
                if seen <= 0 or (rule.times is not None and seen > rule.times):
                    continue
                self.injected.append((call, str(path), rule.error))
                raise OSError(rule.error, f"{os.strerror(rule.error)} (injected)", str(path))

    def _allowed(self, fd: int, wanted: int) -> int:
        with self._lock:
            if self.budget is None:
                return wanted
            allowed = min(wanted, self.budget - self.written)
            if allowed <= 0 and wanted > 0:
                self.injected.append(("write", str(self._paths.get(fd, "?")), errno.ENOSPC))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return allowed

    def _count(self, done: int) -> int:
        with self._lock:
            self.written += done
        return done

    # --- the calls ------------------------------------------------------------------------------
    def open(self, path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        writes = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        self._check("open", Path(path), reading=not writes)
        fd = os.open(path, flags, mode, **kwargs)
        with self._lock:
            self._paths[fd] = Path(path)
        return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._paths.pop(fd, None)
        os.close(fd)

    def _path_of(self, fd: int) -> Path | None:
        with self._lock:
            return self._paths.get(fd)

    def write(self, fd: int, data: Any) -> int:
        self._check("write", self._path_of(fd))
        view = memoryview(data).cast("B")
        return self._count(os.write(fd, view[:self._allowed(fd, len(view))]))

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        self._check("pwrite", self._path_of(fd))
        view = memoryview(data).cast("B")
        return self._count(os.pwrite(fd, view[:self._allowed(fd, len(view))], offset))

    def _sync(self, call: str, fd: int) -> None:
        path = self._path_of(fd)
        try:
            self._check(call, path)
        except OSError as error:
            if error.errno == errno.EIO and path is not None and path.is_file():
                with open(path, "r+b") as dropped:  # buffered: ``fd`` may be a direct-I/O descriptor
                    dropped.write(bytes(os.fstat(fd).st_size))  # what reads back is not the data
            raise
        getattr(os, call)(fd)

    def fsync(self, fd: int) -> None:
        self._sync("fsync", fd)

    def fdatasync(self, fd: int) -> None:
        self._sync("fdatasync", fd)

    def replace(self, source: Any, target: Any, **kwargs: Any) -> None:
        self._check("replace", Path(target))
        os.replace(source, target, **kwargs)

    def rename(self, source: Any, target: Any, **kwargs: Any) -> None:
        self._check("rename", Path(target))
        os.rename(source, target, **kwargs)

    def link(self, source: Any, target: Any, **kwargs: Any) -> None:
        self._check("link", Path(target))
        os.link(source, target, **kwargs)


class DiskWithBudget(FaultyDisk):
    """A :class:`FaultyDisk` that only runs out of space after ``budget`` bytes (None: counts only)."""

    def __init__(self, budget: int | None) -> None:
        super().__init__(budget=budget)
