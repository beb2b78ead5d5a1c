"""The in-process background uploader: promotes committed local steps while training continues.

:class:`BackgroundUploader` owns one named thread (``ckptd-uploader``, a
:class:`~ckptd.background.BackgroundWorker`). Call order, from the training thread:
:meth:`~BackgroundUploader.on_commit` after each local commit (the saver's ``on_commit`` callback),
:meth:`~BackgroundUploader.wait` to block until every queued step is promoted, and
:meth:`~BackgroundUploader.close` at the end. Failures do not stop training: the step stays pinned
locally (and is retried on the next start), the error is logged and kept (every one: one record per
step), and ``wait``/``close`` re-raise them. When no promotion is queued, rank 0 applies ``keep_remote``
and collects garbage on the object tier, on the same thread, so in-process promotion and GC never
overlap and a backlog of steps is promoted before any collection.

Bounded waits: ``wait`` gives up after ``CKPTD_WAIT_TIMEOUT_S`` (StillRunningError), ``close`` after
``CKPTD_CLOSE_TIMEOUT_S``; ``close`` then raises :class:`~ckptd.errors.UnpromotedError` listing the steps
left unpromoted (and pinned locally). Once ``close`` has begun, a promotion that fails on the object
tier (it is down) drops the steps still queued, so that ``close`` reports them at once instead of
trying each against a tier that does not answer.

The node daemon reuses this class with its own queue of steps.
"""

from __future__ import annotations

import logging
import threading

from ckptd.background import BackgroundWorker, FailureRecord, raise_failures
from ckptd.config import settings
from ckptd.errors import CkptdError, StillRunningError, StorageError, UnpromotedError
from ckptd.format.layout import MANIFEST_NAME, rank_files, rank_index_name
from ckptd.policy import Policy
from ckptd.promotion.gc import collect_garbage
from ckptd.promotion.pinning import PinnedSteps
from ckptd.promotion.promoter import Promoter, PromotionReport
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier

log = logging.getLogger("ckptd.promotion")
_RESUME_HINT = "the local copies stay pinned; promotion resumes when a manager or `ckptd promote` starts again"


class BackgroundUploader:
    """Promotes steps of ``local`` to ``remote`` on a background thread (see the module docstring).

    With ``world_size > 1`` each rank promotes its own share and rank 0 commits the step. When
    ``policy.remote_every_steps`` is None every saved step is promoted.
    """

    def __init__(self, local: LocalTier, remote: ObjectTier, *, policy: Policy, rank: int = 0,
                 world_size: int = 1) -> None:
        self.local, self.remote, self.policy = local, remote, policy
        self.rank, self.world_size = rank, world_size
        self.pins = PinnedSteps(local)
        self.promoter = Promoter(self.pins.tier, remote)
        self.reports: list[PromotionReport] = []
        self._queued: set[int] = set()
        #: Steps handed to this uploader and not promoted yet (queued, running or failed): pinned locally.
        self._unpromoted: set[int] = set()
        self._collection_due = False
        self._closing = False
        self._lock = threading.Lock()
        self._worker: BackgroundWorker[int] = BackgroundWorker(
            "ckptd-uploader", self._promote, describe=self._describe, failures=self._failed,
            step_of=lambda step: step, on_start=self.remote.connect, on_idle=self._collect_if_due)

    # --- called from the training thread --------------------------------------------------------
    def wants(self, step: int) -> bool:
        """Whether the policy promotes this step."""
        return self.policy.promotes(step)

    def on_commit(self, step: int) -> None:
        """Saver callback: pin and queue a step the policy promotes."""
        if self.wants(step):
            self.submit(step)

    def submit(self, step: int) -> None:
        """Pin a committed local step and queue its promotion."""
        self.pins.pin(step, self._own_files(self.pins.local, step))
        self._enqueue(step)

    def resume_pending(self) -> list[int]:
        """Queue the steps pinned by an earlier run that crashed before promoting them."""
        own_index = rank_index_name(self.rank)
        pending = [step for step in self.pins.pinned() if own_index in self.pins.tier.list_files(step)]
        for step in pending:
            log.info("resuming the promotion of step %d left by an earlier run", step)
            self._enqueue(step)
        return pending

    @property
    def unpromoted(self) -> list[int]:
        """Steps handed to this uploader that are not promoted yet (queued, being promoted, or failed)."""
        with self._lock:
            return sorted(self._unpromoted)

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
        timeout_s = settings().wait_timeout_s if timeout_s is None else timeout_s
        self._worker.wait(timeout_s, what=f"uploads to {self.remote.label}",
                          hint="the object tier may be slow or down; " + _RESUME_HINT)
        self._worker.raise_failures()

    def close(self, timeout_s: float | None = None) -> None:
        """Finish queued promotions, stop the thread and release the object tier, within ``timeout_s``
        seconds (default ``CKPTD_CLOSE_TIMEOUT_S``).

        Raises :class:`~ckptd.errors.UnpromotedError` listing the steps that stayed unpromoted (pinned
        locally; promotion resumes at the next start), when a promotion failed or the deadline passed (the
        steps not started are then dropped, the running one ends on its own: see :attr:`running`, and a
        later ``close`` waits for it again). Other kept failures are raised as :meth:`wait` does."""
        timeout_s = settings().close_timeout_s if timeout_s is None else timeout_s
        self._closing = True
        try:
            self._worker.close(timeout_s, what=f"uploads to {self.remote.label}")
        except StillRunningError as error:
            for step in self._worker.drop_queued():
                self._forget_queued(step)
            steps = self.unpromoted
            raise UnpromotedError(f"uploads to the object tier did not finish within {timeout_s:g} s: "
                                  f"step(s) {', '.join(map(str, steps))} stay unpromoted and pinned locally "
                                  f"({error.running})", steps, tier=self.remote.label,
                                  hint=_RESUME_HINT) from error
        self.remote.close()
        records = self._worker.take_failures()
        steps = self.unpromoted
        if steps:
            why = "; ".join(record.describe() for record in records) or "not promoted"
            raise UnpromotedError(f"step(s) {', '.join(map(str, steps))} could not be promoted to the object tier "
                                  f"and stay pinned locally: {why}", steps, tier=self.remote.label,
                                  hint=_RESUME_HINT) from (records[0].error if records else None)
        raise_failures(records)

    # --- the uploader thread ----------------------------------------------------------------------
    def _own_files(self, tier: LocalTier, step: int) -> list[str]:
        """This rank's files of a step on ``tier``, and the manifest."""
        return rank_files(tier.list_files(step), self.rank) + [MANIFEST_NAME]

    def _enqueue(self, step: int) -> None:
        with self._lock:
            if step in self._queued:
                return
            self._queued.add(step)
            self._unpromoted.add(step)
        self._worker.submit(step)

    def _forget_queued(self, step: int) -> None:
        with self._lock:
            self._queued.discard(step)

    def _describe(self, step: int) -> str:
        return f"step {step} is still being promoted to {self.remote.label} by rank {self.rank}"

    def _promote(self, step: int) -> None:
        """Uploader thread: promote one step (its failure is kept by the worker, see :meth:`_failed`)."""
        try:
            ranks = None if self.world_size == 1 else [self.rank]
            report = self.promoter.promote(step, ranks=ranks)
            self.reports.append(report)
            self.pins.unpin(step, None if ranks is None else self._own_files(self.pins.tier, step))
            with self._lock:
                self._unpromoted.discard(step)
            self._collection_due = self.rank == 0 and self.policy.keep_remote is not None
        finally:
            self._forget_queued(step)

    def _failed(self, step: int, error: BaseException) -> list[FailureRecord]:
        """Uploader thread: log a failed promotion and keep it; while closing, a tier that fails drops the
        steps still queued (they stay pinned and are reported by close)."""
        if isinstance(error, CkptdError):
            log.warning("promotion of step %d on %s failed; local copies stay and pinned steps are retried on the "
                        "next start: %s", step, self.remote.label, error)
        else:  # a bug must not kill the thread silently
            log.error("the uploader crashed promoting step %d", step, exc_info=error)
            crashed = CkptdError(f"uploader crashed: {error!r}", step=step, tier=self.remote.label)
            crashed.__cause__ = error
            error = crashed
        if self._closing and isinstance(error, StorageError):
            for dropped in self._worker.drop_queued():
                self._forget_queued(dropped)
        return [FailureRecord("promotion", error, step=step, rank=self.rank)]

    def _collect_if_due(self) -> None:
        """Uploader thread, when no promotion is queued: apply ``keep_remote`` and collect garbage."""
        if self._collection_due:
            self._collection_due = False
            collect_garbage(self.remote, retention=self.policy.remote_retention)
