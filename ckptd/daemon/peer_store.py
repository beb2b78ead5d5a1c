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

**Only what the manifest names** (:meth:`PeerNamespaces.open_served`): when a committed step's manifest is a
ckptd manifest, only the manifest, the rank indexes it names, the data files those indexes name and the list
of ranks a node directory holds (``ranks-here.json``, served only when it is such a list) are served; any
other file (a hard link of a file from elsewhere, a stray file) is refused as not found and logged. Each is
checked against the records while it is served: the manifest against its own digest, an index against the
size and digest the manifest records, a data file against the size its index records and every chunk of the
range served against its digest (the chunks the range cuts are read whole for the check). A manifest, an
index or a data file of the wrong size that fails is refused (500); a chunk of a data file that fails, and
bytes no chunk covers, are sent as zeros (header ``X-Ckptd-Withheld-Chunks``), so that the reader's own
digest check reads that chunk from another tier, as for a chunk that rotted on its way. Every failure is
logged and counted (``on_verify_failure``). Hard links are legitimate there (pins, steps sharing unchanged
data files), and safe: a linked file is served only when its content matches digests that whoever made the
link had to compute from bytes it could read. A step whose manifest is no ckptd manifest (a peer tier used
as a plain blob store) serves its regular files with one link only.

Safety, on top of the grammar (which already refuses ``..``, separators, NUL and absolute paths after
exactly one percent-decoding): every directory and file on the way must be what it claims, not a
symlink (``lstat``), the real path of every file must stay inside the real path of its namespace root,
and files are opened with ``O_NOFOLLOW``. Errors raised here (all from :mod:`ckptd.errors`) name the
namespace and the path relative to it, never a path of this machine.

Thread safety: every method may run on any thread at once (the HTTP server runs file work on threads).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.errors import (AlreadyCommittedError, CkptdError, ConfigError, IntegrityError, NotFoundError,
                          StorageError, UnsafePathError)
from ckptd.format.hashing import StreamingChunkDigest, chunk_digest
from ckptd.format.layout import MANIFEST_NAME, RANKS_HERE_NAME, TEMP_MARKER, parse_step_dir, step_dir
from ckptd.format.records import FORMAT_NAME, ChunkRecord, Manifest, RankIndex
from ckptd.format.verify import decode_verified
from ckptd.tiers.confined import confined_path
from ckptd.tiers.local import AtomicFile, LocalTier
from ckptd.tiers.peer_paths import PeerPath

_HASH_BLOCK = 4 * 1024 * 1024
#: Steps whose parsed records are kept per daemon (a restore reads one step's files many times).
_CACHED_STEPS = 8
#: Largest ranks-here file served (a list of rank numbers).
_RANKS_FILE_MAX_BYTES = 64 * 1024
log = logging.getLogger("ckptd.daemon.peer")


@dataclass(frozen=True)
class ServedFile:
    """A file a peer may read: its open descriptor (the caller closes it), size and how it is checked.

    ``kind``: ``manifest`` / ``index`` (``content`` holds its checked bytes, sent as they are), ``data``
    (``chunks``: the chunks stored in it, checked as ranges are served) or ``blob`` (a step with no ckptd
    manifest: sent as it is)."""

    fd: int
    size: int
    kind: str
    relative: str
    step: int | None = None
    content: bytes | None = None
    chunks: tuple[ChunkRecord, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class _Named:
    """What a committed step's records name: file name -> (kind, expected size, expected digest, chunks)."""

    files: dict[str, tuple[str, int | None, str | None, tuple[ChunkRecord, ...]]]


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

    def __init__(self, roots: dict[str, Path], replica_dir: Path | None, *,
                 on_verify_failure: Callable[[str], None] | None = None) -> None:
        #: Called with the namespace name when a served file fails its check (the daemon's metric).
        self.on_verify_failure = on_verify_failure
        self._named: OrderedDict[tuple[str, int, int, int], _Named | None] = OrderedDict()
        self._named_lock = threading.Lock()
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
        named = self._records(namespace, step) if self._committed(namespace, step) else None
        names = []
        for name in os.listdir(directory):
            if named is not None and name not in named.files:
                continue
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

    def open_served(self, namespace: Namespace, asked: PeerPath, *, content: bool = True) -> ServedFile:
        """The file a peer asked for, opened and checked (see the module docstring); NotFoundError for a file
        the step's records do not name, IntegrityError for a copy that fails its check (both logged)."""
        self._check_readable(namespace, asked, content=content)
        assert asked.relative is not None
        if asked.step is None or not self._committed(namespace, asked.step):
            fd, size = self._open(namespace, asked)  # a HEAD of a file of an uncommitted replica step
            return ServedFile(fd, size, "blob", asked.relative, asked.step)
        step = asked.step
        name = asked.relative.rpartition("/")[2]
        named = self._records(namespace, step)
        if named is None:  # no ckptd manifest: a blob store's step; never a file with a second name
            fd, size = self._open(namespace, asked)
            if os.fstat(fd).st_nlink != 1:
                os.close(fd)
                log.warning("refused %s in peer namespace %s: a hard link in a step without a ckptd manifest",
                            asked.relative, namespace.name)
                raise NotFoundError("file not found: a hard link is not served", path=asked.relative)
            return ServedFile(fd, size, "blob", asked.relative, step)
        if name not in named.files:
            log.warning("refused %s in peer namespace %s: the step's manifest does not name it", asked.relative,
                        namespace.name)
            raise NotFoundError("file not found: only the files a committed manifest names are served",
                                step=step, path=asked.relative)
        kind, size_expected, digest, chunks = named.files[name]
        fd, size = self._open(namespace, asked)
        try:
            if size_expected is not None and size != size_expected:
                raise self._failed(namespace, asked, f"has {size} bytes, its records say {size_expected}")
            if kind == "data":
                return ServedFile(fd, size, kind, asked.relative, step, chunks=chunks)
            data = _read_all(fd, size)
            if kind == "index" and chunk_digest(data) != digest:
                raise self._failed(namespace, asked, "does not match the digest its manifest records")
            if kind == "manifest":
                try:
                    Manifest.from_json_bytes(data, path=asked.relative, step=step)
                except CkptdError as error:
                    raise self._failed(namespace, asked, f"fails its check ({error.message})") from None
            if kind == "ranks" and not _is_ranks_list(data):
                raise self._failed(namespace, asked, "is not the list of ranks a node directory holds")
            return ServedFile(fd, size, kind, asked.relative, step, content=data)
        except BaseException:
            os.close(fd)
            raise

    def verified_range(self, namespace: Namespace, served: ServedFile, start: int, end: int) -> tuple[bytes, int]:
        """Bytes ``start``..``end`` of a data file and how many chunks were withheld: every chunk the range
        touches is read whole and checked against its digest; a chunk that fails (logged, counted) and bytes no
        chunk covers come back as zeros, so that no byte leaves that the records do not vouch for, and the
        reader's own check sends it to another tier for that chunk only."""
        touched = [chunk for chunk in served.chunks if chunk.offset < end and chunk.offset + chunk.length > start]
        low = min([start] + [chunk.offset for chunk in touched])
        high = max([end] + [chunk.offset + chunk.length for chunk in touched])
        data = memoryview(_read_all(served.fd, high - low, low))
        out = bytearray(end - start)
        withheld = 0
        for chunk in touched:
            stored = data[chunk.offset - low:chunk.offset - low + chunk.length]
            try:
                decode_verified(chunk, stored, path=served.relative, step=served.step or 0,
                                tier=f"peer namespace {namespace.name}")
            except IntegrityError as error:
                withheld += 1
                asked = PeerPath(tuple(namespace.name.split("/")), "file", step=served.step, relative=served.relative)
                self._failed(namespace, asked, f"holds a chunk at offset {chunk.offset} that fails its check "
                             f"({error.message}); it is sent as zeros")
                continue
            first, last = max(chunk.offset, start), min(chunk.offset + chunk.length, end)
            out[first - start:last - start] = data[first - low:last - low]
        return bytes(out), withheld

    def _failed(self, namespace: Namespace, asked: PeerPath, why: str) -> IntegrityError:
        log.warning("refused %s in peer namespace %s: the file %s", asked.relative, namespace.name, why)
        if self.on_verify_failure is not None:
            self.on_verify_failure(namespace.name)
        return IntegrityError(f"this node's copy {why}; read another tier", path=asked.relative, step=asked.step,
                              tier=f"peer namespace {namespace.name}")

    def _records(self, namespace: Namespace, step: int) -> _Named | None:
        """What the step's manifest and indexes name (None: its manifest is no ckptd manifest), cached by the
        manifest file's identity."""
        directory = self._step_directory(namespace, step)
        if directory is None:
            raise NotFoundError("step is not committed", step=step, path=namespace.name)
        relative = f"{step_dir(step)}/{MANIFEST_NAME}"
        fd, size = self._open(namespace, PeerPath(("",), "file", step=step, relative=relative))
        try:
            info = os.fstat(fd)
            key = (str(directory), step, info.st_ino, info.st_mtime_ns)
            with self._named_lock:
                if key in self._named:
                    self._named.move_to_end(key)
                    return self._named[key]
            raw = _read_all(fd, size)
        finally:
            os.close(fd)
        named = self._parse(namespace, step, raw)
        with self._named_lock:
            self._named[key] = named
            while len(self._named) > _CACHED_STEPS:
                self._named.popitem(last=False)
        return named

    def _parse(self, namespace: Namespace, step: int, raw: bytes) -> _Named | None:
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError):
            body = None
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            return None
        asked = PeerPath(tuple(namespace.name.split("/")), "file", step=step,
                         relative=f"{step_dir(step)}/{MANIFEST_NAME}")
        try:
            manifest = Manifest.from_json_bytes(raw, path=asked.relative or "", step=step)
        except CkptdError as error:
            raise self._failed(namespace, asked, f"is a manifest that fails its check ({error.message})") from None
        files: dict[str, tuple[str, int | None, str | None, tuple[ChunkRecord, ...]]] = {
            MANIFEST_NAME: ("manifest", None, None, ()), RANKS_HERE_NAME: ("ranks", None, None, ())}
        for entry in manifest.ranks:
            files[entry.index_file] = ("index", entry.index_size, entry.index_digest, ())
            relative = f"{step_dir(step)}/{entry.index_file}"
            try:
                fd, size = self._open(namespace, PeerPath(("",), "file", step=step, relative=relative))
            except NotFoundError:
                continue  # a rank another node holds
            try:
                data = _read_all(fd, size)
            finally:
                os.close(fd)
            if not entry.matches_index(data):
                continue  # served as named and refused then, with the reason; its data files stay unnamed
            index = RankIndex.from_json_bytes(data, path=relative, step=step)
            for number, data_file in enumerate(index.data_files):
                files[data_file.name] = ("data", data_file.size, None, tuple(index.packed_chunks(number)))
        return _Named(files)

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
                     digest: str) -> None:
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

    def _holds(self, namespace: Namespace, asked: PeerPath, size: int, digest: str) -> bool:
        try:
            fd, found = self._open(namespace, asked)
        except NotFoundError:
            return False
        try:
            if found != size:
                return False
            hasher, offset = StreamingChunkDigest(), 0
            while offset < size:
                block = os.pread(fd, _HASH_BLOCK, offset)
                if not block:
                    return False
                hasher.update(block)
                offset += len(block)
            return hasher.hexdigest() == digest
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


def _is_ranks_list(data: bytes) -> bool:
    """Whether ``data`` is a small ``{"ranks": [int, ...]}`` (what a node directory's ranks file holds)."""
    if len(data) > _RANKS_FILE_MAX_BYTES:
        return False
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    ranks = body.get("ranks") if isinstance(body, dict) else None
    return isinstance(ranks, list) and all(isinstance(rank, int) and not isinstance(rank, bool) for rank in ranks) \
        and all(isinstance(value, (int, float, list, type(None))) for value in body.values())


def _read_all(fd: int, size: int, offset: int = 0) -> bytes:
    """``size`` bytes of an open file from ``offset``; IntegrityError-free: a short file gives fewer bytes."""
    pieces, done = [], 0
    while done < size:
        piece = os.pread(fd, min(_HASH_BLOCK * 4, size - done), offset + done)
        if not piece:
            break
        pieces.append(piece)
        done += len(piece)
    return b"".join(pieces)


def _within(path: Path, directory: Path) -> bool:
    """Whether ``path`` is ``directory`` or lies under it (both real paths)."""
    return path == directory or directory in path.parents


__all__ = ["Namespace", "PeerNamespaces", "ServedFile"]
