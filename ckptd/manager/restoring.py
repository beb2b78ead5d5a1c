"""The restore path: agree on one step with every rank, read it verified, load it into the live state.

Call on every rank, from the training thread, in the same order (agreement goes through the
coordinator's c10d Store; resharding through DCP issues collectives on the default process group).

1. Each rank lists the steps it could restore: committed on some tier, with a manifest and (at the
   same world size) its own index that parse and match their digests.
2. The ranks exchange their lists through the store and take the newest step every rank listed.
3. Each rank loads that step: from the memory tier (the staged copy of its last save) when it holds
   that committed step, else from the nearest tier that has it, with every other tier as a chunk-by-chunk
   fallback. A step saved by another world size is resharded through DCP (:mod:`ckptd.dcp.resharding`).
4. The ranks exchange the outcome; if any rank failed, every rank drops that step and goes back to 2.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.format.values import manager_skeleton, parse_values
from ckptd.dcp.resharding import TensorReader, live_reader, resharded_source
from ckptd.errors import CkptdError, NoIntactCheckpointError, NotFoundError, PickleRefusedError, \
    ResumeMismatchError
from ckptd.format.records import Manifest, RankIndex
from ckptd.stepio.step_reader import ChunkSource, FallbackEvent, StepReader, load_step_manifest, load_rank_index
from ckptd.manager.commit import CommitCoordinator, SingleProcessCoordinator
from ckptd.manager.saving import MemoryCopy
from ckptd.state import rng
from ckptd.state.tree import load_into, no_pending_reads
from ckptd.tiers.base import StorageTier

log = logging.getLogger("ckptd.restore")


@dataclass
class RestoreResult:
    """What a restore did: the step loaded (None on a fresh run), the tier it came from, fallbacks."""

    step: int | None
    tier: str | None = None
    events: list[FallbackEvent] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    resharded: bool = False


class _Metadata:
    """Manifests and rank indexes read during one restore, each read and parsed at most once (failures
    are remembered too): choosing a step and then loading it look at the same files."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int, int | None], Manifest | RankIndex | CkptdError] = {}

    def _get(self, key: tuple[int, int, int | None], read: Callable[[], Manifest | RankIndex]) -> Any:
        if key not in self._seen:
            try:
                self._seen[key] = read()
            except CkptdError as error:
                self._seen[key] = error
        found = self._seen[key]
        if isinstance(found, CkptdError):
            raise found
        return found

    def manifest(self, tier: StorageTier, step: int) -> Manifest:
        return self._get((id(tier), step, None), lambda: load_step_manifest(tier, step))

    def rank_index(self, tier: StorageTier, step: int, rank: int) -> RankIndex:
        return self._get((id(tier), step, rank),
                         lambda: load_rank_index(tier, self.manifest(tier, step), rank))


def _sources(metadata: _Metadata, tiers: list[StorageTier], step: int, rank: int,
             world_size: int) -> list[ChunkSource]:
    sources, errors = [], []
    for tier in tiers:
        if not tier.is_committed(step):
            continue
        try:
            manifest = metadata.manifest(tier, step)
            if manifest.world_size != world_size:
                raise ResumeMismatchError(f"step {step} was saved by {manifest.world_size} rank(s), "
                                          f"this job has {world_size}", step=step, tier=tier.label)
            sources.append(ChunkSource(tier, metadata.rank_index(tier, step, rank)))
        except CkptdError as error:
            errors.append(str(error))
            log.warning("step %d unusable on %s: %s", step, tier.label, error)
    if not sources:
        raise NotFoundError(f"no tier has a usable copy of step {step} for rank {rank}: " + " | ".join(errors),
                            step=step)
    return sources


def _restorable(metadata: _Metadata, tiers: list[StorageTier], step: int, rank: int,
                world_size: int) -> str | None:
    """None when this rank could try ``step``; otherwise why not (metadata only, no data read)."""
    errors = []
    for tier in tiers:
        try:
            if metadata.manifest(tier, step).world_size == world_size:
                metadata.rank_index(tier, step, rank)
            return None
        except CkptdError as error:
            errors.append(str(error))
    return " | ".join(errors) or "not committed on any tier"


def restore_state(tiers: list[StorageTier], state: MutableMapping[str, Any], *, rank: int, world_size: int,
                  step: int | None = None, allow_pickle: bool = False, restore_rng: bool = True,
                  coordinator: CommitCoordinator | None = None, memory: MemoryCopy | None = None) -> RestoreResult:
    """Load the newest step intact on every rank (or ``step``) into ``state``; see the module docstring."""
    coordinator = coordinator or SingleProcessCoordinator()
    metadata = _Metadata()
    committed = sorted({s for tier in tiers for s in tier.committed_steps()}, reverse=True)
    if step is not None:
        if step not in committed:
            raise NotFoundError("step is not committed on any tier", step=step,
                                tier=", ".join(t.label for t in tiers), hint="`ckptd ls` lists committed steps")
        committed = [step]
    result = RestoreResult(step=None)
    candidates = []
    for candidate in committed:
        why = _restorable(metadata, tiers, candidate, rank, world_size)
        if why is None:
            candidates.append(candidate)
        else:
            result.skipped.append(f"step {candidate} on rank {rank}: {why}")
            log.warning("step %d cannot be restored on rank %d, trying an older one: %s", candidate, rank, why)
    while True:
        lists = coordinator.exchange("restore-candidates", candidates)
        common = set(lists[0]).intersection(*map(set, lists[1:]))
        if not common:
            break
        agreed = max(common)
        error = _try_load(metadata, tiers, agreed, state, result, rank=rank, world_size=world_size,
                          allow_pickle=allow_pickle, restore_rng=restore_rng, memory=memory)
        outcomes = coordinator.exchange("restore-outcome", error)
        failures = {r: why for r, why in enumerate(outcomes) if why is not None}
        if not failures:
            result.step = agreed
            return result
        refused = {r: why["error"] for r, why in failures.items() if why["pickle"]}
        if refused:
            raise PickleRefusedError(" | ".join(f"rank {r}: {why}" for r, why in sorted(refused.items())),
                                     step=agreed)
        mismatched = {r: why["error"] for r, why in failures.items() if why["mismatch"]}
        if mismatched:
            raise ResumeMismatchError("the saved state does not fit the live state: " + " | ".join(
                f"rank {r}: {why}" for r, why in sorted(mismatched.items())), step=agreed)
        for failed_rank, why in sorted(failures.items()):
            result.skipped.append(f"step {agreed} on rank {failed_rank}: {why['error']}")
            log.warning("step %d cannot be restored on rank %d, trying an older one: %s", agreed, failed_rank,
                        why["error"])
        candidates = [c for c in candidates if c != agreed]
    if result.skipped or any(lists):
        raise NoIntactCheckpointError("no step is intact on every rank: " + " | ".join(result.skipped),
                                      tier=", ".join(t.label for t in tiers),
                                      hint="`ckptd verify` shows every bad file")
    return result


def _try_load(metadata: _Metadata, tiers: list[StorageTier], step: int, state: MutableMapping[str, Any],
              result: RestoreResult, *, rank: int, world_size: int, allow_pickle: bool, restore_rng: bool,
              memory: MemoryCopy | None) -> dict[str, Any] | None:
    """None on success, else ``{"error": text, "mismatch": bool}`` (JSON, for the outcome exchange)."""
    try:
        skeleton, read, settle = _source(metadata, tiers, step, state, result, rank=rank, world_size=world_size,
                                         allow_pickle=allow_pickle, memory=memory)
        _load(skeleton, read, settle, state, allow_pickle=allow_pickle, restore_rng=restore_rng)
    except CkptdError as error:
        return {"error": str(error), "mismatch": isinstance(error, ResumeMismatchError),
                "pickle": isinstance(error, PickleRefusedError)}
    return None


def _source(metadata: _Metadata, tiers: list[StorageTier], step: int, state: MutableMapping[str, Any],
            result: RestoreResult, *, rank: int, world_size: int, allow_pickle: bool,
            memory: MemoryCopy | None) -> tuple[Any, TensorReader, Callable[..., None]]:
    """The skeleton to load, the reader of its tensors, and what waits for reads that are still running."""
    saved_world = _saved_world_size(metadata, tiers, step)
    if saved_world != world_size:
        result.resharded, result.tier = True, tiers[0].label
        return (*resharded_source(tiers, step, state, rank=rank, allow_pickle=allow_pickle), no_pending_reads)
    if memory is not None and memory.step == step and memory.committed:
        result.tier = "memory"
        staged = memory.staged.tensors

        def from_memory(name: str, out: torch.Tensor | None) -> torch.Tensor:
            if out is None:
                return staged[name].clone()
            with torch.no_grad():
                out.copy_(staged[name])
            return out

        return memory.values.skeleton, live_reader(from_memory), no_pending_reads
    reader = StepReader(_sources(metadata, tiers, step, rank, world_size))
    result.tier, result.events = reader.sources[0].tier.label, reader.events

    def read_deferred(name: str, out: torch.Tensor | None) -> torch.Tensor:
        return reader.read_tensor(name, out, defer=True)

    skeleton = manager_skeleton(parse_values(reader.index.values), step=step)
    return skeleton, live_reader(read_deferred), reader.settle


def _saved_world_size(metadata: _Metadata, tiers: list[StorageTier], step: int) -> int:
    errors = []
    for tier in tiers:
        try:
            return metadata.manifest(tier, step).world_size
        except CkptdError as error:
            errors.append(str(error))
    raise NotFoundError(f"no tier has a readable manifest of step {step}: " + " | ".join(errors), step=step)


def _load(skeleton: Any, read: TensorReader, settle: Callable[..., None], state: MutableMapping[str, Any], *,
          allow_pickle: bool, restore_rng: bool) -> None:
    target = dict(state)
    with torch.no_grad():
        load_into(target, skeleton, read, allow_pickle=allow_pickle, settle=settle)
    saved_rng = target.pop(rng.RNG_KEY, None)
    state.update(target)
    if restore_rng and saved_rng is not None:
        rng.restore(saved_rng)
