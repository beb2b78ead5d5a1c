"""Which chunks a promotion must upload: those the object tier lacks, and those it holds but cannot vouch for.

Dedup used to trust a stored chunk when its key and size matched, so one flipped object was inherited
by every later step. Here a stored chunk is reused only when all of these hold:

1. it is stored under ``chunks/`` with the recorded size (one LIST for the whole step, or one HEAD per
   chunk once the store is large: see below). An object of
   another size is bad, unless it decodes to the chunk's digest: then it is the same chunk in another
   encoding (a zstd level or version other than this step's), which the older steps that reference it
   read with its own length, so it is never replaced and the promotion fails with CommitError;
2. it is not recorded as bad (:mod:`ckptd.tiers.chunk_health`; one LIST);
3. the CRC32 the store kept since its upload (``ChecksumMode=ENABLED`` on a HEAD, no body transferred)
   equals the CRC32 of the intact local copy's stored bytes, which are read and checked against their
   digest first. A store that kept no checksum for the object (written by an older ckptd, or a store
   without checksums) has the object read back once instead and compared byte for byte.

A chunk that passes is remembered for the life of the process by (tier, key, size, ETag from the
listing; a store that sends no ETag has its chunks checked every time): a frozen chunk that every step
shares is checked once, and again only when the listing shows another ETag (the object was replaced). A chunk that fails is recorded as bad and uploaded again; after
the upload :func:`mark_uploaded` clears its record.

Cost per step, with every chunk already stored and remembered: the two LISTs (the promoter lists the bad
records once and passes them in, and looks for the chunks once more before committing only when it keeps
chunks it did not upload itself). For each chunk not yet remembered: one HEAD plus a local read and CRC32
of its stored bytes (zlib, about 2 GB/s on one core).

A listing of the chunk store grows with every step kept on the tier (a run that keeps every step of a
model of 5,000 chunks lists 5 million objects after 1,000 promotions, minutes of CPU each time), while
the chunks a step needs do not. So once this process has seen the store hold more than
:data:`LOOKUPS_ABOVE` objects per chunk a step needs, it looks the step's chunks up instead: one HEAD each
(with ``ChecksumMode``, so the CRC32 of step 3 comes with it), in parallel, none of them a listing. The
first promotion of a process always lists, to learn the size; a collection in the process sets it again.

Thread safety: every function may be called from any thread; the memo is shared by the process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TypeVar

from ckptd.background import TaskPool
from ckptd.config import settings
from ckptd.errors import CommitError, IntegrityError, NotFoundError
from ckptd.format.records import ChunkRecord
from ckptd.promotion.contents import RankShare, check_stored_chunk, read_stored_chunk
from ckptd.tiers.base import StorageTier
from ckptd.tiers.chunk_health import bad_chunk_paths, clear_bad_chunk, report_bad_chunk
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.s3_transfers import crc32_checksum

log = logging.getLogger("ckptd.promotion")

T = TypeVar("T")
R = TypeVar("R")
_memo_lock = threading.Lock()
_verified: set[tuple[str, str, int, str]] = set()
#: A step's chunks are looked up one HEAD each, instead of listing the whole chunk store, once the store holds
#: more than this many objects per chunk looked for: one HEAD costs about the CPU of parsing 64 listed objects.
LOOKUPS_ABOVE = 64
#: Object tier URL -> objects under ``chunks/`` at this process's last listing of it, plus the chunks
#: uploaded since (deletions are not subtracted: the estimate errs towards lookups, whose cost does not grow).
_store_sizes: dict[str, int] = {}
#: Size, ETag and store-kept CRC32 (None: none kept) of an object, from a lookup.
_Stored = tuple[int, str, "str | None"]


@dataclass(frozen=True)
class DedupCheck:
    """What one dedup decision looked at (counts of content-addressed chunks)."""

    needed: int
    missing: int
    recorded_bad: int
    remembered: int
    checked_by_checksum: int
    checked_by_reading: int
    mismatched: int
    local_bytes_read: int


#: The last check this process made (for logs, benchmarks and tests).
last_check: DedupCheck | None = None


def forget_verified() -> None:
    """Drop the memo of verified chunks (tests, and a process that wants every chunk checked again)."""
    with _memo_lock:
        _verified.clear()


def _looks_up(remote: ObjectTier, count: int) -> bool:
    """Whether ``count`` chunks are cheaper to look up one by one than to find in a listing of the store."""
    with _memo_lock:
        known = _store_sizes.get(remote.url)
    return known is not None and known > LOOKUPS_ABOVE * max(1, count)


def _in_parallel(function: Callable[[T], R], items: list[T]) -> list[R]:
    """``function`` of every item, on up to ``s3_concurrency`` threads, in the items' order."""
    if not items:
        return []
    workers = max(1, min(settings().s3_concurrency, len(items)))
    with TaskPool("ckptd-dedup", workers) as pool:
        futures = [pool.submit(function, item) for item in items]
        return [future.result() for future in futures]


def _look_up(remote: ObjectTier, paths: list[str]) -> dict[str, _Stored]:
    """Size, ETag and CRC32 of those of ``paths`` that are stored: one HEAD each, in parallel."""

    def head(path: str) -> _Stored | None:
        try:
            return remote.stored_checksum(path)
        except NotFoundError:
            return None

    return {path: stored for path, stored in zip(paths, _in_parallel(head, paths)) if stored is not None}


def note_store_size(tier: StorageTier, count: int) -> None:
    """Remember that ``tier`` holds ``count`` chunks (a listing, or a collection that just swept some)."""
    with _memo_lock:
        _store_sizes[tier.url] = count


def _listed_store(remote: ObjectTier) -> dict[str, tuple[int, str]]:
    """Path -> (size, ETag) of every chunk stored: one paginated listing, whose size this process remembers."""
    listed = remote.listed_tags(remote.chunk_path("").rstrip("/"))
    note_store_size(remote, len(listed))
    return listed


def _find_stored(remote: ObjectTier, paths: list[str]) -> tuple[dict[str, tuple[int, str]], dict[str, _Stored]]:
    """(path -> (size, ETag) of the chunks stored, path -> HEAD answer of those looked up): a listing of the
    whole chunk store, or one HEAD per path once the store is much larger (:data:`LOOKUPS_ABOVE`)."""
    if _looks_up(remote, len(paths)):
        looked_up = _look_up(remote, paths)
        return {path: (size, tag) for path, (size, tag, _) in looked_up.items()}, looked_up
    return _listed_store(remote), {}


def stored_sizes(remote: ObjectTier, keys: Iterable[str]) -> dict[str, int]:
    """Content address -> stored size of those of ``keys`` that the object tier holds (a listing of the chunk
    store, or one HEAD per key once the store is much larger than ``keys``: see the module docstring)."""
    paths = {remote.chunk_path(key): key for key in keys}
    stored, _ = _find_stored(remote, list(paths))
    return {key: stored[path][0] for path, key in paths.items() if path in stored}


def _verdict(remote: ObjectTier, local: StorageTier, share: RankShare, chunk: ChunkRecord,
             looked_up: _Stored | None = None) -> tuple[bool, str, int]:
    """(whether the stored object holds exactly the local copy's bytes, how it was checked, local bytes read).
    ``looked_up``: the object's HEAD, when the dedup decision made one."""
    path = remote.chunk_path(chunk.object_key)
    try:
        size, _, crc = looked_up if looked_up is not None else remote.stored_checksum(path)
    except NotFoundError:
        return False, "checksum", 0
    stored = read_stored_chunk(local, share, chunk)  # the local copy, checked against its digest
    if size != len(stored):
        return False, "checksum", len(stored)
    if crc is not None:
        return crc == crc32_checksum(stored), "checksum", len(stored)
    try:
        return remote.read_bytes(path) == stored, "reading", len(stored)
    except NotFoundError:
        return False, "reading", len(stored)


def _refuse_if_other_encoding(remote: ObjectTier, path: str, share: RankShare, chunk: ChunkRecord,
                              size: int) -> None:
    """Raise CommitError when the object at ``path`` (``size`` bytes, not ``chunk.length``) is an intact
    copy of ``chunk`` in another encoding: replacing it would break every step that reads it as it is."""
    try:
        check_stored_chunk(remote.read_bytes(path), replace(chunk, length=size), path=path,
                           step=share.index.step, tier=remote.label)
    except (IntegrityError, NotFoundError):
        return  # bad (or gone): uploading the local copy mends it
    raise CommitError(f"chunk {chunk.digest} is stored in another encoding ({size} bytes, this step's copy "
                      f"{chunk.length}); older steps read it as it is, so it is not replaced and the step "
                      "was not promoted", step=share.index.step, tier=remote.label, path=path,
                      hint="save with the codec and CKPTD_ZSTD_LEVEL of the steps already on the object tier, "
                      "or promote to another prefix")


def chunks_to_upload(remote: ObjectTier, needed: dict[str, tuple[RankShare, ChunkRecord]],
                     local: StorageTier, *, bad: set[str] | None = None) -> list[tuple[RankShare, ChunkRecord]]:
    """The chunks of ``needed`` (content address -> first rank share and record, as
    :meth:`~ckptd.promotion.contents.StepContents.unique_chunks` gives) that must be uploaded to
    ``remote``: missing, of another size, recorded bad, or failing the checksum check against the intact
    copy on ``local``. Raises IntegrityError when the local copy of a checked chunk is itself corrupt,
    CommitError when the object tier holds a chunk intact in another encoding (see the module docstring).
    ``bad``: the paths recorded bad, when the caller listed them (:func:`bad_chunk_paths`; else listed here);
    the paths this check records bad are added to it, so that :func:`mark_uploaded` clears them too."""
    global last_check
    listed, looked_up = _find_stored(remote, [remote.chunk_path(key) for key in needed])
    bad = bad_chunk_paths(remote) if bad is None else bad
    upload: list[tuple[RankShare, ChunkRecord]] = []
    to_check: list[tuple[RankShare, ChunkRecord, tuple[str, str, int, str]]] = []
    missing = recorded_bad = remembered = 0
    for key, (share, chunk) in needed.items():
        path = remote.chunk_path(key)
        size, tag = listed.get(path, (None, ""))
        if size != chunk.length:
            if size is not None:
                _refuse_if_other_encoding(remote, path, share, chunk, size)
            missing += 1
            upload.append((share, chunk))
        elif path in bad:
            recorded_bad += 1
            upload.append((share, chunk))
        else:
            memo = (remote.url, path, size, tag)
            with _memo_lock:
                known = memo in _verified
            if known:
                remembered += 1
            else:
                to_check.append((share, chunk, memo))
    by_checksum = by_reading = mismatched = local_bytes = 0
    if to_check:
        verdicts = _in_parallel(lambda item: _verdict(remote, local, item[0], item[1], looked_up.get(item[2][1])),
                                to_check)
        for (share, chunk, memo), (intact, how, read) in zip(to_check, verdicts):
            local_bytes += read
            if how == "checksum":
                by_checksum += 1
            else:
                by_reading += 1
            if intact:
                if memo[3]:  # without an ETag a same-size replacement could not be told apart: check every time
                    with _memo_lock:
                        _verified.add(memo)
                continue
            mismatched += 1
            upload.append((share, chunk))
            report_bad_chunk(remote, memo[1], step=share.index.step,
                             reason=f"dedup: the stored object differs from the intact local copy ({how})")
            bad.add(memo[1])
    last_check = DedupCheck(needed=len(needed), missing=missing, recorded_bad=recorded_bad, remembered=remembered,
                            checked_by_checksum=by_checksum, checked_by_reading=by_reading, mismatched=mismatched,
                            local_bytes_read=local_bytes)
    if recorded_bad or mismatched:
        log.warning("promotion to %s uploads %d chunk(s) again that the object tier holds but cannot vouch for "
                    "(%d recorded bad, %d failing the checksum check)", remote.label, recorded_bad + mismatched,
                    recorded_bad, mismatched)
    return upload


def mark_uploaded(remote: ObjectTier, keys: Iterable[str], *, recorded_bad: set[str] | None = None) -> None:
    """After chunks (content addresses ``keys``) were uploaded again from intact copies: clear their bad
    records, so later promotions and restores trust them. One DELETE per cleared record, and one LIST
    unless ``recorded_bad`` gives the records the dedup decision saw (none when nothing was uploaded). A
    record made after that decision stays: the next promotion uploads that chunk once more."""
    keys = list(keys)
    if not keys:
        return
    with _memo_lock:
        if remote.url in _store_sizes:
            _store_sizes[remote.url] += len(keys)
    bad = bad_chunk_paths(remote) if recorded_bad is None else recorded_bad
    for key in keys:
        path = remote.chunk_path(key)
        if path in bad:
            clear_bad_chunk(remote, path)


__all__ = ["LOOKUPS_ABOVE", "DedupCheck", "chunks_to_upload", "forget_verified", "last_check", "mark_uploaded",
           "note_store_size", "stored_sizes"]
