"""Reading a committed step back, verifying every byte.

:func:`load_step_manifest` and :func:`load_rank_index` parse and check the metadata (sizes and digests
recorded one level up). :class:`StepReader` reads one rank's tensors; every chunk is hashed after
decoding and compared with its record. A chunk that is missing or bad on the first tier is read from the
next tier that holds the same step (chunk by chunk, not the whole step), and each such event is logged
with file, chunk and tier and kept in :attr:`StepReader.events`. On a tier that stores chunks by digest,
chunks in a pack are read through the source's :class:`~ckptd.stepio.packs.PackReads` (a few coalesced
ranged reads per pack), the others as their own objects.

The chunks of a tensor are read and verified in parallel on the ``ckptd-read`` pool (``preadv``, xxhash
and zstd release the GIL); :meth:`StepReader.read_tensor` must therefore not be called from that pool.
A restore defers its reads (into live tensors, and into tensors the reader allocates for values the
live state lacks), so that the chunks of all its tensors are in flight together, and calls
:meth:`StepReader.settle` before the values are used.

Targets are often memory that was never written (``torch.empty_like``, an optimizer's state at job
start, tensors the reader allocates): each reader thread pre-faults the pages of its chunk's target
(:func:`~ckptd.tiers.direct_io.prefault`) just before reading it, so that the page faults run on the
reader threads in parallel and without a trap per page, instead of inside the copy out of the
direct-I/O bounce buffer.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptd._types import Buffer
from ckptd.errors import CkptdError, IntegrityError, NotFoundError
from ckptd.format import codecs
from ckptd.format.hashing import chunk_digest
from ckptd.format.layout import MANIFEST_NAME, RANKS_HERE_NAME, step_file
from ckptd.format.verify import check_chunk_digest, decode_verified
from ckptd.format.records import ChunkRecord, Manifest, RankIndex, TensorRecord
from ckptd.stepio.packs import PackReads, chunk_location, read_by_digest
from ckptd.stepio.rank_writer import io_pool, tensor_bytes
from ckptd.tiers.atomicity import ranks_held
from ckptd.tiers.base import StorageTier
from ckptd.tiers.chunk_health import report_bad_chunk
from ckptd.tiers.direct_io import address, aligned_empty, prefault

if TYPE_CHECKING:  # torch loads with the first tensor read: listings and verification need none
    import torch

log = logging.getLogger("ckptd.restore")

#: Largest manifest or index a reader loads into memory.
MAX_METADATA_BYTES = 512 * 1024 * 1024
#: Chunk targets from this size on are pre-faulted before their read (smaller ones span few pages).
_PREFAULT_MIN_BYTES = 256 * 1024


def _read_metadata(tier: StorageTier, path: str, step: int) -> bytes:
    """The bytes of a manifest or index: one read of at most one byte past the limit (no size lookup
    first: on the object tier that was a HEAD before every GET)."""
    raw = tier.read_bytes(path, 0, MAX_METADATA_BYTES + 1)
    if len(raw) > MAX_METADATA_BYTES:
        raise IntegrityError("metadata file is implausibly large", path=path, step=step, tier=tier.label,
                             expected=f"<= {MAX_METADATA_BYTES}", actual=f"> {MAX_METADATA_BYTES}")
    return raw


def load_step_manifest(tier: StorageTier, step: int) -> Manifest:
    """The parsed, digest-checked manifest of a step on a tier."""
    path = step_file(step, MANIFEST_NAME)
    try:
        raw = _read_metadata(tier, path, step)
    except NotFoundError as exc:
        raise NotFoundError("step is not committed (no manifest)", path=path, step=step,
                            tier=tier.label) from exc
    return Manifest.from_json_bytes(raw, path=path, step=step, tier=tier.label)


def load_rank_index(tier: StorageTier, manifest: Manifest, rank: int) -> RankIndex:
    """The parsed index of one rank, checked against the manifest (size, digest, data file size)."""
    entry = manifest.entry(rank)
    path = step_file(manifest.step, entry.index_file)
    raw = _read_metadata(tier, path, manifest.step)
    if not entry.matches_index(raw):
        raise IntegrityError("rank index does not match the manifest", path=path, step=manifest.step,
                             tier=tier.label, expected=entry.index_digest, actual=chunk_digest(raw),
                             hint="the index is corrupt; restore another tier or an older step")
    index = RankIndex.from_json_bytes(raw, path=path, step=manifest.step, tier=tier.label)
    if index.step != manifest.step or index.rank != rank or index.data_files != entry.data_files:
        raise IntegrityError("rank index disagrees with the manifest on step, rank or data files", path=path,
                             step=manifest.step, tier=tier.label)
    if not tier.stores_chunks_by_digest:
        for data_file in index.data_files:
            data_path = step_file(manifest.step, data_file.name)
            actual = tier.size(data_path)
            if actual != data_file.size:
                raise IntegrityError("data file size differs from the index", path=data_path, step=manifest.step,
                                     tier=tier.label, expected=str(data_file.size), actual=str(actual))
    return index


@dataclass(frozen=True)
class ChunkSource:
    """One tier's copy of a rank's share of a step, and the reads of its packs in progress."""

    tier: StorageTier
    index: RankIndex
    packs: PackReads = field(default_factory=PackReads, compare=False, repr=False)


@dataclass(frozen=True)
class FallbackEvent:
    """A chunk that could not be read from one tier and was read from the next."""

    step: int
    tensor: str
    chunk: str
    tier: str
    error: str


def read_chunk(source: ChunkSource, chunk: ChunkRecord, out: memoryview, *, tensor: str = "?") -> None:
    """Read one chunk from one tier into ``out`` (exactly ``chunk.raw_length`` bytes) and verify it
    (:mod:`ckptd.format.verify`, the check promotion and pull use too). A chunk that fails its check on
    a tier that stores chunks by digest is recorded there as bad (its object or its pack, see
    :func:`~ckptd.tiers.chunk_health.report_bad_chunk`) before the IntegrityError is raised."""
    tier, index = source.tier, source.index
    path = chunk_location(tier, index, chunk)
    stored: Buffer | None
    by_digest = read_by_digest(tier, index, chunk)
    if by_digest and chunk.codec == codecs.RAW:
        tier.read_whole_into(path, out)  # its digest is its name: the whole object is the chunk
        stored = None
    elif by_digest:
        stored = tier.read_bytes(path)
    elif tier.stores_chunks_by_digest:  # in a pack, stored whole in the step directory
        stored = source.packs.stored_bytes(tier, index, chunk)
    else:
        if chunk.codec == codecs.RAW:
            tier.read_into(path, chunk.offset, out)
            stored = None
        else:
            stored = tier.read_bytes(path, chunk.offset, chunk.length)
    try:
        if stored is None:
            check_chunk_digest(chunk, out, path=path, step=index.step, tier=tier.label, tensor=tensor)
        else:
            out[:] = memoryview(decode_verified(chunk, stored, path=path, step=index.step, tier=tier.label,
                                                tensor=tensor)).cast("B")
    except IntegrityError as error:
        report_bad_chunk(tier, path, step=index.step, reason=str(error))  # promotion uploads it again
        raise


class _DisjointSpans:
    """Byte ranges of memory, none overlapping another, kept sorted: overlap tests in O(log n)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def overlaps(self, start: int, end: int) -> bool:
        at = bisect.bisect_right(self.starts, start)
        return (at > 0 and self.ends[at - 1] > start) or (at < len(self.starts) and self.starts[at] < end)

    def add(self, start: int, end: int) -> None:
        if end > start:
            at = bisect.bisect_right(self.starts, start)
            self.starts.insert(at, start)
            self.ends.insert(at, end)

    def clear(self) -> None:
        self.starts, self.ends = [], []


class StepReader:
    """Reads one rank's tensors of one committed step, trying tiers nearest first for each chunk."""

    def __init__(self, sources: list[ChunkSource]) -> None:
        if not sources:
            raise ValueError("StepReader needs at least one source")
        self.sources = sources
        self.events: list[FallbackEvent] = []
        self._pending: list[Future[None]] = []
        self._pending_memory = _DisjointSpans()
        # reads from a tier over the network wait on it, not on a core: more of them are kept in flight
        self._purpose = "read" if sources[0].tier.capabilities.node_local else "remote-read"

    @property
    def index(self) -> RankIndex:
        return self.sources[0].index

    def record(self, name: str) -> TensorRecord:
        try:
            return self.index.tensors[name]
        except KeyError:
            raise NotFoundError(f"tensor {name!r} is not in the checkpoint", step=self.index.step) from None

    def read_tensor(self, name: str, out: torch.Tensor | None = None, *, defer: bool = False) -> torch.Tensor:
        """Read a saved tensor, into ``out`` when given (it must have the saved shape).

        With ``defer``, a read straight into ``out`` (a contiguous CPU tensor of the saved dtype), or
        into a tensor the reader allocates when ``out`` is None, only starts: the target is returned at
        once and holds the saved values after :meth:`settle`. Restores use this to keep every chunk of
        every tensor in flight instead of waiting tensor by tensor."""
        record = self.record(name)
        if out is not None and tuple(out.shape) != record.shape:
            from ckptd.errors import ResumeMismatchError

            raise ResumeMismatchError(
                f"tensor {name!r} was saved with shape {list(record.shape)} but the live tensor has shape "
                f"{list(out.shape)}", step=self.index.step, hint="restore into a model of the saved shape")
        direct = out is None or (out.device.type == "cpu" and out.is_contiguous()
                                 and out.dtype == record.torch_dtype and not out.requires_grad)
        target = out if direct and out is not None else aligned_empty(record.shape, record.torch_dtype)
        view = tensor_bytes(target)
        pieces, position = [], 0
        for chunk in record.chunks:
            pieces.append((chunk, view[position:position + chunk.raw_length]))
            position += chunk.raw_length
        if defer and direct:
            start = target.data_ptr()
            end = start + target.numel() * target.element_size()
            if not self._pending_memory.overlaps(start, end):
                self._pending.extend(io_pool(self._purpose).submit(self._read_chunk, name, chunk, piece)
                                     for chunk, piece in pieces)
                self._pending_memory.add(start, end)
                return target
            # memory that a pending read fills too (tied weights): two reads hashing the same bytes
            # while both write them could fail a healthy chunk, so the earlier reads finish first
            self.settle()
        if len(pieces) <= 1:
            for chunk, piece in pieces:
                self._read_chunk(name, chunk, piece)
        else:
            _finish([io_pool(self._purpose).submit(self._read_chunk, name, chunk, piece) for chunk, piece in pieces])
        if out is not None and not direct:
            import torch

            with torch.no_grad():
                out.copy_(target)
            return out
        return target

    def settle(self, *, raise_errors: bool = True) -> None:
        """Wait until every deferred read has stopped; then raise the first failure, if any and asked."""
        settle_all([self], raise_errors=raise_errors)

    def _read_chunk(self, name: str, chunk: ChunkRecord, out: memoryview) -> None:
        if len(out) >= _PREFAULT_MIN_BYTES:
            prefault(address(out), len(out))
        first_error: CkptdError | None = None
        for source in self.sources:
            try:
                read_chunk(source, chunk, out, tensor=name)
                return
            except (IntegrityError, NotFoundError) as error:
                first_error = first_error or error
                event = FallbackEvent(step=source.index.step, tensor=name, chunk=chunk.digest,
                                      tier=source.tier.label, error=str(error))
                self.events.append(event)
                log.warning("bad or missing chunk, trying the next tier: %s", error)
        assert first_error is not None
        raise first_error


def settle_all(readers: Iterable[StepReader], *, raise_errors: bool = True) -> None:
    """:meth:`StepReader.settle` for several readers at once: no read of any of them is still running
    when the first failure is raised."""
    readers = list(readers)
    try:
        _finish([future for reader in readers for future in reader._pending], raise_errors=raise_errors)
    finally:
        for reader in readers:
            reader._pending = []
            reader._pending_memory.clear()


def _finish(futures: list[Future[None]], *, raise_errors: bool = True) -> None:
    """Return once every read has stopped, then raise the first failure if asked. After a failure, or
    when failures are not wanted, reads that have not started are cancelled.

    Every read must have stopped before any exception propagates, an interrupt included: the caller
    may fall back to another step, and a read still running would write this one's bytes into live
    tensors."""
    try:
        if raise_errors:
            wait(futures, return_when=FIRST_EXCEPTION)
        _stop(futures)
    except BaseException:
        _stop(futures)
        raise
    if raise_errors:
        for future in futures:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                raise error


def _stop(futures: list[Future[None]]) -> None:
    for future in futures:
        future.cancel()
    wait(futures)


@dataclass(frozen=True)
class VerifyProblem:
    """One thing `verify` found wrong. ``chunk``: the record of the chunk that failed (None when the
    problem is the step's metadata), which a repair of a tier that keeps data files needs."""

    step: int
    rank: int | None
    path: str
    error: str
    chunk: ChunkRecord | None = None


def verify_step(tier: StorageTier, step: int, progress: Callable[[int], None] | None = None, *,
                checked: set[str] | None = None,
                should_stop: Callable[[], bool] | None = None) -> Iterator[VerifyProblem]:
    """Re-hash every chunk of every rank a step holds on one tier (:func:`~ckptd.tiers.atomicity.
    ranks_held`), yielding each problem found. ``progress`` is called with each chunk's raw length after
    the chunk was read (a caller may pace the reads there). ``should_stop`` is asked after each chunk:
    when it answers True the verification ends there (the step is then only partly verified; the caller
    knows, since it answered). ``checked``: paths of content-addressed chunk objects the caller already
    read (a scrub over many steps sharing chunks): they are skipped, and every such object read here is
    added."""
    try:
        manifest = load_step_manifest(tier, step)
    except CkptdError as error:
        yield VerifyProblem(step, None, error.path or step_file(step, MANIFEST_NAME), str(error))
        return
    try:
        held = ranks_held(tier, step, manifest)
    except CkptdError as error:
        yield VerifyProblem(step, None, error.path or step_file(step, RANKS_HERE_NAME), str(error))
        return
    indexes: dict[int, RankIndex] = {}
    for entry in manifest.ranks:
        if entry.rank not in held:  # a node-local directory holds its node's ranks only
            continue
        try:
            index = indexes[entry.rank] = load_rank_index(tier, manifest, entry.rank)
        except CkptdError as error:
            yield VerifyProblem(step, entry.rank, error.path or entry.index_file, str(error))
            continue
        source = ChunkSource(tier, index)
        for name, record in index.tensors.items():
            for chunk in record.chunks:
                if checked is not None and read_by_digest(tier, index, chunk):
                    if tier.chunk_path(chunk.object_key) in checked:
                        continue
                    checked.add(tier.chunk_path(chunk.object_key))
                buffer = memoryview(bytearray(chunk.raw_length))
                try:
                    read_chunk(source, chunk, buffer, tensor=name)
                except CkptdError as error:
                    yield VerifyProblem(step, entry.rank, error.path or index.data_file(chunk), str(error),
                                        chunk=chunk)
                if progress is not None:
                    progress(chunk.raw_length)
                if should_stop is not None and should_stop():
                    return
    yield from _unwritten_replicas(manifest, indexes)


def _unwritten_replicas(manifest: Manifest, indexes: dict[int, RankIndex]) -> Iterator[VerifyProblem]:
    """A problem for each piece a rank left to a writer (replicas written once) whose index, read here,
    does not hold it: that rank could not restore it. A writer not held on this tier is not checked."""
    for entry in manifest.ranks:
        for name, writer in sorted(entry.replicas.items()):
            if writer in indexes and name not in indexes[writer].tensors:
                yield VerifyProblem(manifest.step, entry.rank, manifest.entry(writer).index_file,
                                    f"tensor {name!r} of rank {entry.rank} is a replica that rank {writer} wrote, "
                                    f"but rank {writer}'s index does not hold it: rank {entry.rank} cannot restore it")
