"""Which ranks share a local-tier directory, and which of them owns it.

A rank's local root may be its own (one NVMe per node), shared by the ranks of its node, or shared by
the whole job (a parallel file system). Path strings cannot tell these apart: ``/nvme/ckpt`` names a
different directory on every node, and one shared directory may be mounted under different paths.
So every directory carries an identity: a random id in the file ``.ckptd-directory-id``, created once
(atomically: the first rank to link its file into place wins, every other rank reads the winner's id).
At construction the ranks exchange their ids through the job's store and group by them.

The lowest rank of each group owns its directory: it alone writes the commit marker there (and, when
the directory holds only some ranks' files, the list of those ranks), applies retention (which deletes
whole steps, every rank's files with them, and uncommitted steps older than the newest committed one) and
re-populates the directory from the object tier, so every directory is bounded by the policy whatever the
layout. Every rank removes its own temporary files at start; the owner also those of the commit marker.
"""

from __future__ import annotations

import errno
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from ckptd.errors import StorageError
from ckptd.manager.set_aside import SET_ASIDE_DIRECTORY, set_aside_step  # noqa: F401  (where callers look)

#: File in a local-tier root that holds the directory's identity.
IDENTITY_FILE = ".ckptd-directory-id"


def directory_identity(root: Path) -> str:
    """The identity of the directory ``root``, created on first use (safe against racing ranks)."""
    final = root / IDENTITY_FILE
    try:
        return _read_identity(final)
    except FileNotFoundError:
        pass
    temporary = root / f"{IDENTITY_FILE}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, uuid.uuid4().hex.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, final)  # fails with EEXIST when another rank was first
        except FileExistsError:
            pass
        return _read_identity(final)
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            return _read_identity(final)
        raise StorageError(f"cannot create the directory identity: {exc.strerror or exc}", path=str(final),
                           tier="local", hint=_unwritable_hint(exc, root)) from exc
    finally:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:  # a read-only or unwritable root: the error above says so
            pass


def _unwritable_hint(exc: OSError, root: Path) -> str:
    """What to do about a local root this process cannot write."""
    if exc.errno == errno.EROFS:
        return (f"{root} is on a read-only file system: remount it read-write or pass a directory on a writable "
                "disk (a new root needs its identity file written once)")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"this process (uid {os.geteuid()}) may not write {root}: make it writable for this user or pass "
                "another local directory")
    return f"the local tier directory {root} must be writable"


def _read_identity(path: Path) -> str:
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StorageError(f"cannot read the directory identity: {exc.strerror or exc}", path=str(path),
                           tier="local", hint=_unwritable_hint(exc, path.parent)) from exc
    if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
        raise StorageError("the directory identity file is damaged", path=str(path), tier="local",
                           hint="delete it; it is re-created on the next start")
    return text


@dataclass(frozen=True)
class DirectorySharing:
    """How the job's ranks map onto local-tier directories, as seen by one rank."""

    rank: int
    #: Identity of each rank's directory, by rank.
    identities: tuple[str, ...]

    @property
    def ranks_here(self) -> tuple[int, ...]:
        """The ranks (this one included) whose local tier is this rank's directory, ascending."""
        mine = self.identities[self.rank]
        return tuple(rank for rank, identity in enumerate(self.identities) if identity == mine)

    @property
    def owner(self) -> int:
        """The rank that owns this rank's directory (the lowest rank using it)."""
        return self.ranks_here[0]

    @property
    def is_owner(self) -> bool:
        return self.owner == self.rank

    @property
    def layout(self) -> str:
        """``"single"``, ``"node-local"`` (one rank per directory), ``"job-shared"`` (one directory) or
        ``"mixed"`` (directories shared by some ranks, e.g. one per node)."""
        count = len(set(self.identities))
        if len(self.identities) == 1:
            return "single"
        if count == len(self.identities):
            return "node-local"
        if count == 1:
            return "job-shared"
        return "mixed"
