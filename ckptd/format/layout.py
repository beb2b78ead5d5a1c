"""Names of things inside a checkpoint root, and the guard that keeps paths inside it.

A root holds one directory per step, ``step-<12-digit step>/``. A step directory holds, per rank,
its data files ``rank-<5-digit rank>.data``, ``rank-<5-digit rank>.1.data``, ... (chunks, on tiers
that keep data files; one per parallel writer) and ``rank-<5-digit rank>.index.json``, and one
``manifest.json``, written last: a step is committed exactly when its manifest exists.
"""

from __future__ import annotations

import re

from ckptd.errors import UnsafePathError

MANIFEST_NAME = "manifest.json"
#: In a step directory that holds only some ranks' files (a node-local directory): which ranks, as JSON
#: ``{"ranks": [...]}``, written before the manifest. Without it the directory holds every rank.
RANKS_HERE_NAME = "ranks-here.json"
STEP_PREFIX = "step-"
TEMP_MARKER = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d{12})$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def step_dir(step: int) -> str:
    """Directory name of a step."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a step directory."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def rank_file_prefix(rank: int) -> str:
    """The start of the name of every file of one rank in a step directory."""
    return f"rank-{rank:05d}."


def rank_files(names: list[str], rank: int) -> list[str]:
    """The names among ``names`` that belong to ``rank`` (its data files and its index)."""
    return [name for name in names if name.startswith(rank_file_prefix(rank))]


def rank_data_name(rank: int, part: int = 0) -> str:
    """Name of a rank's data file number ``part`` (``rank-NNNNN.data``, then ``rank-NNNNN.<part>.data``)."""
    return f"{rank_file_prefix(rank)}data" if part == 0 else f"{rank_file_prefix(rank)}{part}.data"


def rank_index_name(rank: int) -> str:
    return f"rank-{rank:05d}.index.json"


def step_file(step: int, name: str) -> str:
    """Path of a file of a step, relative to the root, after checking the name is safe."""
    return f"{step_dir(step)}/{safe_name(name, step=step)}"


def safe_name(name: object, *, step: int | None = None, path: str | None = None) -> str:
    """Accept a file name read from a manifest or index only if it stays inside its step directory.

    Absolute paths, separators, ``..``, empty names, control characters and hidden names are refused.
    ``path`` is the manifest or index the name was read from, named in the error.
    """
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise UnsafePathError(
            f"refusing file name {name!r}: it could leave the step directory",
            step=step, path=path,
            hint="the manifest or index was tampered with or is corrupt; use another step or tier",
        )
    return name
