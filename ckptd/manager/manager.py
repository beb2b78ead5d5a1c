"""CheckpointManager: the training loop's entry point for saving and restoring.

Call order, on every rank: construct once; :meth:`CheckpointManager.restore` once before training;
:meth:`CheckpointManager.save` every step (the policy decides which steps are written);
:meth:`CheckpointManager.close` at the end (or use it as a context manager).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

import torch

from ckptd.config import settings
from ckptd.errors import CkptdError, ConfigError, NoIntactCheckpointError, NotFoundError, \
    ResumeMismatchError, WorkerError
from ckptd.format import codecs
from ckptd.format.layout import MANIFEST_NAME, rank_data_name, rank_index_name, step_file
from ckptd.format.rank_writer import RankWriter
from ckptd.format.records import Manifest, RankEntry
from ckptd.format.step_reader import ChunkSource, StepReader, load_manifest, load_rank_index
from ckptd.manager.commit import CommitCoordinator, SingleProcessCoordinator, StoreCoordinator
from ckptd.manager.policy import Policy
from ckptd.state import rng
from ckptd.state.tree import flatten, load_into
from ckptd.tiers.local import LocalTier

log = logging.getLogger("ckptd.manager")


def _default_coordinator(rank: int | None, world_size: int | None, store: Any) -> CommitCoordinator:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
        if store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
    if world_size in (None, 1):
        return SingleProcessCoordinator()
    if store is None or rank is None:
        raise ConfigError("a multi-rank CheckpointManager needs rank and a c10d store",
                          hint="initialise torch.distributed first or pass rank=, world_size=, store=")
    return StoreCoordinator(store, rank, world_size, timeout_s=settings().commit_timeout_s)


class CheckpointManager:
    """Saves training state to a local tier (and later tiers) and restores the newest intact step.

    ``local`` is a directory or ``file://`` URL. ``policy`` decides which steps are saved and kept.
    ``codec`` is ``raw``, ``zstd`` or ``byteplane`` (default from ``CKPTD_CODEC``). RNG states of torch,
    numpy and ``random`` are saved and restored unless ``capture_rng=False``. Values that need pickle
    are refused unless ``allow_pickle=True``. In a process group, rank and world size come from
    ``torch.distributed`` and ranks agree on commits through its store.
    """

    def __init__(
        self,
        local: str | os.PathLike[str],
        *,
        policy: Policy | None = None,
        codec: str | None = None,
        capture_rng: bool = True,
        allow_pickle: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        store: Any = None,
    ) -> None:
        self.policy = policy or Policy()
        self.codec = codec or settings().codec
        codecs.codec_id_for(self.codec, floating=False, itemsize=1)
        self.capture_rng = capture_rng
        self.allow_pickle = allow_pickle
        self.coordinator = _default_coordinator(rank, world_size, store)
        self.rank, self.world_size = self.coordinator.rank, self.coordinator.world_size
        self.local = LocalTier(local)
        self.local.acquire_lock(self.rank)
        self._own_prefixes = (rank_data_name(self.rank), rank_index_name(self.rank)) + \
            ((MANIFEST_NAME,) if self.rank == 0 else ())
        removed = self.local.remove_temporaries(self._own_prefixes)
        if removed:
            log.info("removed %d temporary file(s) left by an earlier crash", len(removed))
        self.last_restore_events: list[Any] = []
        self._closed = False

    # --- saving -------------------------------------------------------------------------------
    def save(self, step: int, state: MutableMapping[str, Any], force: bool = False) -> bool:
        """Save ``state`` as ``step`` if the policy asks for it (or ``force``); returns whether it did.

        When this returns True the step is committed on the local tier on every rank.
        """
        self._check_open()
        if not force and not self.policy.saves(step):
            return False
        flat = flatten(self._with_rng(state), allow_pickle=self.allow_pickle)
        entry, error = None, None
        writer = RankWriter(self.local, step, self.rank, codec=self.codec, chunk_bytes=settings().chunk_bytes)
        try:
            for name, tensor in flat.tensors.items():
                writer.add(name, tensor.to("cpu").contiguous())
            entry = writer.finish(flat.skeleton)
        except CkptdError as exc:
            writer.abort()
            error = str(exc)
            if self.world_size == 1:
                raise
        manifest_bytes = self.coordinator.agree(step, entry, error, self._build_manifest(step))
        if error is not None:
            raise WorkerError(f"step {step} failed", {self.rank: error}, step=step)
        self.local.write_bytes(step_file(step, MANIFEST_NAME), manifest_bytes)
        if self.rank == 0:
            self._apply_retention()
        return True

    def _build_manifest(self, step: int):  # type: ignore[no-untyped-def]
        def build(entries: list[RankEntry]) -> Manifest:
            return Manifest(step=step, world_size=self.world_size, ranks=tuple(entries), codec=self.codec)
        return build

    def _with_rng(self, state: MutableMapping[str, Any]) -> dict[str, Any]:
        if rng.RNG_KEY in state:
            raise ConfigError(f"state key {rng.RNG_KEY!r} is reserved for ckptd")
        combined = dict(state)
        if self.capture_rng:
            combined[rng.RNG_KEY] = rng.capture()
        return combined

    def _apply_retention(self) -> None:
        committed = self.local.committed_steps()
        for step in self.policy.local_retention.deletable(committed):
            self.local.delete_step(step)
        newest = committed[-1] if committed else None
        for step in self.local.list_step_numbers():
            if newest is not None and step < newest and step not in committed:
                self.local.delete_step(step)

    # --- restoring ----------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Steps committed on the local tier, ascending."""
        return self.local.committed_steps()

    def restore(self, state: MutableMapping[str, Any], step: int | None = None) -> int | None:
        """Load the newest intact step (or ``step``) into ``state`` in place; returns the step, or None
        when there is no checkpoint. A corrupt step is reported and the next older one is tried.

        Tensors are copied into the live tensors; dict and list entries are replaced in place;
        objects with ``load_state_dict`` receive their saved state. If no step is intact,
        NoIntactCheckpointError is raised and ``state`` may hold values of a partly read step.
        """
        self._check_open()
        candidates = sorted(self.local.committed_steps(), reverse=True)
        if step is not None:
            if step not in candidates:
                raise NotFoundError("step is not committed on any tier", step=step, tier=self.local.label,
                                    hint="`ckptd ls` lists the committed steps")
            candidates = [step]
        if not candidates:
            return None
        failures = []
        for candidate in candidates:
            try:
                self._restore_step(candidate, state)
                return candidate
            except ResumeMismatchError:
                raise
            except CkptdError as error:
                failures.append(f"step {candidate}: {error}")
                log.warning("step %d cannot be restored, trying an older one: %s", candidate, error)
        raise NoIntactCheckpointError("no intact checkpoint could be restored: " + " | ".join(failures),
                                      tier=self.local.label, hint="`ckptd verify` shows every bad file")

    def _restore_step(self, step: int, state: MutableMapping[str, Any]) -> None:
        manifest = load_manifest(self.local, step)
        if manifest.world_size != self.world_size:
            raise ResumeMismatchError(
                f"step {step} was saved by {manifest.world_size} rank(s) but this job has {self.world_size}",
                step=step, hint="restore with the saved world size, or save through ckptd's DCP "
                                "integration, which reshards")
        index = load_rank_index(self.local, manifest, self.rank)
        reader = StepReader([ChunkSource(self.local, index)])
        skeleton = index.values
        target = dict(state)
        with torch.no_grad():
            load_into(target, skeleton, reader.read_tensor, allow_pickle=self.allow_pickle)
        saved_rng = target.pop(rng.RNG_KEY, None)
        state.update(target)
        if self.capture_rng and saved_rng is not None:
            rng.restore(saved_rng)
        self.last_restore_events = reader.events

    # --- lifecycle ----------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every pending save is committed locally (saves are synchronous for now)."""
        self._check_open()

    def close(self) -> None:
        """Wait for pending work and release the tiers. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.local.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CkptdError("this CheckpointManager is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
