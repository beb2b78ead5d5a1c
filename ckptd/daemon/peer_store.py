"""The files a daemon serves to its peers, and the rules that keep peer requests inside them.

Namespaces (see :mod:`ckptd.tiers.peer_paths` for the request grammar):

- ``roots/<root name>``: a local root of this node, **read only**, and only its committed steps: a step
  without its manifest is not listed and none of its files is served (a trainer may be writing it).
- ``replicas/<node id>/<root name>``: ``<replica_dir>/<node id>/<root name>``, what that buddy
  replicated here, laid out like a local tier. It is read and written: a file is written under a
  temporary name and renamed into place by a :class:`~ckptd.tiers.local.LocalTier` opened on the
  namespace directory, and only into a step that is not committed (the manifest comes last; a write of
  a committed step's file is refused unless it is an ``if_absent`` write of the very same bytes, which
  is what a retried request finds). The writer may see what it has put in a step it has not committed
  yet (the step in listings, a file's size): the metadata a commit checks.

On every namespace the **bytes** of a file are served only when the file is in a committed step: a read
of a file of an uncommitted step, or of anything outside a step directory (``chunks/``), is refused as
not found, whoever asks.

Safety, on top of the grammar (which already refuses ``..``, separators, NUL and absolute paths after
exactly one percent-decoding): every directory and file on the way must be what it claims, not a
symlink (``lstat``), the real path of every file must stay inside the real path of its namespace root,
and files are opened with ``O_NOFOLLOW``. Errors raised here (all from :mod:`ckptd.errors`) name the
namespace and the path relative to it, never a path of this machine.

Thread safety: every method may run on any thread at once (the HTTP server runs file work on threads).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ckptd.errors import (AlreadyCommittedError, ConfigError, NotFoundError, StorageError, UnsafePathError)
from ckptd.format.layout import MANIFEST_NAME, TEMP_MARKER, parse_step_dir, step_dir
from ckptd.tiers.confined import confined_path
from ckptd.tiers.local import AtomicFile, LocalTier
from ckptd.tiers.peer_paths import PeerPath

_HASH_BLOCK = 4 * 1024 * 1024


@dataclass(frozen=True)
class Namespace:
    """A resolved namespace: its name, its directory (a real path, which may not exist yet for a replica
    namespace) and whether peers may write into it."""

    name: str
    directory: Path
    writable: bool


class PeerNamespaces:
    """Resolves namespaces and paths to files under the configured roots, or raises (see the module
    docstring). ``roots``: root name -> local root directory; ``replica_dir``: where buddies' replicas go
    (None: this daemon accepts none)."""

    def __init__(self, roots: dict[str, Path], replica_dir: Path | None) -> None:
        self._roots = {name: Path(os.path.realpath(path)) for name, path in roots.items()}
        self._replicas = Path(os.path.realpath(replica_dir)) if replica_dir is not None else None
        for name, root in self._roots.items():
            if self._replicas is not None and (_within(root, self._replicas) or _within(self._replicas, root)):
                raise ConfigError(f"the replica directory and local root {name!r} overlap: peers that write "
                                  "replicas could write steps into the root (or read it through replicas/)",
                                  path=str(replica_dir), hint="put replica_dir outside every local root, and no "
                                  "root inside it (the default is <state_dir>/replicas)")

    # --- namespaces ----------------------------------------------------------------------------
    def namespace(self, parts: tuple[str, ...]) -> Namespace:
        """The namespace ``parts`` name (already checked by the grammar); NotFoundError if unknown."""
        name = "/".join(parts)
        if parts[0] == "roots":
            if parts[1] not in self._roots:
                raise NotFoundError(f"no root named {parts[1]!r} on this node", path=name,
                                    hint=f"roots served here: {', '.join(sorted(self._roots)) or 'none'}")
            return Namespace(name, self._roots[parts[1]], writable=False)
        if self._replicas is None:
            raise NotFoundError("this node keeps no replicas", path=name, hint="set replica_dir on the buddy")
        return Namespace(name, self._replicas / parts[1] / parts[2], writable=True)

    def _inside(self, namespace: Namespace, path: Path, relative: str) -> Path:
        """``path`` after checking that nothing on the way from the namespace root is a symlink and that
        its real path stays inside the namespace root."""
        confined_path(namespace.directory, path.relative_to(namespace.directory).as_posix(),
                      tier=f"peer namespace {namespace.name}")
        real = os.path.realpath(path)
        if real != str(namespace.directory) and not real.startswith(str(namespace.directory) + os.sep):
            raise UnsafePathError("refusing a path that leaves its namespace", path=relative,
                                  tier=f"peer namespace {namespace.name}")
        return path

    def _committed(self, namespace: Namespace, step: int) -> bool:
        """Whether the step's manifest is a regular file in a real step directory."""
        directory = self._step_directory(namespace, step)
        try:
            return directory is not None and stat.S_ISREG(os.lstat(directory / MANIFEST_NAME).st_mode)
        except OSError:
            return False

    def _step_directory(self, namespace: Namespace, step: int) -> Path | None:
        """The step's directory when it is a real directory inside the namespace, else None."""
        directory = namespace.directory / step_dir(step)
        try:
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                return None
        except OSError:
            return None
        return self._inside(namespace, directory, step_dir(step))

    def _visible_step(self, namespace: Namespace, step: int) -> bool:
        """Whether a peer may see the step in listings and the sizes of its files (not their bytes)."""
        return namespace.writable or self._committed(namespace, step)

    # --- listings ------------------------------------------------------------------------------
    def list_steps(self, namespace: Namespace) -> list[int]:
        """Steps a peer may see: committed ones, and on a replica namespace every step directory."""
        try:
            names = os.listdir(self._inside(namespace, namespace.directory, "."))
        except FileNotFoundError:
            if namespace.writable:
                return []
            raise NotFoundError("the root directory is gone", path=namespace.name) from None
        except OSError as exc:
            raise StorageError(f"cannot list the namespace: {exc.strerror}", path=namespace.name) from exc
        steps = [step for step in map(parse_step_dir, names) if step is not None]
        return sorted(step for step in steps
                      if self._step_directory(namespace, step) is not None and self._visible_step(namespace, step))

    def list_files(self, namespace: Namespace, step: int) -> list[str]:
        """Regular files of a step a peer may see (temporary files excluded); NotFoundError for a step
        that is not committed in a read-only namespace."""
        if not self._visible_step(namespace, step):
            raise NotFoundError("step is not committed", step=step, path=namespace.name)
        directory = self._step_directory(namespace, step)
        if directory is None:
            return []
        names = []
        for name in os.listdir(directory):
            try:
                regular = stat.S_ISREG(os.lstat(directory / name).st_mode)
            except OSError:
                continue
            if regular and TEMP_MARKER not in name:
                names.append(name)
        return sorted(names)

    # --- reading -------------------------------------------------------------------------------
    def _check_readable(self, namespace: Namespace, asked: PeerPath, *, content: bool) -> None:
        """Refuse (NotFoundError) a file whose bytes (``content``) or size a peer may not have."""
        assert asked.relative is not None
        if asked.step is None:  # a chunk: in no step, so never committed
            if content or not namespace.writable:
                raise NotFoundError("file not found: only files of committed steps are served", path=asked.relative)
        elif not (self._committed(namespace, asked.step) if content else self._visible_step(namespace, asked.step)):
            raise NotFoundError("step is not committed; only files of committed steps are served", step=asked.step,
                                path=asked.relative)

    def open_for_read(self, namespace: Namespace, asked: PeerPath, *, content: bool = True) -> tuple[int, int]:
        """An open descriptor of a file a peer may read and its size (the caller closes it). ``content``:
        its bytes are to be sent (only files of committed steps); False: only its size is (a HEAD)."""
        self._check_readable(namespace, asked, content=content)
        return self._open(namespace, asked)

    def _open(self, namespace: Namespace, asked: PeerPath) -> tuple[int, int]:
        assert asked.relative is not None
        path = self._inside(namespace, namespace.directory / asked.relative, asked.relative)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFoundError("file not found", path=asked.relative) from None
        except OSError as exc:
            raise UnsafePathError("refusing a file that cannot be opened without following a link",
                                  path=asked.relative) from exc
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise NotFoundError("file not found", path=asked.relative)
        return fd, info.st_size

    # --- writing -------------------------------------------------------------------------------
    def _writable(self, namespace: Namespace, asked: PeerPath) -> LocalTier:
        if not namespace.writable:
            raise ConfigError("this namespace is read only", path=asked.relative or namespace.name,
                              hint="replicate into replicas/<node id>/<root>")
        self._inside(namespace, namespace.directory, ".")
        return LocalTier(namespace.directory)

    def begin_write(self, namespace: Namespace, asked: PeerPath, *, if_absent: bool) -> AtomicFile:
        """A temporary file to receive a peer's write; :meth:`finish_write` puts it in place. Refuses
        read-only namespaces and committed steps (unless ``if_absent``: then the bytes decide)."""
        tier = self._writable(namespace, asked)
        assert asked.relative is not None
        if asked.step is not None and self._committed(namespace, asked.step) and not if_absent:
            raise AlreadyCommittedError("this step is already committed; a committed step is never rewritten",
                                        step=asked.step, path=asked.relative,
                                        hint="save under a new step number, or delete the step first")
        self._inside(namespace, namespace.directory / asked.relative, asked.relative)
        handle = tier.open_file(asked.relative)
        self._inside(namespace, handle.final, asked.relative)
        return handle

    def finish_write(self, namespace: Namespace, asked: PeerPath, handle: AtomicFile, *, if_absent: bool,
                     digest: bytes) -> None:
        """Rename a received file into place. With ``if_absent`` an existing file is never replaced: the
        write counts as done when it holds the same bytes (``digest``: xxh3-128 of what was received),
        else AlreadyCommittedError."""
        assert asked.relative is not None
        committed = asked.step is not None and self._committed(namespace, asked.step)
        if committed and not if_absent:
            handle.abort()
            raise AlreadyCommittedError("this step was committed while the file was written",
                                        step=asked.step, path=asked.relative)
        try:
            if committed:  # only the very same bytes are accepted, and nothing is renamed
                raise AlreadyCommittedError("the file exists", path=asked.relative)
            handle.commit(if_absent=if_absent)
        except AlreadyCommittedError:
            handle.abort()
            if not self._holds(namespace, asked, handle.size, digest):
                raise AlreadyCommittedError("the file already exists and is never replaced", step=asked.step,
                                            path=asked.relative,
                                            hint="a committed step is immutable; save a new step") from None

    def _holds(self, namespace: Namespace, asked: PeerPath, size: int, digest: bytes) -> bool:
        try:
            fd, found = self._open(namespace, asked)
        except NotFoundError:
            return False
        try:
            if found != size:
                return False
            hasher, offset = xxhash.xxh3_128(), 0
            while offset < size:
                block = os.pread(fd, _HASH_BLOCK, offset)
                if not block:
                    return False
                hasher.update(block)
                offset += len(block)
            return hasher.digest() == digest
        finally:
            os.close(fd)

    def delete(self, namespace: Namespace, asked: PeerPath) -> None:
        """Delete a file (missing is fine). In a committed step only the manifest may go (which uncommits
        the step), so that a committed step is never left without its data."""
        tier = self._writable(namespace, asked)
        assert asked.relative is not None
        if asked.step is not None and self._committed(namespace, asked.step) \
                and asked.relative != f"{step_dir(asked.step)}/{MANIFEST_NAME}":
            raise AlreadyCommittedError("files of a committed step are not deleted one by one", step=asked.step,
                                        path=asked.relative, hint="delete its manifest first")
        self._inside(namespace, namespace.directory / asked.relative, asked.relative)
        tier.delete_files([asked.relative])

    def remove_step_dir(self, namespace: Namespace, step: int) -> None:
        """Remove what is left of an uncommitted step directory."""
        tier = self._writable(namespace, PeerPath(("",), "step", step=step))
        if self._committed(namespace, step):
            raise AlreadyCommittedError("the step is committed", step=step, path=step_dir(step),
                                        hint="delete its manifest first")
        if self._step_directory(namespace, step) is not None:
            tier.remove_step_dir(step)


def _within(path: Path, directory: Path) -> bool:
    """Whether ``path`` is ``directory`` or lies under it (both real paths)."""
    return path == directory or directory in path.parents


__all__ = ["Namespace", "PeerNamespaces"]
