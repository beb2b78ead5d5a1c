"""What a path given to ``ls``, ``verify``, ``restore`` or ``gc`` is, when it is not a checkpoint root.

A checkpoint root is the directory given to :class:`ckptd.CheckpointManager` (or its ``s3://`` URL): it
holds ``step-*`` directories, the directory identity file and ``.set-aside/``. A file, one step's folder
or the ``.set-aside`` folder given instead is refused with :class:`~ckptd.errors.ConfigError` (exit 2)
saying what it is and which path to pass; a directory that holds no root at all is told apart from an
empty root by :func:`holds_root`.
"""

from __future__ import annotations

from pathlib import Path

from ckptd.cli.options import open_cli_tier
from ckptd.errors import ConfigError
from ckptd.format.layout import parse_step_dir
from ckptd.manager.directories import IDENTITY_FILE
from ckptd.manager.set_aside import SET_ASIDE_DIRECTORY, SetAsideRecord, set_aside_steps
from ckptd.tiers import StorageTier
from ckptd.tiers.local import LocalTier, local_root
from ckptd.tiers.registry import scheme_of


def _looks_like_root(directory: Path) -> bool:
    """Whether ``directory`` holds a ckptd checkpoint root (its identity file, a step or a set-aside step)."""
    try:
        if (directory / IDENTITY_FILE).is_file() or (directory / SET_ASIDE_DIRECTORY).is_dir():
            return True
        return any(parse_step_dir(entry.name) is not None for entry in directory.iterdir() if entry.is_dir())
    except OSError:
        return False


def _enclosing_root(path: Path) -> Path | None:
    """The nearest directory above ``path`` that holds a checkpoint root."""
    for parent in path.parents:
        if _looks_like_root(parent):
            return parent
    return None


def _step_folder(path: Path) -> str | None:
    """What ``path`` is when it is a folder inside a root (a step's, a set-aside step's, ``.set-aside``)."""
    step = parse_step_dir(path.name)
    if step is not None and not _looks_like_root(path):
        return f"the folder of step {step}"
    if path.name == SET_ASIDE_DIRECTORY:
        return "the folder of set-aside steps"
    if path.parent.name == SET_ASIDE_DIRECTORY and path.name.startswith("step-"):
        return "a step set aside by a restore"
    return None


def refuse_non_root(url: str) -> None:
    """ConfigError when the local path ``url`` is a file or a folder inside a checkpoint root, saying what it
    is and what to pass instead; nothing for a URL of another tier, a missing path or anything else."""
    if scheme_of(url) != "file":
        return
    path = local_root(url)
    if path.is_dir():
        what = _step_folder(path)
        if what is None:
            return
        root = _enclosing_root(path) or (path.parent.parent if path.parent.name == SET_ASIDE_DIRECTORY
                                         else path.parent)
        raise ConfigError(f"the path given is {what}, not a checkpoint root", path=str(path),
                          hint=f"pass the checkpoint root that holds it: {root}")
    if path.exists():
        root = _enclosing_root(path)
        where = f"pass the checkpoint root that holds it: {root}" if root is not None else \
            "pass a checkpoint root (the directory given to CheckpointManager, holding step-* folders)"
        raise ConfigError("the path given is a file, not a checkpoint root", path=str(path), hint=where)


def open_root(url: str, endpoint_url: str | None, region: str | None) -> StorageTier:
    """The tier at ``url`` after :func:`refuse_non_root`."""
    refuse_non_root(url)
    return open_cli_tier(url, endpoint_url, region)


def holds_root(tier: StorageTier) -> bool:
    """Whether ``tier`` holds a checkpoint root: a local directory with ckptd's identity file, a step or a
    set-aside step; another tier with a step."""
    if isinstance(tier, LocalTier):
        return _looks_like_root(tier.root)
    return bool(tier.list_step_numbers())


def set_aside_of(tier: StorageTier) -> list[SetAsideRecord]:
    """The set-aside steps of a local tier (see :mod:`ckptd.manager.set_aside`); none elsewhere."""
    return set_aside_steps(tier.root) if isinstance(tier, LocalTier) else []
