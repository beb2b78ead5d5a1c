"""Retention and garbage collection for the local and the object tier.

Both tiers: committed steps past the retention policy are deleted (manifest first, so a half-deleted
step is never listed as committed), and uncommitted step directories untouched for ``gc_abandoned_s``
are removed as abandoned (a crashed save or promotion). The local tier also never removes an
uncommitted step newer than its newest committed one (a save in progress).

Object tier, in addition, mark and sweep under the GC lease (:mod:`ckptd.promotion.lease`): every
content-addressed chunk referenced by a retained manifest's indexes or by an in-flight step's indexes is
marked, every other chunk is deleted (packed chunks are no objects of their own: they go with their
step's pack). When a retained step's metadata cannot be read, nothing is swept (its chunks are
unknown). Multipart uploads no live writer owns are aborted: their owner record names a dead process on
this host or stopped being refreshed (:mod:`ckptd.tiers.upload_owners`); an upload of a live promoter
on another host is left alone however old, and one without a record is aborted after ``gc_abandoned_s``.

A step whose promoter is alive (its step owner lease, :func:`~ckptd.promotion.lease.live_step_owners`) is
in flight, never abandoned, however old its objects: its directory and the chunks its indexes name stay.

Clocks. No age here is this process's wall clock against another machine's: every age is the tier's
clock (:meth:`~ckptd.tiers.StorageTier.clock`: the object store's ``Date``) minus a time the tier itself
stamped (``LastModified`` of a step's objects and of owner records, an upload's ``Initiated``), so a
collector or a promoter whose clock is off by minutes (or stepped by NTP) judges the same ages as one
with a true clock. Committed and pinned steps are never deleted for their age at all: only retention
(counts of steps) deletes them. On a local file system the tier's clock is this machine's, the clock its
mtimes come from; an uncommitted step newer than the newest committed one is never removed there. Waits
(a lease held, a promotion waiting for a collector) are timed with the monotonic clock.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from typing import Any

from ckptd.config import settings
from ckptd.errors import CkptdError
from ckptd.format.layout import step_dir, step_file
from ckptd.format.records import RankIndex
from ckptd.stepio.packs import read_by_digest
from ckptd.stepio.step_reader import load_step_manifest, load_rank_index
from ckptd.policy import RetentionPolicy
from ckptd.promotion.dedup import note_store_size
from ckptd.promotion.lease import gc_lease, live_step_owners
from ckptd.promotion.promoter import stored_chunks
from ckptd.tiers.base import StorageTier
from ckptd.tiers.chunk_health import bad_chunk_paths, clear_bad_chunk

log = logging.getLogger("ckptd.gc")
_INDEX_SUFFIX = ".index.json"


@dataclass(frozen=True)
class GcReport:
    """What a collection deleted (or, with ``dry_run``, would delete)."""

    tier: str
    dry_run: bool
    kept_steps: tuple[int, ...]
    deleted_steps: tuple[int, ...]
    abandoned_steps: tuple[int, ...]
    in_flight_steps: tuple[int, ...]
    deleted_chunks: int = 0
    deleted_chunk_bytes: int = 0
    aborted_uploads: int = 0
    swept: bool = True
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _step_age_s(tier: StorageTier, step: int, now: float) -> float:
    """Seconds since anything in a step directory last changed, ``now`` on the tier's clock."""
    newest = tier.step_modified(step)
    return 0.0 if newest is None else now - newest


def _uncommitted(tier: StorageTier, committed: list[int], abandoned_after_s: float) -> tuple[list[int], list[int]]:
    """(abandoned, in flight) among the uncommitted step directories."""
    newest = committed[-1] if committed else None
    abandoned, in_flight = [], []
    now = tier.clock()  # the clock the step's times are stamped with (the store's, for an object store)
    for step in tier.list_step_numbers():
        if step in committed:
            continue
        protected = tier.capabilities.node_local and (newest is None or step > newest)
        if not protected and _step_age_s(tier, step, now) >= abandoned_after_s and not live_step_owners(tier, step):
            abandoned.append(step)
        else:
            in_flight.append(step)
    return abandoned, in_flight


def _content_addressed(tier: StorageTier, index: RankIndex) -> set[str]:
    """Content addresses of ``index``'s chunks stored by digest (a packed chunk lives in its step's pack)."""
    return {chunk.object_key for chunk in index.chunks if read_by_digest(tier, index, chunk)}


def _referenced_by_committed(tier: StorageTier, step: int) -> set[str]:
    manifest = load_step_manifest(tier, step)
    keys: set[str] = set()
    for entry in manifest.ranks:
        keys |= _content_addressed(tier, load_rank_index(tier, manifest, entry.rank))
    return keys


def _referenced_by_in_flight(tier: StorageTier, step: int) -> set[str]:
    keys: set[str] = set()
    for name in tier.list_files(step):
        if name.endswith(_INDEX_SUFFIX):
            path = step_file(step, name)
            index = RankIndex.from_json_bytes(tier.read_bytes(path), path=path, step=step, tier=tier.label)
            keys |= _content_addressed(tier, index)
    return keys


def collect_garbage(tier: StorageTier, *, retention: RetentionPolicy | None = None, dry_run: bool = False,
                    abandoned_after_s: float | None = None) -> GcReport:
    """Apply ``retention`` (None: delete no committed step) and collect garbage on one tier."""
    threshold = settings().gc_abandoned_s if abandoned_after_s is None else abandoned_after_s
    if tier.capabilities.chunks_by_digest and not dry_run:
        with gc_lease(tier):
            return _collect(tier, retention, dry_run, threshold)
    return _collect(tier, retention, dry_run, threshold)


def _collect(tier: StorageTier, retention: RetentionPolicy | None, dry_run: bool, threshold: float) -> GcReport:
    committed = tier.committed_steps()
    doomed = retention.deletable(committed) if retention is not None else []
    kept = [step for step in committed if step not in doomed]
    abandoned, in_flight = _uncommitted(tier, committed, threshold)
    if not dry_run:
        for step in doomed + abandoned:
            if step in abandoned and live_step_owners(tier, step):  # a promoter began meanwhile
                abandoned.remove(step)
                in_flight.append(step)
                continue
            tier.delete_step(step)
            log.info("deleted step %d from %s", step, tier.label)
    report = GcReport(tier=tier.label, dry_run=dry_run, kept_steps=tuple(kept), deleted_steps=tuple(doomed),
                      abandoned_steps=tuple(abandoned), in_flight_steps=tuple(in_flight))
    if not tier.capabilities.chunks_by_digest:
        return report
    return _sweep(tier, report, kept, in_flight, dry_run, threshold)


def _sweep(tier: StorageTier, report: GcReport, kept: list[int], in_flight: list[int], dry_run: bool,
           threshold: float) -> GcReport:
    candidates = stored_chunks(tier)  # listed after the lease was taken, before marking
    marked: set[str] = set()
    try:
        for step in kept:
            marked |= _referenced_by_committed(tier, step)
        for step in in_flight:
            marked |= _referenced_by_in_flight(tier, step)
    except CkptdError as error:
        note = f"nothing swept: the chunks of a kept step are unknown ({error})"
        log.warning("%s", note)
        return replace(report, swept=False, note=note)
    garbage = {key: size for key, size in candidates.items() if key not in marked}
    if not dry_run and garbage:
        tier.delete_files([tier.chunk_path(key) for key in sorted(garbage)])
    if not dry_run:
        note_store_size(tier, len(candidates) - len(garbage))  # promotions here choose listing or lookups by it
    if not dry_run:
        gone = {tier.chunk_path(key) for key in garbage}
        gone_steps = {step_dir(step) for step in (*report.deleted_steps, *report.abandoned_steps)}
        for path in bad_chunk_paths(tier):
            if path in gone or path.partition("/")[0] in gone_steps:
                clear_bad_chunk(tier, path)  # its object is deleted: nothing left to mend
    if not tier.capabilities.multipart_uploads:
        uploads_aborted = 0
    elif dry_run:
        uploads_aborted = len(tier.abandoned_uploads(threshold))
    else:
        uploads_aborted = tier.abort_incomplete_uploads(threshold)
    return replace(report, deleted_chunks=len(garbage), deleted_chunk_bytes=sum(garbage.values()),
                    aborted_uploads=uploads_aborted)


__all__ = ["GcReport", "collect_garbage"]
