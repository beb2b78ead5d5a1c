"""Steps saved by ``dcp.save(..., use_collectives=False)``: each rank commits its part, the last one the step.

Without collectives DCP gives each rank's :meth:`~ckptd.dcp.writer.CkptdStorageWriter.finish` only its own
results, so no rank can write the manifest from everyone's entries. Each rank instead writes, after its
data files and index, a part record ``rank-NNNNN.dcp-part.json`` in the step directory (its manifest entry,
the job's size, the codec and DCP's planner data), then lists the parts: the rank that finds every rank's
part writes the manifest from them. Two ranks that both find every part both try; the manifest is linked
into place without replacing one, so one commit wins and the other sees the step committed.

A step whose parts are not all there is not committed: readers do not list it, and a load that names it
gets :class:`~ckptd.errors.PartialStepError` naming the ranks missing (:func:`partial_step_error`). Part
records stay in the committed step directory; readers ignore them.

Part records carry no attempt id shared by the ranks, so a part left by an earlier, failed attempt at the
step cannot be told from one of this attempt by its content. The writer therefore (a) deletes its own rank's
part record when the save is set up, before it writes anything of the step; (b) commits only parts whose
recorded index digest matches the index file now on disk (a rank that has begun writing again no longer
matches); (c) never writes into a committed step. After a failed attempt the sound recovery is to delete
the step directory (or save a new step) and save again on every rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ckptd.errors import CkptdError, FormatError, PartialStepError
from ckptd.format.layout import step_file
from ckptd.format.records import RankEntry
from ckptd.tiers.base import StorageTier

#: Name of one rank's part record in a step directory.
PART_SUFFIX = ".dcp-part.json"

#: What to do about a step whose attempt without collectives failed (its parts may be of several attempts).
HINT = "delete the step directory (or save a new step) and save again on every rank"


def part_name(rank: int) -> str:
    return f"rank-{rank:05d}{PART_SUFFIX}"


@dataclass(frozen=True)
class RankPart:
    """One rank's part of a step saved without collectives."""

    entry: RankEntry
    world_size: int
    codec: str
    save_id: str
    planner_data: Any = None
    version: str | None = None
    #: Whether the rank stored values that need the newer format version (see the writer's finish).
    newer_values: bool = False

    def to_json_bytes(self) -> bytes:
        return json.dumps({"entry": self.entry.to_json(), "world_size": self.world_size, "codec": self.codec,
                           "save_id": self.save_id, "planner_data": self.planner_data, "version": self.version,
                           "newer_values": self.newer_values}, sort_keys=True).encode()

    @classmethod
    def from_json_bytes(cls, raw: bytes, *, step: int, path: str) -> RankPart:
        try:
            body = json.loads(raw)
            entry = RankEntry.from_json(body["entry"], step=step, path=path)
            world_size, codec, save_id = body["world_size"], body["codec"], body["save_id"]
            if not (isinstance(world_size, int) and world_size > 0 and isinstance(codec, str)
                    and isinstance(save_id, str)):
                raise TypeError("world_size, codec or save_id has the wrong type")
            version = body.get("version")
            return cls(entry=entry, world_size=world_size, codec=codec, save_id=save_id,
                       planner_data=body.get("planner_data"), version=version if isinstance(version, str) else None,
                       newer_values=bool(body.get("newer_values", False)))
        except (ValueError, KeyError, TypeError) as error:
            raise FormatError(f"malformed part record: {error}", path=path, step=step,
                              hint=HINT) from error


def write_part(tier: StorageTier, step: int, part: RankPart) -> None:
    """Write this rank's part record of ``step`` (the writer deleted any older one when the save was set up)."""
    tier.write_bytes(step_file(step, part_name(part.entry.rank)), part.to_json_bytes())


def delete_part(tier: StorageTier, step: int, rank: int) -> None:
    """Delete ``rank``'s part record of ``step`` left by an earlier attempt (nothing when there is none)."""
    tier.delete_files([step_file(step, part_name(rank))])


def part_matches_index(tier: StorageTier, step: int, part: RankPart) -> bool:
    """Whether the index file of ``part``'s rank now on disk is the one the part records (same size and
    digest): False when the rank has begun writing the step again, or its index is missing."""
    path = step_file(step, part.entry.index_file)
    try:
        raw = tier.read_bytes(path)
    except CkptdError:
        if tier.exists(path):
            raise
        return False
    return part.entry.matches_index(raw)


def read_parts(tier: StorageTier, step: int) -> dict[int, RankPart]:
    """Every part record of ``step`` on ``tier``, by rank (a part deleted while listed is left out)."""
    parts: dict[int, RankPart] = {}
    for name in tier.list_files(step):
        if not (name.startswith("rank-") and name.endswith(PART_SUFFIX)):
            continue
        path = step_file(step, name)
        try:
            raw = tier.read_bytes(path)
        except CkptdError:
            if tier.exists(path):
                raise
            continue
        part = RankPart.from_json_bytes(raw, step=step, path=path)
        parts[part.entry.rank] = part
    return parts


def partial_step_error(tiers: list[StorageTier], step: int) -> PartialStepError | None:
    """The error for a load of ``step`` when some tier holds parts of it but no manifest, else None."""
    for tier in tiers:
        try:
            if tier.is_committed(step):
                return None
            parts = read_parts(tier, step)
        except CkptdError:
            continue
        if not parts:
            continue
        world_size = max(part.world_size for part in parts.values())
        missing = [rank for rank in range(world_size) if rank not in parts]
        if not missing:
            return PartialStepError(
                f"step {step} was saved without collectives and every rank wrote its part, but the step was not "
                "committed (the committing rank stopped before writing the manifest)", step=step,
                tier=tier.label, hint=f"{HINT}, or load another step")
        return PartialStepError(
            f"step {step} was saved without collectives and is not committed: ranks {missing} of {world_size} "
            f"have not written their part (present: {sorted(parts)})", step=step, tier=tier.label,
            hint=f"wait for ranks {missing} to finish dcp.save of this step; if that attempt failed, {HINT}; "
                 "or load another step (a load without a step reads the newest committed one)")
    return None
