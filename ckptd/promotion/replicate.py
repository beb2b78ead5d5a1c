"""Replication: a verified copy of a committed local step to a tier laid out like a local tier (a buddy
node's daemon through :class:`~ckptd.tiers.peer.PeerTier`, or another directory).

Order of work for one step (the same on every retry, so a crash at any point is resumed by running it
again):

1. read the step's manifest and the indexes of the ranks the directory holds (each checked against the
   manifest, :func:`ckptd.promotion.contents.read_step_contents`);
2. if the target already has the step committed: the same manifest bytes -> done, nothing is sent; any
   other manifest -> :class:`~ckptd.errors.CommitError`;
3. delete files an earlier, failed attempt left in the target's uncommitted step directory that this
   step does not have;
4. send every data file. A pack is read whole and each chunk in it checked before it is sent
   (:func:`~ckptd.promotion.contents.read_verified_pack`). Any other data file is streamed chunk by
   chunk: each chunk is read, decoded, hashed and compared with the index
   (:func:`~ckptd.promotion.contents.read_stored_chunk`) just before its bytes go out, and the bytes
   between chunks (alignment padding) are sent as zeros, so nothing unverified is copied and a large
   file is never in memory whole. A chunk that fails its check stops that file's transfer midway (the
   target never stores a partial file), and the step is not committed;
5. any other file of the step directory, then the rank indexes (the exact bytes the manifest vouches for);
6. commit through :func:`ckptd.tiers.atomicity.step_commit` of the target: the list of ranks held when
   the directory holds only some, and ``manifest.json`` last.

A failure before the commit discards what was sent (:meth:`~ckptd.tiers.atomicity.StepCommit.discard`,
which never touches a committed step). The local tier may be the pinned copy
(``PinnedSteps(local).tier``) when the step's own directory is gone.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ckptd._types import Buffer
from ckptd.background import TaskPool, run_jobs
from ckptd.config import settings
from ckptd.errors import AlreadyCommittedError, CommitError, NotFoundError
from ckptd.format.layout import MANIFEST_NAME, RANKS_HERE_NAME, step_file
from ckptd.promotion.contents import RankShare, read_step_contents, read_stored_chunk, read_verified_pack
from ckptd.stepio.step_reader import load_step_manifest
from ckptd.tiers.atomicity import ranks_held, step_commit
from ckptd.tiers.base import StorageTier

log = logging.getLogger("ckptd.replicate")

#: Called with the number of bytes just sent (from the replication's worker threads).
ProgressHook = Callable[[int], None]
#: Pieces of one file's body, made again when a write is retried.
_Pieces = Callable[[], Iterable[Buffer]]
_ZEROS = memoryview(bytes(1024 * 1024))


@dataclass(frozen=True)
class ReplicationReport:
    """What one replication did: ``files`` and ``bytes_sent`` count what was written to the target
    (nothing when ``already_committed``)."""

    step: int
    tier: str
    files: int
    bytes_sent: int
    already_committed: bool
    seconds: float


def _zeros(count: int) -> Iterator[memoryview]:
    while count > 0:
        piece = _ZEROS[:min(count, len(_ZEROS))]
        count -= len(piece)
        yield piece


def _verified_data_file(local: StorageTier, share: RankShare, number: int) -> Iterator[Buffer]:
    """The bytes of a (not packed) data file, chunk by chunk, each checked before it is handed out (the
    next chunk is read and checked on a thread while this one is sent); the bytes no chunk covers come
    out as zeros."""
    data_file = share.index.data_files[number]
    chunks = share.index.packed_chunks(number)  # distinct chunks of file ``number``, by offset
    position = 0
    with TaskPool("ckptd-replicate-read", 1) as reader:
        ahead = reader.submit(read_stored_chunk, local, share, chunks[0]) if chunks else None
        for following, chunk in enumerate(chunks, start=1):
            assert ahead is not None
            stored = ahead.result()  # raises IntegrityError before any of the chunk's bytes is sent
            ahead = reader.submit(read_stored_chunk, local, share, chunks[following]) \
                if following < len(chunks) else None
            yield from _zeros(chunk.offset - position)
            yield stored
            position = chunk.offset + chunk.length
    yield from _zeros(data_file.size - position)


def _write(target: StorageTier, path: str, size: int, pieces: _Pieces) -> None:
    """Write one file of ``size`` bytes to the target, streamed where the target can take a stream (a
    directory's temporary file, or the tier's :meth:`~ckptd.tiers.base.StorageTier.write_stream`)."""
    if target.capabilities.node_local:
        handle = target.open_file(path)  # type: ignore[attr-defined]
        try:
            for piece in pieces():
                handle.write(piece)
        except BaseException:
            handle.abort()
            raise
        handle.commit()
    else:
        target.write_stream(path, size, pieces)


class _Sender:
    """Sends files of one step to the target, counting them and reporting progress."""

    def __init__(self, target: StorageTier, progress: ProgressHook | None) -> None:
        self.target, self.progress = target, progress
        self.sent: list[str] = []
        self.bytes_sent = 0
        self._lock = threading.Lock()

    def send(self, path: str, size: int, pieces: _Pieces) -> None:
        reported = 0  # bytes of this file already reported: a retried write sends them again

        def counted() -> Iterator[Buffer]:
            nonlocal reported
            position = 0
            for piece in pieces():
                yield piece
                position += len(memoryview(piece).cast("B"))
                if self.progress is not None and position > reported:
                    self.progress(position - reported)
                    reported = position

        with self._lock:  # before the write: a failed write may have left something to discard
            self.sent.append(path)
        _write(self.target, path, size, counted)
        with self._lock:
            self.bytes_sent += size


def _data_jobs(local: StorageTier, share: RankShare, sender: _Sender) -> list[Callable[[], None]]:
    jobs: list[Callable[[], None]] = []
    for number, data_file in enumerate(share.index.data_files):
        path = step_file(share.index.step, data_file.name)
        if data_file.packed:
            def send_pack(share: RankShare = share, number: int = number, path: str = path) -> None:
                data = read_verified_pack(local, share, number)
                sender.send(path, len(data), lambda: [data])
            jobs.append(send_pack)
        else:
            pieces = functools.partial(_verified_data_file, local, share, number)
            jobs.append(functools.partial(sender.send, path, data_file.size, pieces))
    return jobs


def _committed_manifest(target: StorageTier, step: int) -> bytes | None:
    try:
        return target.read_bytes(step_file(step, MANIFEST_NAME))
    except NotFoundError:
        return None


def _refuse_different(target: StorageTier, step: int) -> CommitError:
    return CommitError("the target already holds a different step with this number", step=step, tier=target.label,
                       path=step_file(step, MANIFEST_NAME),
                       hint="delete it there, or replicate into another namespace")


def replicate_step(local: StorageTier, target: StorageTier, step: int, *,
                   progress: ProgressHook | None = None) -> ReplicationReport:
    """Copy one committed step from ``local`` to ``target`` (see the module docstring for the order and
    the checks); returns what was sent. Raises NotFoundError when the step is not committed on ``local``,
    IntegrityError when a local chunk or index is corrupt (nothing is committed on the target),
    CommitError when the target holds a different step with this number, StorageError (and its
    TierUnreachableError) when the target fails. ``progress`` is called from worker threads."""
    started = time.monotonic()
    manifest = load_step_manifest(local, step)
    held = ranks_held(local, step, manifest)
    contents = read_step_contents(local, step, list(held))
    existing = _committed_manifest(target, step)
    if existing is not None:
        if existing != contents.manifest_bytes:
            raise _refuse_different(target, step)
        return ReplicationReport(step, target.label, 0, 0, True, time.monotonic() - started)
    commit = step_commit(target)
    sender = _Sender(target, progress)
    try:
        names = _replicate_files(local, target, contents.step, contents.shares, sender)
        commit.check_writable(step)
        stale = [step_file(step, name) for name in target.list_files(step) if name not in names]
        if stale:  # left by an earlier attempt at a different copy of this step
            target.delete_files(stale)
        commit.commit(step, contents.manifest_bytes,
                      ranks_here=held if len(held) < manifest.world_size else None)
    except AlreadyCommittedError:
        if _committed_manifest(target, step) != contents.manifest_bytes:
            raise _refuse_different(target, step) from None
        return ReplicationReport(step, target.label, len(sender.sent), sender.bytes_sent, True,
                                 time.monotonic() - started)
    except BaseException:
        commit.discard(step, [path.rpartition("/")[2] for path in sender.sent])
        raise
    report = ReplicationReport(step, target.label, len(sender.sent) + 1, sender.bytes_sent + len(contents.manifest_bytes),
                               False, time.monotonic() - started)
    log.info("replicated step %d to %s: %d files, %d bytes in %.2fs", step, target.label, report.files,
             report.bytes_sent, report.seconds)
    return report


def _replicate_files(local: StorageTier, target: StorageTier, step: int, shares: tuple[RankShare, ...],
                     sender: _Sender) -> set[str]:
    """Send the data files, other files and indexes of the step; returns every name the step has on the
    target once committed."""
    data_names = {data_file.name for share in shares for data_file in share.index.data_files}
    index_names = {share.index_name for share in shares}
    names = data_names | index_names | {MANIFEST_NAME, RANKS_HERE_NAME}
    run_jobs([job for share in shares for job in _data_jobs(local, share, sender)], threads=settings().io_threads,
             thread_name_prefix="ckptd-replicate")
    for name in local.list_files(step):
        if name not in names:
            data = local.read_bytes(step_file(step, name))
            sender.send(step_file(step, name), len(data), lambda data=data: [data])  # type: ignore[misc]
            names.add(name)
    for share in shares:
        sender.send(step_file(step, share.index_name), len(share.index_bytes),
                    lambda share=share: [share.index_bytes])  # type: ignore[misc]
    return names


__all__ = ["ProgressHook", "ReplicationReport", "replicate_step"]
