"""The in-process background uploader: promotes committed local steps while training continues.

:class:`BackgroundUploader` owns one named thread (``ckptd-uploader``, a
:class:`~ckptd.background.BackgroundWorker`). Call order, from the training thread:
:meth:`~BackgroundUploader.on_commit` after each local commit (the saver's ``on_commit`` callback),
:meth:`~BackgroundUploader.wait` to block until every queued step is promoted, and
:meth:`~BackgroundUploader.close` at the end. Failures do not stop training: the step stays pinned
locally (and is retried on the next start, unless a newer promoted step or the pin cap releases it), the
error is logged and kept (every one: one record per step), and ``wait``/``close`` re-raise them;
``close`` names every failed step. When no promotion is queued, rank 0 applies ``keep_remote``
and collects garbage on the object tier, on the same thread, so in-process promotion and GC never
overlap and a backlog of steps is promoted before any collection.

Bounded waits: ``wait`` gives up after ``CKPTD_WAIT_TIMEOUT_S`` (StillRunningError), ``close`` after
``CKPTD_CLOSE_TIMEOUT_S``; ``close`` then raises :class:`~ckptd.errors.UnpromotedError` listing the steps
left unpromoted (and pinned locally). Once ``close`` has begun, a promotion that fails on the object
tier (it is down) drops the steps still queued, so that ``close`` reports them at once instead of
trying each against a tier that does not answer.

Cadence: the object tier is at most one step in flight and one queued behind the local tier. A step
committed while another waits for its upload (or for the uploader thread to start it) supersedes it: the
waiting step is not promoted and its pin is released (unless ``keep_remote`` keeps it for good, see
:meth:`~ckptd.policy.Policy.may_supersede`), and once a step is promoted, older steps whose promotion failed
are released the same way. Nothing on the save path waits for the uploader:
:meth:`~BackgroundUploader.on_commit` links the step's files into the pin directory without an fsync (the
uploader thread makes the pin durable before it promotes). Pins are capped
(:class:`~ckptd.promotion.pinning.PinCap`, settings ``pin_max_steps``/``pin_max_bytes``): past the cap the
oldest unpromoted pins are released with a warning naming how far the object tier is behind.

Several ranks (a :class:`~ckptd.promotion.schedule.PromotionSchedule`, see
:meth:`~BackgroundUploader.use_schedule`): rank 0 decides as a single process does and announces each step
it promotes before it starts; every other
rank promotes its share of exactly the announced steps, in order, and releases its pins of the steps older
than an announced one that were never announced. A rank waits for each decision at most
``CKPTD_COMMIT_TIMEOUT_S`` (rank 0 waits as long for the other ranks' shares), logging while it waits. Rank 0
announces when it closes; the other ranks' ``close`` finishes what was announced, within its deadline. The
pin cap applies on every rank, never to a step announced and not yet promoted by this rank. Without a
schedule each rank decides alone and nothing is superseded (a rank that dropped a step rank 0 still
promotes would make rank 0 wait for its share).
Steps an earlier run left pinned (:meth:`~BackgroundUploader.resume_pending`) are not announced: with a
schedule every rank publishes the steps it holds pinned (:meth:`~BackgroundUploader.share_pins`), and a rank
holding a leftover step waits (at most ``CKPTD_COMMIT_TIMEOUT_S``, never past the deadline of ``close``,
logging) for every rank's answer, then promotes its share with the other ranks that hold it or releases its
pin with a warning (:mod:`ckptd.promotion.leftovers`), so that no rank waits for a share a lost node took
with it. The committing rank's wait for the other shares is bounded the same way. A rank other than rank 0
that drops a pin unpromoted (the pin cap, a leftover settled as lost, a step announced after it stopped
waiting) announces it on the object tier (:func:`~ckptd.promotion.promoter.announce_release`, written from
the uploader thread, never the save path), so that the committing rank stops waiting for that share at once
instead of after ``CKPTD_COMMIT_TIMEOUT_S`` (ranks that switch from a daemon to in-process promotion at
different steps disagree about which steps are leftovers: this settles it within a step).
:attr:`~BackgroundUploader.lag` says how far the object tier is behind, without any I/O.

The node daemon does not use this class: it schedules its own promotions from its journal
(:mod:`ckptd.daemon.service`) and copies each step with the same :class:`~ckptd.promotion.promoter.Promoter`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from ckptd.background import BackgroundWorker, FailureRecord, raise_failures
from ckptd.config import settings
from ckptd.errors import (CkptdError, DeadlineError, StepSetAsideError, StillRunningError, StorageError,
                          UnpromotedError)
from ckptd.format.layout import MANIFEST_NAME, rank_files, step_file
from ckptd.stepio.rank_writer import lower_thread_priority
from ckptd.stepio.step_reader import load_step_manifest
from ckptd.policy import Policy
from ckptd.promotion.gc import collect_garbage
from ckptd.promotion.lag import PromotionLag, lag_between, promotion_lag
from ckptd.promotion.leftovers import holders_of, settle_leftover
from ckptd.promotion.pinning import PinCap, PinnedSteps, pins_over_cap
from ckptd.promotion.promoter import Promoter, PromotionReport, ShareReleasedError, announce_release
from ckptd.promotion.schedule import Decision, PromotionSchedule
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier

log = logging.getLogger("ckptd.promotion")
#: The uploader runs this much below the writer's ``background_nice``: a save never waits for an upload's CPU.
_UPLOADER_EXTRA_NICE = 5
#: An S3 call of the uploader waits at most this long for the local writer of this process to finish a save
#: (then goes on: promotion must not starve behind a writer that is always busy), looking this often.
_YIELD_TO_WRITER_S = 0.02
_YIELD_POLL_S = 0.001
#: How many superseded or released step numbers an uploader remembers (for logs, close and tests).
_KEPT_STEP_NUMBERS = 4096
_RESUME_HINT = "the local copies stay pinned; promotion resumes when a manager or `ckptd promote` starts again"
#: How long a multi-rank uploader's first promotion waits for :meth:`BackgroundUploader.use_schedule`.
_SCHEDULE_GRACE_S = 10.0
#: A rank following rank 0 looks for the next decision this often, and logs its wait this often.
_DECISION_POLL_S = 0.5
_DECISION_LOG_S = 10.0


class BackgroundUploader:
    """Promotes steps of ``local`` to ``remote`` on a background thread (see the module docstring).

    With ``world_size > 1`` each rank promotes its own share and rank 0 commits the step; with a
    ``schedule`` rank 0 decides which steps (see :meth:`use_schedule`). When ``policy.remote_every_steps``
    is None every saved step is promoted.
    """

    def __init__(self, local: LocalTier, remote: ObjectTier, *, policy: Policy, rank: int = 0,
                 world_size: int = 1, pin_cap: PinCap | None = None,
                 schedule: PromotionSchedule | None = None, writer_busy: Callable[[], bool] | None = None) -> None:
        self.local, self.remote, self.policy = local, remote, policy
        #: Whether this process's local writer is writing a save (its S3 calls wait for it, briefly).
        self._writer_busy = writer_busy
        self.rank, self.world_size = rank, world_size
        self.pins = PinnedSteps(local)
        #: Most pinned steps and pin-only bytes kept (default: the ``pin_max_*`` settings).
        self.pin_cap = pin_cap or PinCap.from_settings()
        self.promoter = Promoter(self.pins.tier, remote)
        self.promoter.give_up_at = self._give_up_at
        self.promoter.set_aside = self._current_set_aside
        self.reports: list[PromotionReport] = []
        #: The latest steps dropped, unpromoted, because a newer step superseded them (oldest first).
        self.superseded: deque[int] = deque(maxlen=_KEPT_STEP_NUMBERS)
        #: The latest steps whose pins the pin cap released before they were promoted (oldest first).
        self.released: deque[int] = deque(maxlen=_KEPT_STEP_NUMBERS)
        #: The latest steps dropped, unpromoted, because a restore set them aside (oldest first).
        self.set_aside: deque[int] = deque(maxlen=_KEPT_STEP_NUMBERS)
        #: The step in flight when a restore set it aside (its promotion stops; see :meth:`set_aside_after`).
        self._abandoned: int | None = None
        self._queued: set[int] = set()
        #: Steps handed to this uploader and not promoted yet (queued, running or failed): pinned locally.
        self._unpromoted: set[int] = set()
        #: Steps whose promotion failed (and were not promoted since), with the error in words.
        self._failed_steps: dict[int, str] = {}
        self._current: int | None = None
        #: (step, manifest time) of the newest local commit seen and of the newest step promoted.
        self._local_newest: tuple[int, float | None] | None = None
        self._remote_newest: tuple[int, float | None] | None = None
        self._commit_times: dict[int, float] = {}
        self._logged_behind = 0
        self._asked_tiers = False
        #: Set once the uploader thread listed both tiers (see :meth:`promotion_lag`).
        self._tiers_learned = threading.Event()
        self._collection_due = False
        self._closing = False
        self._lock = threading.Lock()
        self.schedule = schedule
        self._schedule_known = threading.Event()
        if schedule is not None or world_size == 1:
            self._schedule_known.set()
        #: Rank 0: the newest step announced. Other ranks: decisions read and not yet acted on, the index of
        #: the last one read, and the newest announced step.
        self._last_announced: int | None = None
        self._announced_closing = False
        self._decisions: deque[Decision] = deque()
        self._decision_index = 0
        self._fetch_lock = threading.Lock()
        self._close_deadline: float | None = None
        #: A rank following rank 0: the save path found the pins over the cap while the uploader thread read
        #: decisions; the uploader thread applies the cap after its read.
        self._cap_due = False
        #: Steps an earlier run left pinned and not yet promoted or released (see :meth:`resume_pending`), and
        #: every rank's published pins once all answered (or why they did not).
        self._leftovers: set[int] = set()
        #: Steps whose pin this rank dropped unpromoted, with their manifest, to announce (uploader thread).
        self._to_announce: deque[tuple[int, bytes]] = deque(maxlen=_KEPT_STEP_NUMBERS)
        self._pins_shared: dict[int, list[int]] | None = None
        self._pins_unshared: str | None = None
        self._worker: BackgroundWorker[int] = BackgroundWorker(
            "ckptd-uploader", self._promote, describe=self._describe, failures=self._failed,
            step_of=lambda step: step, on_start=self._start, on_idle=self._collect_if_due)

    # --- called from the training thread --------------------------------------------------------
    def use_schedule(self, schedule: PromotionSchedule | None) -> None:
        """With several ranks: decide through ``schedule`` (rank 0 announces, the others follow; None:
        every rank decides alone, nothing superseded). Call it right after construction, before the first
        commit: a multi-rank uploader's first promotion waits for it (at most 10 s)."""
        self.schedule = schedule
        self._schedule_known.set()

    @property
    def decides(self) -> bool:
        """Whether this uploader picks the steps to promote (one rank, or rank 0 with a schedule)."""
        return self.world_size == 1 or (self.schedule is not None and self.rank == 0)

    @property
    def follows(self) -> bool:
        """Whether this uploader promotes the steps rank 0 announces (a rank > 0 with a schedule)."""
        return self.world_size > 1 and self.schedule is not None and self.rank != 0

    def wants(self, step: int) -> bool:
        """Whether the policy promotes this step."""
        return self.policy.promotes(step)

    def on_commit(self, step: int) -> None:
        """Saver callback (writer thread, after each local commit): note the commit for :attr:`lag`; pin and
        queue a step the policy promotes, superseding the steps still queued. Never waits for an upload."""
        now = time.time()
        with self._lock:
            if self._local_newest is None or step > self._local_newest[0]:
                self._local_newest = (step, now)
            self._commit_times[step] = now
        if self.wants(step):
            self.submit(step, supersede=self.decides)
        self._log_lag_growth()

    def submit(self, step: int, *, supersede: bool = False) -> None:
        """Pin a committed local step and queue its promotion; with ``supersede``, the steps still queued
        (not started) that the policy lets go are dropped and their pins released. Then the pin cap is
        applied."""
        self.pins.pin(step, self._own_files(self.pins.local, step), durable=False)
        dropped: list[int] = []
        with self._lock:
            if supersede:
                dropped = sorted(queued for queued in self._queued if queued < step
                                 and self.policy.may_supersede(queued) and queued not in self._leftovers)
                # Nothing in flight does not spare the oldest: a step the uploader thread has not started yet
                # (it connects, or waits for a core) is as stale as the others, and a withdrawn job is skipped
                self._withdraw(dropped)
                self.superseded.extend(dropped)
        if dropped:
            log.info("step %d supersedes step(s) %s queued for %s: they are not promoted", step,
                     ", ".join(map(str, dropped)), self.remote.label)
            self._release_pins(dropped)
        self._enqueue(step)
        self._apply_pin_cap()

    def set_aside_after(self, step: int) -> None:
        """Training thread, once a restore of ``step`` set the newer committed local steps aside, their pins
        included (every rank does, see :meth:`CheckpointManager.restore`): those steps are not promoted.
        The one in flight stops at its next wait for the other ranks (their shares of it may never come: a
        lost rank's new directory never held it) without a failure, and the steps saved again with these
        numbers are promoted as new steps (rank 0 announces them again)."""
        with self._lock:
            dropped = sorted(pending for pending in self._unpromoted if pending > step)
            self._withdraw(dropped)
            self._leftovers.difference_update(dropped)
            self.set_aside.extend(dropped)
            self._failed_steps = {failed: why for failed, why in self._failed_steps.items() if failed <= step}
            self._commit_times = {kept: at for kept, at in self._commit_times.items() if kept <= step}
            if self._current is not None and self._current > step:
                self._abandoned = self._current
            if self._last_announced is not None and self._last_announced > step:
                self._last_announced = step
            self._decisions = deque(decision for decision in self._decisions
                                    if decision.step is None or decision.step <= step)
            if self._local_newest is not None and self._local_newest[0] > step:
                self._local_newest = (step, None)
        if dropped:
            log.info("rank %d: step(s) %s were set aside by the restore of step %d: they are not promoted to %s",
                     self.rank, ", ".join(map(str, dropped)), step, self.remote.label)

    def _current_set_aside(self) -> bool:
        """Whether the step being promoted was set aside (the promoter reads it while it waits)."""
        with self._lock:
            return self._abandoned is not None and self._abandoned == self._current

    @property
    def lag(self) -> PromotionLag:
        """How far the object tier is behind the newest local commit this uploader saw (no I/O; the newest
        remote step is what this uploader promoted, or learned by :meth:`promotion_lag`)."""
        with self._lock:
            local, remote = self._local_newest, self._remote_newest
        (local_step, local_created), (remote_step, remote_created) = local or (None, None), remote or (None, None)
        return lag_between(local_step, remote_step, local_created=local_created, remote_created=remote_created)

    def promotion_lag(self) -> PromotionLag:
        """:attr:`lag`, never asking the object tier: the uploader thread lists both tiers once when it starts
        and keeps the newest steps up to date from then on (commits seen, steps promoted). Until that first
        listing is done, the newest local step is read once from the local tier (no S3 request) and the remote
        counts as known by nothing yet."""
        if not self._asked_tiers and not self._tiers_learned.is_set():
            with self._lock:
                knows_local = self._local_newest is not None
            if not knows_local:
                self._asked_tiers = True
                try:
                    steps = self.pins.local.committed_steps()
                except CkptdError as error:
                    log.debug("could not list the local tier for the promotion lag: %s", error)
                    steps = []
                if steps:
                    self.learn_remote(lag_between(steps[-1], None))
        return self.lag

    def _learn_tiers(self) -> None:
        """Uploader thread, at its start (or, when a step waits for promotion already, once it idles): the newest
        committed step of each tier, from one listing of each (a tier that does not answer is skipped: the lag
        then counts from what this uploader sees)."""
        try:
            self.learn_remote(promotion_lag(self.pins.local, self.remote))
        except CkptdError as error:
            log.debug("could not list the tiers for the promotion lag: %s", error)
        finally:
            self._tiers_learned.set()

    def learn_remote(self, lag: PromotionLag) -> None:
        """Take the newest steps of a :func:`~ckptd.promotion.lag.promotion_lag` computed from the tiers as
        what :attr:`lag` starts from (steps seen or promoted by this uploader since are kept)."""
        with self._lock:
            if lag.local_step is not None and (self._local_newest is None or lag.local_step > self._local_newest[0]):
                self._local_newest = (lag.local_step, None)
            if lag.remote_step is not None and (self._remote_newest is None
                                                or lag.remote_step > self._remote_newest[0]):
                self._remote_newest = (lag.remote_step, None)

    @property
    def knows_both_tiers(self) -> bool:
        """Whether :attr:`lag` knows a newest step of both tiers (else ask the tiers, see :meth:`learn_remote`)."""
        with self._lock:
            return self._local_newest is not None and self._remote_newest is not None

    def resume_pending(self) -> list[int]:
        """Queue the steps pinned by an earlier run that crashed before promoting them (past the pin cap, the
        oldest are released). With a schedule each is settled with the other ranks before it is promoted, and
        this rank publishes the steps it holds pinned (:meth:`share_pins`): call it on every rank."""
        pending = self.pins.held_by(self.rank)
        settles = self.world_size > 1 and self.schedule is not None
        if settles:
            with self._lock:
                self._leftovers.update(pending)
        for step in pending:
            log.info("resuming the promotion of step %d left by an earlier run", step)
            self._enqueue(step)
        if pending:
            self._apply_pin_cap(leftovers_too=True)  # an earlier run may have kept more under a larger cap
        if settles:
            self.share_pins()
        return pending

    def share_pins(self) -> None:
        """With a schedule: publish the steps this rank holds pinned, for the ranks settling the steps an earlier
        run left pinned (at the start, by :meth:`resume_pending`; call it again on every rank when the ranks
        re-form in a new generation of the job's store, so that a replacement rank hears from every rank)."""
        if self.schedule is None or self.world_size == 1:
            return
        try:
            self.schedule.share_pins(self.pins.held_by(self.rank))
        except CkptdError as error:  # a rank settling a leftover step gives up at its deadline
            log.warning("rank %d could not publish the steps it holds pinned: %s", self.rank, error)

    @property
    def unpromoted(self) -> list[int]:
        """Steps handed to this uploader that are not promoted yet (queued, being promoted, or failed)."""
        with self._lock:
            return sorted(self._unpromoted)

    @property
    def announced_pending(self) -> list[int]:
        """A rank following rank 0: the announced steps it read and has not promoted yet, the one it promotes
        included (what the object tier still waits for from this rank)."""
        with self._lock:
            pending = self._announced_pending()
            if self._current is not None:
                pending.add(self._current)
        return sorted(pending)

    @property
    def running(self) -> bool:
        """Whether the uploader thread still runs (after a :meth:`close` that gave up, it may)."""
        return self._worker.alive

    @property
    def errors(self) -> list[BaseException]:
        """The failures kept since the last :meth:`wait` (``wait``/``close`` raise and forget them)."""
        return [record.error for record in self._worker.peek_failures()]

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every queued step is promoted, at most ``timeout_s`` seconds (default
        ``CKPTD_WAIT_TIMEOUT_S``, then StillRunningError naming the step); re-raise the failures kept since
        the last wait (one as itself, several as a BackgroundError listing each)."""
        self.settle(timeout_s)
        self._worker.raise_failures()

    def settle(self, timeout_s: float | None = None) -> None:
        """:meth:`wait` without raising the failures: they stay kept (:attr:`errors`) for ``wait`` or ``close``."""
        timeout_s = settings().wait_timeout_s if timeout_s is None else timeout_s
        self._worker.wait(timeout_s, what=f"uploads to {self.remote.label}",
                          hint="the object tier may be slow or down; " + _RESUME_HINT)

    def close(self, timeout_s: float | None = None) -> None:
        """Finish queued promotions, stop the thread and release the object tier, within ``timeout_s``
        seconds (default ``CKPTD_CLOSE_TIMEOUT_S``).

        Raises :class:`~ckptd.errors.UnpromotedError` listing the steps that stayed unpromoted (pinned
        locally; promotion resumes at the next start), when a promotion failed or the deadline passed (the
        steps not started are then dropped, the running one ends on its own: see :attr:`running`, and a
        later ``close`` waits for it again). Other kept failures are raised as :meth:`wait` does."""
        timeout_s = settings().close_timeout_s if timeout_s is None else timeout_s
        self._closing = True
        self._close_deadline = time.monotonic() + timeout_s
        try:
            try:
                self._worker.close(timeout_s, what=f"uploads to {self.remote.label}")
            finally:
                self._announce_closing()
        except StillRunningError as error:
            for step in self._worker.drop_queued():
                self._forget_queued(step)
            steps = self.unpromoted
            raise UnpromotedError(f"uploads to the object tier did not finish within {timeout_s:.3g} s: "
                                  f"step(s) {', '.join(map(str, steps))} stay unpromoted and pinned locally "
                                  f"({error.running}){self._failures_in_words()}", steps, tier=self.remote.label,
                                  hint=_RESUME_HINT) from error
        self.remote.close()
        records = self._worker.take_failures()
        steps = self.unpromoted
        if steps:
            raise UnpromotedError(f"step(s) {', '.join(map(str, steps))} could not be promoted to the object tier "
                                  f"and stay pinned locally{self._failures_in_words()}", steps,
                                  tier=self.remote.label,
                                  hint=_RESUME_HINT) from (records[0].error if records else None)
        raise_failures(records)

    def _announce_closing(self) -> None:
        """Rank 0 with a schedule: tell the other ranks that no decision follows (and announce none after)."""
        if self.schedule is None or self.world_size == 1 or self.rank != 0:
            return
        with self._lock:
            self._announced_closing = True
        try:
            self.schedule.announce_closing()
        except CkptdError as error:
            log.warning("could not tell the other ranks that rank 0's uploader closes: %s", error)

    def _failures_in_words(self) -> str:
        """Every step whose promotion failed and was not promoted since, with its error (for close)."""
        with self._lock:
            failed = sorted(self._failed_steps.items())
            released = set(self.released) | set(self.superseded)
        if not failed:
            return ""
        parts = [f"step {step}{' (pin since released)' if step in released else ''}: {why}" for step, why in failed]
        return f"; {len(failed)} failed promotion(s): " + "; ".join(parts)

    # --- the uploader thread ----------------------------------------------------------------------
    def _own_files(self, tier: LocalTier, step: int) -> list[str]:
        """This rank's files of a step on ``tier``, and the manifest."""
        return rank_files(tier.list_files(step), self.rank) + [MANIFEST_NAME]

    def _start(self) -> None:
        """Uploader thread, first: yield the CPU to the writer (the threads this one starts inherit it),
        then connect."""
        nice = settings().background_nice
        lower_thread_priority(0 if nice <= 0 else nice + _UPLOADER_EXTRA_NICE)
        self.remote.connect()
        with self._lock:
            queued = bool(self._queued)
        if not queued:  # else the first promotion goes first, and the listing waits until the uploader idles
            self._learn_tiers()
        if self._writer_busy is not None:
            # Niceness does not stop a thread holding the GIL: an upload's Python work (botocore) beside the
            # writer's slows the save that the next save() then waits for
            self.remote.yield_while(self._writer_busy, limit_s=_YIELD_TO_WRITER_S, poll_s=_YIELD_POLL_S)

    def _enqueue(self, step: int) -> None:
        with self._lock:
            if step in self._queued:
                return
            self._queued.add(step)
            self._unpromoted.add(step)
        self._worker.submit(step)

    def _withdraw(self, steps: list[int]) -> None:
        """Under the lock: forget ``steps`` as unpromoted; a queued job of one of them then does nothing."""
        for step in steps:
            self._queued.discard(step)
            self._unpromoted.discard(step)

    def _release_pins(self, steps: list[int]) -> None:
        for step in steps:
            if self.world_size > 1 and self.rank != 0:  # the committing rank may wait for this share
                try:
                    manifest = self.pins.tier.read_bytes(step_file(step, MANIFEST_NAME))
                except CkptdError:
                    manifest = None
                if manifest is not None:
                    self._to_announce.append((step, manifest))
            try:
                self.pins.release(step, None if self.world_size == 1 else self._own_files(self.pins.tier, step))
            except CkptdError as error:  # the pin stays; the next start resumes it
                log.warning("could not release the pin of step %d: %s", step, error)

    def _announce_releases(self) -> None:
        """Uploader thread: announce the pins this rank dropped unpromoted (see the module docstring)."""
        while self._to_announce:
            step, manifest = self._to_announce.popleft()
            try:
                announce_release(self.remote, step, [self.rank], manifest)
            except CkptdError as error:  # the committing rank then waits until its own deadline
                log.warning("rank %d could not announce that it dropped its share of step %d: %s", self.rank, step,
                            error)

    def _unpin(self, step: int) -> None:
        self.pins.unpin(step, None if self.world_size == 1 else self._own_files(self.pins.tier, step))

    def _apply_pin_cap(self, *, leftovers_too: bool = False) -> None:
        """Release the oldest unpromoted pins past :attr:`pin_cap` (never the newest, nor the one in flight;
        the steps ``keep_remote`` keeps for good only when the cap cannot be met otherwise). The steps an
        earlier run left pinned go only with ``leftovers_too`` (at the start, before this rank publishes the
        steps it holds): the other ranks count on the share they were told this rank holds."""
        with self._lock:
            pinned = sorted(self._unpromoted)
            current = self._current
        if len(pinned) <= 1:
            return
        held = {step: self.pins.held_bytes(step) if self.pin_cap.max_bytes else 0 for step in pinned}
        with self._lock:
            keep = self._announced_pending() | ({current} if current is not None else set()) | \
                (set() if leftovers_too else self._leftovers)
        lasting = [step for step in pinned if not self.policy.may_supersede(step)]
        over = pins_over_cap(held, self.pin_cap, keep=keep, keep_if_possible=lasting)
        if over and self.follows:
            try:  # learn the steps rank 0 announced meanwhile: they are kept
                if not self._read_decisions(0.0, blocking=False):
                    # The uploader thread is reading a decision right now (maybe of one of these steps): it
                    # applies the cap once it has read it.
                    self._cap_due = True
                    return
            except CkptdError as error:
                log.debug("could not read rank 0's promotion decisions: %s", error)
        with self._lock:
            announced = self._announced_pending()
            over = [step for step in over
                    if step in self._unpromoted and step != self._current and step not in announced]
            self._withdraw(over)
            self.released.extend(over)
        if not over:
            return
        self._release_pins(over)
        if self.follows:  # rank 0, which decides, warns of the lag; these steps were not announced (yet)
            log.info("pins capped at %d step(s): rank %d released the pins of step(s) %s, which rank 0 has not "
                     "announced", self.pin_cap.max_steps, self.rank, ", ".join(map(str, over)))
            return
        lag = self.lag
        log.warning("pins capped at %d step(s) / %s: released the local pins of step(s) %s, which will not "
                    "reach %s; %s", self.pin_cap.max_steps,
                    f"{self.pin_cap.max_bytes} bytes" if self.pin_cap.max_bytes else "no byte limit",
                    ", ".join(map(str, over)), self.remote.label, lag.describe())

    def _log_lag_growth(self) -> None:
        lag = self.lag
        if lag.steps_behind == 0:
            self._logged_behind = 0
        elif lag.steps_behind > self._logged_behind:
            self._logged_behind = lag.steps_behind
            log.info("promotion lag grows: %s", lag.describe())

    def _forget_queued(self, step: int) -> None:
        with self._lock:
            self._queued.discard(step)

    def _describe(self, step: int) -> str:
        return f"step {step} is still being promoted to {self.remote.label} by rank {self.rank}"

    def _promote(self, step: int) -> None:
        """Uploader thread: promote one step (its failure is kept by the worker, see :meth:`_failed`); a
        step superseded or released while queued is skipped. With a schedule rank 0 announces the step
        first, and the other ranks promote it only once rank 0 announced it."""
        if self.world_size > 1 and not self._schedule_known.is_set():
            self._schedule_known.wait(_SCHEDULE_GRACE_S)
        try:
            self._promote_one(step)
        finally:
            self._announce_releases()

    def _promote_one(self, step: int) -> None:
        self._announce_releases()
        with self._lock:
            self._abandoned = None
            leftover = step in self._leftovers
        committer = None
        if leftover:
            committer = self._settle_leftover(step)
            if committer is None:
                return
        elif self.follows:
            if not self._await_decision(step):
                return
        elif not self._start_deciding(step):
            return
        try:
            if self.world_size > 1 and self.decides and not leftover:
                assert self.schedule is not None
                self.schedule.announce(step)
                self._last_announced = step
            self.pins.make_durable(step)
            ranks = None if self.world_size == 1 else [self.rank]
            try:
                report = self.promoter.promote(step, ranks=ranks,
                                               commits=None if committer is None else committer == self.rank)
            except StepSetAsideError as error:  # its pins are set aside; the step saved again is another one
                log.info("step %d is not promoted to %s: %s", step, self.remote.label, error)
                return
            except ShareReleasedError as error:  # never committed: released like a superseded step
                with self._lock:
                    self._withdraw([step])
                    self.released.append(step)
                log.info("step %d is not promoted to %s: %s", step, self.remote.label, error)
                self._release_pins([step])
                return
            self.reports.append(report)
            with self._lock:
                abandoned = self._abandoned == step
            if abandoned:  # its pins went aside meanwhile: those of the step saved again stay
                log.info("step %d was promoted to %s as it was set aside", step, self.remote.label)
                return
            created = self._commit_times.get(step)
            if created is None:
                created = load_step_manifest(self.pins.tier, step).created
            self._unpin(step)
            with self._lock:
                self._unpromoted.discard(step)
                self._failed_steps = {failed: why for failed, why in self._failed_steps.items() if failed > step}
                self._commit_times = {kept: at for kept, at in self._commit_times.items() if kept > step}
                if self._remote_newest is None or step > self._remote_newest[0]:
                    self._remote_newest = (step, created)
                older = sorted(failed for failed in self._unpromoted
                               if failed < step and failed not in self._queued and self.policy.may_supersede(failed)
                               and failed not in self._leftovers)
                if (self.decides or self.follows) and not leftover:
                    self._withdraw(older)
                    self.superseded.extend(older)
                else:
                    older = []
            if older:
                log.info("step %d is promoted: the failed step(s) %s it supersedes are released", step,
                         ", ".join(map(str, older)))
                self._release_pins(older)
            self._collection_due = self.rank == 0 and self.policy.keep_remote is not None
        finally:
            with self._lock:
                self._current = None
                if leftover:
                    self._leftovers.discard(step)

    def _settle_leftover(self, step: int) -> int | None:
        """Uploader thread: settle a step an earlier run left pinned with the other ranks (see
        :mod:`ckptd.promotion.leftovers`). Returns the rank that commits it (and ``step`` is the current one),
        or None when its pin was released (or dropped meanwhile). Raises when the ranks' answers or the object
        tier did not come in time: the step stays pinned and is settled again at the next start."""
        with self._lock:
            self._queued.discard(step)
            if step not in self._unpromoted:
                self._leftovers.discard(step)
                return None
            self._current = step
        try:
            answers = self._shared_pins()
            manifest = load_step_manifest(self.pins.tier, step)
            holders = set(holders_of(step, answers)) | {self.rank}
            verdict = settle_leftover(step, step_ranks=[entry.rank for entry in manifest.ranks], holders=holders,
                                      remote=self.remote)
        except BaseException:
            with self._lock:
                self._current = None
            raise
        with self._lock:
            if not verdict.promote:
                self._current = None
                self._leftovers.discard(step)
                self._withdraw([step])
                self.released.append(step)
        if not verdict.promote:
            log.warning("step %d, left pinned by an earlier run, is not promoted to %s: %s. Rank %d releases its "
                        "pin; the committed local step stays", step, self.remote.label, verdict.reason, self.rank)
            self._release_pins([step])
            return None
        log.info("step %d, left pinned by an earlier run, is promoted by rank(s) %s (%s); rank %d commits it", step,
                 ", ".join(map(str, sorted(holders))), verdict.reason, verdict.committer)
        return verdict.committer

    def _shared_pins(self) -> dict[int, list[int]]:
        """Uploader thread: every rank's published pins (see :meth:`share_pins`), waited for once, at most
        ``CKPTD_COMMIT_TIMEOUT_S`` and never past the deadline of :meth:`close` (DeadlineError), logging."""
        if self._pins_shared is not None:
            return self._pins_shared
        if self._pins_unshared is not None:
            raise DeadlineError(self._pins_unshared, tier=self.remote.label, hint=_RESUME_HINT)
        assert self.schedule is not None
        started = logged = time.monotonic()
        limit = settings().commit_timeout_s
        while True:
            answers = self.schedule.shared_pins(min(_DECISION_POLL_S, max(0.0, started + limit - time.monotonic())))
            if len(answers) >= self.world_size:
                self._pins_shared = answers
                return answers
            missing = ", ".join(str(rank) for rank in range(self.world_size) if rank not in answers)
            now = time.monotonic()
            give_up_at = self._give_up_at()
            if now - started >= limit or (give_up_at is not None and now >= give_up_at):
                why = f"within {limit:g} s" if now - started >= limit else "before this uploader closed"
                self._pins_unshared = (f"rank(s) {missing} did not say {why} which steps they hold pinned: the "
                                       f"steps rank {self.rank} holds from an earlier run were not promoted")
                raise DeadlineError(self._pins_unshared, tier=self.remote.label,
                                    hint="CKPTD_COMMIT_TIMEOUT_S bounds the wait; " + _RESUME_HINT)
            if now - logged >= _DECISION_LOG_S:
                logged = now
                log.info("rank %d waits for rank(s) %s to say which steps they hold pinned, to settle the steps an "
                         "earlier run left pinned (%.0f s so far)", self.rank, missing, now - started)

    def _give_up_at(self) -> float | None:
        """When a cross-rank wait on the uploader thread gives up: shortly before the deadline of :meth:`close`."""
        deadline = self._close_deadline
        return None if deadline is None else deadline - 2 * _DECISION_POLL_S

    def _start_deciding(self, step: int) -> bool:
        """Uploader thread, one rank or rank 0: whether ``step`` is still to be promoted (it becomes the
        current one). Rank 0 announces steps in ascending order: one not newer than the last announced is
        superseded by it."""
        with self._lock:
            self._queued.discard(step)
            if step not in self._unpromoted:
                return False
            if self._announced_closing:  # the other ranks no longer follow: the step stays pinned
                return False
            stale = self.world_size > 1 and self._last_announced is not None and step <= self._last_announced
            if stale:
                self._withdraw([step])
                self.superseded.append(step)
            else:
                self._current = step
        if stale:
            log.info("step %d is older than step %d, announced already: it is not promoted", step,
                     self._last_announced)
            self._release_pins([step])
        return not stale

    def _await_decision(self, step: int) -> bool:
        """Uploader thread, a rank following rank 0: wait for rank 0's decision about ``step``. True (and
        ``step`` is the current one) when rank 0 announced it; a newer step announced first means rank 0
        never promotes this one: its pin is released. Waits at most ``CKPTD_COMMIT_TIMEOUT_S``
        (DeadlineError; the step stays pinned), or until shortly before the deadline of :meth:`close`."""
        with self._lock:
            self._queued.discard(step)
        started = logged = time.monotonic()
        limit = settings().commit_timeout_s
        while True:
            with self._lock:
                if step not in self._unpromoted:  # released by the pin cap while it waited
                    return False
                while self._decisions and not self._decisions[0].closing and self._decisions[0].step < step:
                    passed = self._decisions.popleft()
                    if passed.step in self._unpromoted or passed.step in self.released:
                        log.warning("rank 0 announced step %d after rank %d stopped waiting for it or released its "
                                    "pin: this rank's share is not promoted, and rank 0 cannot commit the step",
                                    passed.step, self.rank)
                head = self._decisions[0] if self._decisions else None
                if head is not None and head.step == step:
                    self._decisions.popleft()
                    self._current = step
                    return True
                if head is not None and not head.closing:
                    self._withdraw([step])
                    self.superseded.append(step)
            if head is not None:
                if head.closing:
                    log.info("rank 0's uploader closed without announcing step %d: rank %d keeps it pinned", step,
                             self.rank)
                else:
                    log.info("rank 0 promotes step %d: step %d, never announced, is not promoted", head.step, step)
                    self._release_pins([step])
                return False
            now = time.monotonic()
            if self._close_deadline is not None and now >= self._close_deadline - 2 * _DECISION_POLL_S:
                log.warning("rank %d closes before rank 0 decided about step %d: it stays pinned", self.rank, step)
                return False
            if now - started >= limit:
                raise DeadlineError(f"rank {self.rank} waited {limit:g} s for rank 0's promotion decision about "
                                    "this step; its share was not promoted", step=step, tier=self.remote.label,
                                    hint="rank 0's uploader may be stuck or dead (CKPTD_COMMIT_TIMEOUT_S bounds "
                                    "the wait); " + _RESUME_HINT)
            if now - logged >= _DECISION_LOG_S:
                logged = now
                log.info("rank %d waits for rank 0's promotion decision about step %d (%.0f s so far)", self.rank,
                         step, now - started)
            self._announce_releases()
            self._read_decisions(min(_DECISION_POLL_S, max(0.0, started + limit - now)))
            if self._cap_due:
                self._cap_due = False
                self._apply_pin_cap()

    def _read_decisions(self, timeout_s: float, *, blocking: bool = True) -> bool:
        """A rank following rank 0: read the decisions announced since the last read, waiting at most
        ``timeout_s`` seconds for the first of them. ``blocking=False`` (the save path): nothing when the
        uploader thread is reading them right now (then False)."""
        assert self.schedule is not None
        if blocking:  # the wait holds no lock: the save path's pin cap reads the decisions meanwhile
            self.schedule.wait_for_decision(self._decision_index, timeout_s)
        if not self._fetch_lock.acquire(blocking=blocking):
            return False
        try:
            while True:
                decision = self.schedule.next_decision(self._decision_index, 0.0)
                if decision is None:
                    return True
                with self._lock:
                    self._decisions.append(decision)
                    self._decision_index = decision.index
                if decision.closing:
                    return True
        finally:
            self._fetch_lock.release()

    def _announced_pending(self) -> set[int]:
        """Under the lock: the steps rank 0 announced that this rank has read and not yet acted on."""
        return {decision.step for decision in self._decisions if decision.step is not None}

    def _failed(self, step: int, error: BaseException) -> list[FailureRecord]:
        """Uploader thread: log a failed promotion and keep it; while closing, a tier that fails drops the
        steps still queued (they stay pinned and are reported by close). A step set aside while it was
        promoted (its pinned files renamed under it) is no failure."""
        with self._lock:
            abandoned, self._abandoned = self._abandoned == step, None
        if abandoned:
            log.info("the promotion of step %d, set aside meanwhile, stopped: %s", step, error)
            return []
        if isinstance(error, CkptdError):
            log.warning("promotion of step %d on %s failed; local copies stay and pinned steps are retried on the "
                        "next start: %s", step, self.remote.label, error)
        else:  # a bug must not kill the thread silently
            log.error("the uploader crashed promoting step %d", step, exc_info=error)
            crashed = CkptdError(f"uploader crashed: {error!r}", step=step, tier=self.remote.label)
            crashed.__cause__ = error
            error = crashed
        with self._lock:
            self._failed_steps[step] = str(error)
            while len(self._failed_steps) > _KEPT_STEP_NUMBERS:  # a long outage: the oldest are forgotten
                del self._failed_steps[min(self._failed_steps)]
        if self._closing and isinstance(error, StorageError):
            for dropped in self._worker.drop_queued():
                self._forget_queued(dropped)
        else:
            self._apply_pin_cap()
        return [FailureRecord("promotion", error, step=step, rank=self.rank)]

    def _collect_if_due(self) -> None:
        """Uploader thread, when no promotion is queued: learn the tiers' newest steps (once), announce dropped
        shares, apply ``keep_remote`` and collect garbage."""
        if not self._tiers_learned.is_set():
            self._learn_tiers()
        self._announce_releases()
        if self._collection_due:
            self._collection_due = False
            collect_garbage(self.remote, retention=self.policy.remote_retention)
