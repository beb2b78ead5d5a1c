"""Retention per tier for the daemon: keep the newest ``keep`` committed steps of a tier, and never a step
the daemon still needs.

- A tier that stores chunks by digest (the object tier) goes through the library's own collection,
  :func:`ckptd.promotion.gc.collect_garbage`: retention under the GC lease, then the mark and sweep of
  chunks no kept or in-flight step references, and the abort of abandoned multipart uploads.
- A tier that keeps per-rank data files (a replica directory a buddy replicates into; a local root when
  the daemon's ``keep_local`` is set) loses its oldest committed steps beyond ``keep``, each with
  :meth:`~ckptd.tiers.base.StorageTier.delete_step` (manifest first, so a half-deleted step is never
  listed as committed). Step directories without a manifest (a save or a replication in progress) are
  left alone: the writer that owns them cleans them up.

A step in ``protect`` (pinned, or not yet promoted or replicated) is never deleted, on any tier, and the
newest committed step never is (``keep`` is at least 1). ``keep=None`` keeps everything and touches
nothing.

Threads: call from one thread per tier at a time (the daemon's retention worker).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

from ckptd.errors import CkptdError, ConfigError
from ckptd.policy import KeepLatest, RetentionPolicy
from ckptd.promotion.gc import collect_garbage
from ckptd.tiers.base import StorageTier

log = logging.getLogger("ckptd.retention")


@dataclass(frozen=True)
class RetentionReport:
    """What one retention pass over one tier did.

    ``protected_steps``: steps past ``keep`` that were kept because they are protected. ``failed``:
    (step, why) for steps whose deletion failed (retried by the next pass). ``deleted_chunks`` and
    ``deleted_chunk_bytes``: what the sweep of a chunk store removed; ``note`` says why it swept nothing
    when it could not (a kept step's metadata was unreadable)."""

    tier: str
    kept_steps: tuple[int, ...] = ()
    deleted_steps: tuple[int, ...] = ()
    protected_steps: tuple[int, ...] = ()
    failed: tuple[tuple[int, str], ...] = ()
    deleted_chunks: int = 0
    deleted_chunk_bytes: int = 0
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able values (for the daemon's status document)."""
        return asdict(self)


@dataclass(frozen=True)
class _Protecting:
    """A retention policy that never lets ``protect`` go (a RetentionPolicy, for collect_garbage)."""

    inner: RetentionPolicy
    protect: frozenset[int]

    def deletable(self, committed: list[int]) -> list[int]:
        return [step for step in self.inner.deletable(committed) if step not in self.protect]


def apply_retention(tier: StorageTier, *, keep: int | None, protect: Collection[int] = ()) -> RetentionReport:
    """Delete the committed steps of ``tier`` older than its newest ``keep`` ones, except the steps in
    ``protect`` (see the module docstring for what each kind of tier does). Raises ConfigError for a
    ``keep`` that is not None or an integer >= 1, and StorageError when the tier cannot be listed."""
    if keep is None:
        return RetentionReport(tier=tier.label)
    policy = _keep_latest(keep, tier)
    protected = frozenset(protect)
    if tier.stores_chunks_by_digest:
        return _collect(tier, policy, protected)
    return _delete_oldest(tier, policy, protected)


def _keep_latest(keep: object, tier: StorageTier) -> KeepLatest:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"retention for {tier.label} must keep an integer >= 1 of steps, got {keep!r}",
                          hint="the newest step is never deleted: use 1 to keep only it, or leave it unset to "
                               "keep every step")
    return KeepLatest(keep)


def _past_keep(policy: KeepLatest, committed: list[int], protect: frozenset[int]) -> tuple[list[int], list[int]]:
    """(deletable, protected) among the steps ``policy`` would delete."""
    doomed = policy.deletable(committed)
    return [step for step in doomed if step not in protect], [step for step in doomed if step in protect]


def _collect(tier: StorageTier, policy: KeepLatest, protect: frozenset[int]) -> RetentionReport:
    _, shielded = _past_keep(policy, tier.committed_steps(), protect)
    gc = collect_garbage(tier, retention=_Protecting(policy, protect))
    if gc.deleted_steps or gc.deleted_chunks:
        log.info("retention on %s: deleted steps %s and %d unreferenced chunk(s) (%d bytes), kept %s",
                 tier.label, list(gc.deleted_steps), gc.deleted_chunks, gc.deleted_chunk_bytes, list(gc.kept_steps))
    return RetentionReport(tier=tier.label, kept_steps=gc.kept_steps, deleted_steps=gc.deleted_steps,
                           protected_steps=tuple(step for step in shielded if step in gc.kept_steps),
                           deleted_chunks=gc.deleted_chunks, deleted_chunk_bytes=gc.deleted_chunk_bytes, note=gc.note)


def _delete_oldest(tier: StorageTier, policy: KeepLatest, protect: frozenset[int]) -> RetentionReport:
    committed = tier.committed_steps()
    doomed, shielded = _past_keep(policy, committed, protect)
    deleted: list[int] = []
    failed: list[tuple[int, str]] = []
    for step in doomed:  # oldest first
        try:
            tier.delete_step(step)
        except CkptdError as error:
            log.warning("retention on %s: could not delete step %d (the next pass tries again): %s",
                        tier.label, step, error)
            failed.append((step, str(error)))
            continue
        deleted.append(step)
    if deleted:
        log.info("retention on %s: deleted steps %s, kept the newest %d (protected: %s)", tier.label, deleted,
                 policy.count, shielded)
    kept = tuple(step for step in committed if step not in deleted)
    return RetentionReport(tier=tier.label, kept_steps=kept, deleted_steps=tuple(deleted),
                           protected_steps=tuple(shielded), failed=tuple(failed))


__all__ = ["RetentionReport", "apply_retention"]
