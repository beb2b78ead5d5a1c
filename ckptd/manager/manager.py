"""CheckpointManager: the training loop's entry point for saving and restoring.

Call order, on every rank: construct once; :meth:`CheckpointManager.restore` once before training;
:meth:`CheckpointManager.save` every step (the policy decides which steps are written);
:meth:`CheckpointManager.close` at the end (or use it as a context manager).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptd.config import settings
from ckptd.errors import CkptdError, ConfigError, StillRunningError, StorageError
from ckptd.format import codecs
from ckptd.format.layout import MANIFEST_NAME, RANKS_HERE_NAME, rank_file_prefix
from ckptd.manager.commit import CommitCoordinator, SingleProcessCoordinator, StoreCoordinator
from ckptd.manager.directories import DirectorySharing, directory_identity
from ckptd.manager.set_aside import set_aside_reason, set_aside_step
from ckptd.format.mesh_layout import Layout
from ckptd.manager.holdings import LayoutRecorder
from ckptd.policy import Policy
from ckptd.manager.daemon_handoff import (DaemonHandoff, SharedLoss, leftover_pins, open_peer_tier,
                                          split_peer_options)
from ckptd.manager.daemon_link import DaemonLink
from ckptd.promotion.lag import PromotionLag, promotion_lag
from ckptd.promotion.pinning import PIN_DIRECTORY
from ckptd.manager.interrupted_commit import complete_interrupted_commit
from ckptd.manager.restoring import RestoreResult, TierListings, restore_state
from ckptd.manager.saving import CommitRecord, MemoryCopy, Saver
from ckptd.tiers.base import StorageTier
from ckptd.tiers.local import LocalTier

if TYPE_CHECKING:
    from ckptd.promotion.uploader import BackgroundUploader

log = logging.getLogger("ckptd.manager")
#: The name of the constructor's store exchange of what each rank's node daemon does.
_DAEMON_EXCHANGE = "daemon"


def _default_coordinator(rank: int | None, world_size: int | None, store: Any) -> CommitCoordinator:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
        if store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
    if world_size in (None, 1):
        return SingleProcessCoordinator()
    if store is None or rank is None:
        raise ConfigError("a multi-rank CheckpointManager needs rank and a c10d store",
                          hint="initialise torch.distributed first or pass rank=, world_size=, store=")
    return StoreCoordinator(store, rank, world_size, timeout_s=settings().commit_timeout_s)


class CheckpointManager:
    """Saves training state to a local tier (and later tiers) and restores the newest intact step.

    ``local`` is a directory or ``file://`` URL. ``policy`` decides which steps are saved and kept.
    ``codec`` is ``raw``, ``zstd`` or ``byteplane`` (default from ``CKPTD_CODEC``). RNG states of torch,
    numpy and ``random`` are saved and restored unless ``capture_rng=False``. Values that need pickle
    are refused unless ``allow_pickle=True``. In a process group, rank and world size come from
    ``torch.distributed`` and ranks agree on commits through its store.

    ``remote`` (``s3://bucket/prefix``) adds the object tier: committed steps that
    ``policy.remote_every_steps`` selects (every saved step when it is None) are promoted in the
    background, ``policy.keep_remote`` steps are kept there, and restore falls back to it chunk by chunk.
    ``storage_options`` go to s3fs (endpoint, credentials, region). With ``repopulate_local=True`` a step
    restored from the object tier is copied back to the local tier.

    ``daemon`` (default ``CKPTD_DAEMON``, else ``auto``) decides whether the node's ``ckptd daemon`` takes
    this manager's steps: ``auto`` uses the daemon that watches ``local`` when one answers, ``off`` never
    does, ``require`` raises ConfigError when none answers. With a daemon that promotes this root, this
    process uploads nothing: each committed step is pinned locally and the daemon told; save stalls and step
    times are reported to it for its metrics (from the writer thread). A daemon that stops answering turns
    the manager back to in-process promotion (one warning; the pinned steps are resumed). With several ranks
    the daemon takes the steps only when every rank has one that promotes; a daemon that promotes to another
    object tier than ``remote`` is told of the commits but this process promotes its own steps.

    ``peer`` (``peer://HOST:PORT/NAMESPACE``) adds a buddy node's daemon as a restore tier between the local
    and the object tier; without it, the peer the daemon names (its buddy's replica of this root) is used.
    Its token comes from ``storage_options["peer_token"]`` or ``["peer_token_file"]`` (not passed to s3fs),
    else ``CKPTD_PEER_TOKEN`` / ``CKPTD_PEER_TOKEN_FILE``.

    ``layout`` (a :class:`~ckptd.Layout`) states the job's device mesh, ZeRO stage and which mesh dimensions
    hold plain tensors identically; without it the layout is taken from the state's DTensors, if any. The
    manifest records the mesh, every rank's coordinates and who holds each replicated piece. With
    ``write_replicas="once"`` a piece held identically by several ranks (a DTensor's ``Replicate``
    placements, a key the layout marks replicated) is staged and written by one of them, spread by bytes over
    the holders; restore reads it from whichever holder wrote it, through every tier (a rank of another
    node finds it on the object or peer tier). ``"once-per-directory"``: by one holder in each local
    directory, so every directory holds its ranks' whole state. ``"every-rank"``: every rank writes its whole
    state. The default is ``"once"`` with one directory for the job, else ``"once-per-directory"``: a
    node's directory then restores without the other nodes' files, also a step the object tier does not
    have (yet, or ever: ``remote_every_steps``), and the object tier stores shared chunks once anyway. A step restores into another layout (TP, PP, DP or FSDP sharding changed)
    through DCP's resharding.
    """

    def __init__(
        self,
        local: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        codec: str | None = None,
        capture_rng: bool = True,
        allow_pickle: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        store: Any = None,
        remote: str | None = None,
        storage_options: dict[str, Any] | None = None,
        repopulate_local: bool = False,
        daemon: str | None = None,
        peer: str | None = None,
        layout: Layout | None = None,
        write_replicas: str | None = None,
    ) -> None:
        self.policy = policy or Policy()
        #: Runs on the thread calling :meth:`close` about twice a second while close waits for uploads (None:
        #: nothing); a launched rank beats its heartbeat there, so that waiting for the object tier is no hang.
        self.while_closing: Callable[[], None] | None = None
        self.codec = codecs.chosen_codec(codec)
        self.capture_rng = capture_rng
        self.allow_pickle = allow_pickle
        self.coordinator = _default_coordinator(rank, world_size, store)
        self.rank, self.world_size = self.coordinator.rank, self.coordinator.world_size
        self.local = LocalTier(local)
        self.local.acquire_lock(self.rank)
        self._saver: Saver | None = None
        try:
            #: Which ranks share this rank's local directory (by its identity, not its path) and who owns it.
            self.sharing = DirectorySharing(self.rank, tuple(
                self.coordinator.exchange("local-directory", directory_identity(self.local.root))))
            self._own_prefixes = (rank_file_prefix(self.rank),) + \
                ((MANIFEST_NAME, RANKS_HERE_NAME) if self.sharing.is_owner else ())
            removed = self.local.remove_temporaries(self._own_prefixes)
            if removed:
                log.info("removed %d temporary file(s) left by an earlier crash", len(removed))
            self.layout = layout
            if write_replicas is None:  # every directory restores alone: the object tier may lack the newest steps
                write_replicas = "once" if self.sharing.layout in ("single", "job-shared") else "once-per-directory"
            recorder = LayoutRecorder(self.rank, layout, world_size=self.world_size, write_replicas=write_replicas,
                                      directory_ranks=self.sharing.ranks_here)
            self._saver = Saver(self.local, self.coordinator, policy=self.policy, codec=self.codec,
                                allow_pickle=allow_pickle, capture_rng=capture_rng, sharing=self.sharing,
                                layout=recorder)
            self.last_restore: RestoreResult | None = None
            self._prepare_staging = True  # see save(): staging buffers are prepared on the first step not saved
            self._closed = False
            self._released = False  # True once close() released the lock (not while background work runs)
            self.remote: StorageTier | None = None
            self.peer: StorageTier | None = None
            self._remote_sync: Any = None
            self._last_save_call: float | None = None
            self._promotions_seen = 0
            storage_options, peer_options = split_peer_options(storage_options)
            self._handoff = self._find_daemon(daemon, remote=remote)
            self.peer = open_peer_tier(peer, self._handoff.link if self._handoff else None, peer_options)
            if remote is not None:
                from ckptd.promotion.remote_sync import RemoteSync

                owned = self.sharing.ranks_here if self.sharing.is_owner else ()
                self._remote_sync = RemoteSync(self.local, remote, storage_options=storage_options,
                                               policy=self.policy, rank=self.rank, world_size=self.world_size,
                                               repopulate_local=repopulate_local, repopulate_ranks=owned,
                                               start_uploads=False, writer_busy=lambda: self._saver.busy)
                self.remote = self._remote_sync.remote
                if self._handoff is None or not self._handoff.promotes:
                    self._start_uploads()
                self._saver.on_commit.append(self._remote_sync.on_commit)
            if self._handoff is not None:
                self._saver.on_commit.append(self._handoff.on_commit)
        except BaseException:  # nothing of a manager that failed to start may linger: thread, lock, tiers
            self._abandon_start()
            raise

    def _start_uploads(self) -> None:
        """Start the in-process uploader (at construction, or on the writer thread when the daemon is lost)."""
        schedule = None
        if self.world_size > 1 and isinstance(self.coordinator, StoreCoordinator):
            from ckptd.manager.promotion_schedule import StorePromotionSchedule  # rank 0 decides, the others follow

            schedule = StorePromotionSchedule(self.coordinator)
        self._remote_sync.start_uploads(schedule)

    def _find_daemon(self, mode: str | None, *, remote: str | None) -> DaemonHandoff | None:
        """The hand-off to the node daemon that watches the local root (None: this process promotes alone).
        Every rank takes part (training thread): the daemon promotes only when every rank has one that promotes
        to this manager's ``remote`` (or the manager has none)."""
        mode = (mode or settings().daemon).strip().lower()
        if mode not in ("auto", "off", "require"):
            raise ConfigError(f"daemon={mode!r} is not one of auto, off, require",
                              hint="pass daemon='auto' (use the node's daemon when one runs), 'off' or 'require'")
        link = DaemonLink.find(self.local.root) if mode != "off" else None
        if link is not None and link.promotes and remote is not None and \
                str(link.info.get("remote") or "").rstrip("/") != remote.rstrip("/"):
            log.warning("the ckptd daemon promotes %s to %s, not to remote=%s: this process promotes its own steps",
                        self.local.root, link.info.get("remote"), remote)
            link.info["promotes"] = False
        left = leftover_pins(self.local, self.rank) if link is not None and link.promotes and remote else []
        if left:
            log.warning("step(s) %s of an earlier run wait in %s for in-process promotion: this process promotes its "
                        "own steps", ", ".join(map(str, left)), PIN_DIRECTORY)
            link.info["promotes"] = False
        answers = self.coordinator.exchange(_DAEMON_EXCHANGE, [link is not None, link is not None and link.promotes])
        if mode == "require" and not all(found for found, _ in answers):
            if link is not None:
                link.close()
            missing = [rank for rank, (found, _) in enumerate(answers) if not found]
            raise ConfigError(f"daemon='require' but no ckptd daemon watches the local directory of rank(s) "
                              f"{', '.join(map(str, missing))}", path=str(self.local.root),
                              hint="start `ckptd daemon` with this directory as a root, or pass daemon='auto'")
        if link is None:
            return None
        if link.promotes and not all(promotes for _, promotes in answers):
            log.info("the ckptd daemon promotes %s, but not on every rank: this process promotes its own steps",
                     self.local.root)
            link.info["promotes"] = False
        pin = link.promotes or (link.replicates and remote is None)  # else the uploader pins, or nothing needs it
        shared = SharedLoss(self.coordinator) if link.promotes and isinstance(self.coordinator, StoreCoordinator) \
            else None  # one rank losing its daemon turns every rank to in-process promotion
        return DaemonHandoff(link, self.local, rank=self.rank, world_size=self.world_size, pin=pin,
                             on_lost=self._daemon_lost, shared=shared)

    def _repeat_start_exchanges(self) -> None:
        """Run again the store exchanges this manager's constructor ran (the directory identity, the daemon
        answers), so that a replacement rank's new manager meets them in a new coordinator generation (the
        elastic worker, after it joined that generation). The answers it sends are this manager's own."""
        self.coordinator.exchange("local-directory", directory_identity(self.local.root))
        handoff = self._handoff
        answers = self.coordinator.exchange(_DAEMON_EXCHANGE, [handoff is not None,
                                                              handoff is not None and handoff.promotes])
        if handoff is not None and handoff.promotes and not all(promotes for _, promotes in answers):
            log.warning("a rank that rejoined has no ckptd daemon that promotes: its steps are promoted in-process "
                        "while this rank's daemon promotes %s", self.local.root)
        if self._remote_sync is not None and self._remote_sync.uploader is not None:
            self._remote_sync.uploader.share_pins()  # a replacement rank settles its leftover pins with these

    def _daemon_lost(self) -> None:
        """Writer thread: the daemon stopped answering; promote in-process from now on."""
        if self._remote_sync is not None and self._remote_sync.uploader is None:
            self._start_uploads()

    def _abandon_start(self) -> None:
        """Undo a constructor that failed half-way: stop the writer and the uploader, release the lock
        (kept when the writer does not stop, as :meth:`close` does)."""
        stopped = True
        for part in (self._saver, getattr(self, "_remote_sync", None)):
            if part is None:
                continue
            try:
                part.close(timeout_s=5.0)
            except CkptdError as error:
                log.warning("a manager that failed to start could not stop its background work: %s", error)
                stopped = stopped and part is not self._saver
        self._close_daemon_parts()
        if stopped:
            self.local.close()

    # --- saving -------------------------------------------------------------------------------
    def save(self, step: int, state: MutableMapping[str, Any], *, force: bool = False,
             durable: bool = False) -> bool:
        """Save ``state`` as ``step`` if the policy asks for it (or ``force``); returns whether it did.

        ``durable=True`` (or ``Policy(durable_every_steps=N)`` for a step that is a multiple of N) returns only
        once the step is committed locally: for the last save before a planned stop. :attr:`last_commit`
        tells how long after ``save()`` returned, and how many steps later, each step was committed.

        Returns once the state is copied into host buffers: the caller may modify it right away. The
        write, the agreement between ranks and the commit run on a background thread; :meth:`wait`
        blocks until they are done. Returns False when the policy does not save this step or, with
        ``Policy(on_busy="skip")``, when the previous save is still being written. An error of an
        earlier background save is raised here (or by :meth:`wait`/:meth:`close`).

        The step the last restore loaded is committed already and is not saved again (False): loops
        that save at the top of an iteration, as nanoGPT does, ask for it right after a resume.
        """
        self._check_open()
        called, previous = time.perf_counter(), self._last_save_call
        self._last_save_call = called
        self._saver.note_step(step)
        self._note_promotions()
        if self.last_restore is not None and step == self.last_restore.step:
            log.info("step %d is the step this run restored; it is committed and not saved again", step)
            return False
        if not force and not self.policy.saves(step):
            if self._prepare_staging:  # once: the first save then finds its buffers allocated, faulted in
                self._prepare_staging = False
                self._saver.prepare_staging(state)
            return False
        saved = self._saver.save(step, state, durable=durable or self.policy.durable(step))
        if saved and self._handoff is not None:  # the daemon's metrics; sent from the writer thread
            self._handoff.record_save(step, time.perf_counter() - called,
                                      None if previous is None else called - previous)
        return saved

    # --- restoring ----------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps committed on the local tier, ascending."""
        return self.local.committed_steps()

    @property
    def tiers(self) -> list[StorageTier]:
        """Tiers restore reads from, nearest first: local, peer, object."""
        return [self.local] + [tier for tier in (self.peer, self.remote) if tier is not None]

    def _memory_copies(self) -> tuple[MemoryCopy, ...]:
        """The staged copies a restore may read instead of the tiers (the memory tier): the last save's."""
        memory = self._saver.memory
        return () if memory is None else (memory,)

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                keys: Sequence[str] | None = None) -> int | None:
        """Load the newest intact step (or ``step``) into ``state`` in place; returns the step, or None
        when there is no checkpoint. A corrupt step is reported and the next older one is tried.

        Tensors are copied into the live tensors; dict and list entries are replaced in place;
        objects with ``load_state_dict`` receive their saved state. Plain values (numbers, strings,
        dicts and lists of them) are what the state held at that ``save()``. If no step is intact,
        NoIntactCheckpointError is raised and ``state`` may hold values of a partly read step. A state
        that does not fit the step raises ResumeMismatchError naming the key: a live key the step does
        not hold, an object (saved through ``state_dict()``) the live state lacks, a tensor of another
        shape.

        ``keys`` restores only those top-level keys (a partial restore), reading only the tensors they
        hold and leaving every other entry of ``state`` (and the RNG states) alone, e.g. a run's config
        before the model built from it: ``step = mgr.restore(state, keys=["config"])`` (a step saved by
        another world size still loads its sharded tensors through DCP). A key the step does not hold
        raises ResumeMismatchError. A later full restore that lands on another step (the
        newest was found corrupt while reading its tensors) logs a warning naming both steps.
        ``last_restore`` tells what the newest restore read, and from which tiers.

        Every rank must call it (training thread): the ranks agree through the store on the newest step
        intact on all of them. Pending saves are waited for first (an error of one is logged, not
        raised). A step this process saved itself is read from the memory tier (its staged copy); a
        step saved by another world size is resharded through DCP.
        """
        self._check_open()
        try:
            self._saver.wait()
        except StillRunningError:  # a save still being written: restoring now could race with it
            raise
        except CkptdError as error:  # a failed save must not prevent recovery; restore picks another step
            log.warning("an earlier background save failed on rank %d: %s", self.rank, error)
        memory = self._memory_copies()
        if step is None and keys is None:  # a dead rank's unfinished commit is finished first
            finished = complete_interrupted_commit(self.local, self.coordinator, self.sharing)
            memory = tuple(MemoryCopy(copy.step, copy.values, copy.staged, committed=True)
                           if copy.step == finished else copy for copy in memory)
        listings = TierListings(self.tiers)  # each tier listed once; one that does not answer is skipped
        if self._remote_sync is not None and keys is None:  # a partial restore reads too little to fetch ahead
            self._remote_sync.before_restore(step, listings)
        result = restore_state(self.tiers, state, rank=self.rank, world_size=self.world_size, step=step,
                               allow_pickle=self.allow_pickle, restore_rng=self.capture_rng,
                               coordinator=self.coordinator, memory=memory, listings=listings,
                               keys=keys, layout=self.layout)
        earlier, self.last_restore = self.last_restore, result
        if keys is not None:  # the full restore that follows prepares staging, sets aside, re-populates
            return result.step
        if earlier is not None and earlier.keys is not None and earlier.step != result.step:
            log.warning("keys %s were restored from step %s, the rest of the state from step %s: restore "
                        "those keys again", ", ".join(map(repr, earlier.keys)), earlier.step, result.step)
        self._saver.prepare_staging(state)  # off the training thread
        if result.step is not None and step is None:
            self._set_aside_newer_steps(result.step, listings.committed(self.local), failed=result.failed)
        if self._remote_sync is not None:
            self._remote_sync.after_restore(result.step, result.tier)
        return result.step

    def _set_aside_newer_steps(self, restored: int, committed: frozenset[int], *,
                               failed: dict[int, list[dict[str, Any]]] | None = None) -> None:
        """Training goes on from ``restored`` and will save the steps after it again: committed local steps
        newer than it (not intact on every rank) are renamed aside by the directory's owner (kept, never
        deleted), so that those saves do not meet a committed step. ``restore(step=N)`` sets nothing aside:
        a later save of a committed step is refused. ``failed``: why the restore could not load each step
        (recorded next to the step set aside, see :mod:`ckptd.manager.set_aside`)."""
        failure: str | None = None
        uploader = self.uploader
        if uploader is not None:  # first: a promotion of a step renamed under it would fail
            uploader.set_aside_after(restored)
        try:
            if self.sharing.is_owner:
                self._set_aside_in(self.local.root, sorted(committed), restored, report=True, failed=failed)
                for name in self._pin_directories():  # a pinned copy would be promoted instead of the new step
                    pins = self.local.root / name
                    if pins.is_dir():
                        self._set_aside_in(pins, LocalTier(pins).list_step_numbers(), restored, report=False)
        except CkptdError as error:  # told to every rank, so that all leave the round together
            failure = f"rank {self.rank}: {error}"
        failures = [why for why in self.coordinator.exchange("newer-steps-set-aside", failure) if why]
        if failures:
            raise StorageError("newer steps could not be set aside after the restore: " + " | ".join(failures),
                               step=restored, tier=self.local.label,
                               hint="fix the directory's permissions; the restored state is loaded")

    def _pin_directories(self) -> list[str]:
        """The directories under the local root that hold pinned steps: the uploader's, and the daemon's own."""
        names = [PIN_DIRECTORY]
        theirs = self._handoff.link.info.get("pin_directory") if self._handoff is not None else None
        if isinstance(theirs, str) and theirs.startswith(".") and theirs not in (".", "..", PIN_DIRECTORY) \
                and "/" not in theirs and "\\" not in theirs:  # one hidden directory in the root, nothing else
            names.append(theirs)
        return names

    @staticmethod
    def _set_aside_in(root: Path, steps: list[int], restored: int, *, report: bool,
                      failed: dict[int, list[dict[str, Any]]] | None = None) -> None:
        for step in steps:
            if step > restored:
                reason, problems = set_aside_reason(step, restored, (failed or {}).get(step, []))
                kept = set_aside_step(root, step, reason=reason, restored_step=restored, problems=problems)
                if report:
                    log.warning("step %d is newer than the restored step %d: kept as %s in %s; training "
                                "continues from step %d", step, restored, kept, root, restored)

    # --- lifecycle ----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a staged save is still being written in the background (never blocks)."""
        return self._saver.busy

    def add_commit_callback(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(step)`` after each step this manager commits to the local tier, on the thread that
        completes the commit, after local retention ran. Keep it quick and let it not raise (the writer runs
        it before it takes the next save). How integrations keep a small record per committed step."""
        self._saver.on_commit.append(callback)

    @property
    def last_commit(self) -> CommitRecord | None:
        """The newest local commit of this process (None before the first): its step, the seconds from
        ``save()`` returning to the commit, the steps the loop moved on meanwhile, ``time.monotonic()`` of it."""
        return self._saver.last_commit

    @property
    def last_promotion(self) -> CommitRecord | None:
        """The newest object-tier commit of this process's in-process uploader, as :attr:`last_commit` (None
        before the first, without an object tier, or while the daemon promotes). Its time is known to within
        one call of :meth:`save` (the uploader's reports are looked at there), or exactly when the uploader
        reports through :meth:`note_promoted`."""
        self._note_promotions()
        return self._saver.last_promotion

    def note_promoted(self, step: int, at: float | None = None) -> None:
        """Record that ``step`` was committed on the object tier at ``at`` (``time.monotonic()``, default now);
        the hook for the uploader. Any thread."""
        self._saver.note_promoted(step, at, tier=self.remote.label if self.remote is not None else "remote")

    def _note_promotions(self) -> None:
        uploader = self._remote_sync.uploader if self._remote_sync is not None else None
        if uploader is None:
            return
        reports = uploader.reports
        if len(reports) != self._promotions_seen:
            self._promotions_seen = len(reports)
            newest = reports[-1]
            last = self._saver.last_promotion
            if last is None or last.step < newest.step:
                self.note_promoted(newest.step)

    def wait(self) -> None:
        """Block until every pending save is committed locally."""
        self._check_open()
        self._saver.wait()

    @property
    def upload_reports(self) -> list[Any]:
        """One :class:`~ckptd.promotion.PromotionReport` per step promoted by this manager, in order."""
        uploader = self.uploader
        return list(uploader.reports) if uploader is not None else []

    @property
    def uploader(self) -> BackgroundUploader | None:
        """The object tier's background uploader (its :attr:`~ckptd.promotion.BackgroundUploader.superseded`,
        ``released`` and ``unpromoted`` steps), or None without an object tier or while the daemon promotes."""
        return self._remote_sync.uploader if self._remote_sync is not None else None

    @property
    def daemon_promotes(self) -> bool:
        """Whether the node's daemon promotes this manager's steps (False without one, or once it stopped
        answering and this process took promotion back)."""
        return self._handoff is not None and self._handoff.active and self._handoff.promotes

    @property
    def promotion_lag(self) -> PromotionLag | None:
        """How far the object tier is behind the local tier: steps and seconds between the newest local
        commit and the newest remote commit (None without an object tier). Known without I/O once this
        manager has committed and promoted; before that the tiers are listed once. While the daemon promotes,
        both tiers are listed on every call."""
        if self._remote_sync is None:
            return None
        if self._remote_sync.uploader is None:
            return promotion_lag(self.local, self._remote_sync.remote)
        return self._remote_sync.uploader.promotion_lag()

    def wait_uploads(self) -> None:
        """Block until every step queued for the object tier is promoted; re-raise an upload failure. While
        the node's daemon promotes (:attr:`daemon_promotes`) nothing is queued here: it returns once the saves
        are committed locally (and handed to the daemon); :attr:`promotion_lag` shows the daemon's progress."""
        self._check_open()
        self._saver.wait()
        if self._remote_sync is not None:
            self._remote_sync.wait()

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for pending writes and uploads, then release the tiers. Safe to call twice. Once the writes
        are done, the local retention runs once more if this manager committed a step: a step the policy
        let go after the last commit (a pointer removed since) leaves then, not at the next run's first
        commit.

        Writes and uploads together get at most ``timeout_s`` seconds (default ``CKPTD_CLOSE_TIMEOUT_S``):
        uploads get what the writes left. A save still being
        written then raises StillRunningError naming it, and the manager keeps its directory lock (and its
        object tier), so that no other manager enters while the old writer may still write: call ``close``
        again later. Uploads that did not finish raise UnpromotedError listing the steps left pinned locally
        (promotion resumes at the next start); the lock is kept while an upload still runs.
        """
        if self._released:
            return
        self._closed = True
        self._saver.stager.stop_preparing()
        budget = settings().close_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        try:
            self._saver.close(budget)
        finally:
            if not self._saver.running:  # a save still being written (StillRunningError) keeps the lock
                self._release(max(0.0, deadline - time.monotonic()))

    def _release(self, timeout_s: float | None) -> None:
        try:
            if self._remote_sync is not None:
                deadline = None if timeout_s is None else time.monotonic() + timeout_s
                try:
                    self._remote_retention_at_close(timeout_s)
                except Exception as error:  # noqa: BLE001 - a failed pass never keeps the uploads from closing
                    log.warning("the object tier's retention pass at close failed (the steps stay; the next "
                                "run's first promotion applies keep_remote): %s", error)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._remote_sync.close(left, while_waiting=self.while_closing)
        finally:
            if self._remote_sync is None or not self._remote_sync.uploads_running:
                self._released = True
                self._close_daemon_parts()
                self.local.close()

    def _remote_retention_at_close(self, timeout_s: float | None) -> None:
        """Rank 0's uploader applies ``keep_remote`` after each promotion, so a step the policy let go after
        the last one (Lightning's save_top_k removes the older checkpoint once the newest is saved) would stay
        on the object tier. When this manager committed a step and its uploads end without a failure, the
        retention runs once more here: the writer has stopped, so no promotion follows or overlaps it."""
        uploader = self._remote_sync.uploader
        if uploader is None or self.rank != 0 or self.policy.keep_remote is None or not self._saver.committed_any:
            return
        try:
            uploader.settle(timeout_s)
        except CkptdError as error:  # the uploads did not end in time: close reports what stayed unpromoted
            log.warning("the object tier's retention pass at close is skipped: %s", error)
            return
        if uploader.errors:  # close reports them; the retention waits for the next run's first promotion
            return
        from ckptd.promotion.gc import collect_garbage

        remote, retention = self._remote_sync.remote, self.policy.remote_retention
        try:
            if retention.deletable(remote.committed_steps()):
                collect_garbage(remote, retention=retention)
        except CkptdError as error:
            log.warning("the object tier's retention pass at close failed (the steps stay; the next run's "
                        "first promotion deletes them): %s", error)

    def _close_daemon_parts(self) -> None:
        handoff, peer = getattr(self, "_handoff", None), getattr(self, "peer", None)
        if handoff is not None:
            handoff.close()
        if peer is not None:
            try:
                peer.close()
            except CkptdError as error:
                log.debug("closing the peer tier: %s", error)

    def _check_open(self) -> None:
        if self._closed:
            raise CkptdError("this CheckpointManager is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
