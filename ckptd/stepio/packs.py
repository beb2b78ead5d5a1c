"""Where a chunk's stored bytes live on a tier, and reading packed chunks with few requests.

A rank's small chunks lie back to back in its pack, a data file the index marks as packed (format 3). On
a tier that stores chunks by digest the pack is one object in the step directory, while every other
chunk is its own object under ``chunks/`` (:func:`chunk_location` says which). Reading each packed chunk
with its own ranged GET would cost one request per chunk; :class:`PackReads` instead plans a few
coalesced ranges per pack (:func:`plan_ranges`: each at most ``s3_part_bytes``, which the object tier
fetches with one GET, split only between chunks; the whole object in one read when it fits, which a
read-ahead hint can serve), fetches a range when one of its chunks is first asked for, and serves the
range's other chunks from memory. A range is dropped once each of its chunks has been read as often as
the index references it, so a restore holds only the ranges still being read. A range whose fetch fails
is remembered: its chunks fail at once with that error (and the reader falls back to another tier).

Bytes handed out here are not verified: callers check every chunk (:mod:`ckptd.format.verify`).

Thread safety: any thread may call :meth:`PackReads.stored_bytes`. The first caller for a range
fetches it and later callers wait for that fetch, which is already running, so a pool thread that
waits can never wait for a task still queued on its own pool.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

from ckptd.config import settings
from ckptd.format.layout import step_file
from ckptd.format.records import ChunkRecord, RankIndex
from ckptd.tiers.base import StorageTier

#: Smallest range a pack is cut into (a smaller ``s3_part_bytes`` is raised to it).
MIN_RANGE_BYTES = 1024 * 1024


def read_by_digest(tier: StorageTier, index: RankIndex, chunk: ChunkRecord) -> bool:
    """Whether ``chunk`` is its own content-addressed object on ``tier`` (not in a pack, not on a tier
    that keeps data files)."""
    return tier.stores_chunks_by_digest and not index.in_pack(chunk)


def chunk_location(tier: StorageTier, index: RankIndex, chunk: ChunkRecord) -> str:
    """Path of the object or file on ``tier`` that holds ``chunk``'s stored bytes: its content address,
    or its data file (a pack, or any data file on a tier that keeps them) in the step directory."""
    if read_by_digest(tier, index, chunk):
        return tier.chunk_path(chunk.object_key)
    return step_file(index.step, index.data_file(chunk))


def max_range_bytes() -> int:
    """Largest range of a pack fetched by one request."""
    return max(MIN_RANGE_BYTES, settings().s3_part_bytes)


def plan_ranges(chunks: list[ChunkRecord], limit: int) -> list[tuple[int, int]]:
    """Coalesced ``(start, end)`` byte ranges that cover ``chunks`` (of one file), ascending.

    Neighbouring chunks share a range while it stays within ``limit`` bytes; a range is cut only
    between chunks, so a chunk larger than ``limit`` gets a range of its own. Gaps between chunks are
    read with them (a pack has none; skipping a few bytes costs less than a request)."""
    ranges: list[tuple[int, int]] = []
    for chunk in sorted(chunks, key=lambda c: c.offset):
        start, end = chunk.offset, chunk.offset + chunk.length
        if ranges and end - ranges[-1][0] <= limit:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], end))
        else:
            ranges.append((start, end))
    return ranges


def whole_object(ranges: list[tuple[int, int]], size: int) -> bool:
    """Whether a pack of ``size`` bytes is read in one request of the whole object."""
    return len(ranges) == 1 and ranges[0] == (0, size)


@dataclass
class _Range:
    start: int
    end: int
    reads_left: int
    data: bytes | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    fetching: bool = False


@dataclass
class _Pack:
    path: str
    size: int
    ranges: list[_Range]
    starts: list[int]
    references: Counter[tuple[int, int]]


class PackReads:
    """Coalesced reads of one rank's packs on one tier (one instance per rank share being read)."""

    def __init__(self, *, limit: int | None = None) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._packs: dict[tuple[str, int], _Pack] = {}
        #: Requests sent (ranges fetched), for tests and benchmarks.
        self.requests = 0

    def stored_bytes(self, tier: StorageTier, index: RankIndex, chunk: ChunkRecord) -> memoryview:
        """The stored bytes of a packed chunk (``chunk.length`` of them unless the object is short);
        raises the fetch's error (NotFoundError, StorageError) when its range cannot be read."""
        pack = self._pack(tier, index, chunk.file)
        at = bisect.bisect_right(pack.starts, chunk.offset) - 1
        piece = pack.ranges[at]
        data = self._fetched(tier, pack, piece)
        start = chunk.offset - piece.start
        view = memoryview(data)[start:start + chunk.length]
        with self._lock:
            piece.reads_left -= 1
            if piece.reads_left <= 0:  # every reference read: a later read of it fetches again
                piece.data, piece.done, piece.reads_left = None, threading.Event(), self._reads_of(pack, piece)
        return view

    def _pack(self, tier: StorageTier, index: RankIndex, number: int) -> _Pack:
        key = (tier.url, number)
        with self._lock:
            pack = self._packs.get(key)
            if pack is None:
                chunks = index.packed_chunks(number)
                references = Counter((c.offset, c.length) for c in index.chunks if c.file == number)
                ranges = plan_ranges(chunks, self._limit or max_range_bytes())
                pieces = [_Range(start, end, 0) for start, end in ranges]
                pack = _Pack(path=step_file(index.step, index.data_files[number].name),
                             size=index.data_files[number].size, ranges=pieces,
                             starts=[start for start, _ in ranges], references=references)
                for piece in pieces:
                    piece.reads_left = self._reads_of(pack, piece)
                self._packs[key] = pack
            return pack

    @staticmethod
    def _reads_of(pack: _Pack, piece: _Range) -> int:
        return sum(count for (offset, _), count in pack.references.items() if piece.start <= offset < piece.end)

    def _fetched(self, tier: StorageTier, pack: _Pack, piece: _Range) -> bytes:
        with self._lock:
            done = piece.done
            fetch = not piece.fetching and not done.is_set()
            if fetch:
                piece.fetching = True
        if fetch:
            try:
                if whole_object([(r.start, r.end) for r in pack.ranges], pack.size):
                    data = tier.read_bytes(pack.path)  # a read-ahead hint may already be fetching it
                else:
                    data = tier.read_bytes(pack.path, piece.start, piece.end - piece.start)
                with self._lock:
                    self.requests += 1
                    piece.data, piece.error = data, None
            except Exception as error:  # remembered; an interrupt is not, and a waiter then fetches itself
                with self._lock:
                    piece.error = error
                raise
            finally:
                with self._lock:
                    piece.fetching = False
                    if piece.data is None and piece.error is None:  # interrupted: the next read fetches
                        piece.done = threading.Event()
                done.set()
            return data
        done.wait()
        with self._lock:
            data, error = piece.data, piece.error
        if error is not None:
            raise error
        if data is None:  # dropped by the last of its reads, or its fetch interrupted: fetch it again
            return self._fetched(tier, pack, piece)
        return data
