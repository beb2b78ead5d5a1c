"""Reading a step back from the object tier: read-ahead for restores, and re-populating the local tier.

:func:`prefetch_step` tells the object tier which chunks one rank's restore will read, in the order it
reads them, so they are fetched by parallel requests ahead of the reader (a pack that is read in one
request is fetched ahead whole). Uncompressed chunks are left out: the reader's threads read them straight
into the tensors (:meth:`~ckptd.tiers.object.ObjectTier.read_whole_into`), which a read-ahead into new
buffers cannot. :func:`pull_step` rebuilds a rank's data files and index on the local
tier from the verified chunks and packs (byte for byte the files that were promoted) and writes the
manifest once every rank's share is there, so the next restore is local.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from ckptd.errors import CkptdError, IntegrityError
from ckptd.format import codecs
from ckptd.format.layout import step_file
from ckptd.stepio.step_reader import load_step_manifest, load_rank_index
from ckptd.format.records import ChunkRecord, DataFile, RankIndex
from ckptd.promotion.contents import RankShare, read_step_contents, read_stored_chunk, read_verified_pack
from ckptd.stepio.packs import chunk_location, max_range_bytes, plan_ranges, read_by_digest, whole_object
from ckptd.state.tree import skeleton_tensor_names
from ckptd.tiers.atomicity import step_commit
from ckptd.tiers.base import StorageTier
from ckptd.tiers.local import LocalTier
from ckptd.tiers.object import ObjectTier

log = logging.getLogger("ckptd.promotion")


class MetadataReader(Protocol):
    """Reads each manifest and rank index of a restore once (``ckptd.manager.restoring``'s)."""

    def prefetch_index(self, tier: StorageTier, step: int, rank: int) -> RankIndex: ...


def prefetch_step(remote: ObjectTier, step: int, rank: int, *, metadata: MetadataReader | None = None) -> int:
    """Start fetching the chunks of ``rank`` at ``step`` in restore order; returns how many. Best effort:
    a step that cannot be read is simply not prefetched. With ``metadata`` (the restore's) the prefetch and
    the restore read the manifest and the index once."""
    try:
        if metadata is not None:
            index = metadata.prefetch_index(remote, step, rank)
        else:
            index = load_rank_index(remote, load_step_manifest(remote, step), rank)
    except CkptdError as error:
        log.debug("not prefetching step %d: %s", step, error)
        return 0
    order = [name for name in skeleton_tensor_names(index.values) if name in index.tensors]
    order += [name for name in index.tensors if name not in set(order)]
    whole_packs = {number for number, data_file in enumerate(index.data_files) if data_file.packed and
                   whole_object(plan_ranges(index.packed_chunks(number), max_range_bytes()), data_file.size)}
    paths = [chunk_location(remote, index, chunk) for name in order for chunk in index.tensors[name].chunks
             if (read_by_digest(remote, index, chunk) and chunk.codec != codecs.RAW) or chunk.file in whole_packs]
    paths = list(dict.fromkeys(paths))
    remote.read_ahead(paths)
    return len(paths)


def pull_step(remote: ObjectTier, local: LocalTier, step: int, *, ranks: Iterable[int] | None = None) -> int:
    """Copy ``ranks`` (default: all) of a committed step from the object tier to the local tier, verified;
    returns the bytes written. The step is committed locally last (through the tier's
    :class:`~ckptd.tiers.atomicity.StepCommit`), once the files of ``ranks`` exist: a node-local directory
    holds the ranks of its node only. A step already committed locally is left as it is."""
    commit = step_commit(local)
    commit.check_writable(step)
    ranks = None if ranks is None else sorted(set(ranks))
    contents = read_step_contents(remote, step, ranks)
    written = 0
    for share in contents.shares:
        index = share.index
        placed = sorted({(chunk.file, chunk.offset): chunk for chunk in index.chunks}.values(),
                        key=lambda c: (c.file, c.offset))
        packs = [step_file(step, f.name) for f in index.data_files if f.packed and f.size]
        remote.read_ahead(packs + [remote.chunk_path(chunk.object_key) for chunk in placed
                                   if read_by_digest(remote, index, chunk)])
        for number, data_file in enumerate(index.data_files):
            if data_file.packed:
                local.write_bytes(step_file(step, data_file.name), read_verified_pack(remote, share, number))
            else:
                _rebuild_data_file(remote, local, share, data_file, [c for c in placed if c.file == number])
        local.write_bytes(step_file(step, share.index_name), share.index_bytes)
        written += index.data_size + len(share.index_bytes)
    commit.commit(step, contents.manifest_bytes, ranks_here=ranks)
    written += len(contents.manifest_bytes)
    log.info("re-populated step %d on %s from %s (%d bytes)", step, local.label, remote.label, written)
    return written


def _rebuild_data_file(remote: ObjectTier, local: LocalTier, share: RankShare, data_file: DataFile,
                       chunks: list[ChunkRecord]) -> None:
    """Write one data file of a rank from its chunks (sorted by offset), zero-filling any gaps."""
    data_path = step_file(share.index.step, data_file.name)
    handle = local.open_file(data_path)
    try:
        for chunk in chunks:
            if chunk.offset < handle.size:
                raise IntegrityError("rank index has overlapping chunks", path=data_path, step=share.index.step,
                                     tier=remote.label)
            if chunk.offset > handle.size:
                handle.write(bytes(chunk.offset - handle.size))
            handle.write(read_stored_chunk(remote, share, chunk))
        if handle.size < data_file.size:
            handle.write(bytes(data_file.size - handle.size))
        handle.commit()
    except BaseException:
        handle.abort()
        raise
