"""The save path: flatten the state, write this rank's share, agree on the commit, write the manifest.

:class:`Saver` is used by :class:`~ckptd.manager.manager.CheckpointManager`; call order on every rank:
:meth:`Saver.save` per saved step (same order on all ranks), :meth:`Saver.wait`, :meth:`Saver.close`.
Callbacks in ``on_commit`` run after a step is committed locally (retention, promotion).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import Any

from ckptd.config import settings
from ckptd.errors import CkptdError, ConfigError, WorkerError
from ckptd.format.layout import MANIFEST_NAME, step_file
from ckptd.format.rank_writer import RankWriter
from ckptd.format.records import Manifest, RankEntry
from ckptd.manager.commit import CommitCoordinator
from ckptd.manager.policy import Policy
from ckptd.state import rng
from ckptd.state.tree import flatten
from ckptd.tiers.local import LocalTier

log = logging.getLogger("ckptd.save")


class Saver:
    """Writes steps to the local tier and commits them with the other ranks."""

    def __init__(self, local: LocalTier, coordinator: CommitCoordinator, *, policy: Policy, codec: str,
                 allow_pickle: bool, capture_rng: bool) -> None:
        self.local, self.coordinator, self.policy = local, coordinator, policy
        self.codec, self.allow_pickle, self.capture_rng = codec, allow_pickle, capture_rng
        self.rank, self.world_size = coordinator.rank, coordinator.world_size
        self.on_commit: list[Callable[[int], None]] = []

    def save(self, step: int, state: MutableMapping[str, Any]) -> bool:
        """Write ``state`` as ``step`` and commit it on every rank; returns True when committed."""
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
        manifest_bytes = self.coordinator.agree(step, entry, error, self._manifest_builder(step))
        if error is not None:
            raise WorkerError(f"step {step} failed", {self.rank: error}, step=step)
        self.local.write_bytes(step_file(step, MANIFEST_NAME), manifest_bytes)
        self._committed(step)
        return True

    def _committed(self, step: int) -> None:
        if self.rank == 0:
            self._apply_retention()
        for callback in self.on_commit:
            callback(step)

    def _manifest_builder(self, step: int) -> Callable[[list[RankEntry]], Manifest]:
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

    def wait(self) -> None:
        """Block until every pending save is committed locally (saves are synchronous here)."""

    def close(self) -> None:
        """Finish pending work."""
        self.wait()
