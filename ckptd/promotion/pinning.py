"""Pinning a committed local step while it waits to be promoted.

Local retention may delete a step before its promotion has run. When a step is handed to the uploader,
its files are hard-linked (copied where links are not possible) into ``<local root>/.promoting/``, a
directory laid out like a tier; retention deletes only the original names, so the pinned copy stays
readable until the promotion finishes and unpins it. A pin left by a crash is found again on the next
start and its promotion is resumed.

Pins are bounded (:class:`PinCap`, from the ``pin_max_steps`` and ``pin_max_bytes`` settings): while the
object tier is down or slow, :func:`pins_over_cap` picks the oldest pins to release so that the local disk
holds at most that many pinned steps and bytes beyond what local retention keeps. A pin costs no space while
its step is still in the local tier (a hard link); only bytes whose sole remaining name is the pin count.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from ckptd.config import Settings, settings
from ckptd.errors import ConfigError, StorageError
from ckptd.format.layout import MANIFEST_NAME, rank_index_name, step_dir
from ckptd.tiers.local import LocalTier, fsync_directory

#: Directory under the local root that holds pinned steps.
PIN_DIRECTORY = ".promoting"


class PinnedSteps:
    """The pinned copies of steps waiting for promotion, readable as a :class:`LocalTier`.

    ``directory`` (under the local root) is :data:`PIN_DIRECTORY` for the in-process uploader; another
    consumer of the same root (the node daemon) may keep its pins apart, so that neither drops a pin the
    other still reads."""

    def __init__(self, local: LocalTier, directory: str = PIN_DIRECTORY) -> None:
        self.local = local
        self.tier = LocalTier(local.root / directory)

    def pin(self, step: int, names: list[str], *, durable: bool = True) -> None:
        """Pin files of a committed step (the manifest is pinned last, so a pin is complete when it has one).

        ``durable=False`` skips the directory fsync (the save path pins that way and the uploader calls
        :meth:`make_durable` before it promotes): a crash may then lose the pin, never the local step,
        which retention deletes only at a later commit."""
        source, target = self.local.root / step_dir(step), self.tier.root / step_dir(step)
        target.mkdir(parents=True, exist_ok=True)
        ordered = [name for name in names if name != MANIFEST_NAME] + [MANIFEST_NAME]
        for name in ordered:
            self._link(source / name, target / name)
        if durable:
            fsync_directory(target)

    def make_durable(self, step: int) -> None:
        """fsync a pinned step's directory (see :meth:`pin`); nothing when the step is not pinned."""
        target = self.tier.root / step_dir(step)
        if target.is_dir():
            fsync_directory(target)

    def release(self, step: int, names: list[str] | None = None) -> None:
        """Drop a pin that will not be promoted (superseded, or past the cap) without any fsync, so that the
        save path that calls it never waits for the disk: the manifest goes first, so a pin a crash leaves
        half-removed is incomplete and ignored (only ``names`` when given: other ranks may need theirs)."""
        directory = self.tier.root / step_dir(step)
        if names is not None:
            for name in names:
                if name != MANIFEST_NAME:
                    (directory / name).unlink(missing_ok=True)
            if any(name != MANIFEST_NAME for name in self.tier.list_files(step)):
                return
        try:
            (directory / MANIFEST_NAME).unlink(missing_ok=True)
            for leftover in directory.iterdir():
                leftover.unlink(missing_ok=True)
            directory.rmdir()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"could not release a pinned step: {exc.strerror}", path=str(directory), step=step,
                               tier="local", hint="check the permissions of the checkpoint directory") from exc

    def held_bytes(self, step: int) -> int:
        """Bytes of a pinned step that only the pin still holds (files with no other name on disk)."""
        total = 0
        try:
            entries = list(os.scandir(self.tier.root / step_dir(step)))
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.st_nlink <= 1:
                total += stat.st_size
        return total

    @staticmethod
    def _link(source: Path, target: Path) -> None:
        if target.exists():
            return
        try:
            os.link(source, target)
        except FileExistsError:
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise StorageError(f"could not pin a file for promotion: {exc.strerror}", path=str(source),
                                   tier="local", hint="check the permissions of the checkpoint directory") from exc
            temporary = target.with_name(f"{target.name}.tmp-pin")
            shutil.copyfile(source, temporary)
            os.replace(temporary, target)

    def pinned(self) -> list[int]:
        """Steps whose pin is complete, ascending."""
        return self.tier.committed_steps()

    def held_by(self, rank: int) -> list[int]:
        """Steps whose pin is complete and holds ``rank``'s share (its index), ascending."""
        return [step for step in self.pinned() if rank_index_name(rank) in self.tier.list_files(step)]

    def unpin(self, step: int, names: list[str] | None = None) -> None:
        """Drop a pin (only ``names`` when given: other ranks may still need theirs)."""
        if names is None:
            self.tier.delete_step(step)
            return
        self.tier.delete_files([f"{step_dir(step)}/{name}" for name in names if name != MANIFEST_NAME])
        remaining = [name for name in self.tier.list_files(step) if name != MANIFEST_NAME]
        if not remaining:
            self.tier.delete_step(step)


@dataclass(frozen=True)
class PinCap:
    """How many pinned steps, and how many bytes held only by pins, one uploader keeps (0 bytes: no limit)."""

    max_steps: int
    max_bytes: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_steps, bool) or self.max_steps < 1:
            raise ConfigError(f"pin_max_steps must be >= 1, got {self.max_steps}",
                               hint="set CKPTD_PIN_MAX_STEPS to 1 or more (the newest pin is always kept)")
        if self.max_bytes < 0:
            raise ConfigError(f"pin_max_bytes must be >= 0, got {self.max_bytes}",
                               hint="set CKPTD_PIN_MAX_BYTES to 0 (no limit) or a byte count")

    @classmethod
    def from_settings(cls, options: Settings | None = None) -> PinCap:
        """The cap the ``pin_max_steps`` / ``pin_max_bytes`` settings (``CKPTD_PIN_MAX_*``) ask for."""
        options = options or settings()
        return cls(options.pin_max_steps, options.pin_max_bytes)


def pins_over_cap(pinned: Mapping[int, int], cap: PinCap, *, keep: Collection[int] = (),
                  keep_if_possible: Collection[int] = ()) -> list[int]:
    """The pins to release, oldest first, so that ``pinned`` (step -> bytes held only by its pin) fits ``cap``.

    The newest pin and the steps in ``keep`` (the one being uploaded) are never released; when they alone
    exceed the cap, everything else goes and the rest stays. The steps in ``keep_if_possible`` (those
    ``keep_remote`` keeps for good) go only when releasing every other pin does not fit the cap."""
    first = _over_cap(pinned, cap, set(keep) | set(keep_if_possible))
    rest = {step: held for step, held in pinned.items() if step not in first}
    return sorted(first + _over_cap(rest, cap, set(keep)))


def _over_cap(pinned: Mapping[int, int], cap: PinCap, keep: Collection[int]) -> list[int]:
    steps = sorted(pinned)
    if not steps:
        return []
    protected = set(keep) | {steps[-1]}
    count, held = len(steps), sum(pinned.values())
    released: list[int] = []
    for step in steps:
        over_count = count > cap.max_steps
        over_bytes = cap.max_bytes > 0 and held > cap.max_bytes
        if not (over_count or over_bytes):
            break
        if step in protected:
            continue
        released.append(step)
        count -= 1
        held -= pinned[step]
    return released
