"""Records of objects found bad on a chunk store, so that nothing reuses them until they are mended.

When a reader (restore, ``ckptd verify``, a scrub) finds that an object on a content-addressed tier
fails its digest check, it calls :func:`report_bad_chunk`. The record is a small JSON object under
``health/bad/`` at the tier root, outside every step directory and outside ``chunks/``, so step and
chunk listings never see it and GC never sweeps it as a chunk. Promotion's dedup treats a recorded
object as missing and uploads it again from an intact copy, then clears the record
(:func:`clear_bad_chunk`); ``ckptd verify --repair`` does the same for older steps.

A recorded path is a chunk (``chunks/<2 hex>/<digest>.<codec>``) or a packed data file of a step; a
bad pack is mended by uploading the whole pack object again. Tiers that keep chunks in per-rank data
files (the local tier) have their own answer to a bad file (the step is set aside) and record nothing.

Thread safety: every function may be called from any thread; records are whole-object writes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from ckptd.errors import CkptdError, UnsafePathError
from ckptd.tiers.base import StorageTier

_log = logging.getLogger(__name__)

#: Directory (relative to the tier root) holding one record per bad object.
BAD_PREFIX = "health/bad"
_SUFFIX = ".bad.json"


def _checked(path: str) -> str:
    """A recorded path must stay inside the tier root and name a file."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(part in ("", ".", "..") for part in parts) \
            or any(ord(char) < 32 for char in path) or path.startswith(f"{BAD_PREFIX}/"):
        raise UnsafePathError(f"refusing to record {path!r} as a bad object: not a file under the tier root",
                              path=path, hint="pass the object's path relative to the tier root")
    return path


def record_path(path: str) -> str:
    """Where the record of a bad object at ``path`` lives."""
    return f"{BAD_PREFIX}/{_checked(path)}{_SUFFIX}"


def _records_apply(tier: StorageTier) -> bool:
    return tier.capabilities.chunks_by_digest


def report_bad_chunk(tier: StorageTier, path: str, *, step: int | None, reason: str) -> None:
    """Record that the object at ``path`` (relative to the root of ``tier``) is bad, so that promotion
    uploads it again instead of reusing it and ``verify --repair`` mends the steps that reference it.

    Never raises for a storage failure (a reader calls it on its way to the next tier): a record that
    cannot be written is logged as a warning; an unsafe ``path`` raises UnsafePathError. ``step`` is the
    step whose read found it (None: a scrub)."""
    if not _records_apply(tier):
        return
    body = {"path": path, "step": step, "reason": reason, "reported": time.time(),
            "host": socket.gethostname(), "pid": os.getpid()}
    record = record_path(path)
    try:
        tier.write_bytes(record, json.dumps(body, sort_keys=True).encode())
    except CkptdError as exc:
        _log.warning("could not record %s as bad on %s (step %s: %s): %s", path, tier.label, step, reason, exc)
        return
    _log.warning("recorded %s as bad on %s (step %s): %s; the next promotion uploads it again, "
                 "`ckptd verify --repair` mends older steps", path, tier.label, step, reason)


def bad_chunk_paths(tier: StorageTier) -> set[str]:
    """Paths (relative to the tier root) of every object recorded as bad: one listing. Records whose
    name is not a safe path under the root (``..``, empty parts) are ignored with a warning."""
    if not _records_apply(tier):
        return set()
    prefix = f"{BAD_PREFIX}/"
    found = set()
    for obj in tier.list_objects(BAD_PREFIX):
        if not (obj.path.startswith(prefix) and obj.path.endswith(_SUFFIX)):
            continue
        path = obj.path[len(prefix):-len(_SUFFIX)]
        try:  # a record's name comes from the store: one that names no file under the root is ignored
            found.add(_checked(path))
        except UnsafePathError:
            _log.warning("ignoring the bad-object record %s on %s: it names no file under the tier root",
                         obj.path, tier.label)
    return found


def clear_bad_chunk(tier: StorageTier, path: str) -> None:
    """Forget the record of ``path`` (after an intact copy was uploaded there); missing records are fine."""
    if _records_apply(tier):
        tier.delete_files([record_path(path)])


__all__ = ["BAD_PREFIX", "bad_chunk_paths", "clear_bad_chunk", "record_path", "report_bad_chunk"]
