"""The daemon's upkeep of what it stores: retention per tier, scrub passes and the multipart uploads a dead
writer left open, on its maintenance thread.

Both call H4's functions (:func:`ckptd.daemon.retention.apply_retention`,
:meth:`ckptd.daemon.scrub.Scrubber.scrub_tier`). Retention never deletes a step with unfinished tasks or
a pin; scrub checks this node's copies (the local root, mended from the object tier and the buddy; the
object tier, mended from the others) and the replicas buddies sent here, never a buddy's copy over the
network (the buddy scrubs that itself). Uploads left open on an object tier by a writer that died (this
daemon's previous process, SIGKILLed mid-upload, or a trainer's uploader) are aborted from the first pass
after the daemon starts, at every pass while a dead writer's upload waits on a key a live writer is uploading anew, then every ``gc_abandoned_s``; an upload
whose owner still runs is left alone (:meth:`~ckptd.tiers.object.ObjectTier.abort_incomplete_uploads`).
Failures are counted in the metrics and handed to ``record_error``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from ckptd.config import settings
from ckptd.daemon.config import DaemonConfig
from ckptd.daemon.roots import RootRuntime
from ckptd.errors import CkptdError
from ckptd.tiers.base import StorageTier
from ckptd.tiers.local import LocalTier

log = logging.getLogger("ckptd.daemon")

#: Called with (where, root name, step or None, error text).
ErrorRecorder = Callable[[str, str, "int | None", str], None]


class Upkeep:
    """Retention and scrub for one daemon (see the module docstring); called from one thread.

    ``sleep`` paces the scrub (the daemon passes its stop event's ``wait``, so that SIGTERM ends a pause at
    once); one :class:`~ckptd.daemon.scrub.Scrubber` serves the daemon's life, so its bandwidth budget spans
    passes."""

    def __init__(self, config: DaemonConfig, metrics: Any, record_error: ErrorRecorder, *,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        self.config, self.metrics, self.record_error = config, metrics, record_error
        self._sleep = sleep
        self._scrubber: Any = None
        self._uploads_checked_at: dict[str, float] = {}

    def replica_tiers(self) -> list[LocalTier]:
        """The replicas buddies sent here, one tier per ``<replica_dir>/<node id>/<root name>``."""
        base = self.config.replica_path
        if not base.is_dir():
            return []
        return [LocalTier(root, create=False) for node in sorted(base.iterdir()) if node.is_dir()
                for root in sorted(node.iterdir()) if root.is_dir()]

    def apply_retention(self, runtime: RootRuntime, protected: Collection[int]) -> None:
        """``keep_local`` on the root and ``keep_remote`` on its object tier, never a step in ``protected``."""
        wanted = [(runtime.local, runtime.config.keep_local), (runtime.remote, runtime.config.keep_remote)]
        self._retain([(runtime.name, tier, keep, protected) for tier, keep in wanted
                      if tier is not None and keep is not None])

    def abort_abandoned_uploads(self, runtime: RootRuntime) -> int:
        """Abort the multipart uploads no live writer owns on the root's object tier: at every call until one
        leaves no two open uploads of one key, then every ``gc_abandoned_s``; returns how many were aborted."""
        tier = runtime.remote
        if tier is None or not tier.capabilities.multipart_uploads:
            return 0
        now = time.monotonic()
        last = self._uploads_checked_at.get(runtime.name)
        threshold = settings().gc_abandoned_s
        if last is not None and now - last < threshold:
            return 0
        try:
            aborted, waiting = tier.sweep_incomplete_uploads(threshold)
        except CkptdError as error:
            self.record_error("uploads", runtime.name, None, str(error))
            log.warning("aborting the abandoned uploads of %s failed: %s", tier.label, error)
            return 0
        if not waiting:
            # an upload is spared while its key has a live owner, even one uploading that key anew (a
            # restarted daemon re-sends the chunk a dead one left half sent): look again at every pass while
            # a dead writer's upload waits on such a key, not while any is open (other writers' live uploads
            # nearly always are)
            self._uploads_checked_at[runtime.name] = now
        if aborted:
            log.info("aborted %d multipart upload(s) a dead writer left on %s", aborted, tier.label)
        return aborted

    def apply_replica_retention(self) -> None:
        """``keep_peer`` on every replica buddies sent here."""
        self._retain([(_replica_name(tier), tier, self.config.keep_peer, ()) for tier in self.replica_tiers()])

    def _retain(self, work: list[tuple[str, StorageTier, int, Collection[int]]]) -> None:
        if not work:
            return
        try:
            from ckptd.daemon.retention import apply_retention
        except ImportError:
            return
        for name, tier, keep, protected in work:
            try:
                apply_retention(tier, keep=keep, protect=protected)
            except CkptdError as error:
                self.record_error("retention", name, None, str(error))
                log.warning("retention on %s failed: %s", tier.label, error)

    def scrub(self, runtimes: Iterable[RootRuntime], should_stop: Callable[[], bool]) -> None:
        """One scrub pass over this node's copies and the replicas held here (bandwidth-limited)."""
        try:
            from ckptd.daemon.scrub import Scrubber
        except ImportError:
            return
        if self._scrubber is None:
            self._scrubber = Scrubber(bytes_per_s=self.config.scrub_bytes_per_s, sleep=self._sleep)
        scrubber = self._scrubber
        work: list[tuple[str, StorageTier, list[StorageTier]]] = []
        for runtime in runtimes:
            # the root's pins hold steps retention deleted from the root: a copy to mend the other tiers from
            copies = [tier for tier in (runtime.local, runtime.pins.tier, runtime.remote, runtime.peer)
                      if tier is not None]
            work.extend((runtime.name, tier, [other for other in copies if other is not tier])
                        for tier in (runtime.local, runtime.remote) if tier is not None)
        work.extend((_replica_name(tier), tier, []) for tier in self.replica_tiers())
        for name, tier, sources in work:
            if should_stop():
                return
            try:
                report = scrubber.scrub_tier(tier, repair_from=sources, should_stop=should_stop)
            except CkptdError as error:
                self.metrics.error("scrub")
                self.record_error("scrub", name, None, str(error))
                continue
            self.metrics.scrubbed(tier.kind, report.bytes)
            for _ in report.bad:
                self.metrics.scrub_failure(tier.kind)
                self.metrics.verify_failure(tier.kind)
            for _ in report.repaired:
                self.metrics.repaired(tier.kind)
            for _ in report.unrepaired:
                self.metrics.error("scrub-unrepaired")
            if report.bad:
                self.record_error("scrub", name, None,
                                  f"{len(report.bad)} bad file(s) on {tier.label}, {len(report.repaired)} repaired")


def _replica_name(tier: LocalTier) -> str:
    """``<source node id>/<root name>`` of a replica directory."""
    return f"{tier.root.parent.name}/{tier.root.name}"
