"""What a committed step holds, read from one tier and checked: the manifest, the rank indexes, the
unique content-addressed chunks they reference and their packs, plus the check every copied chunk and
pack passes."""

from __future__ import annotations

from dataclasses import dataclass

from ckptd._types import Buffer
from ckptd.errors import IntegrityError
from ckptd.format.hashing import chunk_digest
from ckptd.format.verify import decode_verified
from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.format.records import ChunkRecord, DataFile, Manifest, RankIndex
from ckptd.stepio.packs import chunk_location, read_by_digest
from ckptd.stepio.step_reader import load_step_manifest, load_rank_index
from ckptd.tiers.base import StorageTier


@dataclass(frozen=True)
class RankShare:
    """One rank's part of a step: its parsed index and the exact index bytes the manifest vouches for."""

    rank: int
    index_name: str
    index_bytes: bytes
    index: RankIndex


@dataclass(frozen=True)
class StepContents:
    """A committed step as stored on one tier (all ranks, or the ranks asked for)."""

    step: int
    manifest_bytes: bytes
    manifest: Manifest
    shares: tuple[RankShare, ...]

    def unique_chunks(self) -> dict[str, tuple[RankShare, ChunkRecord]]:
        """Each content address once, with the first rank and record that reference it: the chunks a
        tier that stores chunks by digest keeps as their own objects (chunks in packs are not among
        them, see :meth:`packs`)."""
        found: dict[str, tuple[RankShare, ChunkRecord]] = {}
        for share in self.shares:
            for chunk in share.index.chunks:
                if not share.index.in_pack(chunk):
                    found.setdefault(chunk.object_key, (share, chunk))
        return found

    def packs(self) -> list[tuple[RankShare, int]]:
        """(rank share, data file number) of every pack that holds bytes; a tier that stores chunks by
        digest keeps each whole in the step directory."""
        return [(share, number) for share in self.shares
                for number, data_file in enumerate(share.index.data_files) if data_file.packed and data_file.size]


def read_step_contents(tier: StorageTier, step: int, ranks: list[int] | None = None) -> StepContents:
    """Read and check a committed step's metadata on ``tier`` (raises NotFoundError when uncommitted)."""
    manifest = load_step_manifest(tier, step)
    manifest_bytes = tier.read_bytes(step_file(step, MANIFEST_NAME))
    if Manifest.from_json_bytes(manifest_bytes, path=step_file(step, MANIFEST_NAME), step=step,
                                tier=tier.label).ranks != manifest.ranks:
        raise IntegrityError("manifest changed while it was read", path=step_file(step, MANIFEST_NAME), step=step,
                             tier=tier.label, hint="another writer replaced the step; try again")
    wanted = [entry.rank for entry in manifest.ranks] if ranks is None else sorted(set(ranks))
    shares = []
    for rank in wanted:
        entry = manifest.entry(rank)
        index = load_rank_index(tier, manifest, rank)
        raw = tier.read_bytes(step_file(step, entry.index_file))
        if not entry.matches_index(raw):
            raise IntegrityError("rank index changed while it was read", path=step_file(step, entry.index_file),
                                 step=step, tier=tier.label, expected=entry.index_digest, actual=chunk_digest(raw))
        shares.append(RankShare(rank=rank, index_name=entry.index_file, index_bytes=raw, index=index))
    return StepContents(step=step, manifest_bytes=manifest_bytes, manifest=manifest, shares=tuple(shares))


def check_stored_chunk(stored: Buffer, chunk: ChunkRecord, *, path: str, step: int, tier: str) -> None:
    """Decode the stored bytes of a chunk exactly as a reader would and compare their digest with the
    record (:func:`ckptd.format.verify.decode_verified`). Raises IntegrityError naming the file, step,
    tier and chunk."""
    decode_verified(chunk, stored, path=path, step=step, tier=tier)


def stored_chunk_path(tier: StorageTier, share: RankShare, chunk: ChunkRecord) -> str:
    """Where a chunk's stored bytes live on a tier (content address, or the rank's data file or pack)."""
    return chunk_location(tier, share.index, chunk)


def read_stored_chunk(tier: StorageTier, share: RankShare, chunk: ChunkRecord) -> bytes:
    """The stored (encoded) bytes of one chunk from a tier, checked against its digest: its own object,
    or its range of its data file or pack (a whole pack is read by :func:`read_verified_pack`)."""
    path = stored_chunk_path(tier, share, chunk)
    if read_by_digest(tier, share.index, chunk):
        stored = tier.read_bytes(path)
    else:
        stored = tier.read_bytes(path, chunk.offset, chunk.length)
    check_stored_chunk(stored, chunk, path=path, step=share.index.step, tier=tier.label)
    return stored


def pack_path(share: RankShare, number: int) -> str:
    """Path of a rank's pack (its data file ``number``) relative to a tier's root."""
    return step_file(share.index.step, share.index.data_files[number].name)


def read_verified_pack(tier: StorageTier, share: RankShare, number: int) -> bytes:
    """The bytes of a rank's pack (data file ``number``) from a tier, in one read, after checking its
    size and every chunk in it against its digest. Bytes no chunk covers (a pack has none) come back as
    zeros, so that nothing unverified is copied. Raises IntegrityError naming the pack, step and tier."""
    data_file: DataFile = share.index.data_files[number]
    path, step = pack_path(share, number), share.index.step
    if data_file.size == 0:
        return b""
    data = tier.read_bytes(path)
    if len(data) != data_file.size:
        raise IntegrityError("pack has the wrong size", path=path, step=step, tier=tier.label,
                             expected=str(data_file.size), actual=str(len(data)),
                             hint="this copy is corrupt; use another tier's copy or an older step")
    view, covered, gaps = memoryview(data), 0, []
    for chunk in share.index.packed_chunks(number):
        check_stored_chunk(view[chunk.offset:chunk.offset + chunk.length], chunk, path=path, step=step,
                           tier=tier.label)
        if chunk.offset > covered:
            gaps.append((covered, chunk.offset))
        covered = max(covered, chunk.offset + chunk.length)
    if covered < len(data):
        gaps.append((covered, len(data)))
    if not gaps:
        return data
    cleaned = bytearray(data)
    for start, end in gaps:
        cleaned[start:end] = bytes(end - start)
    return bytes(cleaned)
