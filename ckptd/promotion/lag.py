"""How far the object tier is behind the local tier, computed from the two tiers alone.

:func:`promotion_lag` compares the newest committed step of each tier, so it needs no running uploader:
the manager (:attr:`~ckptd.manager.manager.CheckpointManager.promotion_lag`) and ``ckptd ls`` call the
same function. Seconds are measured between the two manifests' ``created`` times; a promoted manifest
is a byte copy of the local one, so this is the training time between the two commits, not the time
the upload took.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd.errors import CkptdError
from ckptd.stepio.step_reader import load_step_manifest
from ckptd.tiers.base import StorageTier


@dataclass(frozen=True)
class PromotionLag:
    """The distance between the newest committed local step and the newest committed remote step.

    - ``local_step`` / ``remote_step``: the newest committed step of each tier (None: the tier has none).
    - ``steps_behind``: ``local_step - remote_step``, in step numbers (training steps a loss of the local
      tier would cost); ``local_step`` when the object tier has no step yet; 0 when the object tier is
      level or ahead, or there is no local step.
    - ``seconds_behind``: ``created`` of the local manifest minus that of the remote one (0.0 when level
      or ahead); None when either tier has no step or a manifest cannot be read.
    """

    local_step: int | None
    remote_step: int | None
    steps_behind: int
    seconds_behind: float | None

    @property
    def behind(self) -> bool:
        """Whether the local tier holds a step newer than every remote one."""
        return self.steps_behind > 0

    def describe(self) -> str:
        """One line for logs and listings, e.g. ``object tier 3 step(s) behind (12.5 s): local 30, remote 27``."""
        local = "none" if self.local_step is None else str(self.local_step)
        remote = "none" if self.remote_step is None else str(self.remote_step)
        if not self.behind:
            return f"object tier up to date: local {local}, remote {remote}"
        seconds = "" if self.seconds_behind is None else f" ({self.seconds_behind:.1f} s)"
        return f"object tier {self.steps_behind} step(s) behind{seconds}: local {local}, remote {remote}"


def _newest(tier: StorageTier) -> int | None:
    steps = tier.committed_steps()
    return steps[-1] if steps else None


def _created(tier: StorageTier, step: int) -> float | None:
    try:
        return load_step_manifest(tier, step).created
    except CkptdError:
        return None


def lag_between(local_step: int | None, remote_step: int | None, *, local_created: float | None = None,
                remote_created: float | None = None) -> PromotionLag:
    """The :class:`PromotionLag` of two newest steps (and their manifests' creation times when known)."""
    if local_step is None:
        return PromotionLag(None, remote_step, 0, None)
    if remote_step is None:
        return PromotionLag(local_step, None, local_step, None)
    if remote_step >= local_step:
        return PromotionLag(local_step, remote_step, 0, 0.0)
    seconds = None
    if local_created is not None and remote_created is not None:
        seconds = max(local_created - remote_created, 0.0)
    return PromotionLag(local_step, remote_step, local_step - remote_step, seconds)


def promotion_lag(local: StorageTier, remote: StorageTier) -> PromotionLag:
    """How far ``remote`` is behind ``local``, from their committed steps and manifests (two listings and,
    when the remote is behind, two manifest reads). Storage errors of the listings propagate."""
    local_step, remote_step = _newest(local), _newest(remote)
    if local_step is None or remote_step is None or remote_step >= local_step:
        return lag_between(local_step, remote_step)
    return lag_between(local_step, remote_step, local_created=_created(local, local_step),
                       remote_created=_created(remote, remote_step))
