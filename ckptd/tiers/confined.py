"""Paths that stay inside a root: no component below it may be a symbolic link.

A file named by a manifest or a peer request is reached from its root one component at a time; a
component that is a symbolic link (or a ``..``) could lead anywhere on the machine, so it is refused with
:class:`~ckptd.errors.UnsafePathError` before the file is opened. The root itself may be a link (a
scratch directory linked to an NVMe mount is common); only what lies below it is checked.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from ckptd.errors import UnsafePathError


def confined_path(root: Path, relative: str, *, tier: str) -> Path:
    """``root / relative`` after checking that ``relative`` has no ``..`` or absolute part and that no
    existing component on the way below ``root`` is a symbolic link (components that do not exist yet are
    fine: the caller may be about to create them)."""
    parts = PurePosixPath(relative).parts
    if PurePosixPath(relative).is_absolute() or ".." in parts:
        raise UnsafePathError("refusing a path that leaves its root", path=relative, tier=tier,
                              hint="the manifest or request that named it was forged or damaged")
    current = root
    for part in parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):  # the caller's own call fails as it should
            break
        if stat.S_ISLNK(mode):
            raise UnsafePathError("refusing a path through a symbolic link", path=relative, tier=tier,
                                  hint="checkpoint files are never links; replace the link by the file it "
                                       "points to if you trust it")
    return root.joinpath(*parts)
