"""Mending objects found bad on the object tier from any intact copy (``ckptd verify --repair``).

A bad object is a content-addressed chunk (``chunks/...``), which every step that shares it needs, or a
rank's pack in one step directory. Copies are looked for, in this order, on the *sources* given: the
local tier, the pinned copies of steps waiting for promotion (``<local>/.promoting/``, laid out like a
tier) and the object tier itself (another step's pack may hold a chunk with the same content address).
A chunk is the same object wherever it lies when its content address (digest and codec) is the same;
a pack is mended only from a copy of the same step whose manifest is byte-identical.

Every copy is read and checked against its digest before it is written, the written object is read
back and checked again, and only then is its bad record cleared (:mod:`ckptd.tiers.chunk_health`). A
committed step is never deleted or rewritten here: only objects that fail their digest are replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptd.errors import CkptdError
from ckptd.format.layout import parse_step_dir
from ckptd.promotion.contents import (RankShare, StepContents, check_stored_chunk, pack_path, read_step_contents,
                                      read_stored_chunk, read_verified_pack, stored_chunk_path)
from ckptd.promotion.pinning import PIN_DIRECTORY
from ckptd.format.records import ChunkRecord
from ckptd.tiers.base import StorageTier
from ckptd.tiers.chunk_health import clear_bad_chunk
from ckptd.tiers.local import LocalTier

log = logging.getLogger("ckptd.repair")


@dataclass(frozen=True)
class RepairReport:
    """What a repair mended, what it found intact after all (its record cleared), and what it could not
    mend (path and why)."""

    tier: str
    repaired: tuple[str, ...] = ()
    unrepairable: tuple[tuple[str, str], ...] = ()
    intact: tuple[str, ...] = ()


@dataclass
class _Copies:
    """Where intact copies may be: chunk content address -> candidates, (step, pack name) -> candidates."""

    chunks: dict[str, list[tuple[StorageTier, RankShare, ChunkRecord]]] = field(default_factory=dict)
    packs: dict[tuple[int, str], list[tuple[StorageTier, StepContents, RankShare, int]]] = field(default_factory=dict)


def repair_sources(remote: StorageTier, local_roots: Iterable[str | Path] = ()) -> list[StorageTier]:
    """The tiers a repair looks for copies on: each local root and its pinned steps, then ``remote``."""
    sources: list[StorageTier] = []
    for root in local_roots:
        sources.append(LocalTier(root))
        if (Path(root) / PIN_DIRECTORY).is_dir():
            sources.append(LocalTier(Path(root) / PIN_DIRECTORY))
    sources.append(remote)
    return sources


def _index_copies(sources: Sequence[StorageTier]) -> _Copies:
    copies = _Copies()
    for source in sources:
        try:
            steps = sorted(source.committed_steps(), reverse=True)
        except CkptdError as error:
            log.warning("repair: cannot list %s: %s", source.label, error)
            continue
        for step in steps:
            try:
                contents = read_step_contents(source, step)
            except CkptdError as error:
                log.info("repair: step %d on %s is not usable as a source: %s", step, source.label, error)
                continue
            for share in contents.shares:
                for chunk in share.index.chunks:
                    copies.chunks.setdefault(chunk.object_key, []).append((source, share, chunk))
                for number, data_file in enumerate(share.index.data_files):
                    if data_file.packed:
                        copies.packs.setdefault((step, data_file.name), []).append((source, contents, share, number))
    return copies


def _is_the_object(remote: StorageTier, path: str, source: StorageTier, share: RankShare, chunk: ChunkRecord) -> bool:
    """Whether this candidate is the object at ``path`` on ``remote`` itself (not another copy)."""
    return source is remote and stored_chunk_path(source, share, chunk) == path


def _intact(remote: StorageTier, path: str, step: int | None, copies: _Copies) -> bool:
    """Whether the recorded object at ``path`` now passes the check of a step on ``remote`` that holds
    it: the record came from a read that went bad on its way (or from a promotion that stored the
    object again but could not clear the record)."""
    try:
        if path.startswith(remote.chunk_path("")):
            for source, share, chunk in copies.chunks.get(path[len(remote.chunk_path("")):], []):
                if _is_the_object(remote, path, source, share, chunk):
                    read_stored_chunk(remote, share, chunk)
                    return True
        elif step is not None:
            for source, _, share, number in copies.packs.get((step, path.rpartition("/")[2]), []):
                if source is remote and pack_path(share, number) == path:
                    read_verified_pack(remote, share, number)
                    return True
    except CkptdError:
        return False
    return False


def _mend_chunk(remote: StorageTier, path: str, copies: _Copies) -> str | None:
    """Write an intact copy of chunk ``path``; None when done, else why not."""
    key = path[len(remote.chunk_path("")):]
    candidates = copies.chunks.get(key, [])
    # the stored lengths the steps on the object tier read it with (a copy in another encoding breaks them)
    lengths = {chunk.length for source, share, chunk in candidates
               if _is_the_object(remote, path, source, share, chunk)}
    tried = []
    for source, share, chunk in candidates:
        if _is_the_object(remote, path, source, share, chunk):
            continue  # the bad object itself
        if lengths and chunk.length not in lengths:
            tried.append(f"{source.label} step {share.index.step}: another encoding ({chunk.length} bytes)")
            continue
        try:
            stored = read_stored_chunk(source, share, chunk)
            remote.write_bytes(path, stored)
            check_stored_chunk(remote.read_bytes(path), chunk, path=path, step=share.index.step, tier=remote.label)
        except CkptdError as error:
            tried.append(f"{source.label} step {share.index.step}: {error}")
            continue
        log.warning("repaired %s on %s from step %d on %s", path, remote.label, share.index.step, source.label)
        return None
    return "no intact copy found" + (f" (tried {'; '.join(tried)})" if tried else " on the sources given")


def _mend_pack(remote: StorageTier, path: str, step: int, copies: _Copies) -> str | None:
    """Write an intact copy of pack ``path`` of ``step``; None when done, else why not."""
    try:
        wanted = read_step_contents(remote, step)
    except CkptdError as error:
        return f"the step's metadata on the object tier cannot be read: {error}"
    name = path.rpartition("/")[2]
    tried = []
    for source, contents, share, number in copies.packs.get((step, name), []):
        if source is remote or contents.manifest_bytes != wanted.manifest_bytes:
            continue
        try:
            data = read_verified_pack(source, share, number)
            remote.write_bytes(path, data)
            mine = next(s for s in wanted.shares if s.rank == share.rank)
            read_verified_pack(remote, mine, number)
        except (CkptdError, StopIteration) as error:
            tried.append(f"{source.label}: {error}")
            continue
        log.warning("repaired pack %s on %s from %s", path, remote.label, source.label)
        return None
    return "no intact copy of this step's pack found" + (f" (tried {'; '.join(tried)})" if tried else "")


def repair_objects(remote: StorageTier, paths: Iterable[str], sources: Sequence[StorageTier]) -> RepairReport:
    """Replace each bad object at ``paths`` on ``remote`` (chunks and packs) with an intact copy found on
    ``sources`` (:func:`repair_sources`), and clear its bad record. An object that passes its check on
    ``remote`` now (when ``remote`` is among the sources) only has its record cleared. Raises nothing for
    an object that cannot be mended: the report names it and why."""
    wanted = sorted(set(paths))
    if not wanted:
        return RepairReport(tier=remote.label)
    copies = _index_copies(sources)
    repaired, unrepairable, intact = [], [], []
    for path in wanted:
        directory = path.partition("/")[0]
        step = parse_step_dir(directory)
        if _intact(remote, path, step, copies):
            clear_bad_chunk(remote, path)
            log.info("%s on %s is intact: its bad record is cleared", path, remote.label)
            intact.append(path)
            continue
        if path.startswith(remote.chunk_path("")):
            why = _mend_chunk(remote, path, copies)
        elif step is not None:
            why = _mend_pack(remote, path, step, copies)
        else:
            why = "not a chunk or pack object"
        if why is None:
            clear_bad_chunk(remote, path)
            repaired.append(path)
        else:
            unrepairable.append((path, why))
    return RepairReport(tier=remote.label, repaired=tuple(repaired), unrepairable=tuple(unrepairable),
                        intact=tuple(intact))


__all__ = ["RepairReport", "repair_objects", "repair_sources"]
