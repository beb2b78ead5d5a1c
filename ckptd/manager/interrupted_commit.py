"""Finishing a commit that a rank's death interrupted, so that restore finds the step on every rank.

A step is committed in two halves (:mod:`ckptd.manager.commit`): every rank writes its files and reports
them, rank 0 decides the manifest, and then the owner of each local directory writes that manifest into
its directory. A rank that dies between the two halves leaves its files of the step complete (indexes
and data in place, under their final names) but no manifest beside them, while the other directories
hold the step committed. Restore would then find no step common to every rank; when that step was the
job's first save it raised NoIntactCheckpointError and the replacement rank could never start.

:func:`complete_interrupted_commit` runs on every rank before restore agrees on a step. When the newest
step committed in some directory is, in every other directory, left complete but uncommitted, the rank
that committed it sends the manifest rank 0 decided through the store, and each such directory's owner
checks its ranks' files against that manifest (index digests, data file sizes) and commits the step, as
its dead predecessor would have. That is no guess: the manifest is the one every rank agreed on.

A directory that lost its files (a lost disk) or holds files that do not match is left alone: restore
then reports, as before, that no step is intact on every rank.

Call on every rank, on the training thread, in the same order (store exchanges).
"""

from __future__ import annotations

import logging
from typing import Any

from ckptd.errors import CkptdError
from ckptd.format.layout import MANIFEST_NAME, rank_index_name, step_file
from ckptd.format.records import Manifest
from ckptd.manager.commit import CommitCoordinator
from ckptd.manager.directories import DirectorySharing
from ckptd.stepio.step_reader import load_rank_index
from ckptd.tiers.atomicity import DirectoryCommit
from ckptd.tiers.local import LocalTier

log = logging.getLogger("ckptd.restore")


def complete_interrupted_commit(local: LocalTier, coordinator: CommitCoordinator,
                                sharing: DirectorySharing) -> int | None:
    """Commit in this rank's directory the step whose commit a dead rank left unfinished (see the module
    docstring); returns that step, the same on every rank, once every directory holds it committed (None:
    nothing was interrupted, or it could not be finished)."""
    if coordinator.world_size == 1:
        return None
    committed = local.committed_steps()
    pending = [step for step in local.list_step_numbers() if step not in committed
               and all(rank_index_name(rank) in local.list_files(step) for rank in sharing.ranks_here)]
    held = coordinator.exchange("interrupted-commit", {"committed": committed, "pending": pending})
    step = _interrupted_step(held)
    if step is None:
        return None
    source = min(rank for rank, answer in enumerate(held) if step in answer["committed"])
    manifest = None
    if coordinator.rank == source:
        try:
            manifest = local.read_bytes(step_file(step, MANIFEST_NAME)).decode()
        except (CkptdError, UnicodeDecodeError) as error:  # every rank still answers the next round
            log.warning("rank %d: cannot read the manifest of step %d to finish its commit elsewhere: %s",
                        coordinator.rank, step, error)
    sent = coordinator.exchange("interrupted-commit-manifest", manifest)[source]
    if sent is None:  # seen alike by every rank
        return None
    failure = None
    if sharing.is_owner and step not in committed:
        failure = _commit_here(local, step, sent.encode(), coordinator, sharing)
    failures = [why for why in coordinator.exchange("interrupted-commit-done", failure) if why]
    if failures:
        log.warning("step %d could not be committed where a rank died before committing it: %s", step,
                    " | ".join(failures))
        return None
    return step


def _interrupted_step(held: list[dict[str, Any]]) -> int | None:
    """The newest step committed in some directory and left complete but uncommitted in all the others,
    when it is newer than every step committed everywhere."""
    lists = [set(answer["committed"]) for answer in held]
    everywhere = set.intersection(*lists)
    newest = max(set.union(*lists), default=None)
    if newest is None or (everywhere and newest <= max(everywhere)):
        return None
    if all(newest in answer["committed"] or newest in answer["pending"] for answer in held):
        return newest
    return None


def _commit_here(local: LocalTier, step: int, manifest_bytes: bytes, coordinator: CommitCoordinator,
                 sharing: DirectorySharing) -> str | None:
    """Check this directory's files of ``step`` against the agreed manifest and commit them; None on
    success, else why not."""
    try:
        manifest = Manifest.from_json_bytes(manifest_bytes, path=step_file(step, MANIFEST_NAME), step=step,
                                            tier=local.label)
        for rank in sharing.ranks_here:
            load_rank_index(local, manifest, rank)
        DirectoryCommit(local).commit(step, manifest_bytes, world_size=coordinator.world_size,
                                      ranks_here=sharing.ranks_here)
    except CkptdError as error:
        return f"rank {coordinator.rank}: {error}"
    log.warning("rank %d: step %d was agreed, but the rank that owned %s died before committing it there: "
                "its files match the agreed manifest, the step is committed now", coordinator.rank, step,
                local.label)
    return None
