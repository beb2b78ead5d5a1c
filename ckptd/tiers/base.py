"""The interface every storage tier implements.

A tier is a root (a directory or an object-store prefix) holding step directories laid out as
:mod:`ckptd.format.layout` says. All paths given to a tier are relative to its root and use ``/``.

Commit rule, on every tier: a step is committed exactly when its ``manifest.json`` exists. Writers
write everything else first and the manifest last; :meth:`StorageTier.delete_step` removes the manifest
first, so a half-deleted step is never listed as committed.

Files that must be written exactly once (commit markers) are written with
``write_bytes(path, data, if_absent=True)``: the write is refused with
:class:`~ckptd.errors.AlreadyCommittedError` when the file exists, and race-free where the tier's
:attr:`TierCapabilities.conditional_put` says so.

Thread safety: reads may run from several threads at once; a file is written by one thread.

**The small protocol.** A tier implements ``read_bytes``, ``size``, ``exists``, ``write_bytes`` (with
``if_absent``, the conditional create), ``delete_files`` and a listing: ``list_objects`` (every file under a
directory, recursively), or the two step listings ``list_step_numbers`` and ``list_files``. Everything else has
a default built on those: the step listings from ``list_objects``, ranged and whole reads into memory, streamed
writes, commit checks, step deletion, and no-ops for what only some stores have (uploads in parts, owner
records, the store's clock and ages). A tier declares what more it can do in :class:`TierCapabilities`
(``chunks_by_digest``, which a remote tier needs and which takes ``list_objects``; ``conditional_put``;
``multipart_uploads``; ...) and overrides the methods that go with it. A third-party tier registered through
the ``ckptd.storage`` entry points needs nothing more (``tests/test_tier_minimal_plugin.py``).
"""

from __future__ import annotations

import abc
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from ckptd._types import Buffer
from ckptd.format.layout import MANIFEST_NAME, TEMP_MARKER, parse_step_dir, step_dir, step_file


@dataclass(frozen=True)
class StoredObject:
    """A file listed under a tier's root: its path relative to the root, size and modification time."""

    path: str
    size: int
    modified: float


@dataclass(frozen=True)
class TierCapabilities:
    """What a tier can do, so that callers ask the tier instead of checking its class."""

    #: Chunks live content-addressed under ``chunks/`` instead of in per-rank data files.
    chunks_by_digest: bool = False
    #: ``write_bytes(..., if_absent=True)`` is atomic: of two racing writers exactly one succeeds.
    #: Without it the tier checks for the file first and then writes, which is not race-free.
    conditional_put: bool = False
    #: Files live in a directory of this node's file system (the tier has a ``root`` path, temporary
    #: files, writer locks and :meth:`~ckptd.tiers.local.LocalTier.open_file`).
    node_local: bool = False
    #: ``read_bytes`` with an offset and length transfers only that range.
    ranged_reads: bool = True
    #: Large writes go up in parts that can be left behind by a crash; the tier lists and aborts them
    #: (``incomplete_uploads`` / ``abort_incomplete_uploads``).
    multipart_uploads: bool = False
    #: The bytes of a file are read back only once its step is committed (its manifest exists): reads of
    #: a file of an uncommitted step, or of one outside every step (``chunks/``), raise NotFoundError,
    #: while ``exists``, ``size`` and the listings still see it (the peer tier: a daemon serves only
    #: committed steps).
    reads_committed_only: bool = False


def step_files(objects: Iterable[StoredObject]) -> dict[int, set[str]]:
    """Every step directory among listed files, with the names of the files directly in it."""
    steps: dict[int, set[str]] = {}
    for obj in objects:
        directory, _, name = obj.path.partition("/")
        step = parse_step_dir(directory)
        if step is not None and name and "/" not in name and TEMP_MARKER not in name:
            steps.setdefault(step, set()).add(name)
    return steps


def repeated_keys(paths: list[str]) -> list[str]:
    """The paths that occur more than once in ``paths``, sorted."""
    return sorted(path for path, count in Counter(paths).items() if count > 1)


class StorageTier(abc.ABC):
    """A place that holds checkpoints: the local directory, a peer's daemon, or object storage."""

    #: Short label used in logs and errors ("local", "peer", "object").
    kind: ClassVar[str] = "tier"
    #: What this tier can do; a tier whose abilities depend on its settings overrides it per instance.
    capabilities: TierCapabilities = TierCapabilities()

    @property
    def stores_chunks_by_digest(self) -> bool:
        """Shorthand for ``capabilities.chunks_by_digest``."""
        return self.capabilities.chunks_by_digest

    def __init__(self, url: str) -> None:
        self.url = url

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if any(getattr(getattr(cls, name, None), "__isabstractmethod__", False) for name in dir(cls)):
            return  # still abstract (a base of other tiers): the concrete subclasses are checked
        lists_objects = cls.list_objects is not StorageTier.list_objects
        lists_steps = (cls.list_step_numbers is not StorageTier.list_step_numbers
                       and cls.list_files is not StorageTier.list_files)
        if not (lists_objects or lists_steps):
            raise TypeError(f"{cls.__name__} lists nothing: implement list_objects, or list_step_numbers and "
                            "list_files (see ckptd.tiers.base)")

    @classmethod
    def from_url(cls, url: str, *, storage_options: dict[str, Any] | None = None,
                 create: bool = False) -> StorageTier:
        """Open the tier a URL names (what :func:`ckptd.tiers.open_tier` calls on a registered class).

        ``storage_options`` are the backend's connection options; ``create`` asks a tier that has
        directories to create its root. Tiers ignore what does not apply to them."""
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a URL")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @property
    def label(self) -> str:
        """How errors and logs name this tier."""
        return f"{self.kind} {self.url}"

    # --- reading -----------------------------------------------------------------------------
    @abc.abstractmethod
    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of a file, or of ``length`` bytes from ``offset``. Raises NotFoundError if absent."""

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes of ``path`` from ``offset``."""
        data = self.read_bytes(path, offset, len(buffer))
        buffer[: len(data)] = data
        if len(data) != len(buffer):
            from ckptd.errors import IntegrityError

            raise IntegrityError("file is shorter than its index says", path=path, tier=self.label,
                                 expected=str(len(buffer)), actual=str(len(data)))

    def read_whole_into(self, path: str, buffer: memoryview) -> None:
        """Fill ``buffer`` with the whole of ``path``; IntegrityError when its size is not ``len(buffer)``
        (the buffer may then hold part of it). Tiers that can read straight into memory do so."""
        data = self.read_bytes(path)
        check_whole_size(self, path, len(data), len(buffer))
        buffer[:] = data

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes of a file. Raises NotFoundError if absent."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file exists."""

    def list_step_numbers(self) -> list[int]:
        """Every step that has a directory (committed or not), ascending. This default lists the whole tier."""
        return sorted(step_files(self.list_objects("")))

    def list_files(self, step: int) -> list[str]:
        """File names in a step directory (temporary files excluded)."""
        directory = f"{step_dir(step)}/"
        names = (obj.path[len(directory):] for obj in self.list_objects(step_dir(step)))
        return sorted(name for name in names if name and "/" not in name and TEMP_MARKER not in name)

    # --- writing -----------------------------------------------------------------------------
    @abc.abstractmethod
    def write_bytes(self, path: str, data: Buffer, *, if_absent: bool = False) -> None:
        """Write a whole file so that it appears complete or not at all, durably.

        With ``if_absent=True`` an existing file is never replaced: the write raises
        :class:`~ckptd.errors.AlreadyCommittedError` naming the path and tier instead, unless the file
        already holds exactly ``data`` (then the write counts as done: that is what a retried request
        whose first attempt landed finds)."""

    def write_stream(self, path: str, size: int, pieces: Callable[[], Iterable[Buffer]], *,
                     if_absent: bool = False) -> None:
        """Write a file of ``size`` bytes made of the pieces ``pieces()`` yields; same contract as
        :meth:`write_bytes`. ``pieces`` may be called again when the write is retried; an error it raises
        stops the write and nothing is stored, and so do pieces that do not add up to ``size``
        (IntegrityError). This default joins the pieces and writes them whole; a tier that can send pieces
        as they come (the peer tier) overrides it."""
        data = b"".join(bytes(piece) for piece in pieces())
        if len(data) != size:
            from ckptd.errors import IntegrityError

            raise IntegrityError("the pieces of a write do not add up to its size", path=path, tier=self.label,
                                 expected=str(size), actual=str(len(data)))
        self.write_bytes(path, data, if_absent=if_absent)

    def _refuse_unless_identical(self, path: str, data: Buffer) -> None:
        """For ``if_absent`` writes that found ``path`` taken: return when it holds exactly ``data`` (a
        retried write whose first attempt landed), otherwise raise AlreadyCommittedError."""
        from ckptd.errors import AlreadyCommittedError, NotFoundError

        view = memoryview(data).cast("B")
        try:
            if self.size(path) == len(view) and self.read_bytes(path) == view:
                return
        except NotFoundError:
            pass
        raise AlreadyCommittedError("the file already exists and is never replaced", path=path, tier=self.label,
                                    hint="a committed step is immutable; save a new step")

    @abc.abstractmethod
    def delete_files(self, paths: list[str]) -> None:
        """Delete files; missing ones are ignored."""

    def remove_step_dir(self, step: int) -> None:
        """Remove what is left of a step directory (after its files are deleted). This default does nothing:
        a blob store has no directories."""

    # --- content-addressed chunks (tiers with stores_chunks_by_digest) -------------------------
    def chunk_path(self, object_key: str) -> str:
        return f"chunks/{object_key}"

    def list_objects(self, directory: str) -> list[StoredObject]:
        """Every file under ``directory`` (relative to the root; ``""``: the whole tier), recursively, with its
        path relative to the root, size and time. Tiers with :attr:`TierCapabilities.chunks_by_digest` implement
        it (promotion and GC list chunks)."""
        raise NotImplementedError(f"{type(self).__name__} does not list objects")

    def read_ahead(self, paths: list[str]) -> None:
        """Hint that whole files ``paths`` will be read in this order; a tier may fetch them early.
        Replaces an earlier hint. The default ignores it."""

    # --- what promotion asks of an object store; these defaults serve a tier without the feature ----
    def connect(self) -> None:
        """Open the tier's connections now instead of at the first request. Default: nothing to open."""

    def yield_while(self, busy: Callable[[], bool], *, limit_s: float, poll_s: float = 0.001) -> None:
        """Before each of this tier's requests from now on, wait while ``busy()`` holds, at most ``limit_s``
        (how the in-process uploader yields to a save being written). Default: the requests do not wait; a
        tier with a hook on its requests overrides it."""

    def listed_tags(self, directory: str) -> dict[str, tuple[int, str]]:
        """Path -> (size, ETag) of every file under ``directory``. Default: from :meth:`list_objects`, with no
        ETag (so dedup checks such a chunk at every promotion instead of remembering it)."""
        return {obj.path: (obj.size, "") for obj in self.list_objects(directory)}

    def stored_checksum(self, path: str) -> tuple[int, str, str | None]:
        """(size, ETag, full-object CRC32) the store keeps for a file; NotFoundError when absent. Default: the
        size only (no ETag, no checksum), so dedup reads the object back to compare it."""
        return self.size(path), "", None

    # --- derived operations ------------------------------------------------------------------
    def is_committed(self, step: int) -> bool:
        return self.exists(step_file(step, MANIFEST_NAME))

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending. A tier that lists through :meth:`list_objects` only answers from one
        listing; one that lists steps asks for each step's manifest."""
        if type(self).list_step_numbers is StorageTier.list_step_numbers:
            return sorted(step for step, names in step_files(self.list_objects("")).items() if MANIFEST_NAME in names)
        return [step for step in self.list_step_numbers() if self.is_committed(step)]

    def incomplete_uploads(self) -> list[tuple[str, str, float]]:
        """Uploads in parts that were started and never completed nor aborted: (path, upload id, start
        time). Empty on tiers without :attr:`TierCapabilities.multipart_uploads`."""
        return []

    def abandoned_uploads(self, older_than_s: float = 0.0) -> list[tuple[str, str, str]]:
        """The incomplete uploads :meth:`abort_incomplete_uploads` would abort: (path, upload id, why).
        Here those started more than ``older_than_s`` ago; a tier that knows uploads' owners overrides it."""
        now = time.time()
        return [(path, upload_id, f"started over {older_than_s:.0f}s ago")
                for path, upload_id, started in self.incomplete_uploads() if now - started >= older_than_s]

    def abort_incomplete_uploads(self, older_than_s: float = 0.0) -> int:
        """Abort the incomplete uploads started more than ``older_than_s`` ago; returns how many."""
        return 0

    def sweep_incomplete_uploads(self, older_than_s: float = 0.0) -> tuple[int, list[str]]:
        """:meth:`abort_incomplete_uploads`, then :meth:`uploads_awaiting_owners`: (aborted, awaiting). A tier
        that knows owners does both from one listing."""
        return self.abort_incomplete_uploads(older_than_s), self.uploads_awaiting_owners()

    def uploads_awaiting_owners(self) -> list[str]:
        """Paths of open uploads to look at again soon, not in ``gc_abandoned_s``: here the keys with two
        open uploads (a writer re-sending what a dead one left open); a tier that knows owners adds more."""
        return repeated_keys([path for path, _, _ in self.incomplete_uploads()])

    def clock(self) -> float:
        """Now, on the clock the tier's modification times are stamped with (seconds since the epoch):
        this machine's for a file system, the store's own for an object store. Ages compared against the
        tier's times (:meth:`step_modified`, upload start times) use it, so a skewed local clock does not
        make live work look old."""
        return time.time()

    def age_s(self, path: str) -> float | None:
        """Seconds since ``path`` was last written, on the tier's clock (:meth:`clock`); None when it does
        not exist or the tier cannot tell."""
        return None

    def step_modified(self, step: int) -> float | None:
        """When anything in a step directory last changed (seconds since the epoch); None when the tier
        cannot tell (GC then treats the step as fresh)."""
        return None

    def delete_step(self, step: int) -> None:
        """Uncommit a step (manifest first), then delete its files and directory."""
        self.delete_files([step_file(step, MANIFEST_NAME)])
        self.delete_files([f"{step_dir(step)}/{name}" for name in self.list_files(step)])
        self.remove_step_dir(step)

    def close(self) -> None:
        """Release resources (locks, connections)."""


def check_whole_size(tier: StorageTier, path: str, size: int, expected: int) -> None:
    """IntegrityError unless file ``path`` of ``tier`` has the ``expected`` size."""
    if size != expected:
        from ckptd.errors import IntegrityError

        raise IntegrityError("file has the wrong stored length", path=path, tier=tier.label,
                             expected=str(expected), actual=str(size),
                             hint="the file is damaged; the restore reads it from another tier")
