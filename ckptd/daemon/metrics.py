"""The daemon's Prometheus metrics, in a registry of their own.

:class:`DaemonMetrics` holds every metric the daemon exposes on ``/metrics``; the service, its workers
and the control socket record through its methods (thread-safe, as prometheus-client's metrics are). A
registry per instance (not the process-wide default) keeps several daemons in one process, as tests run
them, apart. Names start with ``ckptd_`` and carry their unit (``_bytes_total``, ``_seconds``). Label values
are root names, tier kinds and operation names from the daemon's configuration and code: a bounded set,
never a step number or a path.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Buckets of the trainers' save stall: a save that stages into host memory returns in milliseconds.
_STALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Buckets of training step times and of whole promotions / replications (seconds to many minutes).
_LONG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)


class DaemonMetrics:
    """Every metric of one daemon; :meth:`render` gives the ``/metrics`` body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._promoted_bytes = Counter("ckptd_promoted_bytes", "Bytes uploaded to the object tier by promotions",
                                       ["root"], registry=r)
        self._promoted_steps = Counter("ckptd_promoted_steps", "Steps promoted to the object tier", ["root"],
                                       registry=r)
        self._promotion_seconds = Histogram("ckptd_promotion_seconds", "Time one step's promotion took",
                                            ["root"], buckets=_LONG_BUCKETS, registry=r)
        self._replicated_bytes = Counter("ckptd_replicated_bytes", "Bytes sent to the buddy node by replication",
                                         ["root"], registry=r)
        self._replicated_steps = Counter("ckptd_replicated_steps", "Steps replicated to the buddy node", ["root"],
                                         registry=r)
        self._replication_seconds = Histogram("ckptd_replication_seconds", "Time one step's replication took",
                                              ["root"], buckets=_LONG_BUCKETS, registry=r)
        self._lag_steps = Gauge("ckptd_promotion_lag_steps", "Steps the tier is behind the newest local commit",
                                ["root", "tier"], registry=r)
        self._lag_seconds = Gauge("ckptd_promotion_lag_seconds",
                                  "Training time between the newest local commit and the tier's newest step",
                                  ["root", "tier"], registry=r)
        self._verify_failures = Counter("ckptd_verify_failures", "Chunks or files that failed verification",
                                        ["tier"], registry=r)
        self._scrubbed_bytes = Counter("ckptd_scrubbed_bytes", "Bytes re-read and re-hashed by scrub", ["tier"],
                                       registry=r)
        self._scrub_failures = Counter("ckptd_scrub_failures", "Bad chunks found by scrub", ["tier"], registry=r)
        self._repairs = Counter("ckptd_repairs", "Bad chunks repaired from another tier", ["tier"], registry=r)
        self._retries = Counter("ckptd_retries", "Operations retried after a failure", ["tier", "operation"],
                                registry=r)
        self._journal_depth = Gauge("ckptd_journal_depth", "Journaled tasks not done yet", ["kind"], registry=r)
        self._set_aside = Gauge("ckptd_steps_set_aside", "Steps a restore set aside in the root's .set-aside/ "
                                "(corrupt or not restorable; `ckptd ls` says why)", ["root"], registry=r)
        self._save_stall = Histogram("ckptd_trainer_save_stall_seconds",
                                     "Time the training thread spent inside save(), as trainers report it",
                                     ["root"], buckets=_STALL_BUCKETS, registry=r)
        self._step_seconds = Histogram("ckptd_trainer_step_seconds",
                                       "Time between a trainer's consecutive save() calls (one training step)",
                                       ["root"], buckets=_LONG_BUCKETS, registry=r)
        self._peer_served = Counter("ckptd_peer_served_bytes", "Bytes of committed chunks served to peers",
                                    registry=r)
        self._tier_degraded = Gauge("ckptd_tier_degraded", "1 while a probe write to the tier fails (read-only, "
                                    "full, I/O errors), else 0", ["root", "tier"], registry=r)
        self._pinned_steps = Gauge("ckptd_pinned_steps", "Steps the daemon pins until they are copied", ["root"],
                                   registry=r)
        self._pinned_bytes = Gauge("ckptd_pinned_bytes", "Bytes only the daemon's pins hold (their steps are gone "
                                   "from the root)", ["root"], registry=r)
        self._pin_cap_skipped = Counter("ckptd_pin_cap_skipped_steps", "Steps released by the pin cap before they "
                                        "reached a tier (they are never promoted)", ["root"], registry=r)
        self._last_promotion = Gauge("ckptd_last_promotion_timestamp_seconds",
                                     "When the last promotion of the root to the object tier succeeded", ["root"],
                                     registry=r)
        self._in_flight = Gauge("ckptd_copy_in_flight_bytes", "Bytes sent so far by the promotion or replication "
                                "running now (0 when none runs)", ["root", "tier"], registry=r)
        self._upkeep_last_pass = Gauge("ckptd_upkeep_last_pass_timestamp_seconds",
                                       "When the last maintenance pass (retention, probes, listings, aborts) ended",
                                       registry=r)
        self._scrub_running = Gauge("ckptd_scrub_running", "1 while a scrub pass runs (on its own worker)",
                                    registry=r)
        self._errors = Counter("ckptd_errors", "Errors by the part of the daemon they happened in", ["where"],
                               registry=r)

    def promoted(self, root: str, bytes_: int, seconds: float) -> None:
        """One step of ``root`` promoted: ``bytes_`` uploaded in ``seconds``."""
        self._last_promotion.labels(root).set_to_current_time()
        self._promoted_bytes.labels(root).inc(max(bytes_, 0))
        self._promoted_steps.labels(root).inc()
        self._promotion_seconds.labels(root).observe(max(seconds, 0.0))

    def replicated(self, root: str, bytes_: int, seconds: float) -> None:
        """One step of ``root`` replicated to the buddy: ``bytes_`` sent in ``seconds``."""
        self._replicated_bytes.labels(root).inc(max(bytes_, 0))
        self._replicated_steps.labels(root).inc()
        self._replication_seconds.labels(root).observe(max(seconds, 0.0))

    def lag(self, root: str, tier: str, steps: int, seconds: float | None) -> None:
        """How far ``tier`` (``object``, ``peer``) of ``root`` is behind its local tier (``seconds`` None:
        not known, the gauge keeps its last value)."""
        self._lag_steps.labels(root, tier).set(steps)
        if seconds is not None:
            self._lag_seconds.labels(root, tier).set(seconds)

    def verify_failure(self, tier: str) -> None:
        """A chunk or file of ``tier`` did not match its digest (while promoting, replicating or serving)."""
        self._verify_failures.labels(tier).inc()

    def scrubbed(self, tier: str, bytes_: int) -> None:
        """Scrub re-read ``bytes_`` of ``tier``."""
        self._scrubbed_bytes.labels(tier).inc(max(bytes_, 0))

    def scrub_failure(self, tier: str) -> None:
        """Scrub found one bad chunk on ``tier``."""
        self._scrub_failures.labels(tier).inc()

    def repaired(self, tier: str) -> None:
        """One bad chunk of ``tier`` was repaired from another tier."""
        self._repairs.labels(tier).inc()

    def retry(self, tier: str, operation: str) -> None:
        """A failed ``operation`` (``promote``, ``replicate``, ...) on ``tier`` is retried."""
        self._retries.labels(tier, operation).inc()

    def journal_depth(self, kind: str, count: int) -> None:
        """``count`` journaled tasks of ``kind`` (``promote``, ``replicate``) are not done yet."""
        self._journal_depth.labels(kind).set(count)

    def trainer_report(self, root: str, save_stall_s: float | None, step_s: float | None) -> None:
        """A trainer of ``root`` reported one save's stall and its step time (either may be None)."""
        if save_stall_s is not None:
            self._save_stall.labels(root).observe(max(save_stall_s, 0.0))
        if step_s is not None:
            self._step_seconds.labels(root).observe(max(step_s, 0.0))

    def peer_served(self, bytes_: int) -> None:
        """``bytes_`` of committed chunks were served to a peer."""
        self._peer_served.inc(max(bytes_, 0))

    def tier_degraded(self, root: str, tier: str, degraded: bool) -> None:
        """The last probe of ``root``'s ``tier`` failed (``degraded``) or worked."""
        self._tier_degraded.labels(root=root, tier=tier).set(1 if degraded else 0)

    def steps_set_aside(self, root: str, count: int) -> None:
        """How many steps a restore set aside in the root's ``.set-aside/`` (they wait for an operator)."""
        self._set_aside.labels(root).set(count)

    def pinned(self, root: str, steps: int, bytes_: int) -> None:
        """The daemon pins ``steps`` steps of ``root``; ``bytes_`` are held by pins only."""
        self._pinned_steps.labels(root).set(steps)
        self._pinned_bytes.labels(root).set(max(bytes_, 0))

    def pin_cap_skipped(self, root: str) -> None:
        """The pin cap released one step of ``root`` before it reached its tiers."""
        self._pin_cap_skipped.labels(root).inc()

    def in_flight(self, root: str, tier: str, bytes_: int) -> None:
        """The copy of ``root`` to ``tier`` running now has sent ``bytes_`` (0: none runs)."""
        self._in_flight.labels(root, tier).set(max(bytes_, 0))

    def upkeep_pass(self, when: float) -> None:
        """A maintenance pass (retention, probes, listings, aborts, gauges) ended at ``when`` (Unix time)."""
        self._upkeep_last_pass.set(when)

    def scrub_running(self, running: bool) -> None:
        """A scrub pass began (``running``) or ended."""
        self._scrub_running.set(1 if running else 0)

    def error(self, where: str) -> None:
        """An error in ``where`` (``promote``, ``replicate``, ``scrub``, ``control``, ``http``, ...)."""
        self._errors.labels(where).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
