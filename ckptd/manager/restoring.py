"""The restore path: agree on one step with every rank, read it verified, load it into the live state.

Call on every rank, from the training thread, in the same order (agreement goes through the
coordinator's c10d Store; resharding through DCP issues collectives on the default process group).

1. Each rank lists the steps it could restore: committed on some tier, with a manifest and (at the
   same world size) its own index that parse and match their digests. Each tier is listed once per
   restore (:class:`TierListings`); a tier that cannot answer (unreachable, misconfigured) is named in
   one warning and skipped for the rest of the restore, so it never blocks the tiers that work.
2. The ranks exchange their lists through the store and take the newest step every rank listed.
3. Each rank loads that step: from the memory tier (the staged copy of its last save) when it holds
   that committed step, else from the nearest tier that has it, with every other tier as a chunk-by-chunk
   fallback. A step saved by another world size is resharded through DCP (:mod:`ckptd.dcp.resharding`).
4. The ranks exchange the outcome; if any rank failed, every rank drops that step and goes back to 2.
   A state that does not fit the step (a live key the step lacks, an object the live state lacks, a
   tensor of another shape) raises :class:`~ckptd.errors.ResumeMismatchError` on every rank instead:
   an older step would not fit either.

With ``keys`` (a partial restore) only those top-level keys are loaded, and only the tensors they hold
are read: a run's config can be read before the model that depends on it is built. The RNG states are
restored by a full restore only.

When no step is left and some rank could not list a tier, the restore raises
:class:`~ckptd.errors.TierUnreachableError` on every rank rather than report a fresh run: the tier that
did not answer may hold the job's checkpoints.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.format.values import manager_skeleton, parse_values
from ckptd.state.live_reader import TensorReader, live_reader
from ckptd.errors import CkptdError, NoIntactCheckpointError, NotFoundError, PickleRefusedError, \
    ResumeMismatchError, StorageError, TierMisconfiguredError, TierUnreachableError
from ckptd.format.records import DTYPE_NAMES, Manifest, RankIndex
from ckptd.stepio.step_reader import ChunkSource, FallbackEvent, StepReader, load_step_manifest, load_rank_index, \
    settle_all
from ckptd.manager.relayout import relayout_source
from ckptd.state.replicas import mesh_of_state, placement_codes
from ckptd.format.mesh_layout import Layout
from ckptd.manager.commit import CommitCoordinator, SingleProcessCoordinator
from ckptd.manager.saving import MemoryCopy
from ckptd.state import rng
from ckptd.state.saved_values import saved_keys, select_keys, stateful_keys
from ckptd.state.staging import local_view
from ckptd.state.tree import flatten, load_into, no_pending_reads
from ckptd.tiers.base import StorageTier

log = logging.getLogger("ckptd.restore")

#: The memory tier a restore may read: the staged copy of one save, or of several (the newest saves).
MemoryTier = MemoryCopy | Sequence[MemoryCopy] | None


def _held_copy(memory: MemoryTier, step: int) -> MemoryCopy | None:
    """The committed staged copy of ``step`` in the memory tier, if it holds one."""
    copies = () if memory is None else (memory,) if isinstance(memory, MemoryCopy) else memory
    return next((copy for copy in copies if copy.step == step and copy.committed), None)


@dataclass
class RestoreResult:
    """What a restore did: the step loaded (None on a fresh run), where its data came from, fallbacks.

    ``tier`` is the nearest tier holding the step (``"memory"`` for the staged copy of this process's
    own save); ``tiers`` names every tier that supplied data, nearest first, and ``chunks_by_tier`` how
    many chunks each supplied (a tensor counts as one chunk from the memory tier). A chunk read from a
    farther tier because a nearer copy was bad or missing is in ``events``. A resharded restore reads
    through DCP and reports only ``tier``. ``keys`` are the keys a partial restore loaded (None: all)."""

    step: int | None
    tier: str | None = None
    events: list[FallbackEvent] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    resharded: bool = False
    tiers: list[str] = field(default_factory=list)
    chunks_by_tier: dict[str, int] = field(default_factory=dict)
    keys: tuple[str, ...] | None = None
    #: Why each step tried and not restored failed, by step: per failing rank, ``rank``, ``error`` and what the
    #: error names (``tier``, ``file``, and for bad bytes ``chunk``, ``expected``, ``actual``).
    failed: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


class TierListings:
    """The committed steps of each tier, listed once per restore, and the tiers that could not answer.

    A tier whose listing fails (any :class:`~ckptd.errors.StorageError`), or that later turns out to be
    unreachable or misconfigured (:class:`~ckptd.errors.TierUnreachableError` while reading), is logged
    once, naming the tier and its URL, and left out of the rest of the restore. Training thread only.
    """

    def __init__(self, tiers: list[StorageTier]) -> None:
        self.tiers = list(tiers)
        self._steps: dict[int, frozenset[int]] = {}
        #: Why each tier that failed was left out, by its label.
        self.failed: dict[str, str] = {}
        #: The hint of each failed tier that answered but refused the request (a wrong token or credentials).
        self.misconfigured: dict[str, str] = {}
        #: The manifests and rank indexes read during the restore (the read-ahead before it too), once each.
        self.metadata = _Metadata(self)

    def committed(self, tier: StorageTier) -> frozenset[int]:
        """The tier's committed steps (listed on first use); empty for a tier that did not answer."""
        if tier.label in self.failed:
            return frozenset()
        if id(tier) not in self._steps:
            try:
                self._steps[id(tier)] = frozenset(tier.committed_steps())
            except StorageError as error:
                self.fail(tier, error)
                return frozenset()
        return self._steps[id(tier)]

    def fail(self, tier: StorageTier, error: CkptdError) -> None:
        """Leave ``tier`` out of the rest of the restore, with one warning."""
        if tier.label in self.failed:
            return
        self.failed[tier.label] = str(error)
        if isinstance(error, TierMisconfiguredError):
            self.misconfigured[tier.label] = error.hint or "fix the tier's configuration"
        log.warning("tier %s cannot be used for this restore, restoring from the tiers that answer: %s",
                    tier.label, error)

    def answering(self) -> list[StorageTier]:
        """The tiers that answered, nearest first (listing each one not listed yet)."""
        for tier in self.tiers:
            self.committed(tier)
        return [tier for tier in self.tiers if tier.label not in self.failed]

    def holding(self, step: int) -> list[StorageTier]:
        """The tiers that answered and list ``step`` as committed, nearest first."""
        return [tier for tier in self.answering() if step in self.committed(tier)]

    def all_committed(self) -> list[int]:
        """Every step committed on some tier that answered, newest first."""
        return sorted({step for tier in self.answering() for step in self.committed(tier)}, reverse=True)


class _Metadata:
    """Manifests and rank indexes read during one restore, each read and parsed at most once (failures
    are remembered too): choosing a step and then loading it look at the same files. A tier found
    unreachable while reading is left out of the rest of the restore (see :class:`TierListings`)."""

    def __init__(self, listings: TierListings) -> None:
        self.listings = listings
        self._seen: dict[tuple[int, int, int | None], Manifest | RankIndex | CkptdError] = {}

    def _get(self, tier: StorageTier, key: tuple[int, int, int | None], read: Callable[[], Manifest | RankIndex],
             remember_failure: bool) -> Any:
        if key not in self._seen:
            try:
                self._seen[key] = read()
            except TierUnreachableError as error:
                if not remember_failure:
                    raise
                self.listings.fail(tier, error)
                self._seen[key] = error
            except CkptdError as error:
                if not remember_failure:
                    raise
                self._seen[key] = error
        found = self._seen[key]
        if isinstance(found, CkptdError):
            raise found
        return found

    def manifest(self, tier: StorageTier, step: int, *, remember_failure: bool = True) -> Manifest:
        return self._get(tier, (id(tier), step, None), lambda: load_step_manifest(tier, step), remember_failure)

    def rank_index(self, tier: StorageTier, step: int, rank: int, *, remember_failure: bool = True) -> RankIndex:
        return self._get(tier, (id(tier), step, rank), lambda: load_rank_index(
            tier, self.manifest(tier, step, remember_failure=remember_failure), rank), remember_failure)

    def prefetch_index(self, tier: StorageTier, step: int, rank: int) -> RankIndex:
        """:meth:`rank_index` for a read-ahead, which is best effort: a failure is not remembered and does not
        leave the tier out, so the restore reads the file again itself."""
        return self.rank_index(tier, step, rank, remember_failure=False)


def _sources(metadata: _Metadata, step: int, rank: int, world_size: int) -> list[ChunkSource]:
    sources, errors = [], []
    for tier in metadata.listings.holding(step):
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


def _restorable(metadata: _Metadata, step: int, rank: int, world_size: int) -> str | None:
    """None when this rank could try ``step``; otherwise why not (metadata only, no data read)."""
    errors = []
    for tier in metadata.listings.holding(step):
        try:
            if metadata.manifest(tier, step).world_size == world_size:
                metadata.rank_index(tier, step, rank)
            return None
        except CkptdError as error:
            errors.append(str(error))
    return " | ".join(errors) or "not committed on any tier"


def restore_state(tiers: list[StorageTier], state: MutableMapping[str, Any], *, rank: int, world_size: int,
                  step: int | None = None, allow_pickle: bool = False, restore_rng: bool = True,
                  coordinator: CommitCoordinator | None = None, memory: MemoryTier = None,
                  listings: TierListings | None = None, keys: Sequence[str] | None = None,
                  layout: Layout | None = None) -> RestoreResult:
    """Load the newest step intact on every rank (or ``step``) into ``state``; see the module docstring.

    ``layout`` is the live job's (a step that records another mesh is restored through DCP's resharding).
    ``listings`` shares one listing of the tiers with what ran before the restore (a read-ahead).
    ``keys`` loads only those top-level keys (a partial restore); one string is one key."""
    keys = [keys] if isinstance(keys, str) else keys
    coordinator = coordinator or SingleProcessCoordinator()
    listings = listings if listings is not None else TierListings(tiers)
    metadata = listings.metadata
    committed = listings.all_committed()
    missing = None
    if step is not None:  # a rank that lacks it still takes part in the exchange, then every rank raises
        if step not in committed:
            missing = f"rank {rank}: not committed on any tier that answered ({', '.join(t.label for t in tiers)})"
        committed = [step] if missing is None else []
    result = RestoreResult(step=None, keys=None if keys is None else tuple(keys))
    candidates = []
    for candidate in committed:
        why = _restorable(metadata, candidate, rank, world_size)
        if why is None:
            candidates.append(candidate)
        else:
            result.skipped.append(f"step {candidate} on rank {rank}: {why}")
            result.failed.setdefault(candidate, []).append({"rank": rank, "error": why})
            log.warning("step %d cannot be restored on rank %d, trying an older one: %s", candidate, rank, why)
    # The first round also tells every rank which tiers some rank could not list, so that all ranks
    # decide alike whether "nothing to restore" means a fresh run.
    exchanged = coordinator.exchange("restore-candidates", {"steps": candidates, "failed": listings.failed,
                                                            "misconfigured": listings.misconfigured,
                                                            "missing": missing, "tiers": [t.label for t in tiers]})
    lists = [answer["steps"] for answer in exchanged]
    failed_tiers = {label: why for answer in exchanged for label, why in answer["failed"].items()}
    misconfigured = {label: hint for answer in exchanged for label, hint in answer["misconfigured"].items()}
    lacking = [answer["missing"] for answer in exchanged if answer["missing"]]
    if lacking:
        raise NotFoundError("the step asked for is not committed on every rank: " + " | ".join(lacking), step=step,
                            tier=", ".join(t.label for t in tiers),
                            hint=_failed_hint(failed_tiers, misconfigured) or "`ckptd ls` lists the committed steps")
    while True:
        common = set(lists[0]).intersection(*map(set, lists[1:]))
        if not common:
            break
        agreed = max(common)
        # resharding calls dcp.load, whose collectives wait for every rank: the ranks decide it together
        votes = coordinator.exchange("restore-reshard", _reshard_vote(metadata, agreed, state, rank=rank,
                                                                      world_size=world_size,
                                                                      allow_pickle=allow_pickle, layout=layout))
        unread = {r: vote["error"] for r, vote in enumerate(votes) if "error" in vote}
        reshard = not unread and any(vote["reshard"] for vote in votes)
        if reshard:  # a rank that cannot open every saved rank's index would leave the others in dcp.load
            ready = coordinator.exchange("restore-reshard-ready", _reshard_ready(listings, agreed, rank=rank,
                                                                               allow_pickle=allow_pickle))
            unread = {r: why for r, why in enumerate(ready) if why is not None}
        if unread:
            error = {"error": f"rank(s) {sorted(unread)} could not read the step's metadata: " + " | ".join(
                unread.values()), "mismatch": False, "pickle": False, "message": "", "hint": None, "tier": None}
        else:
            error = _try_load(metadata, agreed, state, result, rank=rank, world_size=world_size,
                              allow_pickle=allow_pickle, restore_rng=restore_rng and keys is None, memory=memory,
                              keys=keys, reshard=reshard)
        outcomes = coordinator.exchange("restore-outcome", error)
        failures = {r: why for r, why in enumerate(outcomes) if why is not None}
        if not failures:
            result.step = agreed
            return result
        refused = {r: why["error"] for r, why in failures.items() if why["pickle"]}
        if refused:
            raise PickleRefusedError(" | ".join(f"rank {r}: {why}" for r, why in sorted(refused.items())),
                                     step=agreed)
        mismatched = {r: why for r, why in failures.items() if why["mismatch"]}
        if mismatched:
            first = mismatched[min(mismatched)]
            raise ResumeMismatchError("the saved state does not fit the live state: " + " | ".join(
                f"rank {r}: {why['message']}" for r, why in sorted(mismatched.items())), step=agreed,
                tier=first["tier"], hint=first["hint"])
        for failed_rank, why in sorted(failures.items()):
            result.skipped.append(f"step {agreed} on rank {failed_rank}: {why['error']}")
            result.failed.setdefault(agreed, []).append({"rank": failed_rank, "error": why["error"],
                                                         **why.get("where", {"tier": why["tier"]})})
            log.warning("step %d cannot be restored on rank %d, trying an older one: %s", agreed, failed_rank,
                        why["error"])
        candidates = [c for c in candidates if c != agreed]
        lists = coordinator.exchange("restore-candidates", candidates)
    if result.skipped or any(lists):
        message, hint = _no_common_step(exchanged, result.skipped)
        raise NoIntactCheckpointError(message, tier=", ".join(t.label for t in tiers),
                                      hint=_failed_hint(failed_tiers, misconfigured) or hint)
    if failed_tiers:
        error_type = TierMisconfiguredError if misconfigured else TierUnreachableError
        raise error_type("no tier that answered holds a committed step, and "
                                   f"{', '.join(sorted(failed_tiers))} could not be listed: it may hold the "
                                   "job's checkpoints, so this is not treated as a fresh run",
                                   tier=", ".join(sorted(failed_tiers)), hint=_failed_hint(failed_tiers, misconfigured))
    return result


def _no_common_step(exchanged: list[dict[str, Any]], skipped: list[str]) -> tuple[str, str]:
    """(message, hint) when no step is intact on every rank: which ranks had which intact steps at the
    start (a rank with none is named with the tiers it tried), then why the steps tried failed."""
    by_text: dict[str, list[int]] = {}
    for rank, answer in enumerate(exchanged):
        if answer["steps"]:
            text = f"step(s) {', '.join(map(str, sorted(answer['steps'])))} to try"
        else:
            text = f"no intact committed step on any tier it tried ({', '.join(answer.get('tiers') or ['none'])})"
        by_text.setdefault(text, []).append(rank)
    parts = [f"{_ranks(ranks)}: {text}" for text, ranks in by_text.items()]
    message = "no step is intact on every rank: " + "; ".join(parts)
    if skipped:
        message += "; steps tried: " + " | ".join(skipped)
    bare = [rank for rank, answer in enumerate(exchanged) if not answer["steps"]]
    if bare:
        hint = (f"{_ranks(bare)} found no intact copy of any step on its tiers (as when a node is lost before any "
                "of its steps was replicated to a peer or promoted to the object store): give those ranks the tier "
                "that holds their steps, or start the job fresh (move its checkpoint directories aside)")
    else:
        hint = "the ranks hold no step in common: `ckptd ls` lists each node's steps, `ckptd verify` every bad file"
    return message, hint


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-3, 6``."""
    spans: list[str] = []
    start = previous = ranks[0]
    following: list[int | None] = [*ranks[1:], None]
    for rank in following:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def _failed_hint(failed: dict[str, str], misconfigured: dict[str, str]) -> str | None:
    """What to do about the tiers that failed: fix the configuration of one that refused every request
    (retrying never helps), restore again once an unreachable one answers."""
    if not failed:
        return None
    reasons = " | ".join(f"{label}: {why}" for label, why in sorted(failed.items()))
    if misconfigured:
        fixes = "; ".join(f"{label}: {hint}" for label, hint in sorted(misconfigured.items()))
        return f"fix the configuration of the tier that refused the restore ({fixes}), then restore again; " \
               f"it failed with: {reasons}"
    return f"restore again once the tier answers; it failed with: {reasons}"


def _try_load(metadata: _Metadata, step: int, state: MutableMapping[str, Any],
              result: RestoreResult, *, rank: int, world_size: int, allow_pickle: bool, restore_rng: bool,
              memory: MemoryTier, keys: Sequence[str] | None, reshard: bool = False) -> dict[str, Any] | None:
    """None on success, else ``{"error": text, "mismatch": bool, ...}`` (JSON, for the outcome exchange).
    ``reshard``: what the ranks decided together (see :func:`_reshard_vote`)."""
    try:
        skeleton, read, settle, supplied = _source(metadata, step, state, result, rank=rank, world_size=world_size,
                                                   allow_pickle=allow_pickle, memory=memory, reshard=reshard)
        _load(_selected(skeleton, state, keys, step=step, tier=result.tier), read, settle, state,
              allow_pickle=allow_pickle, restore_rng=restore_rng)
    except CkptdError as error:
        where = {"tier": error.tier or result.tier, "file": error.path, "chunk": getattr(error, "chunk", None),
                 "expected": getattr(error, "expected", None), "actual": getattr(error, "actual", None)}
        return {"error": str(error), "mismatch": isinstance(error, ResumeMismatchError),
                "pickle": isinstance(error, PickleRefusedError), "message": error.message, "hint": error.hint,
                "tier": error.tier or result.tier, "where": where}
    result.chunks_by_tier = supplied()
    result.tiers = list(result.chunks_by_tier) or ([result.tier] if result.resharded and result.tier else [])
    return None


def _selected(skeleton: Any, state: MutableMapping[str, Any], keys: Sequence[str] | None, *, step: int,
              tier: str | None) -> Any:
    """The part of ``skeleton`` to load: the ``keys`` asked for, or all of it when the live state has no
    key the step lacks. ResumeMismatchError names a key that one side lacks."""
    saved = [key for key in saved_keys(skeleton) if key != rng.RNG_KEY]
    loaded = saved if keys is None else [key for key in keys if key in saved]
    objects = stateful_keys(skeleton)
    held = f"(it holds {_listed(saved) or 'nothing'})"

    def mismatch(message: str, hint: str) -> ResumeMismatchError:
        return ResumeMismatchError(message, step=step, tier=tier, hint=hint)

    absent = [key for key in loaded if key in objects and state.get(key) is None]
    if absent:
        raise mismatch(f"the checkpoint holds the state of an object (saved through state_dict()) under key(s) "
                       f"{_listed(absent)}, but the live state has no value there",
                       "build the object and put it under that key before restoring, or load the other keys "
                       "with restore(state, keys=[...])")
    if keys is None:
        unsaved = [key for key in state if key not in saved and key != rng.RNG_KEY]
        if unsaved:
            raise mismatch(f"the live state has key(s) {_listed(unsaved)} that the checkpoint does not hold {held}",
                           "remove them from the state before restoring, or load the saved keys alone with "
                           "restore(state, keys=[...])")
        return skeleton
    subset, missing = select_keys(skeleton, [key for key in keys if key != rng.RNG_KEY])
    if missing:
        raise mismatch(f"key(s) {_listed(missing)} asked for are not in the checkpoint {held}",
                       "ask for keys the checkpoint holds (`ckptd inspect PATH` lists them)")
    return subset


def _listed(keys: Sequence[str]) -> str:
    return ", ".join(map(repr, keys))


def _source(metadata: _Metadata, step: int, state: MutableMapping[str, Any],
            result: RestoreResult, *, rank: int, world_size: int, allow_pickle: bool,
            memory: MemoryTier, reshard: bool = False
            ) -> tuple[Any, TensorReader, Callable[..., None], Callable[[], dict[str, int]]]:
    """The skeleton to load, the reader of its tensors, what waits for reads that are still running, and
    what counts, once they are done, the chunks each tier supplied. ``reshard``: as every rank decided."""
    saved_world = _saved_world_size(metadata, step)
    saved = _manifest(metadata, step)
    if saved.layout is not None and reshard:
        holding = metadata.listings.holding(step)
        result.resharded, result.tier = True, holding[0].label
        skeleton, relaid, readers = relayout_source(holding, step, state, rank=rank, allow_pickle=allow_pickle)
        return skeleton, relaid, lambda **kw: settle_all(readers, **kw), dict
    if reshard:
        holding = metadata.listings.holding(step)
        result.resharded, result.tier = True, holding[0].label
        from ckptd.dcp.resharding import resharded_source  # DCP: imported only when a step is resharded

        skeleton, resharded = resharded_source(holding, step, state, rank=rank, allow_pickle=allow_pickle)
        share = rank if rank < saved_world else 0  # the saved rank whose share resharded_source reads
        own = next((metadata.rank_index(tier, step, share) for tier in holding
                    if _has_index(metadata, tier, step, share)), None)

        def strictly(name: str, out: torch.Tensor | None) -> torch.Tensor:
            record = None if own is None else own.tensors.get(name)
            if record is not None:
                _same_dtype(name, record.dtype, out, step=step, tier=result.tier)
            return resharded(name, out)

        return skeleton, strictly, no_pending_reads, dict
    read_names: list[str] = []
    replicas = saved.entry(rank).replicas
    others = _ReplicaReaders(metadata, step, rank, world_size)
    memory = _held_copy(memory, step)
    if memory is not None:
        result.tier = "memory"
        staged = memory.staged.tensors

        def from_memory(name: str, out: torch.Tensor | None) -> torch.Tensor:
            if name not in staged and name in replicas:  # another rank wrote it: read through the tiers
                return others.read(name, replicas[name], out)
            read_names.append(name)
            _same_dtype(name, DTYPE_NAMES[staged[name].dtype], out, step=step, tier="memory")
            if out is None:
                return staged[name].clone()
            with torch.no_grad():
                out.copy_(staged[name])
            return out

        return (memory.values.skeleton, live_reader(from_memory), others.settle,
                lambda: others.supplied({"memory": len(read_names)} if read_names else {}))
    reader = StepReader(_sources(metadata, step, rank, world_size))
    result.tier, result.events = reader.sources[0].tier.label, reader.events

    def read_deferred(name: str, out: torch.Tensor | None) -> torch.Tensor:
        if name in replicas and name not in reader.index.tensors:
            return others.read(name, replicas[name], out)
        read_names.append(name)
        _same_dtype(name, reader.record(name).dtype, out, step=step, tier=result.tier)
        return reader.read_tensor(name, out, defer=True)

    def settle(*, raise_errors: bool = True) -> None:
        settle_all([reader, *others.readers.values()], raise_errors=raise_errors)

    skeleton = manager_skeleton(parse_values(reader.index.values), step=step)
    return skeleton, live_reader(read_deferred), settle, \
        lambda: others.supplied(_chunks_by_tier(reader, read_names))


class _ReplicaReaders:
    """Readers of the shares of other saved ranks, for the pieces they wrote for this rank (replicas written
    once): each found through every tier that holds the step, nearest first."""

    def __init__(self, metadata: _Metadata, step: int, rank: int, world_size: int) -> None:
        self.metadata, self.step, self.rank, self.world_size = metadata, step, rank, world_size
        self.readers: dict[int, StepReader] = {}
        self.names: dict[int, list[str]] = {}

    def read(self, name: str, writer: int, out: torch.Tensor | None) -> torch.Tensor:
        reader = self.readers.get(writer)
        if reader is None:
            try:
                reader = self.readers[writer] = StepReader(_sources(self.metadata, self.step, writer, self.world_size))
            except NotFoundError as error:
                tiers = ", ".join(t.label for t in self.metadata.listings.holding(self.step)) or "none"
                raise NotFoundError(
                    f"tensor {name!r} of rank {self.rank} is a replica that rank {writer} wrote, and no tier this "
                    f"rank reads ({tiers}) holds rank {writer}'s share of the step: {error.message}", step=self.step,
                    tier=tiers, hint="give the manager the object tier (remote=) or a peer tier that holds every "
                    "rank's files, or save with write_replicas='every-rank'") from error
        self.names.setdefault(writer, []).append(name)
        _same_dtype(name, reader.record(name).dtype, out, step=self.step, tier=reader.sources[0].tier.label)
        return reader.read_tensor(name, out, defer=True)

    def settle(self, *, raise_errors: bool = True) -> None:
        settle_all(self.readers.values(), raise_errors=raise_errors)

    def supplied(self, counts: dict[str, int]) -> dict[str, int]:
        """``counts`` plus the chunks each tier supplied to the replicas read here."""
        total = Counter(counts)
        for writer, reader in self.readers.items():
            total.update(_chunks_by_tier(reader, self.names.get(writer, [])))
        return dict(total)


def _same_dtype(name: str, saved: str, out: torch.Tensor | None, *, step: int, tier: str | None) -> None:
    """ResumeMismatchError when the live tensor ``out`` has another dtype than the one saved under ``name``:
    a restore returns the saved bytes, never a cast of them (the rule of every layout, resharded or not)."""
    if out is not None and DTYPE_NAMES.get(out.dtype) != saved:
        raise ResumeMismatchError(
            f"tensor {name!r} was saved as {saved} but the live state holds {DTYPE_NAMES.get(out.dtype, out.dtype)} "
            f"{list(out.shape)} there: a restore returns the saved values, it does not cast them", step=step,
            tier=tier, hint="build the model with the saved dtypes (`ckptd inspect` lists them), cast after restoring")


def _manifest(metadata: _Metadata, step: int) -> Manifest:
    errors = []
    for tier in metadata.listings.holding(step):
        try:
            return metadata.manifest(tier, step)
        except CkptdError as error:
            errors.append(str(error))
    raise NotFoundError(f"no tier has a readable manifest of step {step}: " + " | ".join(errors), step=step)


def _reshard_vote(metadata: _Metadata, step: int, state: MutableMapping[str, Any], *, rank: int, world_size: int,
                  allow_pickle: bool, layout: Layout | None) -> dict[str, Any]:
    """This rank's vote on whether ``step`` is restored through resharding (``{"reshard": bool}``), or why
    it could not tell (``{"error": text}``). The ranks reshard when any votes for it: a pipeline stage sees
    only its own DTensors, so one rank may see a change that the others cannot."""
    try:
        saved = _manifest(metadata, step)
        if saved.world_size != world_size:
            return {"reshard": True}
        if saved.layout is None:
            return {"reshard": False}
        try:
            live = flatten(dict(state), allow_pickle=allow_pickle).tensors
        except CkptdError:  # a live value that cannot be taken apart; the load reports what does not fit
            return {"reshard": False}
        changed = _layout_changed(saved, live, layout=layout) or _shards_moved(metadata, saved, live, rank=rank)
        return {"reshard": changed}
    except CkptdError as error:
        return {"error": f"rank {rank}: {error}"}


def _reshard_ready(listings: TierListings, step: int, *, rank: int, allow_pickle: bool) -> str | None:
    """None when this rank can open the manifest and every saved rank's index of ``step`` (what a resharded
    restore reads before ``dcp.load``), else why not."""
    from ckptd.dcp.reader import CkptdStorageReader  # DCP: imported only when a step is resharded

    try:
        CkptdStorageReader(listings.holding(step), step, allow_pickle=allow_pickle).read_metadata()
    except Exception as error:  # noqa: BLE001 - any failure here would leave the other ranks in dcp.load
        return f"rank {rank}: {error}"
    return None


def _shards_moved(metadata: _Metadata, saved: Manifest, live: Mapping[str, torch.Tensor], *, rank: int) -> bool:
    """Whether a live tensor of this rank sits elsewhere in its global tensor than the piece this rank saved
    under its name (another shard, a DTensor saved as a plain tensor or the other way round)."""
    index = next((metadata.rank_index(tier, saved.step, rank) for tier in metadata.listings.holding(saved.step)
                  if _has_index(metadata, tier, saved.step, rank)), None)
    if index is None:
        return False  # the direct load reports the missing index
    shards = parse_values(index.values).shards
    replicas = saved.entry(rank).replicas
    for name, tensor in live.items():
        local, placement = local_view(tensor.detach())
        piece = shards.get(name)
        if piece is None and name not in index.tensors and name not in replicas:
            continue  # not saved by this rank: the load says what does not fit
        if (placement is None) != (piece is None) or (placement is not None and (
                piece[1] != placement or _local_shape(index, name) not in (None, tuple(local.shape)))):
            return True
    return False


def _has_index(metadata: _Metadata, tier: StorageTier, step: int, rank: int) -> bool:
    try:
        metadata.rank_index(tier, step, rank)
        return True
    except CkptdError:
        return False


def _local_shape(index: RankIndex, name: str) -> tuple[int, ...] | None:
    """The shape of the piece saved under ``name`` by this rank; None for a replica another rank wrote."""
    record = index.tensors.get(name)
    return None if record is None else tuple(record.shape)


def _layout_changed(saved: Manifest, live: Mapping[str, torch.Tensor], *, layout: Layout | None) -> bool:
    """Whether the live job is laid out otherwise than the step's layout records: another mesh (the given
    ``layout``, else the live DTensors' mesh), or a live DTensor with other placements than the step records
    for it (the sharding changed on the same mesh). One rank's view: the ranks vote (:func:`_reshard_vote`)."""
    recorded = saved.layout
    found = mesh_of_state(live)
    mesh = dict(layout.mesh) if layout is not None else (found[0] if found is not None else None)
    if mesh is not None and list(mesh.items()) != list(recorded.mesh.items()):  # type: ignore[union-attr]
        return True
    return any(recorded.placements.get(name, code) != code  # type: ignore[union-attr]
               for name, code in ((n, placement_codes(t)) for n, t in live.items()) if code is not None)


def _chunks_by_tier(reader: StepReader, names: list[str]) -> dict[str, int]:
    """How many chunks of the tensors ``names`` each tier supplied, from the reader's fallback events:
    every chunk is tried on the tiers nearest first, and each failed try is one event."""
    labels = [source.tier.label for source in reader.sources]
    failed = Counter((event.tensor, event.chunk, event.tier) for event in reader.events)
    supplied: Counter[str] = Counter()
    for name in dict.fromkeys(names):
        for digest, count in Counter(chunk.digest for chunk in reader.record(name).chunks).items():
            reached = count  # chunks with this digest that got as far as the tier
            for label in labels:
                failures = min(failed[(name, digest, label)], reached)
                supplied[label] += reached - failures
                reached = failures
                if not reached:
                    break
    return {label: supplied[label] for label in labels if supplied[label]}


def _saved_world_size(metadata: _Metadata, step: int) -> int:
    errors = []
    for tier in metadata.listings.holding(step):
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
        rng.restore_rng_states(saved_rng)
