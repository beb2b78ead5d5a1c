"""When to save, and how many steps each tier keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ckptd.errors import ConfigError


class RetentionPolicy(Protocol):
    """Chooses which committed steps of a tier may be deleted."""

    def deletable(self, committed: list[int]) -> list[int]:
        """Steps to delete, given every committed step ascending. Never the newest one."""


@dataclass(frozen=True)
class KeepLatest:
    """Keep the newest ``count`` committed steps (``None``: keep everything)."""

    count: int | None

    def deletable(self, committed: list[int]) -> list[int]:
        if self.count is None or len(committed) <= max(self.count, 1):
            return []
        return committed[: len(committed) - max(self.count, 1)]


@dataclass(frozen=True)
class Policy:
    """What the manager saves and keeps.

    ``every_steps``: save steps that are multiples of it. ``keep_local``: committed steps kept on the
    local tier (``None`` keeps all; the newest is never deleted). ``remote_every_steps``/``keep_remote``:
    the same for the object tier. ``on_busy``: when a save is requested while the previous one is still
    being written, ``"wait"`` for it or ``"skip"`` the new one.
    """

    every_steps: int = 1
    keep_local: int | None = 2
    remote_every_steps: int | None = None
    keep_remote: int | None = None
    on_busy: str = "wait"

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ConfigError(f"Policy.every_steps must be >= 1, got {self.every_steps}")
        for name in ("keep_local", "keep_remote", "remote_every_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"Policy.{name} must be >= 1 or None, got {value}")
        if self.on_busy not in ("wait", "skip"):
            raise ConfigError(f"Policy.on_busy must be 'wait' or 'skip', got {self.on_busy!r}")

    def saves(self, step: int) -> bool:
        return step % self.every_steps == 0

    def promotes(self, step: int) -> bool:
        return self.remote_every_steps is not None and step % self.remote_every_steps == 0

    @property
    def local_retention(self) -> RetentionPolicy:
        return KeepLatest(self.keep_local)

    @property
    def remote_retention(self) -> RetentionPolicy:
        return KeepLatest(self.keep_remote)
