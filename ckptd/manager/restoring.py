"""The restore path: pick the newest intact step, read it verified, load it into the live state.

Tiers are given nearest first. A step is a candidate when it is committed on at least one tier; it is
read from the nearest tier that has it, with every other tier that has it as a chunk-by-chunk fallback.
When no tier holds an intact copy, the next older step is tried, and the reason is logged.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.errors import CkptdError, NoIntactCheckpointError, NotFoundError, ResumeMismatchError
from ckptd.format.step_reader import ChunkSource, FallbackEvent, StepReader, load_manifest, load_rank_index
from ckptd.state import rng
from ckptd.state.tree import load_into
from ckptd.tiers.base import StorageTier

log = logging.getLogger("ckptd.restore")


@dataclass
class RestoreResult:
    """What a restore did: the step loaded (None on a fresh run), the tier it came from, fallbacks."""

    step: int | None
    tier: str | None = None
    events: list[FallbackEvent] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _sources(tiers: list[StorageTier], step: int, rank: int, world_size: int) -> list[ChunkSource]:
    sources, errors = [], []
    for tier in tiers:
        try:
            manifest = load_manifest(tier, step)
            if manifest.world_size != world_size:
                raise ResumeMismatchError(
                    f"step {step} was saved by {manifest.world_size} rank(s) but this job has {world_size}",
                    step=step, tier=tier.label,
                    hint="restore with the saved world size, or use ckptd's DCP integration, which reshards")
            sources.append(ChunkSource(tier, load_rank_index(tier, manifest, rank)))
        except ResumeMismatchError:
            raise
        except CkptdError as error:
            errors.append(str(error))
            log.warning("step %d unusable on %s: %s", step, tier.label, error)
    if not sources:
        raise NotFoundError(f"no tier has a usable copy of step {step}: " + " | ".join(errors), step=step)
    return sources


def restore_state(tiers: list[StorageTier], state: MutableMapping[str, Any], *, rank: int, world_size: int,
                  step: int | None = None, allow_pickle: bool = False, restore_rng: bool = True) -> RestoreResult:
    """Load the newest intact step (or ``step``) committed on any of ``tiers`` into ``state``."""
    committed = sorted({s for tier in tiers for s in tier.committed_steps()}, reverse=True)
    if step is not None:
        if step not in committed:
            raise NotFoundError("step is not committed on any tier", step=step,
                                tier=", ".join(t.label for t in tiers), hint="`ckptd ls` lists committed steps")
        committed = [step]
    result = RestoreResult(step=None)
    for candidate in committed:
        try:
            reader = StepReader(_sources(tiers, candidate, rank, world_size))
            _load(reader, state, allow_pickle=allow_pickle, restore_rng=restore_rng)
        except ResumeMismatchError:
            raise
        except CkptdError as error:
            result.skipped.append(f"step {candidate}: {error}")
            log.warning("step %d cannot be restored, trying an older one: %s", candidate, error)
            continue
        result.step, result.tier, result.events = candidate, reader.sources[0].tier.label, reader.events
        return result
    if result.skipped:
        raise NoIntactCheckpointError("no intact checkpoint could be restored: " + " | ".join(result.skipped),
                                      tier=", ".join(t.label for t in tiers),
                                      hint="`ckptd verify` shows every bad file")
    return result


def _load(reader: StepReader, state: MutableMapping[str, Any], *, allow_pickle: bool, restore_rng: bool) -> None:
    target = dict(state)
    with torch.no_grad():
        load_into(target, reader.index.values, reader.read_tensor, allow_pickle=allow_pickle)
    saved_rng = target.pop(rng.RNG_KEY, None)
    state.update(target)
    if restore_rng and saved_rng is not None:
        rng.restore(saved_rng)
