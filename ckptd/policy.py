"""When to save, when to promote, and which steps each tier keeps.

:class:`Policy` is the one place that decides these: the manager asks it whether a step is saved, the
uploader whether a saved step is promoted, and retention which committed steps may go. Retention is a
:class:`RetentionPolicy` (a Protocol with one method); :class:`KeepLatest` and :class:`KeepEvery` are
the built-in ones, and any object with a ``deletable`` method works as well.

This module is a leaf: it imports nothing of ckptd but :mod:`ckptd.errors`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, Union, runtime_checkable

from ckptd.errors import ConfigError


@runtime_checkable
class RetentionPolicy(Protocol):
    """Chooses which committed steps of a tier may be deleted.

    Called by the owner of a tier's directory after each commit, once more when its manager closes (and
    by ``ckptd gc``) with every committed step of that tier. An answer may change between calls (a
    framework's pointer removed after the last save), but must never include the newest step.
    """

    def deletable(self, committed: list[int]) -> list[int]:
        """Steps to delete, given every committed step ascending. Never the newest one."""


#: Newer steps a retention policy is shown when :meth:`Policy.may_supersede` asks whether it keeps a
#: step for good.
_SUPERSEDE_PROBE = 64

#: What ``Policy.keep_local``/``Policy.keep_remote`` accept: a count of newest steps, None (keep
#: everything) or a retention policy object.
Retention = Union[int, None, RetentionPolicy]


def _check_count(owner: str, name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an integer >= 1 or None" if optional else "an integer >= 1"
        raise ConfigError(f"{owner}.{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class KeepLatest:
    """Keep the newest ``count`` committed steps (``None``: keep everything)."""

    count: int | None

    def __post_init__(self) -> None:
        _check_count("KeepLatest", "count", self.count, optional=True)

    def deletable(self, committed: list[int]) -> list[int]:
        if self.count is None or len(committed) <= self.count:
            return []
        return list(committed[: len(committed) - self.count])


@dataclass(frozen=True)
class KeepEvery:
    """Keep every step that is a multiple of ``every``, plus the newest ``latest`` steps.

    For long runs that want a sparse history (``KeepEvery(1000, latest=2)`` keeps steps 1000, 2000, ...
    for good and the two newest steps whatever they are).
    """

    every: int
    latest: int = 1

    def __post_init__(self) -> None:
        _check_count("KeepEvery", "every", self.every, optional=False)
        _check_count("KeepEvery", "latest", self.latest, optional=False)

    def deletable(self, committed: list[int]) -> list[int]:
        older = committed[: max(len(committed) - self.latest, 0)]
        return [step for step in older if step % self.every != 0]


def _check_retention(name: str, value: object) -> None:
    if value is None or isinstance(value, RetentionPolicy):
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"Policy.{name} must be an integer, None or a retention policy, got {value!r}",
                          hint="a retention policy is an object with deletable(committed) -> steps, "
                               "e.g. ckptd.KeepLatest(3) or ckptd.KeepEvery(1000, latest=2)")
    if value < 1:
        raise ConfigError(f"Policy.{name} must be >= 1 or None, got {value}",
                          hint=f"use {name}=1 to keep only the newest step (the newest is never deleted)")


def _as_retention(value: Retention) -> RetentionPolicy:
    if value is None or isinstance(value, int):
        return KeepLatest(value)
    return value


@dataclass(frozen=True)
class Policy:
    """What the manager saves, promotes and keeps.

    - ``every_steps``: save the steps that are multiples of it (``save(..., force=True)`` saves any step).
    - ``remote_every_steps``: which saved steps are promoted to the object tier. ``None`` (the default)
      promotes every saved step. Otherwise promoted steps are the saved steps that are multiples of it;
      since promotion only ever happens to saved steps it must be a multiple of ``every_steps``
      (``every_steps=100, remote_every_steps=250`` would promote only every 500th step, their least
      common multiple, so it is refused with a :class:`~ckptd.errors.ConfigError` naming that).
    - ``keep_local`` / ``keep_remote``: which committed steps the local and object tiers keep: an
      integer (the newest N), ``None`` (all), or a :class:`RetentionPolicy` such as
      :class:`KeepLatest` or :class:`KeepEvery`. The newest committed step is never deleted. When
      steps commit faster than they upload, a newer step supersedes the promoted steps still queued
      behind the one in flight, except those ``keep_remote`` keeps for good (see :meth:`may_supersede`).
    - ``on_busy``: when a save is requested while the previous one is still being written, ``"wait"``
      for it or ``"skip"`` the new one.
    - ``durable_every_steps``: a saved step that is a multiple of it is durable: ``save()`` returns only once
      it is committed locally (as ``save(..., durable=True)``). ``None`` (the default): no step.
    """

    every_steps: int = 1
    keep_local: Retention = 2
    remote_every_steps: int | None = None
    keep_remote: Retention = None
    on_busy: str = "wait"
    durable_every_steps: int | None = None

    def __post_init__(self) -> None:
        _check_count("Policy", "every_steps", self.every_steps, optional=False)
        _check_count("Policy", "remote_every_steps", self.remote_every_steps, optional=True)
        _check_count("Policy", "durable_every_steps", self.durable_every_steps, optional=True)
        _check_retention("keep_local", self.keep_local)
        _check_retention("keep_remote", self.keep_remote)
        if self.remote_every_steps is not None and self.remote_every_steps % self.every_steps:
            common = math.lcm(self.every_steps, self.remote_every_steps)
            raise ConfigError(
                f"Policy.remote_every_steps={self.remote_every_steps} is not a multiple of "
                f"every_steps={self.every_steps}: only saved steps are promoted, so only multiples of "
                f"{common} (their least common multiple) would ever reach the object tier",
                hint=f"use remote_every_steps={common} (or another multiple of {self.every_steps})")
        if self.on_busy not in ("wait", "skip"):
            raise ConfigError(f"Policy.on_busy must be 'wait' or 'skip', got {self.on_busy!r}")

    def saves(self, step: int) -> bool:
        """Whether ``save(step, ...)`` saves this step (without ``force``)."""
        return step % self.every_steps == 0

    def durable(self, step: int) -> bool:
        """Whether a save of ``step`` returns only after its local commit (``durable_every_steps``)."""
        return self.durable_every_steps is not None and step % self.durable_every_steps == 0

    def promotes(self, step: int) -> bool:
        """Whether a saved (committed) step is promoted to the object tier; every one when
        ``remote_every_steps`` is None."""
        return self.remote_every_steps is None or step % self.remote_every_steps == 0

    def may_supersede(self, step: int) -> bool:
        """Whether a promoted step still waiting for its upload may be dropped for a newer committed step.

        When steps commit faster than they upload, the uploader promotes the newest one and drops those
        queued behind it (their local pins are released). ``keep_remote`` decides which may go: with an
        integer or None (a :class:`KeepLatest`) any step may, since that retention only ever keeps the
        newest steps; another retention (such as :class:`KeepEvery`) keeps for good the steps it would not
        delete however many newer steps follow, and those are never dropped. ``remote_every_steps`` is
        respected by construction: only steps it promotes are ever queued."""
        retention = self.remote_retention
        if isinstance(retention, KeepLatest):
            return True
        spacing = self.remote_every_steps or self.every_steps
        newer = [step + spacing * offset for offset in range(1, _SUPERSEDE_PROBE + 1)]
        return step in retention.deletable([step, *newer])

    @property
    def local_retention(self) -> RetentionPolicy:
        """The retention of the local tier (``keep_local`` as a policy object)."""
        return _as_retention(self.keep_local)

    @property
    def remote_retention(self) -> RetentionPolicy:
        """The retention of the object tier (``keep_remote`` as a policy object)."""
        return _as_retention(self.keep_remote)
