"""A multi-rank save through a failing disk on one rank: the rank function of the I/O-error tests.

:func:`save_through_a_fault` runs on every gloo rank (``ckptd.testing.multirank.run_multirank``): it
commits step 1, saves step 2 while one rank's local tier fails as an :class:`~harness.write_faults.
ErrnoRule` says (the other ranks' disks work), then saves step 3 and restores it in a fresh manager. It
returns what the rank saw, so the caller can check that every rank learnt of the failure, that nothing
was committed, and that the next save works. It lives here, not in a test module, so that the forkserver's
children import only ckptd (cheap) to run it.
"""

from __future__ import annotations

import time
from typing import Any

from ckptd.config import override
from ckptd.errors import CkptdError
from ckptd.manager.manager import CheckpointManager
from ckptd.policy import Policy
from ckptd.testing.compare import state_differences
from harness.workloads import synthetic_state, synthetic_template
from harness.write_faults import ErrnoRule, FaultyDisk

GOOD, FAILED, NEXT = 1, 2, 3


def rank_state(step: int, rank: int, nbytes: int) -> dict[str, Any]:
    """What ``rank`` saves at ``step`` (ranks differ)."""
    return synthetic_state(step * 10 + rank, nbytes)


def save_through_a_fault(rank: int, world_size: int, root: str, failing_rank: int, rule: ErrnoRule,
                         nbytes: int, chunk_bytes: int = 16 * 1024, codec: str = "raw", io_threads: int = 1,
                         keep_local: int | None = 1) -> dict[str, Any]:
    """Steps 1, 2 (``rule`` failing on ``failing_rank``) and 3, then a restore; what this rank saw:
    ``failure`` (the error of step 2, "" if none), ``after_failure`` (committed steps then), ``committed`` and
    ``restored`` (after step 3), ``differences`` (restored against saved), ``injected`` (failures raised on
    purpose on this rank) and ``recovery_s`` (from the failing save to step 3 restored). Arguments after
    ``rule`` are positional too (``run_multirank`` passes no keywords)."""
    policy = Policy(keep_local=keep_local)
    with override(chunk_bytes=chunk_bytes, io_threads=io_threads):
        manager = CheckpointManager(root, policy=policy, capture_rng=False, codec=codec, daemon="off")
        manager.save(GOOD, rank_state(GOOD, rank, nbytes), force=True)
        manager.wait()
        failure, started = "", time.monotonic()
        with FaultyDisk(rules=[rule] if rank == failing_rank else []) as disk:
            try:
                manager.save(FAILED, rank_state(FAILED, rank, nbytes), force=True)
                manager.wait()
            except CkptdError as error:
                failure = f"{type(error).__name__}: {error}"
        after_failure = manager.committed_steps()
        manager.save(NEXT, rank_state(NEXT, rank, nbytes), force=True)
        manager.wait()
        manager.close()
        with CheckpointManager(root, policy=policy, capture_rng=False, daemon="off") as restarted:
            live = synthetic_template(nbytes)
            restored = restarted.restore(live)
            committed = restarted.committed_steps()
        recovery = time.monotonic() - started
    return {"failure": failure, "after_failure": after_failure, "committed": committed, "restored": restored,
            "differences": state_differences(live, rank_state(NEXT, rank, nbytes))[:3],
            "injected": len(disk.injected), "recovery_s": recovery}


__all__ = ["FAILED", "GOOD", "NEXT", "rank_state", "save_through_a_fault"]
