"""What a :class:`~ckptd.manager.manager.CheckpointManager` does on a node whose daemon takes its steps.

:class:`DaemonHandoff` runs on the saver's ``on_commit`` (the writer thread): it pins the step just committed
(:class:`~ckptd.promotion.pinning.PinnedSteps`, no fsync, as the in-process uploader does) when the daemon
promotes or replicates it, so that local retention cannot delete it before the daemon has it; it tells the
daemon (``committed``); then the save stalls and step times recorded by the training thread
(:meth:`DaemonHandoff.record_save`, a deque append) are reported. Nothing of this runs on the training
thread.

The first request the daemon does not answer ends the hand-off: one warning, and ``on_lost`` (the manager
starts its own uploader, which resumes the pinned steps). So does an error answer to ``committed`` (a
stopping daemon, one that could not pin or journal the step): the daemon did not take that step, which is
pinned here, and nobody else would promote it. A daemon that answers it does not want a step
(``wanted`` false) gets no pin for it: the pin is released at once. A daemon whose hello names a
``pin_directory`` other than ``.promoting`` pins the steps it takes there itself, before it answers: the
manager's pin in ``.promoting`` only bridges until that answer and is released then too (so that the
in-process uploader alone owns ``.promoting``).

With several ranks the loss is the whole job's (:class:`SharedLoss`, a key in the job's c10d store): the rank
that loses its daemon sets it, and every other rank gives up its daemon at its next commit, so that all ranks
promote in-process together (rank 0 decides and the others follow: a rank still handing its steps to a
daemon would leave the ranks following rank 0 waiting for decisions that never come).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from typing import Any

from ckptd.errors import CkptdError, ConfigError
from ckptd.format.layout import MANIFEST_NAME, rank_files
from ckptd.manager.daemon_link import DaemonLink
from ckptd.promotion.pinning import PIN_DIRECTORY, PinnedSteps
from ckptd.tiers import StorageTier, open_tier
from ckptd.tiers.local import LocalTier

if TYPE_CHECKING:
    from ckptd.manager.commit import StoreCoordinator

log = logging.getLogger("ckptd.manager")
#: Reports kept while the writer thread has not sent them (the oldest are dropped past it).
_MAX_QUEUED_REPORTS = 1024
#: ``storage_options`` keys meant for the peer tier (not for s3fs), and the peer tier's names for them.
PEER_OPTION_KEYS = {"peer_token": "token", "peer_token_file": "token_file"}


def split_peer_options(storage_options: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``storage_options`` without the peer tier's keys, and the peer tier's options (``token``, ``token_file``)."""
    if not storage_options:
        return storage_options, {}
    rest = {key: value for key, value in storage_options.items() if key not in PEER_OPTION_KEYS}
    peer = {PEER_OPTION_KEYS[key]: value for key, value in storage_options.items() if key in PEER_OPTION_KEYS}
    return rest, peer


def open_peer_tier(url: str | None, link: DaemonLink | None, options: dict[str, Any]) -> StorageTier | None:
    """The peer restore tier: ``url`` when given (errors raised), else the ``peer_url`` the daemon's hello named
    (one that cannot be opened is skipped with a warning), else None."""
    if url is not None:
        if not url.startswith("peer://"):
            raise ConfigError(f"peer={url!r} is not a peer:// URL", hint="pass peer='peer://HOST:PORT/NAMESPACE'")
        return open_tier(url, storage_options=options)
    named = link.info.get("peer_url") if link is not None else None
    if not isinstance(named, str) or not named:
        return None
    try:
        return open_tier(named, storage_options=options)
    except CkptdError as error:
        log.warning("the ckptd daemon names the peer tier %s, which cannot be opened (restores skip it): %s", named,
                    error)
        return None


class SharedLoss:
    """Whether some rank of the job lost its daemon: the key ``<coordinator prefix>/daemon-lost`` in the job's
    store (set once, by the first rank that lost it; its value says which rank and why). A store that does
    not answer reads as not set (this rank's own link still decides for it)."""

    def __init__(self, coordinator: StoreCoordinator) -> None:
        self.coordinator = coordinator

    @property
    def key(self) -> str:
        """The store key (under the coordinator's current generation)."""
        return f"{self.coordinator.prefix}/daemon-lost"

    def is_set(self) -> str | None:
        """Who lost the daemon and why, or None while no rank did."""
        store = self.coordinator.store
        try:
            if not store.check([self.key]):
                return None
            return store.get(self.key).decode(errors="replace")
        except Exception as error:  # noqa: BLE001 - c10d raises plain RuntimeErrors; never into training
            log.debug("could not read %s from the job's store: %s", self.key, error)
            return None

    def set(self, rank: int, why: str) -> None:
        """Tell every rank that ``rank`` lost its daemon."""
        try:
            self.coordinator.store.set(self.key, f"rank {rank}: {why}")
        except Exception as error:  # noqa: BLE001 - the other ranks then notice their own loss, or never
            log.warning("could not tell the other ranks that the ckptd daemon is lost: %s", error)


def leftover_pins(local: LocalTier, rank: int) -> list[int]:
    """Steps an earlier run of ``rank`` left pinned in ``.promoting`` for its in-process uploader (a crash,
    or a run that took promotion back from a daemon): only an in-process uploader resumes them (the daemon
    neither reads nor drops that directory), so a manager that finds any promotes in-process."""
    pins = PinnedSteps(local)
    try:
        return pins.held_by(rank)
    except CkptdError as error:
        log.warning("could not list the steps pinned in %s: %s", pins.tier.label, error)
        return []


@dataclass(frozen=True)
class SaveTiming:
    """One save as the training thread saw it: its stall (time inside ``save()``) and the step time (since the
    previous ``save()`` call; None for the first)."""

    step: int
    save_stall_s: float
    step_s: float | None


class DaemonHandoff:
    """Hands committed steps of ``local`` to the daemon behind ``link`` (see the module docstring).

    ``pin``: pin this rank's files of each committed step (the daemon promotes or replicates from the pin when
    the step is gone). Every rank tells the daemon (which takes a step once), so that each learns whether
    to keep its pin. ``on_lost`` is called once, on the writer thread, when the daemon stops answering, or when
    ``shared`` (several ranks) says another rank's did."""

    def __init__(self, link: DaemonLink, local: LocalTier, *, rank: int, world_size: int, pin: bool,
                 on_lost: Callable[[], None], shared: SharedLoss | None = None) -> None:
        self.link, self.rank, self.world_size = link, rank, world_size
        self.shared = shared
        self.pins = PinnedSteps(local) if pin else None
        #: Whether the daemon pins into ``.promoting`` too (then a pin it took is its to drop).
        self.shares_pins = link.info.get("pin_directory", PIN_DIRECTORY) == PIN_DIRECTORY
        self.on_lost = on_lost
        self._timings: deque[SaveTiming] = deque(maxlen=_MAX_QUEUED_REPORTS)
        self._lost = threading.Event()

    @property
    def active(self) -> bool:
        """Whether the daemon still takes this manager's steps."""
        return not self._lost.is_set()

    @property
    def promotes(self) -> bool:
        """Whether the daemon promotes the root (the manager then starts no uploader)."""
        return self.link.promotes

    def record_save(self, step: int, save_stall_s: float, step_s: float | None) -> None:
        """Training thread, after a ``save()`` that saved: keep its timing for the next report."""
        if self.active:
            self._timings.append(SaveTiming(step, save_stall_s, step_s))

    def on_commit(self, step: int) -> None:
        """Saver callback (writer thread, after each local commit): pin, tell the daemon, report timings."""
        if not self.active:
            return
        own = self._own_files(step)
        if self.pins is not None:
            try:
                self.pins.pin(step, own, durable=False)
            except CkptdError as error:  # the daemon still has the step while the local tier keeps it
                log.warning("could not pin step %d for the ckptd daemon: %s", step, error)
        elsewhere = self.shared.is_set() if self.shared is not None else None
        if elsewhere is not None:  # the pin just taken hands this step to the uploader on_lost starts
            self._lose(step, f"{elsewhere}; every rank promotes in-process")
            return
        wanted = self.link.committed(step)
        if wanted is None:  # no answer, or an error answer: the daemon did not take the step
            self._lose(step)
            return
        if self.pins is not None and wanted is not None and not (wanted and self.shares_pins):
            self._release(step, own)
        while self._timings and self._timings[0].step <= step:
            timing = self._timings.popleft()
            if not self.link.report(timing.step, save_stall_s=timing.save_stall_s, step_s=timing.step_s):
                self._lose(step)
                return

    def close(self) -> None:
        """Close the link (the daemon keeps whatever it was told)."""
        self.link.close()

    def _own_files(self, step: int) -> list[str]:
        return rank_files(self.pins.local.list_files(step), self.rank) + [MANIFEST_NAME] if self.pins else []

    def _release(self, step: int, own: list[str]) -> None:
        assert self.pins is not None
        try:
            self.pins.release(step, None if self.world_size == 1 else own)
        except CkptdError as error:
            log.warning("could not release the pin of step %d, which the ckptd daemon has answered for: %s", step,
                        error)

    def _lose(self, step: int, elsewhere: str | None = None) -> None:
        self._lost.set()
        self._timings.clear()
        if elsewhere is None:
            why = f"stopped answering ({self.link.failure})" if not self.link.alive else \
                f"did not take step {step} ({self.link.refusal})"
            if self.shared is not None:
                self.shared.set(self.rank, f"its ckptd daemon {why} at step {step}")
        else:
            why = f"is given up because a rank lost its own ({elsewhere})"
        log.warning("the ckptd daemon on %s %s at step %d: this process promotes its own steps from now on",
                    self.link.socket_path, why, step)
        self.link.close()
        self.on_lost()
