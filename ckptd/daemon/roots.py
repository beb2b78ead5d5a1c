"""A watched root at run time, and the locks that keep one daemon per state_dir and per root."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.daemon.config import RootConfig
from ckptd.daemon.tier_health import TierHealth
from ckptd.errors import LockedError
from ckptd.promotion.lag import PromotionLag
from ckptd.promotion.pinning import PinnedSteps
from ckptd.tiers.base import StorageTier
from ckptd.tiers.local import LocalTier

#: The daemon's own pin directory under each root, apart from the in-process uploader's ``.promoting`` (a
#: trainer that falls back to in-process promotion and the daemon never drop each other's pins); the hello
#: answer names it (``pin_directory``) so that the manager sets aside newer steps there too.
DAEMON_PIN_DIRECTORY = ".ckptd-daemon-pins"


@dataclass
class RootRuntime:
    """One watched root: its config and the tiers the daemon reads (``local``, its ``pins``) and writes
    (``remote``: the object tier; ``peer``: the buddy's ``replicas/<node_id>/<root>`` namespace)."""

    config: RootConfig
    local: LocalTier
    pins: PinnedSteps
    remote: StorageTier | None = None
    peer: StorageTier | None = None
    peer_url: str | None = None
    #: Steps whose tasks are journaled (or that need none), so repeated reports cost nothing.
    seen: set[int] = field(default_factory=set)
    #: tier kind ("object", "peer") -> (committed steps, lag) as last listed.
    listings: dict[str, tuple[list[int], PromotionLag | None]] = field(default_factory=dict)
    #: The latest save-stall and step-time report of the root's trainer.
    trainer_report: dict[str, Any] | None = None
    #: The local tier's health as last probed (:func:`ckptd.daemon.tier_health.probe_local`), None before.
    health: TierHealth | None = None
    #: tier kind ("object", "peer") -> whether its last listing answered, the error if not, and since when.
    reachability: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: tier kind -> (newest committed step, its manifest's creation time) as last listed (the lag during an
    #: outage is counted from it).
    newest_listed: dict[str, tuple[int, float | None]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name


def exclusive_lock(path: Path, message: str, hint: str) -> int:
    """Take an flock on ``path`` (created) for as long as the returned descriptor is open; LockedError with
    ``message`` when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockedError(message, path=str(path), hint=hint) from None
    return fd
