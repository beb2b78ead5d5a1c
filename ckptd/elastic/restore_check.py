"""The check after each restore of a ``ckptd launch`` job, and the rollback when a restored copy is poisoned.

A restore check is a function of the restored state that returns None when the state is fit to train on,
or a sentence saying what is wrong. The default, :func:`finite_tensors`, refuses a floating tensor with
NaN or Inf values: a step saved from a state that had already diverged, or a staged copy damaged in
memory, is committed with correct hashes and restores without an error, but training on it is lost.

:func:`checked_restore` runs the check on every rank after a restore and exchanges the verdicts through
the manager's store, so that every rank makes the same decision:

1. every rank's copy passes: done;
2. a rank that read a poisoned copy from the memory tier reads the same step again from the tiers
   behind it (local disk, peer, object), the others reload it as they did (a farther tier);
3. otherwise every rank rolls back to the newest older step committed for all of them, and so on; the
   steps newer than the one finally restored are set aside, as after any restore that lands on an older
   step, so that training saves them again.

Every rollback is logged, naming the step, the tier, the ranks and what the check found. When no step
passes, :class:`~ckptd.errors.NoIntactCheckpointError` names every refusal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Protocol

import torch

from ckptd.errors import CkptdError, NoIntactCheckpointError, ResumeMismatchError
from ckptd.manager.restoring import RestoreResult, TierListings
from ckptd.state.staging import local_view
from ckptd.state.tree import flatten
from ckptd.tiers.base import StorageTier

log = logging.getLogger("ckptd.elastic")

#: A restore check: None when the restored state is fit to train on, else what is wrong with it.
RestoreCheck = Callable[[Mapping[str, Any]], "str | None"]

#: The tier name of a staged copy read back from host memory (as :class:`RestoreResult` names it).
MEMORY = "memory"


def finite_tensors(state: Mapping[str, Any]) -> str | None:
    """The default restore check: every floating (and complex) tensor of ``state`` holds finite values
    only. Returns the tensors that do not, with their count of NaN/Inf values, or None."""
    poisoned = []
    for name, tensor in flatten(dict(state), allow_pickle=True).tensors.items():
        local, _ = local_view(tensor)
        if not (local.is_floating_point() or local.is_complex()) or local.numel() == 0:
            continue
        bad = int((~torch.isfinite(local.detach())).sum())
        if bad:
            poisoned.append(f"tensor {name!r} has {bad} non-finite value(s) of {local.numel()}")
    if not poisoned:
        return None
    shown = "; ".join(poisoned[:3]) + (f"; and {len(poisoned) - 3} more tensor(s)" if len(poisoned) > 3 else "")
    return shown


class CheckedManager(Protocol):
    """What :func:`checked_restore` needs of a checkpoint manager."""

    rank: int
    coordinator: Any
    last_restore: RestoreResult | None

    @property
    def tiers(self) -> list[StorageTier]: ...

    def restore_unchecked(self, state: MutableMapping[str, Any], step: int | None) -> int | None: ...

    def refuse_memory(self, step: int) -> None: ...

    def set_aside_after(self, step: int) -> None: ...


def checked_restore(manager: CheckedManager, state: MutableMapping[str, Any], check: RestoreCheck) -> int | None:
    """Restore the newest intact step into ``state`` through ``manager`` and run ``check`` on every rank;
    roll back as the module docstring says. Returns the step restored (None: a fresh run). Every rank calls
    it, in the same order."""
    restored = manager.restore_unchecked(state, None)
    if restored is None:
        return None
    refused: list[str] = []
    rolled_back = False
    while True:
        tier = manager.last_restore.tier if manager.last_restore is not None else None
        problem = check(state)
        verdicts = manager.coordinator.exchange("restore-check", {"problem": problem, "tier": tier})
        bad = {rank: verdict for rank, verdict in enumerate(verdicts) if verdict["problem"]}
        if not bad:
            if rolled_back:
                manager.set_aside_after(restored)
            return restored
        described = " | ".join(f"rank {rank} (read from {verdict['tier']}): {verdict['problem']}"
                               for rank, verdict in sorted(bad.items()))
        refused.append(f"step {restored}: {described}")
        from_memory = [rank for rank, verdict in bad.items() if verdict["tier"] == MEMORY]
        if from_memory:
            log.warning("rank %d: restore check: step %d is poisoned in memory on rank(s) %s (%s); reading step %d "
                        "again from the tiers behind memory", manager.rank, restored, sorted(from_memory), described,
                        restored)
            if manager.rank in from_memory:
                manager.refuse_memory(restored)
            attempts = [restored]
        else:
            attempts = _older_steps(manager, restored)
            log.warning("rank %d: restore check: step %d is poisoned (%s); rolling back to %s", manager.rank,
                        restored, described, f"step {attempts[0]}" if attempts else
                        "an older step, but no older step is committed on every rank")
        restored = _restore_first(manager, state, attempts, refused)
        rolled_back = rolled_back or restored != attempts[0] or not from_memory


def _restore_first(manager: CheckedManager, state: MutableMapping[str, Any], attempts: list[int],
                   refused: list[str]) -> int:
    """Restore the first step of ``attempts`` that loads on every rank; NoIntactCheckpointError when none."""
    for attempt in attempts:
        try:
            loaded = manager.restore_unchecked(state, attempt)
        except ResumeMismatchError:
            raise
        except CkptdError as error:  # raised on every rank alike: the restore exchanges its outcome
            refused.append(f"step {attempt}: {error}")
            log.warning("rank %d: restore check: step %d could not be restored either: %s", manager.rank, attempt,
                        error)
            continue
        if loaded is not None:
            return loaded
    raise NoIntactCheckpointError("no restored step passes the restore check: " + " || ".join(refused),
                                  tier=", ".join(tier.label for tier in manager.tiers),
                                  hint="the job's checkpoints hold non-finite values; restore an older run, or "
                                       "pass restore_check=None to ctx.checkpoint_manager() to load them anyway")


def _older_steps(manager: CheckedManager, newer_than: int) -> list[int]:
    """Steps older than ``newer_than`` committed on some tier of every rank, newest first."""
    listings = TierListings(manager.tiers)
    mine = sorted({step for tier in manager.tiers for step in listings.committed(tier) if step < newer_than})
    lists = manager.coordinator.exchange("restore-check-older", mine)
    common = set(lists[0]).intersection(*map(set, lists[1:]))
    return sorted(common, reverse=True)
