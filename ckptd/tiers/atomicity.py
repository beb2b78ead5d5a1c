"""A step becomes visible only when it is committed: the one commit abstraction of every writer.

Every writer of a step (the manager's saver, the DCP writer, promotion to the object tier, a pull back to
the local tier) writes the step's data files and indexes first and then commits the step through a
:class:`StepCommit` of the tier it writes to. A commit is the step's manifest appearing: before it, no
reader lists the step; after it, the step is immutable.

There are two implementations because the two kinds of storage make "appears at once" differently:

- :class:`DirectoryCommit`, for a directory on a file system: files are written under temporary names,
  fsynced and renamed into place, and the manifest is linked into place without replacing an existing
  one (``link`` fails when the name exists), then the directory is fsynced. A power loss leaves either
  no manifest or a complete one.
- :class:`ObjectStoreCommit`, for an object store, where a PUT is atomic but there is no rename: the data
  objects and indexes are uploaded first and the manifest object last, with a conditional PUT
  (``If-None-Match: *``) where the store supports it, so that two writers cannot both commit one step.

Both refuse what would break the promise that a committed step is never changed: a commit of a step
that is already committed (:class:`~ckptd.errors.AlreadyCommittedError`), a manifest that lacks some
rank's entry, and a commit whose indexes are not all in place. :meth:`StepCommit.discard` removes the
files of a failed, uncommitted attempt and never touches a committed step.
"""

from __future__ import annotations

import abc
import json
import logging
from collections.abc import Iterable

from ckptd.errors import AlreadyCommittedError, CommitError, CkptdError, FormatError
from ckptd.format.layout import MANIFEST_NAME, RANKS_HERE_NAME, step_file
from ckptd.format.records import Manifest
from ckptd.tiers.base import StorageTier

log = logging.getLogger("ckptd.commit")


class StepCommit(abc.ABC):
    """Commits steps on one tier. Call order per step: :meth:`check_writable` before writing anything,
    then the writer's files, then :meth:`commit` once (or :meth:`discard` after a failure)."""

    def __init__(self, tier: StorageTier) -> None:
        self.tier = tier

    def check_writable(self, step: int) -> None:
        """Raise AlreadyCommittedError when ``step`` is committed on this tier (nothing may be written)."""
        if self.tier.is_committed(step):
            raise AlreadyCommittedError(
                "this step is already committed; a committed step is never rewritten", step=step,
                tier=self.tier.label, path=step_file(step, MANIFEST_NAME),
                hint="save under a new step number, or delete the step first (`ckptd gc`)")

    def commit(self, step: int, manifest_bytes: bytes, *, world_size: int | None = None,
               ranks_here: Iterable[int] | None = None) -> None:
        """Make ``step`` visible with this manifest. ``world_size``: the job's, which the manifest must
        cover rank by rank. ``ranks_here``: the ranks whose index must be on this tier (default: every rank
        of the manifest; a node-local directory holds only its own ranks')."""
        manifest = Manifest.from_json_bytes(manifest_bytes, path=step_file(step, MANIFEST_NAME), step=step,
                                            tier=self.tier.label)
        check_manifest_complete(manifest, step, world_size=world_size, tier=self.tier.label)
        expected = set(range(manifest.world_size)) if ranks_here is None else set(ranks_here)
        if not expected or not expected <= set(range(manifest.world_size)):
            raise CommitError(f"cannot commit ranks {sorted(expected)} of a {manifest.world_size}-rank step",
                              step=step, tier=self.tier.label)
        missing = [entry.index_file for entry in manifest.ranks
                   if entry.rank in expected and not self.tier.exists(step_file(step, entry.index_file))]
        if missing:
            raise CommitError(f"cannot commit: index file(s) {missing} are not in place", step=step,
                              tier=self.tier.label, hint="every rank's files are written before the manifest")
        if len(expected) < manifest.world_size:  # say which ranks this directory holds, before the commit
            self.check_writable(step)
            path = step_file(step, RANKS_HERE_NAME)
            self.tier.delete_files([path])  # left by an attempt that failed before its commit
            self.tier.write_bytes(path, json.dumps({"ranks": sorted(expected)}).encode(), if_absent=True)
        self._write_manifest(step, manifest_bytes)

    @abc.abstractmethod
    def _write_manifest(self, step: int, manifest_bytes: bytes) -> None:
        """Write the manifest so that it appears complete or not at all, never replacing one."""

    def discard(self, step: int, names: Iterable[str]) -> None:
        """Delete files of a failed attempt at ``step``; a committed step is left untouched."""
        if self.tier.is_committed(step):
            log.warning("not deleting files of step %d on %s: the step is committed", step, self.tier.label)
            return
        paths = [step_file(step, name) for name in names]
        try:
            self.tier.delete_files(paths)
        except CkptdError as error:
            log.warning("could not delete the files of failed step %d on %s: %s", step, self.tier.label, error)


class DirectoryCommit(StepCommit):
    """Commit on a file system: the manifest is linked into place without replacing one, then the
    directory is fsynced (the tier's ``write_bytes(if_absent=True)``)."""

    def _write_manifest(self, step: int, manifest_bytes: bytes) -> None:
        self.tier.write_bytes(step_file(step, MANIFEST_NAME), manifest_bytes, if_absent=True)


class ObjectStoreCommit(StepCommit):
    """Commit on an object store: the manifest object last, with a conditional PUT where supported."""

    def _write_manifest(self, step: int, manifest_bytes: bytes) -> None:
        if not self.tier.capabilities.conditional_put:
            log.debug("%s has no conditional PUT: the manifest of step %d is checked, then written",
                      self.tier.label, step)
        self.tier.write_bytes(step_file(step, MANIFEST_NAME), manifest_bytes, if_absent=True)


def step_commit(tier: StorageTier) -> StepCommit:
    """The commit implementation that fits ``tier``."""
    if tier.capabilities.node_local:
        return DirectoryCommit(tier)
    return ObjectStoreCommit(tier)


def check_manifest_complete(manifest: Manifest, step: int, *, world_size: int | None = None,
                            tier: str | None = None) -> None:
    """Refuse a manifest that does not hold exactly one entry for each rank of the job (``world_size``,
    default the manifest's own)."""
    ranks = sorted(entry.rank for entry in manifest.ranks)
    expected = manifest.world_size if world_size is None else world_size
    if manifest.step != step:
        raise CommitError(f"the manifest is for step {manifest.step}", step=step, tier=tier)
    if manifest.world_size != expected or ranks != list(range(expected)):
        raise CommitError(f"a manifest with entries for ranks {ranks} cannot commit a step of a {expected}-rank "
                          "job; a commit that lacks some rank's entry is refused", step=step, tier=tier,
                          hint="every rank must report its index to the committing rank")


def ranks_held(tier: StorageTier, step: int, manifest: Manifest) -> tuple[int, ...]:
    """The ranks whose files a committed step holds on ``tier``: all of them, unless the step directory
    says it holds only some (a node-local directory, see :data:`~ckptd.format.layout.RANKS_HERE_NAME`)."""
    everyone = tuple(range(manifest.world_size))
    path = step_file(step, RANKS_HERE_NAME)
    if tier.capabilities.chunks_by_digest or not tier.exists(path):
        return everyone
    try:
        ranks = json.loads(tier.read_bytes(path))["ranks"]
        held = tuple(sorted({int(rank) for rank in ranks}))
    except (ValueError, TypeError, KeyError) as exc:
        raise FormatError("the list of ranks this directory holds is malformed", path=path, step=step,
                          tier=tier.label, hint="delete the step here and pull it from another tier") from exc
    if not held or not set(held) <= set(everyone):
        raise FormatError(f"this directory claims ranks {list(held)} of a {manifest.world_size}-rank step",
                          path=path, step=step, tier=tier.label)
    return held
