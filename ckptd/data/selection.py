"""Which files under a dataset root are shards: include/exclude globs, the reader's suffixes, and a
guard against mixing dataset splits.

A pattern without ``/`` matches the file name (``train*.bin``); a pattern with ``/`` matches the path
relative to the root, where ``*`` also crosses directories (``en/*/part-*.jsonl``). With include
patterns, a file is a shard when it matches one of them (the reader's suffixes are then not used);
without, when its name ends with one of the suffixes. Exclude patterns remove files afterwards.

Without any pattern, files whose paths say they belong to different splits (``train.bin`` and
``val.bin``, or ``train/*.parquet`` and ``validation/*.parquet``) are refused with a :class:`~ckptd.errors.ConfigError`: an epoch would silently mix
training and validation data. Any include or exclude pattern counts as an explicit choice.
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from ckptd.errors import ConfigError

#: Words in a file name that name a split, and the split they name.
SPLIT_WORDS = {"train": "train", "training": "train", "val": "validation", "valid": "validation",
               "validation": "validation", "dev": "validation", "eval": "validation", "test": "test"}

_Listed = TypeVar("_Listed")


def matches(relative: str, pattern: str) -> bool:
    """Whether ``relative`` (a path under the root) matches ``pattern`` (see the module docstring)."""
    target = relative if "/" in pattern else posixpath.basename(relative)
    return fnmatch.fnmatchcase(target, pattern.lstrip("/") if "/" in pattern else pattern)


def split_of(relative: str) -> str | None:
    """The split a file's path under the root names (``train``, ``validation``, ``test``; from the file
    name or a directory, as in ``train/part-0.parquet``), or None when it names none or several."""
    words = re.split(r"[^a-z]+", relative.lower())
    found = {SPLIT_WORDS[word] for word in words if word in SPLIT_WORDS}
    return found.pop() if len(found) == 1 else None


def select(files: Iterable[_Listed], path_of: Callable[[_Listed], str], *, suffixes: Sequence[str],
           include: Sequence[str] = (), exclude: Sequence[str] = (), where: str = "the dataset root"
           ) -> list[_Listed]:
    """The shards among ``files`` (see the module docstring); ``path_of`` gives a file's relative path.
    Raises ConfigError when no pattern is given and the shards name more than one split."""
    chosen = []
    for item in files:
        relative = path_of(item)
        wanted = any(matches(relative, p) for p in include) if include else relative.endswith(tuple(suffixes))
        if wanted and not any(matches(relative, p) for p in exclude):
            chosen.append(item)
    if not include and not exclude:
        splits: dict[str, list[str]] = {}
        for item in chosen:
            split = split_of(path_of(item))
            if split is not None:
                splits.setdefault(split, []).append(path_of(item))
        if len(splits) > 1:
            named = "; ".join(f"{split}: {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}"
                              for split, paths in sorted(splits.items()))
            first = sorted(splits)[-1] if "train" not in splits else "train"
            raise ConfigError(f"{where} holds shards of several dataset splits ({named}); one manifest would "
                              f"mix them in every epoch",
                              hint=f"pick the files with --include (e.g. --include '{first}*') or leave some out "
                                   f"with --exclude; --include '*' indexes all of them on purpose")
    return chosen

