"""What :class:`~ckptd.manager.manager.CheckpointManager` does with its object tier: upload committed
steps in the background, read ahead before a restore that needs the object tier, and optionally copy a
step restored from the object tier back to the (empty or stale) local tier."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from ckptd.background import start_thread
from ckptd.errors import CkptdError, ConfigError
from ckptd.policy import Policy
from ckptd.promotion.ownership import read_claim_quietly, run_id_for
from ckptd.promotion.pull import MetadataReader, prefetch_step, pull_step
from ckptd.promotion.schedule import PromotionSchedule
from ckptd.promotion.uploader import BackgroundUploader
from ckptd.tiers import StorageTier, open_tier
from ckptd.tiers.local import LocalTier

log = logging.getLogger("ckptd.promotion")


#: How often a close that waits for uploads runs its ``while_waiting`` callback (seconds).
_WAITING_BEAT_S = 0.5


def _run_beating(work: Callable[[], None], while_waiting: Callable[[], None]) -> None:
    """Run ``work`` on a helper thread and ``while_waiting`` on this one until it ends; re-raise its error."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - re-raised on the calling thread
            failure.append(error)

    helper = start_thread("ckptd-close-uploads", run)
    while not helper.join_within(_WAITING_BEAT_S):
        try:
            while_waiting()
        except Exception as error:  # noqa: BLE001 - a failed beat must not abandon the close half-way
            log.debug("the callback of a close waiting for uploads failed: %s", error)
    if failure:
        raise failure[0]


class _Listings(Protocol):
    metadata: MetadataReader

    def committed(self, tier: StorageTier) -> frozenset[int]: ...


class RemoteSync:
    """The manager's object tier and its uploader. Methods are called from the training thread, except
    :meth:`on_commit`, which the saver calls after each local commit, and :meth:`start_uploads`.

    With ``start_uploads=False`` (the node's daemon promotes the steps) the object tier serves restores only
    and no uploader runs; :meth:`start_uploads` starts one later (the daemon stopped answering)."""

    def __init__(self, local: LocalTier, url: str, *, storage_options: dict[str, Any] | None, policy: Policy,
                 rank: int, world_size: int, repopulate_local: bool,
                 repopulate_ranks: tuple[int, ...] | None = None, start_uploads: bool = True,
                 writer_busy: Callable[[], bool] | None = None) -> None:
        remote = open_tier(url, storage_options=storage_options)
        if not remote.capabilities.chunks_by_digest:
            raise ConfigError(f"remote={url!r} is not an object store URL", hint="pass remote='s3://bucket/prefix'")
        self.local, self.remote = local, remote
        self.rank, self.world_size = rank, world_size
        self.repopulate_local = repopulate_local
        #: The ranks whose files this rank copies back into its directory (all the ranks that share it, when
        #: this rank owns it; none otherwise; None: every rank of the step).
        self.repopulate_ranks = repopulate_ranks
        self.policy = policy
        #: Whether the local writer is writing a save (the uploader's S3 calls yield to it).
        self.writer_busy = writer_busy
        self._told_interrupted = False
        #: None while the node's daemon promotes this root (``start_uploads=False``): see :meth:`start_uploads`.
        self.uploader: BackgroundUploader | None = None
        if start_uploads:
            self.start_uploads()

    def start_uploads(self, schedule: PromotionSchedule | None = None) -> None:
        """Start the in-process uploader (once) and resume the steps left pinned. With several ranks it decides
        through ``schedule`` (see :meth:`BackgroundUploader.use_schedule`)."""
        if self.uploader is not None:
            return
        uploader = BackgroundUploader(self.local, self.remote, policy=self.policy, rank=self.rank,
                                      world_size=self.world_size, writer_busy=self.writer_busy)
        if self.world_size > 1:
            uploader.use_schedule(schedule)
        self.uploader = uploader
        uploader.resume_pending()

    @property
    def uploads_running(self) -> bool:
        """Whether the uploader's thread still runs (False without an uploader)."""
        return self.uploader is not None and self.uploader.running

    def on_commit(self, step: int) -> None:
        if self.uploader is not None:
            self.uploader.on_commit(step)

    def before_restore(self, step: int | None, listings: _Listings | None = None) -> None:
        """Start fetching the chunks this rank will read when the step to restore is only remote.

        ``listings`` (the restore's :class:`~ckptd.manager.restoring.TierListings`) lists each tier once
        for the whole restore and reports a tier that does not answer; without it the tiers are listed
        here and a failure only disables the read-ahead."""
        try:
            if listings is not None:
                remote_steps, local_steps = listings.committed(self.remote), listings.committed(self.local)
            else:
                remote_steps = frozenset(self.remote.committed_steps())
                local_steps = frozenset(self.local.committed_steps())
            target = step if step is not None else max(remote_steps | local_steps, default=None)
            if target is not None and target in remote_steps and target not in local_steps:
                prefetch_step(self.remote, target, self.rank,
                              metadata=None if listings is None else listings.metadata)
        except CkptdError as error:  # read-ahead is an optimisation; restore reports real problems
            log.debug("no read-ahead before restore: %s", error)

    def after_restore(self, step: int | None, tier: str | None) -> None:
        """Say once where training resumes when the object tier holds only interrupted promotions of newer
        steps; with ``repopulate_local``, copy a step restored from the object tier to the local tier."""
        self._tell_interrupted(step)
        if not self.repopulate_local or step is None or tier != self.remote.label:
            return
        ranks = None if self.world_size == 1 else self.repopulate_ranks
        if ranks is not None and not ranks:
            return
        try:
            pull_step(self.remote, self.local, step, ranks=ranks)
        except CkptdError as error:
            log.warning("could not re-populate the local tier with step %d: %s", step, error)

    def _tell_interrupted(self, restored: int | None) -> None:
        """Rank 0, after the first full restore: warn once when the object tier holds uncommitted step
        directories newer than the step training resumes from (a promotion this job's earlier run left
        interrupted: it is replaced when the step is saved again, see :mod:`ckptd.promotion.ownership`; or
        another job's on this prefix: its promotion is refused)."""
        if self._told_interrupted or self.rank != 0:
            return
        self._told_interrupted = True
        pending = set(self.uploader.unpromoted) if self.uploader is not None else set()  # resumed, not interrupted
        try:
            newer = [number for number in self.remote.list_step_numbers()
                     if number not in pending and (restored is None or number > restored)]
            if newer:  # listed again only when some step directory is newer than the restored step
                committed = set(self.remote.committed_steps())
                newer = [number for number in newer if number not in committed]
        except CkptdError as error:
            log.debug("could not list the object tier's step directories: %s", error)
            return
        if not newer:
            return
        run_id = run_id_for(self.remote)
        owners = {number: {claim.run_id for claim in (read_claim_quietly(self.remote, number, 0),) if claim}
                  for number in newer}
        foreign = [number for number in newer if owners[number] and run_id not in owners[number]]
        listed = ", ".join(map(str, newer))
        start = f"step {restored}" if restored is not None else "step 0"
        where = "S3" if self.remote.url.startswith("s3://") else self.remote.label
        log.warning("%s holds only an interrupted promotion of step %s: starting from %s (%s; %s)", where, listed,
                    start, self.remote.label,
                    "this job replaces it when it saves the step again" if not foreign else
                    f"step(s) {', '.join(map(str, foreign))} belong to another job on this prefix "
                    f"({', '.join(sorted(owners[foreign[0]]))}): this job's promotion of it will be refused; give "
                    "every job its own prefix or CKPTD_RUN_ID")

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until queued uploads are done (at most ``timeout_s``); re-raise the upload failures. Nothing
        without an uploader (the daemon promotes)."""
        if self.uploader is not None:
            self.uploader.wait(timeout_s)

    def close(self, timeout_s: float | None = None, *, while_waiting: Callable[[], None] | None = None) -> None:
        """Finish queued uploads and release the object tier within ``timeout_s`` (see
        :meth:`BackgroundUploader.close`: raises UnpromotedError listing the steps left pinned locally).
        ``while_waiting`` runs on the calling thread about twice a second while the uploads finish (a
        launched rank's heartbeat: a close that waits for the object tier is no hang)."""
        if self.uploader is None:
            self.remote.close()
        elif while_waiting is None:
            self.uploader.close(timeout_s)
        else:
            _run_beating(functools.partial(self.uploader.close, timeout_s), while_waiting)
