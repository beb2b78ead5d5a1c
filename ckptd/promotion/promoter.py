"""Promotion: a verified, deduplicated, resumable copy of a committed local step to the object tier.

Order of work for one step (the same on every retry, so a crash at any point is resumed by running
it again):

1. read the local manifest and rank indexes (their digests are checked against the manifest);
2. stop if the object tier already has this step committed with the same content (idempotent);
3. claim the shares (:mod:`ckptd.promotion.ownership`: which job and process promotes them), then upload
   the rank indexes: the step's in-flight marker, which protects its chunks from GC
   (see :mod:`ckptd.promotion.lease`), then wait while a collector holds the GC lease (a step of packs
   only, keeping no content-addressed chunk, neither waits nor looks up chunks). Indexes and packs
   (the step directory's objects, not content-addressed) are written once (``If-None-Match``): a promoter
   of another step with the same number stops with a CommitError instead of replacing what the first
   one's manifest names, unless the claim shows an interrupted promotion of this same job (a restart),
   whose objects of the step are then removed and the step promoted again;
4. decide which content-addressed chunks to upload (:func:`ckptd.promotion.dedup.chunks_to_upload`: the
   missing ones, and stored ones recorded bad or failing their store-kept checksum), and every rank's pack (its small chunks
   in one object in the step directory, format 3). Each chunk's bytes are read from the local data
   file, decoded and hashed, and compared with the index *before* those same bytes are sent (a pack is
   read whole and each of its chunks checked before the pack is sent); a local chunk that fails its
   digest stops the promotion and nothing is committed remotely;
5. look again (a listing, or a HEAD per chunk once the store is large) and check that every chunk the step
   keeps from earlier uploads, and every pack, is stored with the right size (the chunks uploaded in step 4
   are vouched for by their PUTs: a step whose chunks are all new looks up none), then clear the bad
   records of the chunks uploaded again;
6. with several ranks promoting their own shares, each writes ``rank-NNNNN.promoted`` and the committing
   rank (the share that includes rank 0, unless the caller names another) waits for all of them, at most
   ``CKPTD_COMMIT_TIMEOUT_S`` and never past :attr:`Promoter.give_up_at`, logging which ranks it waits for.
   A rank that dropped its pin of the step unpromoted (its pin cap, a leftover it settled as lost) says so
   with ``rank-NNNNN.released`` (:func:`announce_release`, holding the digest of the step's manifest, so that
   only this very step counts): the committing rank then stops waiting at once (CommitError), and a rank that
   has not started its share skips it;
7. check that no restart of the job took the step over, write ``manifest.json`` last (the exact bytes of the
   local manifest), then delete the claims.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptd.background import run_jobs
from ckptd.config import settings
from ckptd.errors import (AlreadyCommittedError, CkptdError, CommitError, DeadlineError, NotFoundError,
                          OtherPromotionError, ShareReleasedError, StepSetAsideError)
from ckptd.format.hashing import chunk_digest
from ckptd.format.layout import MANIFEST_NAME, step_dir, step_file
from ckptd.tiers.atomicity import step_commit
from ckptd.format.records import ChunkRecord, Manifest
from ckptd.stepio.step_reader import load_step_manifest
from ckptd.promotion.dedup import chunks_to_upload, mark_uploaded, stored_sizes
from ckptd.promotion.contents import (RankShare, StepContents, pack_path, read_step_contents, read_stored_chunk,
                                     read_verified_pack)
from ckptd.promotion.lease import live_step_owners, step_owner_lease, wait_for_collector
from ckptd.promotion.ownership import FOREIGN, Claim, claim_name, decide, read_claim, run_id_for, take_over
from ckptd.tiers.chunk_health import bad_chunk_paths
from ckptd.tiers.base import StorageTier
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.upload_owners import this_host

log = logging.getLogger("ckptd.promotion")

#: Called with the name of each phase a promotion enters ("marked", "chunks", "verified", "committed").
PhaseHook = Callable[[str], None]
#: Called with the number of bytes just uploaded (progress bars).
ProgressHook = Callable[[int], None]
#: A rank committing a step logs which other ranks' shares it still waits for this often (seconds).
_WAIT_LOG_S = 10.0
#: ... and looks this often whether one of them announced that it dropped its share (seconds).
_RELEASED_LOOK_S = 1.0


@dataclass(frozen=True)
class PromotionReport:
    """What one promotion did. Byte counts are of stored (encoded) chunk bytes. ``chunks`` and
    ``chunks_uploaded`` count content-addressed chunks; ``packs_uploaded`` the packs sent (whose bytes
    ``bytes_uploaded`` includes)."""

    step: int
    tier: str
    ranks: tuple[int, ...]
    chunks: int
    chunks_uploaded: int
    chunk_bytes: int
    bytes_uploaded: int
    already_committed: bool
    seconds: float
    packs_uploaded: int = 0


def promoted_marker_name(rank: int) -> str:
    """Name of the object a rank writes once its share of a step is uploaded and verified."""
    return f"rank-{rank:05d}.promoted"


def released_marker_name(rank: int) -> str:
    """Name of the object a rank writes when it dropped its pin of a step without promoting its share."""
    return f"rank-{rank:05d}.released"


def manifest_digest(manifest_bytes: bytes) -> bytes:
    """What a ``rank-NNNNN.released`` marker holds: it names one step's manifest, not any step with its number."""
    return hashlib.sha256(manifest_bytes).hexdigest().encode()


def announce_release(remote: ObjectTier, step: int, ranks: list[int], manifest_bytes: bytes) -> None:
    """Tell the object tier that ``ranks`` dropped their pins of ``step`` unpromoted, so that the rank committing
    it stops waiting for their shares at once (StorageError when the tier does not answer)."""
    digest = manifest_digest(manifest_bytes)
    for rank in ranks:
        remote.write_bytes(step_file(step, released_marker_name(rank)), digest)


def stored_chunks(remote: ObjectTier) -> dict[str, int]:
    """Content address -> size of every chunk stored on an object tier."""
    prefix = remote.chunk_path("")
    return {obj.path[len(prefix):]: obj.size for obj in remote.list_objects(prefix.rstrip("/"))}


def _same_step(first: Manifest, second: Manifest) -> bool:
    return first.world_size == second.world_size and first.ranks == second.ranks


class Promoter:
    """Copies committed steps from a local tier to an object tier.

    One promoter per process and remote tier; :meth:`promote` may be called from one thread at a time.
    ``ranks`` limits a promotion to some ranks' shares (multi-node jobs where each node promotes its own);
    the share that includes rank 0 commits the step once every rank's marker exists (``commits`` names
    another committing share: a step whose rank 0 share was promoted by an earlier run).
    """

    def __init__(self, local: StorageTier, remote: ObjectTier, *, concurrency: int | None = None,
                 on_phase: PhaseHook | None = None) -> None:
        self.local, self.remote = local, remote
        self.concurrency = concurrency or max(1, settings().s3_concurrency)
        self.on_phase = on_phase or (lambda phase: None)
        #: The monotonic time past which the committing rank stops waiting for the other ranks' shares (None:
        #: only ``CKPTD_COMMIT_TIMEOUT_S`` bounds it); read while waiting (an uploader's close sets it).
        self.give_up_at: Callable[[], float | None] = lambda: None
        #: Whether the step being promoted was set aside meanwhile (read while waiting for the other ranks'
        #: shares: StepSetAsideError then; an uploader sets it). Default: never.
        self.set_aside: Callable[[], bool] = lambda: False
        #: This promoter's claim of the shares it promotes (see :mod:`ckptd.promotion.ownership`).
        self.claim = Claim.mine(run_id_for(remote))
        #: Steps whose interrupted promotion by an earlier incarnation of this job this promoter replaced.
        self.taken_over: list[int] = []

    def promote(self, step: int, *, ranks: list[int] | None = None, progress: ProgressHook | None = None,
                commits: bool | None = None) -> PromotionReport:
        """:meth:`_promote_owned` under the step's owner lease (:func:`~ckptd.promotion.lease.step_owner_lease`), so
        that a garbage collection never takes the step for abandoned while it is promoted."""
        with step_owner_lease(self.remote, step):
            return self._promote_owned(step, ranks=ranks, progress=progress, commits=commits)

    def _promote_owned(self, step: int, *, ranks: list[int] | None = None, progress: ProgressHook | None = None,
                       commits: bool | None = None) -> PromotionReport:
        """Promote one committed local step; returns what was uploaded. Raises NotFoundError when the step
        is not committed locally, IntegrityError when a local chunk is corrupt, StorageError when the
        object tier fails past its retry budget, CommitError when the remote holds a different step or
        another rank's share did not arrive in time (ShareReleasedError when another rank dropped its share). ``commits`` (default: ``ranks`` includes rank 0) says
        whether this share commits the step once every other rank's marker exists."""
        started = time.monotonic()
        contents = read_step_contents(self.local, step, ranks)
        commits = (ranks is None or 0 in ranks) if commits is None else commits
        try:
            return self._promote_contents(contents, ranks, progress, commits, started)
        except OtherPromotionError as conflict:
            self._take_over_or_refuse(contents, ranks, conflict)
        return self._promote_contents(contents, ranks, progress, commits, started)

    def _take_over_or_refuse(self, contents: StepContents, ranks: list[int] | None,
                             conflict: OtherPromotionError) -> None:
        """After a written-once object of the step held other bytes: replace what an interrupted promotion of
        this job left (see :mod:`ckptd.promotion.ownership`), or raise the conflict (another job's, or a live
        one)."""
        step = contents.step
        mine = [share.rank for share in contents.shares]
        stored = {rank: read_claim(self.remote, step, rank) for rank in mine}
        verdicts = {rank: decide(self.claim, claim) for rank, claim in stored.items()}
        if all(verdict != FOREIGN for verdict in verdicts.values()) and not self._other_owners_gone(step):
            verdicts = {rank: FOREIGN for rank in verdicts}  # a live promoter holds the step: never taken over
        if any(verdict == FOREIGN for verdict in verdicts.values()):
            owners = sorted({claim.describe() for claim in stored.values() if claim is not None})
            by = f" (by {'; '.join(owners)})" if owners else ""
            raise CommitError(f"{conflict.message}{by}", step=step, tier=self.remote.label, path=conflict.path,
                              hint=conflict.hint) from conflict
        removed = take_over(self.remote, step, mine, self.claim, whole_step=ranks is None)
        self.taken_over.append(step)
        log.info("step %d on %s: replacing the promotion of step %d that an earlier run of this job (%s) left "
                    "interrupted (%d object(s) removed)", step, self.remote.label, step,
                    "; ".join(sorted({claim.describe() for claim in stored.values() if claim is not None})),
                    len(removed))

    def _other_owners_gone(self, step: int) -> bool:
        """Whether no other process holds the owner lease of ``step`` (:func:`live_step_owners`), waiting up to
        one lease for a holder to go: a claim on another host cannot tell a crashed promotion from a live one
        (a node cut off, still uploading), but its lease can: a live one keeps refreshing it."""
        deadline = time.monotonic() + settings().s3_upload_owner_lease_s + settings().promotion_owner_poll_s
        while True:
            others = [owner for owner in live_step_owners(self.remote, step)
                      if (owner.host, owner.pid) != (this_host(), os.getpid())]
            if not others:
                return True
            if time.monotonic() >= deadline:
                return False
            log.info("step %d on %s: waiting for the owner lease of %s (process %d) to end before replacing its "
                     "promotion", step, self.remote.label, others[0].host, others[0].pid)
            threading.Event().wait(min(settings().promotion_owner_poll_s, max(0.0, deadline - time.monotonic())))

    def _promote_contents(self, contents: StepContents, ranks: list[int] | None, progress: ProgressHook | None,
                 commits: bool, started: float) -> PromotionReport:
        step = contents.step
        existing = self._remote_manifest(step)
        if existing is not None:
            if not _same_step(existing, contents.manifest):
                raise CommitError("the object tier already holds a different step with this number", step=step,
                                  tier=self.remote.label, path=step_file(step, MANIFEST_NAME),
                                  hint="delete it there (ckptd gc) or promote into another prefix")
            return self._report(contents, 0, 0, True, started)
        self._stop_if_released(contents, [entry.rank for entry in contents.manifest.ranks
                                          if ranks is not None and entry.rank not in ranks])
        claims = self._claim(contents)
        uploaded_bytes = 0
        for share in contents.shares:  # 3. in-flight marker
            self._write_once(step, step_file(step, share.index_name), share.index_bytes)
            uploaded_bytes += len(share.index_bytes)
        self.on_phase("marked")
        needed = contents.unique_chunks()
        recorded_bad: set[str] = set()
        missing: list[tuple[RankShare, ChunkRecord]] = []
        if needed:  # a step of packs only (a small state) keeps no shared chunk a collector could take
            waited = wait_for_collector(self.remote)
            if waited >= 0.5:
                log.info("waited %.1fs for a garbage collection to finish before promoting step %d", waited, step)
            recorded_bad = bad_chunk_paths(self.remote)
            missing = chunks_to_upload(self.remote, needed, self.local, bad=recorded_bad)
        self.on_phase("chunks")
        uploaded_bytes += self._upload(missing, contents.packs(), progress)
        uploaded = [chunk.object_key for _, chunk in missing]
        sent = set(uploaded)
        self._check_all_stored(contents, {key: item for key, item in needed.items() if key not in sent})
        mark_uploaded(self.remote, uploaded, recorded_bad=recorded_bad)
        self.on_phase("verified")
        for share in contents.shares if ranks is not None else ():
            # written once too: a retry must not refresh the step directory, or GC never finds a leftover of
            # another incarnation of this step abandoned
            self._write_once(step, step_file(step, promoted_marker_name(share.rank)), b"")
        if commits:
            self._wait_for_other_ranks(contents, ranks)
            self._check_other_indexes(contents, ranks)
            self._check_claims(contents, claims)
            self._stop_if_set_aside(contents, [])
            try:
                step_commit(self.remote).commit(step, contents.manifest_bytes)
            except AlreadyCommittedError:  # another promoter committed it meanwhile
                existing = self._remote_manifest(step)
                if existing is None or not _same_step(existing, contents.manifest):
                    raise
                return self._report(contents, len(missing), uploaded_bytes, True, started, len(contents.packs()))
            uploaded_bytes += len(contents.manifest_bytes)
            self.on_phase("committed")
            self._drop_claims(contents)
        report = self._report(contents, len(missing), uploaded_bytes, False, started, len(contents.packs()))
        log.info("promoted step %d to %s: %d of %d chunks and %d packs uploaded (%d bytes) in %.2fs", step,
                 self.remote.label, report.chunks_uploaded, report.chunks, report.packs_uploaded,
                 report.bytes_uploaded, report.seconds)
        return report

    def _remote_manifest(self, step: int) -> Manifest | None:
        try:
            return load_step_manifest(self.remote, step)
        except NotFoundError:
            return None

    def _write_once(self, step: int, path: str, data: bytes) -> None:
        """Write an object of the step directory (a rank index or pack) that is never replaced: these keys
        are not content-addressed, so a second promoter of another step with this number (another job on
        the same prefix) must not overwrite what the manifest of the first one names. The same bytes
        already there (a resumed or concurrent promotion of this very step) count as written; different
        bytes stop this promotion with a CommitError before it uploads anything of its own. What an
        interrupted promotion of other content left is removed by GC once it counts as abandoned
        (``gc_abandoned_s``); the step can be promoted then."""
        try:
            self.remote.write_bytes(path, data, if_absent=True)
        except AlreadyCommittedError as error:
            raise OtherPromotionError(
                f"the object tier holds another promotion of step {step} with different content (in flight, "
                "committed, or interrupted); this one stops and commits nothing", step=step,
                tier=self.remote.label, path=path,
                hint="give every job its own object-tier prefix; the files of an interrupted promotion are "
                     "removed by `ckptd gc` once CKPTD_GC_ABANDONED_S has passed, then promote again") from error

    def _claim(self, contents: StepContents) -> dict[int, str]:
        """Claim this promoter's shares of the step (written once); returns, per rank, the incarnation whose
        claim stands (this promoter's, or an earlier one's when the step's objects it wrote are the same)."""
        standing: dict[int, str] = {}
        for share in contents.shares:
            path = step_file(contents.step, claim_name(share.rank))
            try:
                self.remote.write_bytes(path, self.claim.to_json_bytes(), if_absent=True)
                standing[share.rank] = self.claim.incarnation
            except AlreadyCommittedError:
                stored = read_claim(self.remote, contents.step, share.rank)
                standing[share.rank] = "" if stored is None else stored.incarnation
        return standing

    def _check_claims(self, contents: StepContents, claims: dict[int, str]) -> None:
        """CommitError when another promoter took over one of this promoter's shares since it claimed them (a
        restart of the job that took this promotion for interrupted): its files are no longer this one's."""
        for rank, incarnation in claims.items():
            stored = read_claim(self.remote, contents.step, rank)
            if stored is not None and stored.incarnation != incarnation:  # none: dropped by a commit of this step
                raise CommitError(
                    f"the object tier holds another promotion of step {contents.step} with different content: "
                    f"{stored.describe()} took this step over; this one stops and "
                    "commits nothing", step=contents.step, tier=self.remote.label,
                    path=step_file(contents.step, claim_name(rank)),
                    hint="give every job its own object-tier prefix, or its own CKPTD_RUN_ID")

    def _drop_claims(self, contents: StepContents) -> None:
        """Delete the claims of a committed step (bookkeeping, not data); a failure only leaves them behind."""
        try:
            self.remote.delete_files([step_file(contents.step, claim_name(entry.rank))
                                      for entry in contents.manifest.ranks])
        except CkptdError as error:
            log.debug("could not delete the claims of step %d: %s", contents.step, error)

    def _check_other_indexes(self, contents: StepContents, ranks: list[int] | None) -> None:
        """CommitError unless every other rank's stored index is the one this manifest names: a
        ``rank-NNNNN.promoted`` marker may be a leftover of another incarnation of this step number, whose
        written-once index stays until GC removes it as abandoned."""
        for entry in contents.manifest.ranks:
            if ranks is None or entry.rank in ranks:
                continue
            path = step_file(contents.step, entry.index_file)
            try:
                stored = chunk_digest(self.remote.read_bytes(path))
            except NotFoundError:
                stored = "none"
            if stored != entry.index_digest:
                raise CommitError(
                    f"rank {entry.rank}'s index of step {contents.step} on the object tier is not the one this "
                    "step's manifest names (a leftover of an interrupted promotion of other content with this "
                    "step number); the step is not committed", step=contents.step, tier=self.remote.label,
                    path=path, hint="the leftover is removed by `ckptd gc` once CKPTD_GC_ABANDONED_S has passed; "
                                    "then promote the step again, or let a newer step be promoted")

    def _upload(self, missing: list[tuple[RankShare, ChunkRecord]], packs: list[tuple[RankShare, int]],
                progress: ProgressHook | None) -> int:
        """Upload the missing chunks by digest and the packs into the step directory, in parallel;
        returns the bytes sent. Every byte sent was checked against its digest first."""
        lock = threading.Lock()
        total = 0

        def sent(count: int) -> None:
            nonlocal total
            with lock:
                total += count
            if progress is not None:
                progress(count)

        def copy(item: tuple[RankShare, ChunkRecord]) -> None:
            share, chunk = item
            stored = read_stored_chunk(self.local, share, chunk)  # digest checked before upload
            self.remote.write_bytes(self.remote.chunk_path(chunk.object_key), stored)
            sent(len(stored))

        def copy_pack(share: RankShare, number: int) -> None:
            data = read_verified_pack(self.local, share, number)  # every chunk checked before upload
            self._write_once(share.index.step, pack_path(share, number), data)
            sent(len(data))

        jobs = [functools.partial(copy, item) for item in missing]
        # packs first: each is one large object, and a rank's many small chunks ride in it
        jobs[:0] = [functools.partial(copy_pack, share, number) for share, number in packs]
        if not jobs:
            return 0
        run_jobs(jobs, threads=self.concurrency, thread_name_prefix="ckptd-promote")
        return total

    def _check_all_stored(self, contents: StepContents, kept: dict[str, tuple[RankShare, ChunkRecord]]) -> None:
        """CommitError unless this promotion's rank indexes and packs are still in the step directory, and
        every chunk the step keeps from earlier uploads (``kept``: those dedup found stored) is still stored
        with its size. The chunks this promotion uploaded are vouched for by their PUTs' answers (S3 reads
        its own writes) and by the indexes: a collector that took this step for abandoned (older than
        ``gc_abandoned_s``) deletes its directory before it sweeps the chunks only the step names. So a step
        whose chunks are all new costs one small listing of its own directory here, and the kept chunks are
        found as dedup finds them (a listing of the chunk store, or a HEAD each once it is large)."""
        in_step = {obj.path: obj.size for obj in self.remote.list_objects(step_dir(contents.step))}
        expected = [(step_file(contents.step, share.index_name), len(share.index_bytes), "rank index")
                    for share in contents.shares]
        expected += [(pack_path(share, number), share.index.data_files[number].size, "pack")
                     for share, number in contents.packs()]
        for path, size, what in expected:
            if in_step.get(path) != size:
                raise CommitError(f"a {what} is missing on the object tier after upload (a garbage collection took "
                                  "the step for abandoned, or the object was deleted); the step was not committed",
                                  step=contents.step, tier=self.remote.label, path=path,
                                  hint="promote the step again")
        stored = stored_sizes(self.remote, kept) if kept else {}
        for key, (_, chunk) in kept.items():
            if stored.get(key) != chunk.length:
                raise CommitError("a chunk is missing on the object tier after upload; the step was not committed",
                                  step=contents.step, tier=self.remote.label, path=self.remote.chunk_path(key),
                                  hint="promote the step again")

    def _stop_if_released(self, contents: StepContents, ranks: list[int]) -> None:
        """CommitError when one of ``ranks`` announced that it dropped its share of this very step."""
        if not ranks:
            return
        digest = manifest_digest(contents.manifest_bytes)
        for rank in ranks:
            path = step_file(contents.step, released_marker_name(rank))
            try:
                released = self.remote.read_bytes(path) == digest
            except NotFoundError:
                continue
            if released:
                raise ShareReleasedError(f"rank {rank} dropped its pin of this step without promoting its share (its pin "
                                  "cap, or its copy was lost): the step is not committed on the object tier",
                                  step=contents.step, tier=self.remote.label, path=path,
                                  hint="nothing to do: a newer step is promoted instead")

    def _stop_if_set_aside(self, contents: StepContents, waiting: list[int]) -> None:
        """StepSetAsideError when the local step is no longer the one being promoted: set aside by a restore
        (training went back to an older step), or saved again since by a newer generation of the job. Its
        shares must not be committed with the other ranks' shares of the step saved again (a node lost while
        this promoter waited: its replacement's share of the replayed step completed the older promotion)."""
        if not self.set_aside() and self._still_local(contents):
            return
        before = (f"before rank(s) {', '.join(map(str, waiting))} promoted their share" if waiting
                  else "before it was committed")
        raise StepSetAsideError(f"the local tier no longer holds this step as it was read (set aside when training "
                                f"went back to an older step, saved again, or deleted) {before}: it is not "
                                "committed on the object tier", step=contents.step, tier=self.remote.label,
                                hint="nothing to do: a step saved again with this number is promoted instead")

    def _still_local(self, contents: StepContents) -> bool:
        """Whether the local tier still holds the step being promoted, with the manifest it was read with."""
        try:
            return self.local.read_bytes(step_file(contents.step, MANIFEST_NAME)) == contents.manifest_bytes
        except NotFoundError:
            return False

    def _wait_for_other_ranks(self, contents: StepContents, ranks: list[int] | None) -> None:
        """Wait until every other rank's marker exists: at most ``CKPTD_COMMIT_TIMEOUT_S``, never past
        :attr:`give_up_at` (DeadlineError naming the ranks), logging the ranks still waited for."""
        waiting = [entry.rank for entry in contents.manifest.ranks if ranks is not None and entry.rank not in ranks]
        limit = settings().commit_timeout_s
        started = logged = time.monotonic()
        looked = started - _RELEASED_LOOK_S
        while waiting:
            waiting = [rank for rank in waiting
                       if not self.remote.exists(step_file(contents.step, promoted_marker_name(rank)))]
            if not waiting:
                return
            self._stop_if_set_aside(contents, waiting)
            now = time.monotonic()
            if now - looked >= _RELEASED_LOOK_S:
                looked = now
                self._stop_if_released(contents, waiting)
            give_up_at = self.give_up_at()
            if now - started >= limit or (give_up_at is not None and now >= give_up_at):
                why = f"within {limit:g} s" if now - started >= limit else "before this uploader closed"
                raise DeadlineError(f"rank(s) {', '.join(map(str, waiting))} did not promote their share {why}; "
                                    "the step was not committed on the object tier", step=contents.step,
                                    tier=self.remote.label,
                                    path=step_file(contents.step, promoted_marker_name(waiting[0])),
                                    hint="their uploaders may have died or never held the step (CKPTD_COMMIT_"
                                    "TIMEOUT_S bounds the wait); promote the step again")
            if now - logged >= _WAIT_LOG_S:
                logged = now
                log.info("step %d: waiting for rank(s) %s to promote their share before committing it on %s "
                         "(%.0f s so far)", contents.step, ", ".join(map(str, waiting)), self.remote.label,
                         now - started)
            time.sleep(0.2)

    def _report(self, contents: StepContents, uploaded: int, uploaded_bytes: int, already: bool,
                started: float, packs_uploaded: int = 0) -> PromotionReport:
        needed = contents.unique_chunks()
        return PromotionReport(step=contents.step, tier=self.remote.label,
                               ranks=tuple(share.rank for share in contents.shares), chunks=len(needed),
                               chunks_uploaded=uploaded, chunk_bytes=sum(c.length for _, c in needed.values()),
                               bytes_uploaded=uploaded_bytes, already_committed=already,
                               seconds=time.monotonic() - started, packs_uploaded=packs_uploaded)


def promote_step(local: StorageTier, remote: ObjectTier, step: int, *, ranks: list[int] | None = None,
                 progress: ProgressHook | None = None) -> PromotionReport:
    """Promote one committed step from ``local`` to ``remote`` (see :class:`Promoter`)."""
    return Promoter(local, remote).promote(step, ranks=ranks, progress=progress)
