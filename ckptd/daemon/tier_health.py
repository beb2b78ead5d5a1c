"""Whether a watched root's local tier can still take a save: a probe write the daemon runs on each
maintenance pass.

A root whose file system went read-only (remounted after errors), ran out of space or quota, or returns
I/O errors makes every save of its trainer fail, while the committed steps in it stay readable. The
daemon cannot see the trainer's errors, so it asks the file system itself: it writes, fsyncs and
deletes a tiny file through the local tier's own file layer (:meth:`LocalTier.write_bytes`, the calls a
save makes), after checking the mount's read-only flag. The result goes into the status document (the
root's ``tiers.local.health``) and the ``ckptd_tier_degraded`` gauge; a root that recovers is reported
healthy again on the next pass.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

from ckptd.errors import CkptdError
from ckptd.tiers.local import LocalTier

#: The probe file, at the root (no step directory, so no listing ever sees it).
PROBE_NAME = ".ckptd-daemon-probe"


@dataclass(frozen=True)
class TierHealth:
    """One probe's verdict: ``state`` is ``"ok"`` or ``"degraded"``; ``reason`` says why (the error)."""

    state: str
    reason: str | None
    checked: float

    @property
    def degraded(self) -> bool:
        return self.state != "ok"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def probe_local(tier: LocalTier) -> TierHealth:
    """Probe ``tier`` (read-only flag, then a write, fsync and delete of :data:`PROBE_NAME`)."""
    now = time.time()
    try:
        if os.statvfs(tier.root).f_flag & os.ST_RDONLY:
            return TierHealth("degraded", f"the file system of {tier.root} is mounted read-only", now)
    except OSError as error:
        return TierHealth("degraded", f"cannot stat {tier.root}: {error.strerror or error}", now)
    try:
        tier.delete_files([PROBE_NAME])  # left by a probe that failed half-way
        tier.write_bytes(PROBE_NAME, b"ckptd daemon probe\n")
        tier.delete_files([PROBE_NAME])
    except CkptdError as error:
        return TierHealth("degraded", f"a probe write failed: {error}", now)
    return TierHealth("ok", None, now)


__all__ = ["PROBE_NAME", "TierHealth", "probe_local"]
