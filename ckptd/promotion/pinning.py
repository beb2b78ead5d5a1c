"""Pinning a committed local step while it waits to be promoted.

Local retention may delete a step before its promotion has run. When a step is handed to the uploader,
its files are hard-linked (copied where links are not possible) into ``<local root>/.promoting/``, a
directory laid out like a tier; retention deletes only the original names, so the pinned copy stays
readable until the promotion finishes and unpins it. A pin left by a crash is found again on the next
start and its promotion is resumed.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ckptd.errors import StorageError
from ckptd.format.layout import MANIFEST_NAME, step_dir
from ckptd.tiers.local import LocalTier, fsync_directory

#: Directory under the local root that holds pinned steps.
PIN_DIRECTORY = ".promoting"


class PinnedSteps:
    """The pinned copies of steps waiting for promotion, readable as a :class:`LocalTier`."""

    def __init__(self, local: LocalTier) -> None:
        self.local = local
        self.tier = LocalTier(local.root / PIN_DIRECTORY)

    def pin(self, step: int, names: list[str]) -> None:
        """Pin files of a committed step (the manifest is pinned last, so a pin is complete when it has one)."""
        source, target = self.local.root / step_dir(step), self.tier.root / step_dir(step)
        target.mkdir(parents=True, exist_ok=True)
        ordered = [name for name in names if name != MANIFEST_NAME] + [MANIFEST_NAME]
        for name in ordered:
            self._link(source / name, target / name)
        fsync_directory(target)

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

    def unpin(self, step: int, names: list[str] | None = None) -> None:
        """Drop a pin (only ``names`` when given: other ranks may still need theirs)."""
        if names is None:
            self.tier.delete_step(step)
            return
        self.tier.delete_files([f"{step_dir(step)}/{name}" for name in names if name != MANIFEST_NAME])
        remaining = [name for name in self.tier.list_files(step) if name != MANIFEST_NAME]
        if not remaining:
            self.tier.delete_step(step)
