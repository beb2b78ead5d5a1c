"""The in-process background uploader: promotes committed local steps while training continues.

:class:`BackgroundUploader` owns one named thread (``ckptd-uploader``). Call order, from the training
thread: :meth:`~BackgroundUploader.on_commit` after each local commit (the saver's ``on_commit``
callback), :meth:`~BackgroundUploader.wait` to block until every queued step is promoted, and
:meth:`~BackgroundUploader.close` at the end. Failures do not stop training: the step stays pinned
locally (and is retried on the next start), the error is logged and kept, and ``wait``/``close``
re-raise the first one. When no promotion is queued, rank 0 applies ``keep_remote`` and collects garbage
on the object tier, on the same thread, so in-process promotion and GC never overlap and a backlog of
steps is promoted before any collection.

The node daemon reuses this class with its own queue of steps.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from ckptd.config import settings
from ckptd.errors import CkptdError, StorageError
from ckptd.format.layout import MANIFEST_NAME, rank_files, rank_index_name
from ckptd.policy import Policy
from ckptd.promotion.gc import collect_garbage
from ckptd.promotion.pinning import PinnedSteps
from ckptd.promotion.promoter import Promoter, PromotionReport
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier

log = logging.getLogger("ckptd.promotion")
_STOP = -1


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
        self.errors: list[CkptdError] = []
        self._queue: queue.Queue[int] = queue.Queue()
        self._queued: set[int] = set()
        self._collection_due = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ckptd-uploader", daemon=True)
        self._thread.start()

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

    def wait(self) -> None:
        """Block until every queued step is promoted; re-raise the first failure since the last wait."""
        self._queue.join()
        with self._lock:
            errors, self.errors = self.errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Finish queued promotions, stop the thread, re-raise the first failure. Gives up after
        ``CKPTD_CLOSE_TIMEOUT_S``: the local copies stay pinned and promotion resumes at the next start."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=settings().close_timeout_s)
            if self._thread.is_alive():
                raise StorageError(
                    f"uploads to the object tier did not finish within {settings().close_timeout_s:.0f} s",
                    tier=self.remote.label, hint="the local steps stay pinned; promotion resumes when a "
                    "manager or `ckptd promote` starts again")
        self.remote.close()
        self.wait()

    # --- the uploader thread ----------------------------------------------------------------------
    def _own_files(self, tier: LocalTier, step: int) -> list[str]:
        """This rank's files of a step on ``tier``, and the manifest."""
        return rank_files(tier.list_files(step), self.rank) + [MANIFEST_NAME]

    def _enqueue(self, step: int) -> None:
        with self._lock:
            if step in self._queued:
                return
            self._queued.add(step)
        self._queue.put(step)

    def _run(self) -> None:
        self._guard(None, self.remote.connect)
        while True:
            step = self._queue.get()
            try:
                if step != _STOP:
                    self._guard(step, lambda: self._promote(step))
                if self._queue.empty() or step == _STOP:  # GC waits until no promotion is queued
                    self._guard(None, self._collect_if_due)
                if step == _STOP:
                    return
            finally:
                with self._lock:
                    self._queued.discard(step)
                self._queue.task_done()

    def _promote(self, step: int) -> None:
        ranks = None if self.world_size == 1 else [self.rank]
        report = self.promoter.promote(step, ranks=ranks)
        self.reports.append(report)
        self.pins.unpin(step, None if ranks is None else self._own_files(self.pins.tier, step))
        self._collection_due = self.rank == 0 and self.policy.keep_remote is not None

    def _collect_if_due(self) -> None:
        if self._collection_due:
            self._collection_due = False
            collect_garbage(self.remote, retention=self.policy.remote_retention)

    def _guard(self, step: int | None, work: Callable[[], None]) -> None:
        """Run work on the uploader thread; keep (and log) its failure instead of dying."""
        try:
            work()
        except CkptdError as error:
            what = f"promotion of step {step}" if step is not None else "object-tier upkeep"
            log.warning("%s on %s failed; local copies stay and pinned steps are retried on the next start: %s",
                        what, self.remote.label, error)
            with self._lock:
                self.errors.append(error)
        except Exception as error:  # a bug must not kill the thread silently
            log.exception("the uploader crashed")
            with self._lock:
                self.errors.append(CkptdError(f"uploader crashed: {error!r}", step=step, tier=self.remote.label))
